"""Tenants: several API keys, each naming the tenant it belongs to, and the draft namespaces
scoped to them. No gRPC import here.

The keys file (``--api-keys-file``) is a JSON object mapping each API key to its tenant::

    {"k-3f9a...": "team-a", "k-77c1...": "team-a", "k-0b2e...": "team-b"}

A client sends one of the keys as ``authorization: Bearer <key>``, as with ``--api-key``. A
``draft_namespace`` is then the tenant's own: the coordinator hands the draft service
``<tenant>/<namespace>``, so tenant A naming "docs" and tenant B naming "docs" reach two
memories, and no name A can send reaches B's (a tenant name holds no "/", so the scoped name
says whose it is). A caller with the single ``--api-key`` key, when both are set, is the tenant
"" (``/<namespace>``).

Example::

    t = Tenants({"ka": "team-a", "kb": "team-b"})
    t.tenant_of("Bearer ka")          # "team-a"
    t.tenant_of("Bearer nope")        # None
    t.scope("team-a", "docs")         # "team-a/docs"
    t.scope("team-a", "")             # "" (no namespace: nothing shared)
"""
from __future__ import annotations

import hmac
import json
import re
from typing import Mapping

from echospec.services.common.auth import check_api_key

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class _Duplicate(ValueError):
    """A key written twice in one JSON object of a keys file."""


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json's object_pairs_hook: a JSON object as a dict, refusing a key written twice (json keeps
    the last silently, so a key mapped to two tenants would reach one of them unsaid)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            shown = k if len(k) <= 12 else k[:8] + "..."
            raise _Duplicate(f"API key {shown!r} is written twice (tenants {out[k]!r} and {v!r}): "
                             f"one tenant per key")
        out[k] = v
    return out


class Tenants:
    """API key -> tenant, and the namespaces scoped to a tenant.

    Args:
        by_key: API key -> tenant name (TENANT_NAME: 1-64 of letters, digits, ".", "_", "-").
    Raises:
        ValueError: a key no client could send (auth.check_api_key), a bad tenant name, no keys.
    """

    def __init__(self, by_key: Mapping[str, str]):
        if not by_key:
            raise ValueError("no API keys in it (a JSON object mapping each key to its tenant)")
        for key, tenant in by_key.items():
            if not isinstance(key, str) or not key:
                raise ValueError("an API key is empty")
            check_api_key(key)
            if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
                raise ValueError(f"tenant {tenant!r}: a tenant name is 1-64 letters, digits, "
                                 f"'.', '_' or '-'")
        self._keys = [(k.encode("utf-8"), t) for k, t in by_key.items()]

    @classmethod
    def load(cls, path: str) -> "Tenants":
        """Read a keys file. Raises ValueError naming the file and what is wrong with it."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f, object_pairs_hook=_no_duplicates)
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror}") from None
        except _Duplicate as exc:
            raise ValueError(f"{path}: {exc}") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a JSON object mapping each API key to its tenant, "
                             f"not a {type(data).__name__}")
        try:
            return cls(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @property
    def names(self) -> set[str]:
        return {t for _, t in self._keys}

    def tenant_of(self, header: str | None) -> str | None:
        """The tenant of an ``authorization`` value ``Bearer <key>`` (None: no key of the file).
        Every key is compared, in constant time, whichever matches."""
        if not header:
            return None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        sent = token.strip().encode("utf-8", "replace")
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(sent, key):
                found = tenant
        return found

    @staticmethod
    def scope(tenant: str, namespace: str) -> str:
        """The draft service's name of ``namespace`` for ``tenant``: ``<tenant>/<namespace>``
        ("" stays "": no namespace)."""
        return f"{tenant}/{namespace}" if namespace else ""
