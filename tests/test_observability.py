"""Per-request log lines (text and JSON) and the Prometheus export of every service; the code a
call is logged with when its client's deadline ended it (DEADLINE_EXCEEDED, not CANCELLED)."""
from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402

from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc  # noqa: E402
from echospec.services.common import logs  # noqa: E402
from echospec.stack import start_stack  # noqa: E402

FIELDS = ("request_id", "rpc", "code", "prompt_tokens", "cached_tokens", "prefill_ms", "tokens_out",
          "ttft_ms", "e2e_ms", "tokens_per_s", "finish_reason", "spec", "tries", "hits", "kv_rolls",
          "draft_tokens", "acceptance_rate")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    write_tiny_model(path, arch="llama", n_vocab=320, n_ctx_train=512, seed=2)
    return str(path)


@pytest.fixture(scope="module")
def stack(model):
    # n_ctx 2048: a generation to the context's end takes hundreds of ms even for the tiny model
    # (the verifier runs the loop), so the deadline and cancel requests below end mid-generation
    st = start_stack(model, n_ctx=2048, n_threads=1, metrics_port=0)
    yield st
    st.stop()


@pytest.fixture()
def json_log():
    """The root logger as JSON lines into a buffer; yields a function returning the parsed lines."""
    buf = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    logs.setup("INFO", "json", stream=buf)
    yield lambda: [json.loads(ln) for ln in buf.getvalue().splitlines() if ln.strip()]
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def request_lines(lines):
    return [ln for ln in lines if ln.get("message") == "request"]


def wait_lines(get, n, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while len(request_lines(get())) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return request_lines(get())


def test_one_json_line_per_request_with_every_field(stack, json_log):
    with grpc.insecure_channel(stack.target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        ok = stub.Complete(cpb.CompleteRequest(text="a b a b a b a", max_tokens=12,
                                               spec=common_pb2.SPEC_MODE_ON), timeout=60,
                           metadata=[("x-request-id", "req-ok-1")]).result
        # the same prompt again: its KV comes from the verifier's prefix cache
        again = stub.Complete(cpb.CompleteRequest(text="a b a b a b a", max_tokens=4), timeout=60,
                              metadata=[("x-request-id", "req-again-5")]).result
        assert again.stats.cached_prompt_tokens > 0
        with pytest.raises(grpc.RpcError) as bad:
            stub.Complete(cpb.CompleteRequest(text="a", max_tokens=10**6), timeout=60,
                          metadata=[("x-request-id", "req-bad-2")])
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as late:
            list(stub.Generate(cpb.GenerateRequest(text="a b", max_tokens=8000), timeout=0.05,
                               metadata=[("x-request-id", "req-late-3")]))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        call = stub.Generate(cpb.GenerateRequest(text="a b c", max_tokens=2000), timeout=60,
                             metadata=[("x-request-id", "req-cancel-4")])
        next(call)
        call.cancel()
    lines = {ln["request_id"]: ln for ln in wait_lines(json_log, 5)}
    assert set(lines) >= {"req-ok-1", "req-bad-2", "req-late-3", "req-cancel-4", "req-again-5"}, lines
    okl = lines["req-ok-1"]
    assert list(okl)[:4] == ["ts", "level", "logger", "message"] and okl["level"] == "INFO"
    assert all(f in okl for f in FIELDS), okl
    assert okl["code"] == "OK" and okl["rpc"] == "Complete" and okl["spec"] is True
    assert okl["tokens_out"] == ok.completion_tokens and okl["prompt_tokens"] == ok.prompt_tokens
    assert okl["tries"] == ok.stats.tries and okl["hits"] == ok.stats.hits
    assert okl["kv_rolls"] == ok.stats.kv_rolls
    assert okl["cached_tokens"] == ok.stats.cached_prompt_tokens
    assert lines["req-again-5"]["cached_tokens"] == again.stats.cached_prompt_tokens
    assert okl["finish_reason"] == "length" and okl["prefill_ms"] > 0
    assert 0 < okl["ttft_ms"] <= okl["e2e_ms"]
    assert okl["tokens_per_s"] == pytest.approx(ok.completion_tokens / (okl["e2e_ms"] / 1e3), rel=0.02)
    assert lines["req-bad-2"]["code"] == "INVALID_ARGUMENT" and lines["req-bad-2"]["finish_reason"] is None
    assert lines["req-late-3"]["code"] == "DEADLINE_EXCEEDED"
    assert lines["req-cancel-4"]["code"] == "CANCELLED" and lines["req-cancel-4"]["rpc"] == "Generate"


def test_text_format_and_levels():
    buf = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        logs.setup("WARNING", "text", stream=buf)
        log = logging.getLogger("echospec.test")
        log.info("hidden", extra={"fields": {"a": 1}})
        log.warning("shown", extra={"fields": {"request_id": "r1", "text": "two words", "x": 0.5}})
        out = buf.getvalue().strip().splitlines()
        assert len(out) == 1
        assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING echospec.test shown "
                        r'request_id=r1 text="two words" x=0.5$', out[0]), out
        with pytest.raises(ValueError, match="log level 'LOUD'"):
            logs.setup("LOUD")
        with pytest.raises(ValueError, match="log format 'xml'"):
            logs.setup("INFO", "xml")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


# ---- metrics ---------------------------------------------------------------------------------

def scrape(port: int, path: str = "/metrics") -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read().decode()


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) ([0-9.e+-]+|NaN|\+Inf)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_port_serves_metrics_only(stack):
    port = stack.metrics_ports["coordinator"]
    assert "echospec_rpc_in_flight" in scrape(port)
    for path in ("/", "/health", "/metrics/x", "/favicon.ico"):
        with pytest.raises(urllib.error.HTTPError) as ei:
            scrape(port, path)
        assert ei.value.code == 404


def test_vllm_named_metrics_in_seconds_and_errors_by_code(stack):
    port = stack.metrics_ports["coordinator"]
    before = samples(scrape(port))
    with grpc.insecure_channel(stack.target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        rs = [stub.Complete(cpb.CompleteRequest(text="a b a b a b a", max_tokens=16,
                                                spec=common_pb2.SPEC_MODE_ON), timeout=60).result
              for _ in range(2)]
        with pytest.raises(grpc.RpcError):
            stub.Complete(cpb.CompleteRequest(text=""), timeout=60)
        call = stub.Generate(cpb.GenerateRequest(text="a b c", max_tokens=2000), timeout=60)
        next(call)
        inflight = samples(scrape(port))
        call.cancel()
    time.sleep(0.3)
    after = samples(scrape(port))

    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert inflight["echospec_num_requests_running"] == 1
    assert inflight['echospec_rpc_in_flight{method="/echospec.v1.CoordinatorService/Generate"}'] == 1
    assert after["echospec_num_requests_running"] == 0
    assert d("echospec_prompt_tokens_total") >= sum(r.prompt_tokens for r in rs)
    assert d("echospec_generation_tokens_total") >= sum(r.completion_tokens for r in rs)
    assert d("echospec_spec_decode_num_drafts_total") >= sum(r.stats.tries for r in rs)
    assert d("echospec_spec_decode_num_accepted_tokens_total") >= sum(r.stats.hits for r in rs)
    assert d("echospec_spec_decode_num_draft_tokens_total") >= sum(r.stats.draft_tokens for r in rs)
    assert d('echospec_request_success_total{finished_reason="length"}') == 2
    assert d('echospec_request_errors_total{code="INVALID_ARGUMENT"}') == 1
    assert d('echospec_request_errors_total{code="CANCELLED"}') == 1
    assert d('echospec_rpc_finished_total{code="CANCELLED",method="/echospec.v1.CoordinatorService/Generate"}') == 1
    assert d("echospec_time_to_first_token_seconds_count") == 3   # the refused one has no token
    assert d("echospec_e2e_request_latency_seconds_count") == 4
    assert d("echospec_time_per_output_token_seconds_count") >= 2
    # seconds, not ms: a tiny-model request takes well under 10 s and more than 10 us
    e2e_mean = d("echospec_e2e_request_latency_seconds_sum") / 4
    assert 1e-5 < e2e_mean < 10
    assert "echospec_decode_step_seconds_count" in after and "echospec_decode_step_ms_count" not in after
    # the verifier's and the draft's RPCs are on the same /metrics (threads mode: one process)
    assert any(k.startswith('echospec_rpc_finished_total{code="OK",method="/echospec.v1.VerifierService/')
               for k in after)
    assert any("/echospec.v1.DraftService/" in k for k in after)


def test_processes_mode_serves_metrics_on_every_service(model):
    st = start_stack(model, n_ctx=256, n_threads=1, metrics_port=0, processes=True, http_port=0)
    try:
        assert set(st.metrics_ports) == {"coordinator", "verifier", "draft", "gateway"}
        with grpc.insecure_channel(st.target) as ch:
            coordinator_pb2_grpc.CoordinatorServiceStub(ch).Complete(
                cpb.CompleteRequest(text="a b a b", max_tokens=4, spec=common_pb2.SPEC_MODE_ON),
                timeout=60)
        for name, svc in (("verifier", "VerifierService"), ("draft", "DraftService"),
                          ("coordinator", "CoordinatorService")):
            text = scrape(st.metrics_ports[name])
            assert f'method="/echospec.v1.{svc}/' in text, (name, text[:500])
        assert "echospec_time_to_first_token_seconds" in scrape(st.metrics_ports["coordinator"])
        # the gateway's own, in its process: its HTTP requests
        body = json.dumps({"prompt": "a b", "max_tokens": 2}).encode()
        urllib.request.urlopen(urllib.request.Request(
            st.http_url + "/v1/completions", data=body,
            headers={"Content-Type": "application/json"}), timeout=60).read()
        assert 'echospec_http_requests_total{code="200",route="/v1/completions"} 1.0' in \
            scrape(st.metrics_ports["gateway"])
    finally:
        st.stop()


# ---- the code a call is logged with --------------------------------------------------------------

class _EndedContext:
    """A servicer context of a call that is no longer active, `remaining` s before its deadline."""

    def __init__(self, remaining):
        self.remaining = remaining

    def code(self):
        return None

    def is_active(self):
        return False

    def time_remaining(self):
        return self.remaining


@pytest.mark.parametrize("remaining, name", [
    (-0.01, "DEADLINE_EXCEEDED"), (0.0, "DEADLINE_EXCEEDED"),
    # the client's deadline fires first (its timer started before the call reached the server):
    # its cancel arrives a few ms before the server's deadline, measured under load up to 4.5 ms
    (0.0045, "DEADLINE_EXCEEDED"),
    (0.5, "CANCELLED"), (None, "CANCELLED")])
def test_a_client_deadline_is_logged_as_deadline_exceeded_not_cancelled(remaining, name):
    from echospec.services.rpc.grpc_util import status_name
    assert status_name(_EndedContext(remaining)) == name
