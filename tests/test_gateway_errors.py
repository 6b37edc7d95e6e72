"""The gateway's error answers, its ASGI app in-process with no coordinator behind it (nothing
listens on its target: a request that passes every check gets 503).

A body that parses as JSON but cannot become a request (a lone surrogate, an integer too large
for a float or of too many digits, a tool-call history, a top_p that rounds to 0) is a 400 in
OpenAI's error shape naming the field, with a short message however large the bad value; a body
too large is a 413 with a code; metadata fields newer openai SDKs send are accepted. A bug in a
route still answers in OpenAI's shape, and a request timeout that runs out is named in the 504."""
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


# -- a body that parses but cannot become a request ------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_too_large_is_413_with_a_code(chunked):
    # was: {"error": {..., "code": null}} while every 400 carries one
    app = gapp.create_app(GatewayConfig(coordinator_target="127.0.0.1:1", max_body_bytes=64))
    body = b'{"prompt": "' + b"x" * 100 + b'"}'
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", content=iter([body]) if chunked else body,
                   headers={"Content-Type": "application/json"})
        ok = _post(c, "/v1/completions", '{"prompt": ')   # a 400 (not JSON), for its code
    err = _assert_openai_error(r, 413, None)
    assert err["message"] == "request body larger than 64 bytes"
    assert err["type"] == "invalid_request_error"
    assert err["code"] == _assert_openai_error(ok, 400, None)["code"] == "invalid_argument"


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


@pytest.mark.parametrize("raw", [
    '{"prompt": "hi", "max_tokens": 2, "seed": %s}' % ("9" * 4301),
    '{"prompt": "hi", "foo": %s}' % ("9" * 4301)], ids=["seed", "unknown-field"])
def test_an_integer_of_too_many_digits_is_400_not_500(gateway, raw, caplog):
    # was: a 500 and a traceback in the log per request (Python's int() limit of 4300 digits)
    import logging
    with caplog.at_level(logging.INFO):
        err = _assert_openai_error(_post(gateway, "/v1/completions", raw), 400, None)
    assert err["message"] == "the request body holds an integer of more than 4300 digits", err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_huge_bad_value_gives_a_short_error(gateway):
    # was: the whole value (and an unknown key twice: in message and param) in the 400 body
    key = "k" * 3_000_000
    r = _post(gateway, "/v1/completions", '{"prompt": "hi", "%s": 1}' % key)
    assert r.status_code == 400 and len(r.content) < 2000, len(r.content)
    err = r.json()["error"]
    assert "characters, some left out" in err["message"] and len(err["param"]) <= 200
    r = _post(gateway, "/v1/chat/completions",
              '{"messages": [{"role": "%s", "content": "hi"}]}' % ("x" * 3_000_000))
    assert r.status_code == 400 and len(r.content) < 2000, len(r.content)
    assert r.json()["error"]["message"].startswith("messages[0].role must be one of")


def test_a_tool_call_history_is_taken_and_a_misplaced_one_named(gateway):
    # OpenAI's usual assistant turn with tool_calls (content null) and the tool's answer pass the
    # gateway's checks (the request then reaches the coordinator: 503, none behind); tool calls on
    # a user message are a 400 naming them
    raw = ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null, '
           '"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},'
           ' {"role": "tool", "tool_call_id": "c1", "content": "42"}]}')
    _assert_openai_error(_post(gateway, "/v1/chat/completions", raw), 503, None)
    raw = ('{"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": "c1", "type": "function", '
           '"function": {"name": "f", "arguments": "{}"}}]}]}')
    err = _assert_openai_error(_post(gateway, "/v1/chat/completions", raw), 400, "messages[0].tool_calls")
    assert "only an assistant message carries tool calls" in err["message"]


def test_a_top_p_that_rounds_to_zero_says_so(gateway):
    # was: "top_p must be in (0, 1] ..., got 0.0" for a value the user sent inside (0, 1]
    err = _assert_openai_error(_post(gateway, "/v1/completions", '{"prompt": "hi", "top_p": 1e-50}'),
                               400, "top_p")
    assert err["message"].startswith("top_p 1e-50 rounds to 0 as the float32"), err


@pytest.mark.parametrize("name", ["prompt_cache_key", "safety_identifier"])
def test_newer_openai_metadata_fields_are_accepted(gateway, name):
    # was: 400 "Unrecognized request argument" for fields newer openai SDKs send, which change
    # nothing in what is generated (the request then reaches the coordinator: 503, none behind)
    r = _post(gateway, "/v1/chat/completions",
              '{"messages": [{"role": "user", "content": "hi"}], "%s": "abc"}' % name)
    _assert_openai_error(r, 503, None)


# -- errors of the gateway itself ------------------------------------------------------------------

def test_unexpected_error_keeps_openai_shape(gateway, monkeypatch):
    # a bug anywhere in a route still answers in OpenAI's error shape (was: text/plain
    # "Internal Server Error", which the openai client cannot parse into an error message)
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(api, "parse_request", broken)
    r = _post(gateway, "/v1/completions", '{"prompt": "hi"}')
    err = _assert_openai_error(r, 500, None)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]


def test_the_gateway_names_its_request_timeout_when_it_runs_out():
    # was: only gRPC's "Stream removed (Deadline Exceeded)" in the 504
    import grpc

    from echospec.services.gateway.upstream import _error
    exc = grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                               grpc.aio.Metadata(), details="Deadline Exceeded")
    err = _error(exc, "127.0.0.1:50051", 0.5)
    assert err.code == "DEADLINE_EXCEEDED"
    assert err.message == ("the generation did not finish within the gateway's request timeout of "
                           "0.5 s (--request-timeout-s, ECHOSPEC_REQUEST_TIMEOUT_S) (Deadline Exceeded)")
    assert api.error_from_status(err.code, err.message).status == 504
