"""What agent frameworks send through the official `openai` client: a `model` the gateway checks
(404 model_not_found for another one, unless --allow-any-model), `stop` of at most 4; and the
gateway's own /metrics."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from echospec.services.common.config import GatewayConfig
from echospec.services.gateway import server as gserver
from echospec.stack import start_stack

MODEL = "n_ctx_train-8192"   # the stack's model id in /v1/models: its GGUF file's stem


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
        assert f"'gpt-4o' is not served here (this server serves '{MODEL}'" in err["message"]
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
