"""Bad input a new user sent while trying the product from its README, one test per find: each
failed (a traceback, a misleading message, a wrong count) before its fix.

The gateway cases run the ASGI app in-process (no coordinator is needed: every request here is
refused before the gateway calls it)."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from echospec.services.common.config import GatewayConfig
from echospec.services.gateway import app as gapp
from echospec.services.gateway import openai_api as api


@pytest.fixture(scope="module")
def gateway():
    # nothing listens on port 1: a request that reached the coordinator would fail with 503
    app = gapp.create_app(GatewayConfig(coordinator_target="127.0.0.1:1"))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _post(client, path: str, raw: str):
    return client.post(path, content=raw.encode("ascii"), headers={"Content-Type": "application/json"})


def _assert_openai_error(r, status: int, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    return err


# -- gateway: JSON that parses but cannot become a request --------------------------------------

@pytest.mark.parametrize("path,raw,param", [
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["\\udfff"], "max_tokens": 2}', "prompt[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\ud800"}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"stop": ["ok", "\\ud800"]}', "stop[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"prediction": {"type": "content", "content": "\\ud83d"}}',
     "prediction.content"),
    ("/v1/completions", '{"prompt": "hi", "draft_namespace": "\\ud800"}', "draft_namespace"),
    ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}', None),
])
def test_lone_surrogate_is_400_not_500(gateway, path, raw, param):
    # JSON's \uXXXX escapes can spell a lone surrogate; protobuf cannot hold it (was: a 500 with
    # a plain-text body and a UnicodeEncodeError traceback in the log)
    err = _assert_openai_error(_post(gateway, path, raw), 400, param)
    assert "not valid Unicode" in err["message"]


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p"])
def test_integer_too_large_for_a_float_is_400(gateway, name):
    # was: OverflowError in math.isfinite -> 500
    raw = '{"prompt": "hi", "%s": 1%s}' % (name, "0" * 400)
    err = _assert_openai_error(_post(gateway, "/v1/completions", raw), 400, name)
    assert "must be a number" in err["message"] and len(err["message"]) < 200


def test_unexpected_error_keeps_openai_shape(gateway, monkeypatch):
    # a bug anywhere in a route still answers in OpenAI's error shape (was: text/plain
    # "Internal Server Error", which the openai client cannot parse into an error message)
    def broken(body, chat):
        raise RuntimeError("boom")

    monkeypatch.setattr(api, "parse_request", broken)
    r = _post(gateway, "/v1/completions", '{"prompt": "hi"}')
    err = _assert_openai_error(r, 500, None)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
