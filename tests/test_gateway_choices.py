"""What agent frameworks send through the official `openai` client that the gateway takes: a
`model` it checks (404 model_not_found for another one, unless --allow-any-model), `stop` of at
most 4, `n` choices (per-choice seeds, greedy copies, streamed with each choice's index), a list
of prompts on /v1/completions (prompt-major with n), and the gateway's own /metrics."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from echospec.services.common.config import GatewayConfig
from echospec.services.gateway import openai_api as api
from echospec.services.gateway import server as gserver
from echospec.services.gateway.choices import choice_request_id
from echospec.stack import start_stack

MODEL = "n_ctx_train-8192"   # the stack's model id in /v1/models: its GGUF file's stem
SAMPLE = {"temperature": 1.5, "seed": 1234}


@pytest.fixture(scope="module")
def stack(tiny_model):
    st = start_stack(tiny_model(n_ctx_train=8192), spec=False, n_ctx=8192, n_threads=1,
                     http_port=0, metrics_port=0)
    yield st
    st.stop(0.5)


@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def _texts(r) -> list[str]:
    assert [c.index for c in r.choices] == list(range(len(r.choices)))
    return [c.text if hasattr(c, "text") else c.message.content for c in r.choices]


# -- model ----------------------------------------------------------------------------------------

def test_the_served_model_is_taken_and_another_is_404(client, stack):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=3)
    assert r.model == MODEL
    for kw in ({}, {"stream": True}):
        with pytest.raises(openai.NotFoundError) as ei:
            client.chat.completions.create(model="gpt-4o", max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}], **kw)
        err = ei.value.body
        assert ei.value.status_code == 404 and err["code"] == "model_not_found"
        assert err["param"] == "model" and err["type"] == "invalid_request_error"
        assert f'"gpt-4o" is not served here (this server serves "{MODEL}"' in err["message"]
    # the field left out (raw HTTP: curl, scripts) is still the served model, as before
    r = httpx.post(stack.http_url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_allow_any_model_takes_any_name(stack):
    g = gserver.start(GatewayConfig(port=0, coordinator_target=stack.target, allow_any_model=True))
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{g.port}/v1", api_key="x",
                           max_retries=0, timeout=60) as c:
            r = c.completions.create(model="gpt-4o", prompt="the cat", max_tokens=2)
        assert r.model == MODEL   # the one served, whatever the request named
    finally:
        g.stop(0)


# -- stop -----------------------------------------------------------------------------------------

def test_stop_takes_four_and_refuses_five(client):
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=3, stop=["1", "2", "3", "4"])
    assert len(r.choices) == 1
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=3,
                                  stop=["1", "2", "3", "4", "5"])
    assert ei.value.body["param"] == "stop" and "at most 4" in ei.value.body["message"]


# -- n --------------------------------------------------------------------------------------------

def test_choice_seeds_are_splitmix64_outputs():
    # SplitMix64's published first outputs from the states 0 and 42
    assert api.choice_seed(0, 1) == 0xE220A8397B1DCDAF
    assert api.choice_seed(42, 1) == 13679457532755275413
    assert api.choice_seed(42, 0) == 42
    seeds = {api.choice_seed(7, j) for j in range(64)}
    assert len(seeds) == 64
    assert api.choice_seed(2 ** 64 - 1, 3) < 2 ** 64


def test_n_sampled_choices_differ_and_replay_with_the_seed(client):
    kw = dict(model=MODEL, prompt="the cat sat", max_tokens=16, **SAMPLE)
    r = client.completions.create(n=3, **kw)
    texts = _texts(r)
    assert len(texts) == 3 and len(set(texts)) == 3
    assert _texts(client.completions.create(n=3, **kw)) == texts       # the same seed, the same choices
    # choice j is the single request with choice_seed(seed, j): the documented derivation
    for j in (0, 2):
        seed = api.choice_seed(SAMPLE["seed"], j)
        one = client.completions.create(**{**kw, "seed": seed})
        assert one.choices[0].text == texts[j]
        assert r.choices[j].model_extra["echospec"]["seed"] == seed
    assert r.usage.prompt_tokens == one.usage.prompt_tokens   # the prompt once


def test_n_chat_choices_and_their_usage(client):
    msgs = [{"role": "user", "content": "the cat sat on"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, n=2, **SAMPLE)
    assert len(r.choices) == 2 and "echospec" not in (r.model_extra or {})
    parts = []
    for j, c in enumerate(r.choices):
        one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12,
                                             temperature=SAMPLE["temperature"],
                                             seed=api.choice_seed(SAMPLE["seed"], j))
        assert c.message.content == one.choices[0].message.content
        assert c.finish_reason == one.choices[0].finish_reason
        parts.append(one.usage)
    assert r.usage.prompt_tokens == parts[0].prompt_tokens
    assert r.usage.completion_tokens == sum(u.completion_tokens for u in parts)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_n_greedy_gives_identical_choices(client):
    one = client.completions.create(model=MODEL, prompt="a dog", max_tokens=10)
    r = client.completions.create(model=MODEL, prompt="a dog", max_tokens=10, n=4)
    assert _texts(r) == [one.choices[0].text] * 4
    assert r.usage.completion_tokens == 4 * one.usage.completion_tokens
    assert all("seed" not in c.model_extra["echospec"] for c in r.choices)
    msgs = [{"role": "user", "content": "a dog"}]
    one = client.chat.completions.create(model=MODEL, max_tokens=10, messages=msgs)
    texts, finals = [""] * 4, []
    for ch in client.chat.completions.create(model=MODEL, max_tokens=10, n=4, stream=True,
                                             messages=msgs):
        c = ch.choices[0]
        texts[c.index] += c.delta.content or ""
        finals += [c.index] if c.finish_reason else []
    assert texts == [one.choices[0].message.content] * 4 and sorted(finals) == [0, 1, 2, 3]


@pytest.mark.parametrize("stream", [False, True])
def test_later_choices_reuse_the_prompts_kv(client, stream):
    """A prompt's choices run one after another: each after the first starts from the previous
    one's session in the prefix cache (all of the prompt but its last token)."""
    prompt = f"the cat sat on the mat ({stream}) and looked at the dog " * 4
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, n=3, temperature=1.0, seed=9)
    if stream:
        ext = [ch.model_extra["echospec"] for ch in client.completions.create(stream=True, **kw)
               if ch.choices and ch.choices[0].finish_reason]
        prompt_tokens = client.completions.create(**{**kw, "n": 1}).usage.prompt_tokens
    else:
        r = client.completions.create(**kw)
        ext = [c.model_extra["echospec"] for c in r.choices]
        prompt_tokens = r.usage.prompt_tokens
    cached = [e["stats"]["cached_prompt_tokens"] for e in ext]
    assert len(cached) == 3 and cached[0] < prompt_tokens - 1   # a prompt not seen before
    assert cached[1:] == [prompt_tokens - 1] * 2, (cached, prompt_tokens)


def test_n_streamed_matches_non_streamed(client):
    for chat in (False, True):
        kw = dict(model=MODEL, max_tokens=12, n=3, **SAMPLE)
        if chat:
            kw["messages"] = [{"role": "user", "content": "the cat sat on"}]
            whole = client.chat.completions.create(**kw)
            chunks = list(client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw))
        else:
            kw["prompt"] = "the cat sat on"
            whole = client.completions.create(**kw)
            chunks = list(client.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw))
        texts, finals = ["", "", ""], {}
        for ch in chunks[:-1]:
            (c,) = ch.choices
            texts[c.index] += (c.delta.content or "") if chat else c.text
            if c.finish_reason:
                assert c.index not in finals
                finals[c.index] = (c.finish_reason, ch.model_extra["echospec"]["seed"])
        assert texts == _texts(whole)
        assert finals == {j: (whole.choices[j].finish_reason,
                              api.choice_seed(SAMPLE["seed"], j)) for j in range(3)}
        if chat:   # each choice opens with its role
            roles = [ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].delta.role]
            assert sorted(roles) == [0, 1, 2]
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


# -- a list of prompts ----------------------------------------------------------------------------

def test_a_list_of_prompts_gives_one_choice_each_in_order(client, stack):
    prompts = ["the cat", "a dog ran", "one two"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=8) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8)
    assert _texts(r) == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # lists of token ids: the same prompts
    ids = [httpx.post(stack.http_url + "/v1/completions", timeout=60,
                      json={"prompt": p, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
           for p in prompts]
    assert ids == [s.usage.prompt_tokens for s in singles]


def test_token_id_prompts_in_a_list(client, stack):
    from echospec.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc
    import grpc
    with grpc.insecure_channel(stack.target) as ch:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
        ids = [list(stub.Tokenize(cpb.TokenizeRequest(text=t)).token_ids) for t in ("the cat", "a dog")]
    by_text = client.completions.create(model=MODEL, prompt=["the cat", "a dog"], max_tokens=8)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8)
    assert _texts(by_ids) == _texts(by_text)


def test_prompts_and_n_are_prompt_major(client):
    prompts = ["the cat", "a dog ran"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2, **SAMPLE)
    texts = _texts(r)
    assert len(texts) == 4
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=8, n=2, **SAMPLE)
        assert texts[i * 2:i * 2 + 2] == _texts(alone)
    streamed = ["", "", "", ""]
    for ch in client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2,
                                        stream=True, **SAMPLE):
        streamed[ch.choices[0].index] += ch.choices[0].text
    assert streamed == texts


def test_more_prompts_than_run_at_once(client):
    """Six prompts, n_limit 4 generations at once: the last two wait for a slot, streamed too
    (a stream's first chunk waits only for the prompts that start at once)."""
    prompts = [f"the cat {w}" for w in ("sat", "ran", "ate", "saw", "hid", "won")]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6)
    streamed = [""] * 6
    for ch in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, stream=True):
        streamed[ch.choices[0].index] += ch.choices[0].text
    assert streamed == _texts(r) and all(streamed)


@pytest.mark.parametrize("prompt, param", [
    (["a"] * (api.MAX_PROMPTS + 1), "prompt"),
    ([], "prompt"),
    (["the cat", ""], "prompt[1]"),
    (["the cat", 5], "prompt[1]"),
    ([[1, 2], []], "prompt[1]"),
    ([[1, -2]], "prompt[0]"),
    ([["a"]], "prompt[0]"),
])
def test_bad_prompt_lists_name_the_entry(stack, prompt, param):
    r = httpx.post(stack.http_url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_prompt_in_a_list_fails_the_request_naming_it(client, stream):
    # the verifier refuses a prompt beyond its context: the error names the list's entry
    with pytest.raises(openai.BadRequestError) as ei:
        r = client.completions.create(model=MODEL, prompt=["the cat", "the cat " * 9000],
                                      max_tokens=2, n=2, temperature=1, stream=stream)
        list(r) if stream else None
    assert ei.value.body["param"] == "prompt[1]"
    assert ei.value.body["message"].startswith("prompt[1]: ")
    with pytest.raises(openai.BadRequestError) as ei:   # a single prompt: named as before
        client.completions.create(model=MODEL, prompt="the cat " * 9000, max_tokens=2)
    assert ei.value.body["param"] == "prompt"


def test_choice_request_ids():
    assert choice_request_id("abc", 0, 1) == "abc"
    assert choice_request_id("abc", 3, 4) == "abc.3"
    long = "x" * 200
    assert len(choice_request_id(long, 11, 12)) <= 128


# -- /metrics -------------------------------------------------------------------------------------

def _sample(text: str, name: str, **labels) -> float:
    """The value of sample ``name{labels}`` in Prometheus text (0 when it is not there yet)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def test_gateway_metrics_count_routes_codes_latency_and_in_flight(stack, client, held_prefill):
    url = f"http://127.0.0.1:{stack.metrics_ports['gateway']}/metrics"
    before = httpx.get(url).text
    entered, release = held_prefill
    # a stream whose prefill is held: in flight until it is let go
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 4, "stream": True}
    done = []
    t = threading.Thread(target=lambda: done.append(
        httpx.post(stack.http_url + "/v1/completions", json=body, timeout=60).status_code))
    t.start()
    assert entered.wait(30)
    during = httpx.get(url).text
    release.set()
    t.join(30)
    assert done == [200]
    client.completions.create(model=MODEL, prompt="the cat", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="the cat", max_tokens=2)
    httpx.get(stack.http_url + "/v1/models/nope")
    after = httpx.get(url).text
    route = "/v1/completions"
    assert _sample(during, "echospec_http_requests_in_flight", route=route) == 1
    assert _sample(after, "echospec_http_requests_in_flight", route=route) == 0
    for code, more in (("200", 2), ("404", 1)):
        assert (_sample(after, "echospec_http_requests_total", route=route, code=code)
                - _sample(before, "echospec_http_requests_total", route=route, code=code)) == more
    assert (_sample(after, "echospec_http_requests_total", route="/v1/models/{model_id}", code="404")
            - _sample(before, "echospec_http_requests_total", route="/v1/models/{model_id}",
                      code="404")) == 1
    assert (_sample(after, "echospec_http_request_duration_seconds_count", route=route)
            - _sample(before, "echospec_http_request_duration_seconds_count", route=route)) == 3
    # the coordinator's /metrics is another registry: no gateway names there
    coord = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['coordinator']}/metrics").text
    assert "echospec_http_" not in coord and "echospec_rpc_in_flight" in coord


def test_a_client_leaving_a_stream_of_several_choices_cancels_them_all(stack):
    """Two prompts, n 2: both prompts' first choices run when the first chunk is out; the client
    closing the stream cancels both calls, frees both sessions, and the second choices never
    start."""
    import grpc
    import time

    from echospec.v1 import verifier_pb2 as vpb, verifier_pb2_grpc
    registry = stack._servers["coordinator"].handle.rpc_metrics.registry
    method = "/echospec.v1.CoordinatorService/Generate"

    def finished(code: str) -> float:
        return registry.get_sample_value("echospec_rpc_finished_total",
                                         {"method": method, "code": code}) or 0.0

    with grpc.insecure_channel(stack.verifier_target) as ch:
        vstub = verifier_pb2_grpc.VerifierServiceStub(ch)

        def sessions() -> int:
            return vstub.GetConfig(vpb.GetConfigRequest()).active_sessions

        before = {code: finished(code) for code in ("OK", "CANCELLED")}
        # sampling (choices one after another) with top_k 1: greedy's text, which from "the
        # cat" runs to max_tokens on this model (test_gateway's disconnect tests)
        body = {"model": MODEL, "prompt": ["the cat", "the cat"], "n": 2, "max_tokens": 8000,
                "temperature": 1, "top_k": 1, "seed": 5, "stream": True, "spec": "off"}
        with httpx.stream("POST", stack.http_url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()   # kept: a dropped iterator closes the connection
            line = next(lines)
            assert line.startswith("data: {\"id\"") and sessions() == 2, line
        deadline = time.monotonic() + 10
        while (finished("CANCELLED") < before["CANCELLED"] + 2 or sessions()) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)   # a second choice started by mistake would show now
        assert finished("CANCELLED") == before["CANCELLED"] + 2
        assert finished("OK") == before["OK"] and sessions() == 0
