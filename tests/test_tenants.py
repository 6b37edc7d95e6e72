"""Tenants (--api-keys-file): several API keys, each with its tenant; a draft_namespace is the
tenant's own, so tenant A naming B's namespace does not draw on B's memory
(services/common/tenants.py)."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from echospec.services.common.config import CoordinatorConfig, load
from echospec.services.common.tenants import Tenants
from echospec.stack import start_stack
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc

KA, KB = "key-of-team-a-1d2f", "key-of-team-b-8e0c"
ON = common_pb2.SPEC_MODE_ON


def test_keys_file_maps_keys_to_tenants():
    t = Tenants({KA: "team-a", KB: "team-b"})
    assert t.tenant_of(f"Bearer {KA}") == "team-a" and t.tenant_of(f"bearer {KB}") == "team-b"
    assert t.tenant_of("Bearer nope") is None and t.tenant_of(None) is None
    assert t.tenant_of(KA) is None   # the scheme is required, as for --api-key
    # one tenant's names never reach another's: a tenant name holds no "/"
    assert t.scope("team-a", "team-b/docs") == "team-a/team-b/docs" != t.scope("team-b", "docs")
    assert t.scope("team-a", "") == ""   # no namespace: nothing shared


@pytest.mark.parametrize("content, message", [
    ("[]", "a JSON object mapping each API key to its tenant, not a list"),
    ("{", "not JSON"),
    ("{}", "no API keys in it"),
    ('{"k": "team/a"}', "tenant 'team/a': a tenant name is 1-64 letters"),
    ('{"k ": "a"}', "must not begin or end with a space"),
    # json keeps the last of a duplicated key silently: the key would reach one tenant unsaid
    ('{"k-aaaaaaaa": "a", "k-aaaaaaaa": "b"}', "'k-aaaaaaaa' is written twice .tenants 'a' and 'b'."),
    # gRPC refuses metadata of 16 KiB and more: every call with this key would fail
    ('{"%s": "a"}' % ("k" * 20000), "the API key is 20000 characters long: at most 4096"),
])
def test_an_unusable_keys_file_is_refused_naming_it(tmp_path, content, message):
    f = tmp_path / "keys.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=message) as ei:
        Tenants.load(str(f))
    assert str(f) in str(ei.value)
    with pytest.raises(SystemExit):   # a service stops at startup (exit 2, the usage message)
        load(CoordinatorConfig, ["--api-keys-file", str(f)], environ={})


@pytest.fixture(scope="module")
def stack(smollm2_path, tmp_path_factory):
    keys = tmp_path_factory.mktemp("tenants") / "keys.json"
    keys.write_text(json.dumps({KA: "team-a", KB: "team-b"}))
    st = start_stack(smollm2_path, n_ctx=512, api_keys_file=str(keys), http_port=0, model_name="m")
    yield st
    st.stop(0.5)


MSGS = [cpb.ChatMessage(role="user",
                        content="Describe a kestrel hunting over a meadow in two sentences.")]


def _complete(stub, key: str, ns: str) -> cpb.GenerationResult:
    return stub.Complete(cpb.CompleteRequest(messages=MSGS, max_tokens=40, spec=ON,
                                             draft_namespace=ns),
                         metadata=(("authorization", f"Bearer {key}"),), timeout=600).result


def _shared(r) -> int:
    return sum(x.hits for x in r.stats.sources if x.source == "shared")


def test_tenant_a_cannot_draw_on_tenant_b_namespace(stack):
    with grpc.insecure_channel(stack.target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        with pytest.raises(grpc.RpcError) as ei:   # a key of no tenant
            _complete(stub, "nope", "docs")
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        first = _complete(stub, KB, "docs")        # team-b's "docs" now holds the answer
        a = _complete(stub, KA, "docs")            # the same name, team-a's own memory: empty
        assert _shared(a) == 0, a.stats
        a2 = _complete(stub, KA, "team-b/docs")    # naming B's scoped name: still A's own
        assert _shared(a2) == 0, a2.stats
        b = _complete(stub, KB, "docs")            # team-b again: drawn from its memory
        assert _shared(b) >= 10, b.stats
        assert list(a.token_ids) == list(b.token_ids) == list(first.token_ids)


def test_the_gateway_sends_each_client_key_on(stack):
    """Over HTTP too: the gateway takes every key of the file and sends the client's own on, so
    the coordinator scopes the namespace to that client's tenant."""
    body = {"model": "m", "max_tokens": 40, "spec": "on", "draft_namespace": "docs",
            "messages": [{"role": "user", "content": MSGS[0].content}]}
    url = f"{stack.http_url}/v1/chat/completions"
    r = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=600)
    assert r.status_code == 401
    body["draft_namespace"] = "http-docs"
    stats = []
    for key in (KB, KA, KB):   # B fills its "http-docs"; A's is empty; B draws on its own
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600)
        assert r.status_code == 200, (r.status_code, r.text)
        stats.append(r.json()["echospec"]["stats"]["sources"])
    assert stats[1].get("shared", {}).get("hits", 0) == 0, stats[1]
    assert stats[2].get("shared", {}).get("hits", 0) >= 10, stats


def test_serve_refuses_an_unusable_keys_file(tmp_path, capsys):
    from echospec import cli
    f = tmp_path / "keys.json"
    f.write_text('{"k": ""}')
    with pytest.raises(SystemExit) as ei:
        cli.main(["serve", "--api-keys-file", str(f)])
    assert ei.value.code == 2
    assert f"--api-keys-file: {f}: tenant ''" in capsys.readouterr().err
