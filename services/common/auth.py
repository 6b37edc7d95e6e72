"""API-key checks shared by the gRPC interceptors (grpc_util.ApiKeyAuth, grpc_util.InternalKeyAuth)
and the HTTP gateway.

A client authenticates with the header (HTTP) or metadata key (gRPC) ``authorization`` set to
``Bearer <key>``, as OpenAI's clients send it. The comparison takes the same time whatever the
prefix of the wrong key that matches (hmac.compare_digest), so a key cannot be guessed byte by byte
from response times. No gRPC import here.
"""
from __future__ import annotations

import hmac
from typing import Iterable

from echospec_client.limits import MAX_KEY_CHARS  # the longest API or internal key

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")  # probes and grpcurl stay open
# The internal key: the coordinator sends it to the verifier, the verifier to the draft service,
# as this metadata key (the key itself, no scheme). It is not `authorization`, so a client's API
# key and the services' own credential are never mistaken for each other.
INTERNAL_KEY_METADATA = "echospec-internal-key"


def bearer(api_key: str) -> str:
    """The ``authorization`` value a client sends for ``api_key``."""
    return f"Bearer {api_key}"


def authorized(header: str | None, api_key: str) -> bool:
    """True when ``api_key`` is "" (no check) or ``header`` is exactly ``Bearer <api_key>``
    (the scheme is matched without regard to case, as HTTP says)."""
    if not api_key:
        return True
    if not header:
        return False
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode("utf-8", "replace"), api_key.encode("utf-8"))


def check_api_key(api_key: str, what: str = "the API key") -> None:
    """Refuse a key no client could send: HTTP headers and gRPC metadata carry printable ASCII,
    and the ``Bearer <key>`` value is compared without surrounding spaces (the internal key
    too: ``what`` names the key in the message).

    Raises:
        ValueError: a character outside `` `` .. ``~`` (controls, non-ASCII), a space at either
            end, or more than MAX_KEY_CHARS characters (gRPC refuses metadata of 16 KiB and
            more: every call would fail).
    """
    if len(api_key) > MAX_KEY_CHARS:
        raise ValueError(f"{what} is {len(api_key)} characters long: at most {MAX_KEY_CHARS} "
                         f"(it travels in gRPC metadata and HTTP headers, which cap their size)")
    for i, c in enumerate(api_key):
        if not " " <= c <= "~":
            raise ValueError(f"{what} must be printable ASCII: character {i + 1} is {c!r}")
    if api_key != api_key.strip(" "):
        raise ValueError(f"{what} must not begin or end with a space")


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None,
                   name: str = "authorization") -> str | None:
    """The value of metadata key ``name`` in gRPC invocation metadata (None when absent)."""
    for key, value in metadata or ():
        if key == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None


def metadata_authorization(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The ``authorization`` value of gRPC invocation metadata (None when absent)."""
    return metadata_value(metadata, "authorization")


def internal_key_ok(value: str | None, internal_key: str) -> bool:
    """True when ``internal_key`` is "" (no check) or ``value`` (the INTERNAL_KEY_METADATA
    metadata a call carried) is exactly it, compared in constant time."""
    if not internal_key:
        return True
    if value is None:
        return False
    return hmac.compare_digest(value.encode("utf-8", "replace"), internal_key.encode("utf-8"))


def is_open_method(method: str) -> bool:
    """gRPC methods answered without a key: health checks and reflection."""
    return method.startswith(OPEN_GRPC_PREFIXES)
