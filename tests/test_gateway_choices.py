"""What agent frameworks send through the official `openai` client: a `model` the gateway checks
(404 model_not_found for another one, unless --allow-any-model), `stop` of at most 4."""
from __future__ import annotations

import httpx
import openai
import pytest

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
