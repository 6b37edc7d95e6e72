"""The internal key (--internal-key / ECHOSPEC_INTERNAL_KEY): the verifier's and the draft
service's ports refuse calls without it (UNAUTHENTICATED; health and reflection stay open), and
the coordinator -> verifier -> draft calls carry it."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from echospec.services.common.auth import INTERNAL_KEY_METADATA
from echospec.services.common.config import DraftConfig, VerifierConfig, check_ranges
from echospec.services.draft import server as dserver
from echospec.services.rpc import grpc_util
from echospec.stack import _args, start_stack
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc
from echospec.v1 import draft_pb2, draft_pb2_grpc, verifier_pb2 as vpb, verifier_pb2_grpc

IKEY = "internal-7c1e"


@pytest.fixture()
def draft():
    handle, _ = dserver.start(DraftConfig(port=0, internal_key=IKEY))
    yield f"127.0.0.1:{handle.port}"
    handle.stop(0).wait()


def _propose(target: str, metadata=(), key: str = ""):
    with grpc_util.channel(target, 1 << 20, internal_key=key) as ch:
        return draft_pb2_grpc.DraftServiceStub(ch).Propose(
            draft_pb2.ProposeRequest(tokens=[1, 2, 3, 1, 2], k=2), metadata=metadata, timeout=10)


def test_the_draft_service_refuses_calls_without_the_internal_key(draft):
    for metadata, why in (((), "no internal key"), (((INTERNAL_KEY_METADATA, "guess"),),
                                                   "wrong internal key")):
        with pytest.raises(grpc.RpcError) as ei:
            _propose(draft, metadata)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert ei.value.details().startswith(why), ei.value.details()
        assert "--internal-key" in ei.value.details()
    # a client's API key is not the internal key
    with pytest.raises(grpc.RpcError) as ei:
        _propose(draft, (("authorization", f"Bearer {IKEY}"),))
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the channel of the services sends it: answered (a draft of 3 after "1 2")
    assert list(_propose(draft, key=IKEY).draft) == [3, 1]
    # probes need no key
    with grpc.insecure_channel(draft) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_an_unusable_internal_key_is_refused_with_its_name():
    with pytest.raises(ValueError, match=r"--internal-key / ECHOSPEC_INTERNAL_KEY: the internal "
                                         r"key must be printable ASCII"):
        check_ranges(VerifierConfig(internal_key="k\u00e9y"))


def test_the_internal_key_is_never_on_a_command_line():
    assert "--internal-key" not in _args(DraftConfig(internal_key=IKEY))
    assert IKEY not in _args(VerifierConfig(internal_key=IKEY))


def test_a_verifier_without_the_draft_service_key_says_it_was_refused(tiny_model):
    """The draft service demands a key the verifier does not send: generations decode plainly
    (same output) and spec_reason names the refusal, not an unreachable service."""
    handle, _ = dserver.start(DraftConfig(port=0, internal_key=IKEY))
    try:
        st = start_stack(tiny_model(), n_ctx=256, n_threads=1, adaptive_k=False)
        try:
            # the stack's own draft service has no key; point its verifier at the keyed one
            from echospec.services.verifier.server import _draft_opener
            st.verifier.servicer.open_draft = _draft_opener(VerifierConfig(
                draft_target=f"127.0.0.1:{handle.port}"))
            with grpc.insecure_channel(st.target) as ch:
                stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
                req = dict(text="a b a b a b a", max_tokens=12)
                off = stub.Complete(cpb.CompleteRequest(**req, spec=common_pb2.SPEC_MODE_OFF),
                                    timeout=60).result
                on = stub.Complete(cpb.CompleteRequest(**req, spec=common_pb2.SPEC_MODE_ON),
                                   timeout=60).result
            assert list(on.token_ids) == list(off.token_ids)
            assert on.spec_reason.startswith("draft service refused this verifier "
                                             "(UNAUTHENTICATED: no internal key"), on.spec_reason
        finally:
            st.stop(0.5)
    finally:
        handle.stop(0).wait()


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_a_stack_with_an_internal_key(tiny_model, processes):
    """The verifier refuses a direct call without the key; the coordinator's calls to the
    verifier (GetConfig polls, and in process mode the generations) and the verifier's to the
    draft service carry it: the stack serves and drafts."""
    st = start_stack(tiny_model(), n_ctx=256, n_threads=1, internal_key=IKEY, adaptive_k=False,
                     processes=processes)
    try:
        with grpc.insecure_channel(st.verifier_target) as ch:
            with pytest.raises(grpc.RpcError) as ei:
                verifier_pb2_grpc.VerifierServiceStub(ch).GetConfig(vpb.GetConfigRequest(), timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            gen = verifier_pb2_grpc.VerifierServiceStub(ch).GenerateTokens(
                vpb.GenerateTokensRequest(), timeout=10)
            with pytest.raises(grpc.RpcError) as ei:
                list(gen)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as ei:
            _propose(st.draft_target)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(st.target) as ch:
            r = coordinator_pb2_grpc.CoordinatorServiceStub(ch).Complete(
                cpb.CompleteRequest(text="a b a b a b a", max_tokens=12, k=4,
                                    spec=common_pb2.SPEC_MODE_ON, prediction=" b a b a b a"),
                timeout=60).result
        assert r.spec_enabled and not r.spec_reason, r.spec_reason
        assert r.stats.draft_tokens > 0, r   # drafts came from the draft service
    finally:
        st.stop(0.5)
