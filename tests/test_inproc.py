"""GenerateTokens in-process (services/rpc/inproc.py): a coordinator and a verifier of one
process skip the network, and the call behaves as the gRPC one does: the same messages, the same
refusals, cancel, deadline, admission, and a stopping server's shutdown message."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from echospec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from echospec.services.rpc import grpc_util, inproc
from echospec.services.common.config import VerifierConfig
from echospec.services.verifier import server as verifier_server


def _start(model: str, **kw):
    cfg = VerifierConfig(model=model, port=0, n_ctx=2048, n_threads=1, **kw)
    v = verifier_server.start(cfg)
    addr = f"{cfg.host}:{v.port}"
    ch = grpc_util.channel(addr, cfg.max_message_bytes, None)
    remote = verifier_pb2_grpc.VerifierServiceStub(ch)
    return v, addr, ch, remote, inproc.LocalVerifierStub(remote, addr)


@pytest.fixture(scope="module")
def verifier(tiny_model):
    v, addr, ch, remote, local = _start(tiny_model(n_ctx_train=2048), max_workers=4,
                                        max_concurrent_rpcs=2)
    yield v, remote, local
    ch.close()
    v.stop(0)


def _req(**kw) -> verifier_pb2.GenerateTokensRequest:
    return verifier_pb2.GenerateTokensRequest(**{"prompt": [5, 6, 7, 8], "max_tokens": 40, **kw})


def _tokens(call) -> list[int]:
    return [t for m in call for r in m.rounds for t in r.result.tokens]


def _idle(v, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if v.handle.limit.active == 0 and v.core.active_sessions == 0:
            return True
        time.sleep(0.01)
    return False


def test_a_local_call_gives_what_the_grpc_call_gives(verifier):
    v, remote, local = verifier
    call = local.GenerateTokens(_req(), timeout=30)
    assert isinstance(call, inproc.LocalCall)
    got = _tokens(call)
    assert len(got) == 40 and got == _tokens(remote.GenerateTokens(_req(), timeout=30))
    assert _idle(v)


@pytest.mark.parametrize("bad", [dict(prompt=[]), dict(prompt=[10 ** 9]), dict(max_tokens=0),
                                 dict(sampling=common_pb2.SamplingParams(temperature=float("nan")))],
                         ids=["empty", "vocab", "max_tokens", "nan"])
def test_a_bad_request_is_refused_alike(verifier, bad):
    v, remote, local = verifier
    with pytest.raises(grpc.RpcError) as over_grpc:
        list(remote.GenerateTokens(_req(**bad), timeout=30))
    with pytest.raises(inproc.LocalRpcError) as here:
        list(local.GenerateTokens(_req(**bad), timeout=30))
    assert here.value.code() == over_grpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert here.value.details() == over_grpc.value.details()
    assert _idle(v)


def test_cancel_ends_the_generation_and_frees_its_session(verifier):
    v, _, local = verifier
    call = local.GenerateTokens(_req(max_tokens=1900), timeout=30)
    it = iter(call)
    next(it)
    threading.Thread(target=call.cancel).start()
    with pytest.raises(inproc.LocalRpcError) as e:
        for _ in it:
            pass
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert _idle(v)


def test_the_deadline_ends_the_call(verifier):
    v, _, local = verifier
    t0 = time.monotonic()
    with pytest.raises(inproc.LocalRpcError) as e:
        _tokens(local.GenerateTokens(_req(max_tokens=1900), timeout=0.02))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 5
    assert _idle(v)


def test_a_caller_that_leaves_frees_the_slot(verifier):
    v, _, local = verifier
    it = iter(local.GenerateTokens(_req(max_tokens=1900), timeout=30))
    next(it)
    assert v.handle.limit.active == 1
    it.close()
    assert _idle(v)


def test_local_calls_count_against_max_concurrent_rpcs(verifier):
    v, remote, local = verifier
    held = [iter(local.GenerateTokens(_req(max_tokens=1900), timeout=30)) for _ in range(2)]
    for it in held:
        next(it)
    with pytest.raises(inproc.LocalRpcError) as here:
        list(local.GenerateTokens(_req(), timeout=30))
    with pytest.raises(grpc.RpcError) as over_grpc:
        list(remote.GenerateTokens(_req(), timeout=30))
    assert here.value.code() == over_grpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert here.value.details() == over_grpc.value.details()
    for it in held:
        it.close()
    assert _idle(v)


def test_a_stopping_verifier_ends_a_local_call_with_its_shutdown_message(tiny_model, caplog):
    v, addr, ch, _, local = _start(tiny_model(n_ctx_train=2048))
    try:
        it = iter(local.GenerateTokens(_req(max_tokens=1900), timeout=30))
        next(it)
        v.stop(0, "a test")
        with pytest.raises(inproc.LocalRpcError) as e:
            for _ in it:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the verifier service is shutting down (a test)" in e.value.details()
        assert inproc.local(addr) is None
        # a later call goes over gRPC, to a server that is gone
        with pytest.raises(grpc.RpcError) as later:
            list(local.GenerateTokens(_req(), timeout=5))
        assert later.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        ch.close()
