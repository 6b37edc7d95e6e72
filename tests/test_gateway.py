"""The OpenAI-compatible HTTP gateway (services/gateway) in front of a tiny-model stack, driven by
the official `openai` client and by raw httpx: same text as the gRPC API, usage, error classes and
codes, SSE framing, and a client disconnect that cancels the generation."""
from __future__ import annotations

import json
import logging
import socket
import time

import grpc
import httpx
import openai
import pytest

from echospec.services.common.config import GatewayConfig
from echospec.stack import start_stack
from echospec.services.gateway import openai_api as api
from echospec.services.gateway import server as gserver
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, verifier_pb2 as vpb
from echospec.v1 import verifier_pb2_grpc

ON, OFF = common_pb2.SPEC_MODE_ON, common_pb2.SPEC_MODE_OFF
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat on"}]
MODEL = "n_ctx_train-8192"   # the stack's model id in /v1/models: its GGUF file's stem


@pytest.fixture(scope="module")
def stack(tiny_model):
    # n_ctx 8192: a long generation (8000 tokens, about a second) outlasts a disconnect
    st = start_stack(tiny_model(n_ctx_train=8192), spec=False, n_ctx=8192, n_threads=1, k=4,
                     http_port=0)
    yield st
    st.stop(0.5)


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.target) as ch:
        yield coordinator_pb2_grpc.CoordinatorServiceStub(ch)


@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def grpc_complete(stub, **kw) -> cpb.GenerationResult:
    return stub.Complete(cpb.CompleteRequest(**kw), timeout=60).result


def grpc_messages():
    return [cpb.ChatMessage(**m) for m in MESSAGES]


def sse_events(resp: httpx.Response) -> list[bytes]:
    """The raw `data:` payloads of an SSE response, split on the blank line between events."""
    raw = b"".join(resp.iter_bytes())
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    for e in events:
        assert e.startswith(b"data: "), e
    return [e[len(b"data: "):] for e in events]


# -- the same text as gRPC ------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["on", "off"])
def test_chat_matches_grpc_complete(client, stub, spec):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                       extra_body={"spec": spec})
    g = grpc_complete(stub, messages=grpc_messages(), max_tokens=40, spec=ON if spec == "on" else OFF)
    assert r.object == "chat.completion" and len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == g.text
    assert r.choices[0].finish_reason == api.finish_reason(g)
    assert r.usage.prompt_tokens == g.prompt_tokens
    assert r.usage.completion_tokens == g.completion_tokens == len(g.token_ids)
    assert r.usage.total_tokens == g.prompt_tokens + g.completion_tokens
    ext = r.model_extra["echospec"]
    assert ext["spec_enabled"] is (spec == "on") and ext["spec_enabled"] == g.spec_enabled
    st = ext["stats"]
    assert st["hits"] + st["kv_rolls"] == st["draft_tokens"]
    # the counts follow the cost model's timing-dependent K: checked for consistency, not equality
    assert set(st["sources"]) <= {"suffix", "shared", "numbered", "prediction"}
    assert sum(x["draft_tokens"] for x in st["sources"].values()) == st["draft_tokens"]
    if spec == "on":
        assert st["tries"] > 0      # the tiny model repeats itself: drafts are proposed
    else:
        assert st["tries"] == 0 and ext["spec_reason"]


def test_chat_stream_matches_non_stream(client, stub):
    g = grpc_complete(stub, messages=grpc_messages(), max_tokens=40, spec=ON)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"spec": "on"}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == g.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == api.finish_reason(g)
    assert finals[0].model_extra["echospec"]["spec_enabled"] is True
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == g.completion_tokens
    assert chunks[-1].usage.prompt_tokens == g.prompt_tokens
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_completions_text_and_token_prompts(client, stub, stream):
    ids = list(stub.Tokenize(cpb.TokenizeRequest(text="the cat sat")).token_ids)
    g = grpc_complete(stub, text="the cat sat", max_tokens=30)
    for prompt in ("the cat sat", ids, [ids]):
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=30, stream=True))
        else:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30)
            text = r.choices[0].text
            assert r.object == "text_completion"
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (g.prompt_tokens,
                                                                        g.completion_tokens)
        assert text == g.text


@pytest.mark.parametrize("temperature", [-1.0, 0.0, 0.7, 2.5, 30.0])
def test_temperature_one_rule_over_http_and_grpc(client, stub, temperature):
    """Any finite temperature, <= 0 greedy, on both surfaces (HTTP refused -1 and 2.5 with
    "must be in [0, 2]" while gRPC took them); the same value gives the same text."""
    g = grpc_complete(stub, text="the cat sat", max_tokens=12, temperature=temperature, seed=11)
    r = client.completions.create(model=MODEL, prompt="the cat sat", max_tokens=12, temperature=temperature,
                                  seed=11)
    assert r.choices[0].text == g.text
    if temperature <= 0:
        assert g.text == grpc_complete(stub, text="the cat sat", max_tokens=12).text   # greedy


def test_temperature_beyond_float32_refused_over_http_and_grpc(client, stub):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=1e39)
    assert ei.value.body["param"] == "temperature"
    assert ei.value.body["message"] == ("temperature must be a finite float32 (within about ±3.4e38; "
                                        "<= 0 is greedy), got 1e+39")
    with pytest.raises(grpc.RpcError) as gi:    # protobuf stores 1e39 in the float32 field as inf
        grpc_complete(stub, text="hi", max_tokens=2, temperature=1e39)
    assert gi.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature must be finite" in gi.value.details()


def test_prediction_same_text_and_counts(client, stub):
    base = grpc_complete(stub, messages=grpc_messages(), max_tokens=40, spec=OFF)
    # a prediction that agrees for a while, then diverges
    pred = base.text[: len(base.text) // 2] + " something else entirely"
    for stream in (False, True):
        kw = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                  prediction={"type": "content", "content": pred}, extra_body={"spec": "on"})
        g = grpc_complete(stub, messages=grpc_messages(), max_tokens=40, spec=ON, prediction=pred)
        if stream:
            chunks = list(client.chat.completions.create(stream=True,
                                                         stream_options={"include_usage": True}, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            r = client.chat.completions.create(**kw)
            text, usage = r.choices[0].message.content, r.usage
        assert text == g.text == base.text     # a prediction changes speed, never output
        d = usage.completion_tokens_details
        assert d.accepted_prediction_tokens == g.stats.accepted_prediction_tokens
        assert d.rejected_prediction_tokens == g.stats.rejected_prediction_tokens


def test_usage_maps_spec_stats_fields():
    r = cpb.GenerationResult(text="x", prompt_tokens=7, completion_tokens=5,
                             finish_reason=common_pb2.FINISH_REASON_CONTEXT,
                             stats=common_pb2.SpecStats(accepted_prediction_tokens=3,
                                                        rejected_prediction_tokens=2,
                                                        cached_prompt_tokens=4, hits=6))
    u = api.usage(r)
    assert u["total_tokens"] == 12
    assert u["completion_tokens_details"] == {"accepted_prediction_tokens": 3,
                                              "rejected_prediction_tokens": 2}
    assert u["prompt_tokens_details"] == {"cached_tokens": 4}
    assert api.finish_reason(r) == "length"
    e = api.extras(r)
    assert e["finish_reason"] == "context" and e["stats"]["hits"] == 6
    assert e["stats"]["accepted_prediction_tokens"] == 3


def test_models_and_health(stack, client):
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == MODEL == "n_ctx_train-8192"   # the GGUF file's stem
    r = httpx.get(stack.http_url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "SERVING"}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert r.model == models[0].id


# -- errors ----------------------------------------------------------------------------------------

def test_tree_nodes_is_taken_and_changes_no_byte(client):
    # was: "Unrecognized request argument" (gRPC requests had it)
    def text(**extra):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                           extra_body=extra)
        return r.choices[0].message.content
    want = text(spec="off")
    assert text(spec="on", tree_nodes=8) == want == text(spec="on", tree_nodes=-1)


@pytest.mark.parametrize("extra, param", [
    ({"n": 5}, "n"),            # over the gateway's n_limit, 4 by default
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),   # OpenAI's most: 4
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stop": [3]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"spec": "maybe"}, "spec"),
    ({"tree_nodes": 64}, "tree_nodes"),    # the coordinator's range, 1..63 (-1: chains)
    ({"tree_nodes": -2}, "tree_nodes"),
    ({"tree_nodes": "8"}, "tree_nodes"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"prediction": {"type": "content"}}, "prediction"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_bad_fields_raise_bad_request(client, extra, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
    body.update(extra)
    with pytest.raises(openai.BadRequestError) as ei:
        client.post("/chat/completions", body=body, cast_to=object)
    err = ei.value.body
    assert ei.value.status_code == 400 and err["param"] == param and err["type"] == \
        "invalid_request_error" and err["message"]
    assert err["code"] == "invalid_argument"   # as the coordinator's refusals
    if "top_p" in extra:   # the coordinator's rule and wording
        assert err["message"] == f"top_p must be in (0, 1] (leave it unset or 1 for off), got {extra['top_p']}"


def test_coordinator_refusals_are_400(client, stack):
    # limits the coordinator checks (max_tokens), the verifier (prompt beyond n_ctx): both 400
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10 ** 6)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="the cat " * 8000, max_tokens=4, stream=True)
    assert ei.value.body["code"] == "invalid_argument"
    r = httpx.post(stack.http_url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(stack.http_url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("code, status", [("INVALID_ARGUMENT", 400), ("UNAUTHENTICATED", 401),
                                          ("RESOURCE_EXHAUSTED", 429), ("UNAVAILABLE", 503),
                                          ("DEADLINE_EXCEEDED", 504), ("INTERNAL", 500)])
def test_status_mapping(code, status):
    e = api.error_from_status(code, "why")
    assert e.status == status and e.body()["error"]["message"] == "why"


def test_unreachable_coordinator_is_503_and_deadline_504(stack):
    from ports import unused_port
    dead = unused_port()                   # nothing listens here (tests/ports.py)
    down = gserver.start(GatewayConfig(port=0, coordinator_target=f"127.0.0.1:{dead}",
                                       model_name="m"))
    slow = gserver.start(GatewayConfig(port=0, coordinator_target=stack.target,
                                       request_timeout_s=0.005))
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{down.port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as ei:
            c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
        assert ei.value.status_code == 503
        # says what it means before gRPC's list of addresses and socket errors
        assert (f"the gateway cannot reach the coordinator at 127.0.0.1:{dead} ("
                in ei.value.body["message"]), ei.value.body
        assert httpx.get(f"http://127.0.0.1:{down.port}/health").status_code == 503
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{slow.port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as ei:
            c.completions.create(model=MODEL, prompt="the cat", max_tokens=900,
                                 extra_body={"spec": "off"})
        assert ei.value.status_code == 504
    finally:
        down.stop(0)
        slow.stop(0)


# -- SSE framing and UTF-8 -------------------------------------------------------------------------

def test_sse_events_are_json_and_end_with_done(stack):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "stream": True}
    with httpx.stream("POST", stack.http_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == b"[DONE]"
    objs = [json.loads(e.decode("utf-8")) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
    assert objs[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_sse_never_splits_utf8(smollm2_path):
    """SmolLM2 continues CJK text with CJK characters of several tokens each; every event's bytes
    must be valid UTF-8 on their own, and the events must add up to the non-streamed text."""
    st = start_stack(smollm2_path, n_ctx=256, n_threads=1, http_port=0, model_name="m")
    try:
        prompt = "日本語の文章です。東京は日本の首都です。京都は古い都です。大阪は"
        body = {"model": "m", "prompt": prompt, "max_tokens": 24, "stream": True}
        with httpx.stream("POST", st.http_url + "/v1/completions", json=body, timeout=120) as r:
            events = sse_events(r)
        assert events[-1] == b"[DONE]"
        pieces = [json.loads(e.decode("utf-8", errors="strict"))["choices"][0]["text"]
                  for e in events[:-1]]
        text = "".join(pieces)
        full = httpx.post(st.http_url + "/v1/completions", timeout=120,
                          json={**body, "stream": False}).json()["choices"][0]["text"]
        assert text == full
        assert sum(1 for ch in text if len(ch.encode()) >= 3) >= 3, text   # CJK came out
        # U+FFFD only where README says: at the very end, for a character max_tokens cut
        assert "\ufffd" not in text.rstrip("\ufffd")
        nonempty = [p for p in pieces if p]
        assert len(nonempty) >= 3 and all("\ufffd" not in p for p in nonempty[:-1])
    finally:
        st.stop(0.5)


# -- disconnect -------------------------------------------------------------------------------------

def test_disconnect_mid_stream_cancels_and_frees_the_session(stack, caplog):
    coord = stack._servers["coordinator"]
    metrics = coord.handle.rpc_metrics
    method = "/echospec.v1.CoordinatorService/Generate"

    def cancelled() -> float:
        return metrics.registry.get_sample_value(
            "echospec_rpc_finished_total", {"method": method, "code": "CANCELLED"}) or 0.0

    with grpc.insecure_channel(stack.verifier_target) as ch:
        vstub = verifier_pb2_grpc.VerifierServiceStub(ch)

        def sessions() -> int:
            return vstub.GetConfig(vpb.GetConfigRequest()).active_sessions

        before = cancelled()
        body = {"model": MODEL, "prompt": "the cat", "max_tokens": 8000, "stream": True, "spec": "off"}
        with caplog.at_level(logging.INFO, logger="echospec.gateway"):
            with httpx.stream("POST", stack.http_url + "/v1/completions", json=body) as r:
                it = r.iter_lines()
                first = next(it)
                assert first.startswith("data: ")
                assert sessions() == 1          # the generation runs
            # the response is closed: the gateway must cancel the gRPC call
            deadline = time.monotonic() + 10
            while (cancelled() == before or sessions() != 0) and time.monotonic() < deadline:
                time.sleep(0.02)
        assert cancelled() == before + 1
        assert sessions() == 0
        gone = [r for r in caplog.records if r.name == "echospec.gateway"
                and r.getMessage() == "client disconnected: generation cancelled"]
        assert len(gone) == 1, [r.getMessage() for r in caplog.records]


def test_disconnect_before_a_whole_answer_cancels(stack):
    """Not streamed: a client that gives up waiting (its timeout) also cancels the generation."""
    coord = stack._servers["coordinator"]
    method = "/echospec.v1.CoordinatorService/Complete"

    def cancelled() -> float:
        return coord.handle.rpc_metrics.registry.get_sample_value(
            "echospec_rpc_finished_total", {"method": method, "code": "CANCELLED"}) or 0.0

    before = cancelled()
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 8000, "spec": "off"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.http_url + "/v1/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cancelled() == before + 1


def _coordinator_record(caplog, rid: str):
    """The coordinator's one INFO ``request`` line of the call with x-request-id ``rid``."""
    return next((r for r in caplog.records if r.getMessage() == "request" and
                 getattr(r, "fields", {}).get("request_id") == rid), None)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_before_the_first_token_cancels_the_prefill(stack, held_prefill, caplog, path):
    """A stream whose client leaves before any output: the gateway cancels the gRPC call while the
    prefill still runs, not once the first token is out. The verifier's prefill is held here until
    the test lets it go, standing for a long prompt on a slow host: the cancel must reach the
    coordinator while it is held (a gateway that waits for the first message never sends it)."""
    coord = stack._servers["coordinator"]
    method = "/echospec.v1.CoordinatorService/Generate"

    def cancelled() -> float:
        return coord.handle.rpc_metrics.registry.get_sample_value(
            "echospec_rpc_finished_total", {"method": method, "code": "CANCELLED"}) or 0.0

    entered, release = held_prefill
    rid = "gw-early-leave" + path.replace("/", "-")
    body = {"model": MODEL, "max_tokens": 50, "stream": True, "spec": "off"}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "the cat sat on"})
    raw = json.dumps(body).encode()
    before = cancelled()
    host, port = stack.http_url.removeprefix("http://").rsplit(":", 1)
    try:
        with caplog.at_level(logging.INFO):
            with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:
                s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nx-request-id: {rid}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
                          .encode() + raw)
                assert entered.wait(30), "the prefill never started"
            deadline = time.monotonic() + 20
            while cancelled() == before and time.monotonic() < deadline:
                time.sleep(0.02)
            assert cancelled() == before + 1, "the gRPC call was not cancelled during the prefill"
            release.set()
            rec = None
            deadline = time.monotonic() + 20
            while rec is None and time.monotonic() < deadline:
                rec = _coordinator_record(caplog, rid)
                time.sleep(0.02)
    finally:
        release.set()
    assert rec is not None and rec.fields["code"] == "CANCELLED", rec and rec.fields
    assert rec.fields["tokens_out"] == 0, rec.fields
    gone = [r for r in caplog.records if r.name == "echospec.gateway"
            and r.getMessage() == "client disconnected: generation cancelled"]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO
    with grpc.insecure_channel(stack.verifier_target) as ch:   # the session is freed
        vstub = verifier_pb2_grpc.VerifierServiceStub(ch)
        deadline = time.monotonic() + 20
        while vstub.GetConfig(vpb.GetConfigRequest()).active_sessions and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        assert vstub.GetConfig(vpb.GetConfigRequest()).active_sessions == 0


def test_disconnect_while_sending_the_body_is_one_info_line(stack, caplog):
    """A client that leaves in the middle of its request body: nothing can be answered; the
    gateway says so in one INFO line, with no ERROR and no traceback (uvicorn's included)."""
    host, port = stack.http_url.removeprefix("http://").rsplit(":", 1)
    with caplog.at_level(logging.INFO):
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
            time.sleep(0.3)

        def seen():
            return [r for r in caplog.records if r.levelno >= logging.ERROR or
                    (r.name == "echospec.gateway" and "request body" in r.getMessage())]

        deadline = time.monotonic() + 20
        while not seen() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)   # anything logged after the line would be this request's too
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    lines = [r for r in seen() if r.name == "echospec.gateway"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in lines]


def test_no_free_session_is_429(tiny_model):
    """max_sessions 1: while a stream holds the verifier's one session, another request is
    RESOURCE_EXHAUSTED, which the openai client sees as RateLimitError (HTTP 429)."""
    st = start_stack(tiny_model(n_ctx_train=8192), n_ctx=8192, n_threads=1, max_sessions=1,
                     prefix_cache=False, http_port=0, model_name="m")
    try:
        c = openai.OpenAI(base_url=st.http_url + "/v1", api_key="x", max_retries=0, timeout=60)
        c.completions.create(model="m", prompt="warm", max_tokens=1)   # the client's first-call cost
        body = {"model": "m", "prompt": "the cat", "max_tokens": 8000, "stream": True, "spec": "off"}
        with httpx.stream("POST", st.http_url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()         # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")      # the one session is in use
            with pytest.raises(openai.RateLimitError) as ei:
                c.completions.create(model="m", prompt="a dog", max_tokens=4)
            assert ei.value.status_code == 429 and ei.value.body["type"] == "rate_limit_error"
        c.close()
    finally:
        st.stop(0.5)


def test_deploy_healthcheck_probes_the_gateway(stack):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "deploy" / "healthcheck.py"
    spec = importlib.util.spec_from_file_location("deploy_healthcheck_gw", path)
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    target = stack.http_url.removeprefix("http://")
    assert hc.main([target, "--http"]) == 0
    assert hc.main([target]) == 1                        # HTTP is not gRPC: the probe says no


def test_openai_fields_at_their_defaults_are_accepted():
    # was: 400 "Unrecognized request argument supplied: modalities" for a client's null default
    body = {"messages": MESSAGES, "modalities": None, "audio": None, "reasoning_effort": None,
            "web_search_options": None}
    assert api.parse_request(body, chat=True).request.max_tokens == 0
    assert api.parse_request({"messages": MESSAGES, "modalities": ["text"]}, chat=True)
    with pytest.raises(api.ApiError) as ei:    # chat fields are not completion fields
        api.parse_request({"prompt": "hi", "modalities": None}, chat=False)
    assert ei.value.param == "modalities"


def test_max_tokens_and_max_completion_tokens_must_agree(client):
    """Both given and different: 400 naming both (max_completion_tokens silently won); equal: one limit."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 9, "max_completion_tokens": 7}
    with pytest.raises(openai.BadRequestError) as ei:
        client.post("/chat/completions", body=body, cast_to=object)
    err = ei.value.body
    assert ei.value.status_code == 400 and err["param"] == "max_completion_tokens"
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_argument"
    assert err["message"] == ("max_tokens (9) and max_completion_tokens (7) differ: give one of them "
                              "(they name the same limit)")
    assert api.parse_request({"messages": MESSAGES, "max_tokens": 7, "max_completion_tokens": 7},
                             chat=True).request.max_tokens == 7
    assert api.parse_request({"messages": MESSAGES, "max_tokens": 5}, chat=True).request.max_tokens == 5
    assert api.parse_request({"messages": MESSAGES, "max_completion_tokens": 6},
                             chat=True).request.max_tokens == 6
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, max_completion_tokens=3)
    assert r.usage.completion_tokens <= 3


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -3])
def test_max_tokens_below_one_names_the_range_over_http(client, name, value):
    """HTTP refuses 0 (it asks for no tokens) and says the range (was: "must be >= 1, got 0")."""
    body = {"model": MODEL, "messages": MESSAGES, name: value}
    with pytest.raises(openai.BadRequestError) as ei:
        client.post("/chat/completions", body=body, cast_to=object)
    assert ei.value.body["param"] == name
    assert ei.value.body["message"] == (f"{name} must be in [1, 8192] (leave it out for the "
                                        f"server's default), got {value}")


def test_max_tokens_messages_give_the_coordinators_own_range(client, stack, monkeypatch):
    # was: 0 said "[1, max_tokens_limit] (the server's limit, 8192 by default)", 1e9 "[1, 8192]":
    # the gateway's guess beside the coordinator's number, which need not be 8192
    import dataclasses
    servicer = stack._servers["coordinator"].servicer
    monkeypatch.setattr(servicer, "config", dataclasses.replace(servicer.config, max_tokens_limit=300))
    for value, message in ((0, "max_tokens must be in [1, 300] (leave it out for the server's "
                               "default), got 0"),
                           (10 ** 9, "max_tokens must be in [1, 300], got 1000000000")):
        for stream in (False, True):
            r = httpx.post(stack.http_url + "/v1/completions", timeout=60,
                           json={"prompt": "hi", "max_tokens": value, "stream": stream})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["message"], err["param"], err["code"]) == \
                (message, "max_tokens", "invalid_argument"), err
    r = httpx.post(stack.http_url + "/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 300})
    assert r.status_code == 200, r.text


def test_max_tokens_below_one_without_a_coordinator_gives_the_default_range():
    # the limit cannot be asked: the message says where the range's upper end comes from
    from starlette.testclient import TestClient
    from echospec.services.gateway import app as gapp
    with TestClient(gapp.create_app(GatewayConfig(coordinator_target="127.0.0.1:1"))) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (
        "max_tokens must be in [1, max_tokens_limit] (the server's limit, 8192 by default); "
        "leave it out for the server's default, got 0")


def test_max_tokens_zero_over_grpc_is_the_server_default(stub):
    """proto3 cannot tell 0 from unset: 0 means the coordinator's default (GetInfo's max_tokens_default)."""
    default = stub.GetInfo(cpb.GetInfoRequest(), timeout=10).max_tokens_default
    g0 = grpc_complete(stub, text="the cat sat", max_tokens=0)
    assert g0.token_ids == grpc_complete(stub, text="the cat sat", max_tokens=default).token_ids
    assert g0.token_ids == grpc_complete(stub, text="the cat sat").token_ids
    with pytest.raises(grpc.RpcError) as gi:
        grpc_complete(stub, text="the cat sat", max_tokens=-3)
    assert gi.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert gi.value.details() == "max_tokens must be in [1, 8192], got -3"


def test_parse_request_maps_fields():
    p = api.parse_request({
        "model": "x", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}]},
                                   {"role": "user", "content": "hi"}],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "stop": "END", "seed": 2 ** 63, "n": 1, "stream": True,
        "stream_options": {"include_usage": True},
        "prediction": {"type": "content", "content": [{"type": "text", "text": "pred"}]},
        "spec": "on", "k": 6, "top_k": 40, "min_p": 0.05, "draft_namespace": "ns",
        "presence_penalty": 0, "user": "u"}, chat=True)
    r = p.request
    assert p.chat and p.stream and p.include_usage
    assert [(m.role, m.content) for m in r.messages] == [("system", "ab"), ("user", "hi")]
    assert r.max_tokens == 7
    assert (round(r.temperature, 6), round(r.top_p, 6), r.seed) == (0.5, 0.9, 2 ** 63)
    assert list(r.stop) == ["END"] and r.prediction == "pred"
    assert (r.spec, r.k, r.top_k, round(r.min_p, 6), r.draft_namespace) == (ON, 6, 40, 0.05, "ns")
    q = api.parse_request({"prompt": [[5, 6, 7]]}, chat=False).request
    assert list(q.token_ids) == [5, 6, 7] and not q.HasField("top_p") and q.temperature == 0
    assert q.max_tokens == 0 and q.spec == common_pb2.SPEC_MODE_UNSPECIFIED   # server defaults
    # a list of prompts: a request each, sharing the other fields; n choices of each
    p = api.parse_request({"prompt": ["a", [5, 6]], "max_tokens": 3, "stop": "x", "n": 2,
                           "temperature": 1, "seed": 7}, chat=False)
    assert (len(p.requests), p.n, p.choices, p.model) == (2, 2, 4, None)
    assert p.requests[0].text == "a" and list(p.requests[1].token_ids) == [5, 6]
    assert [(r.max_tokens, list(r.stop), r.seed) for r in p.requests] == [(3, ["x"], 7)] * 2
    assert [p.choice_request(i).seed for i in range(4)] == [7, api.choice_seed(7, 1)] * 2
    assert p.choice_request(3).token_ids == p.requests[1].token_ids
    with pytest.raises(api.ApiError) as ei:
        api.parse_request({"prompt": "a", "stream_options": {"include_usage": True}}, chat=False)
    assert ei.value.param == "stream_options"


def test_chat_template_kwargs_enable_thinking():
    req = api.parse_request({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
                            chat=True).request
    assert req.HasField("enable_thinking") and req.enable_thinking is False
    assert not api.parse_request({"messages": MESSAGES}, chat=True).request.HasField("enable_thinking")
    assert not api.parse_request({"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": None}},
                                 chat=True).request.HasField("enable_thinking")   # null: the default
    assert api.complete_request(req).enable_thinking is False          # carried to Complete too
    for kw, param in (({"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking"),
                      ({"tools": []}, "chat_template_kwargs"), ([1], "chat_template_kwargs")):
        with pytest.raises(api.ApiError) as ei:
            api.parse_request({"messages": MESSAGES, "chat_template_kwargs": kw}, chat=True)
        assert ei.value.status == 400 and ei.value.param == param
    with pytest.raises(api.ApiError) as ei:    # a chat field, not a completion one
        api.parse_request({"prompt": "hi", "chat_template_kwargs": {}}, chat=False)
    assert ei.value.param == "chat_template_kwargs"
    assert "applies to /v1/chat/completions" in ei.value.message, ei.value.message
