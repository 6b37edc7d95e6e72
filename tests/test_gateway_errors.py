"""The gateway's error answers, its ASGI app in-process with no coordinator behind it (nothing
listens on its target: a request that passes every check gets 503).

A body that parses as JSON but cannot become a request (a lone surrogate, an integer too large
for a float or of too many digits, a tool-call history, a top_p that rounds to 0) is a 400 in
OpenAI's error shape naming the field, with a short message however large the bad value; a body
too large is a 413 with a code; metadata fields newer openai SDKs send are accepted. A bug in a
route still answers in OpenAI's shape, and a request timeout that runs out is named in the 504."""
from __future__ import annotations

import re

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
    assert err["message"] == ("messages[0].tool_calls: a user message takes no tool_calls (only "
                              "assistant messages do)")


# -- message objects: the keys of each role, and their types ---------------------------------------

def _chat(messages: list) -> str:
    import json
    return json.dumps({"messages": messages})


@pytest.mark.parametrize("message", [
    {"role": "system", "content": "be brief", "name": "rules"},
    {"role": "developer", "content": "be brief", "name": "rules"},
    {"role": "user", "content": "hi", "name": "ann"},
    {"role": "user", "content": "hi", "name": None},
    {"role": "assistant", "content": "hello", "name": "bot", "refusal": None, "annotations": [],
     "audio": None, "function_call": None, "tool_calls": None},
    {"role": "assistant", "content": None, "refusal": "I can't", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
], ids=["system", "developer", "user", "user-name-null", "assistant", "assistant-refusal", "tool"])
def test_every_field_of_a_supported_role_is_taken(gateway, message):
    # OpenAI's message fields of each role (and a tool message's name, which templates show) pass
    # the gateway's checks: the request reaches the coordinator (503, none behind)
    raw = _chat([{"role": "user", "content": "hi"}, message])
    _assert_openai_error(_post(gateway, "/v1/chat/completions", raw), 503, None)


def test_an_assistant_message_the_openai_client_dumps_is_taken(gateway):
    # clients send an answer's message back as it is: the openai client's model_dump() holds every
    # field of its ChatCompletionMessage, null where the answer had none
    from openai.types.chat import ChatCompletionMessage
    dumped = ChatCompletionMessage.model_validate({"role": "assistant", "content": "hello"}).model_dump()
    assert set(dumped) - {"role", "content"}, dumped   # the fields the check must take
    raw = _chat([{"role": "user", "content": "hi"}, dumped, {"role": "user", "content": "and?"}])
    _assert_openai_error(_post(gateway, "/v1/chat/completions", raw), 503, None)


@pytest.mark.parametrize("message, param, message_text", [
    ({"role": "user", "content": "hi", "weird": 1}, "messages[1].weird",
     "Unrecognized argument supplied in messages[1]: weird"),
    ({"role": "assistant", "content": "hi", "tool_call_id": "c1"}, "messages[1].tool_call_id",
     "messages[1].tool_call_id: a assistant message takes no tool_call_id (only tool messages do)"),
    ({"role": "system", "content": "hi", "refusal": None}, "messages[1].refusal",
     "messages[1].refusal: a system message takes no refusal (only assistant messages do)"),
    ({"role": "user", "content": "hi", "name": 5}, "messages[1].name",
     "messages[1].name must be a string, got number"),
    ({"role": "tool", "content": "42", "name": ["f"]}, "messages[1].name",
     "messages[1].name must be a string, got array"),
    ({"role": "assistant", "content": "hi", "refusal": False}, "messages[1].refusal",
     "messages[1].refusal must be a string, got boolean"),
    ({"role": "assistant", "content": "hi", "annotations": {}}, "messages[1].annotations",
     "messages[1].annotations must be an array, got object"),
    ({"role": "assistant", "content": "hi", "audio": {"id": "a1"}}, "messages[1].audio",
     'messages[1].audio is not supported (only null), got {"id": "a1"}'),
    ({"role": "assistant", "content": "hi", "function_call": {"name": "f", "arguments": "{}"}},
     "messages[1].function_call", "messages[1].function_call is not supported: use tool_calls"),
    ({"role": "tool", "content": "42", "tool_call_id": 5}, "messages[1].tool_call_id",
     "messages[1].tool_call_id must be a string, got number"),
], ids=["unknown", "another-roles-key", "refusal-off-assistant", "name-number", "tool-name-array",
        "refusal-boolean", "annotations-object", "audio", "function-call", "tool-call-id-number"])
def test_a_bad_message_key_is_400_naming_the_message_and_key(gateway, message, param, message_text):
    # was: unknown keys and a non-string name taken silently (unknown top-level fields were a 400)
    raw = _chat([{"role": "user", "content": "hi"}, message])
    err = _assert_openai_error(_post(gateway, "/v1/chat/completions", raw), 400, param)
    assert err["message"] == message_text


# -- refused fields: refused whatever their value --------------------------------------------------

@pytest.mark.parametrize("path, name, value, text", [
    ("/v1/chat/completions", "functions", [], "functions is not supported: use tools"),
    ("/v1/chat/completions", "functions", None, "functions is not supported: use tools"),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}],
     "functions is not supported: use tools"),
    ("/v1/chat/completions", "function_call", "none", "function_call is not supported: use tool_choice"),
    ("/v1/chat/completions", "function_call", None, "function_call is not supported: use tool_choice"),
    ("/v1/chat/completions", "function_call", "auto", "function_call is not supported: use tool_choice"),
    ("/v1/chat/completions", "logit_bias", {}, "logit_bias is not supported"),
    ("/v1/chat/completions", "logit_bias", None, "logit_bias is not supported"),
    ("/v1/chat/completions", "logit_bias", {"50256": -100}, "logit_bias is not supported"),
    ("/v1/completions", "logit_bias", {}, "logit_bias is not supported"),
])
def test_functions_function_call_and_logit_bias_are_refused_whatever_the_value(gateway, path, name,
                                                                                value, text):
    # was: HTTP 200 for [], {}, "none" and null where README lists the fields as refused (the
    # openai client sends none of them unless asked)
    import json
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    body[name] = value
    err = _assert_openai_error(_post(gateway, path, json.dumps(body)), 400, name)
    assert err["message"] == text


# -- error wording: JSON's names of values and types -----------------------------------------------

_PYTHON_WORDS = re.compile(r"\b(True|False|None|NoneType|dict|list|str|int|float|bool)\b|'")


@pytest.mark.parametrize("path, raw, param, text", [
    ("/v1/completions", '[1]', None, "the request body must be a JSON object, got array"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": true}', "max_tokens",
     "max_tokens must be an integer, got true"),
    ("/v1/completions", '{"prompt": "hi", "temperature": false}', "temperature",
     "temperature must be a number, got false"),
    ("/v1/completions", '{"prompt": "hi", "top_p": "0.5"}', "top_p",
     'top_p must be a number, got "0.5"'),
    ("/v1/completions", '{"prompt": "hi", "stream": 1}', "stream", "stream must be a boolean, got 1"),
    ("/v1/completions", '{"prompt": "hi", "echo": 0}', "echo", "echo is not supported"),
    ("/v1/completions", '{"prompt": "hi", "best_of": true}', "best_of", "best_of must be 1"),
    ("/v1/completions", '{"prompt": "hi", "spec": true}', "spec",
     'spec must be "on", "off" or null (the server\'s default), got true'),
    ("/v1/completions", '{"prompt": {"text": "hi"}}', "prompt",
     "prompt must be a string, an array of token ids, or a non-empty array of these"),
    ("/v1/completions", '{"prompt": ["hi", null]}', "prompt[1]",
     "prompt[1] must be a string or a non-empty array of token ids, got null"),
    ("/v1/chat/completions", '{"messages": [null]}', "messages[0]",
     "messages[0] must be an object, got null"),
    ("/v1/chat/completions", '{"messages": [{"role": null, "content": "hi"}]}', "messages[0].role",
     "messages[0].role must be one of assistant, developer, system, tool, user, got null"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', "messages[0].content",
     "messages[0].content must be a string or an array of text parts, got number"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}',
     "logprobs", 'logprobs must be a boolean, got "yes"'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": {}}',
     "tools", "tools must be an array of tool objects, got object"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [null]}',
     "tools[0].type", 'tools[0].type must be "function" (the only tool type), got null'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": '
     '[{"type": "function", "function": {"name": null}}]}', "tools[0].function.name",
     "tools[0].function.name: null must be 1-64 letters, digits, _ or -"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": '
     'false}', "reasoning_effort", "reasoning_effort is not supported (only null), got false"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "response_format": '
     '{"type": null}}', "response_format",
     'response_format.type must be "text", "json_object" or "json_schema", got null'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "response_format": '
     '{"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}}',
     "response_format.json_schema.strict",
     'response_format.json_schema.strict must be a boolean, got "yes"'),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_errors_name_json_values_and_types(gateway, path, raw, param, text):
    # was: Python's names in the messages: "got True", "got None", "got NoneType", "got a JSON dict"
    err = _assert_openai_error(_post(gateway, path, raw), 400, param)
    assert err["message"] == text.replace("_ or -", "'_' or '-'")
    assert not _PYTHON_WORDS.search(err["message"].replace("'_' or '-'", "").replace("server's", "")), \
        err["message"]


def test_json_words_helper():
    from echospec.services.text.clip import json_type, json_value
    assert [json_type(v) for v in (None, True, 0, 1.5, "a", [], {})] == \
        ["null", "boolean", "number", "number", "string", "array", "object"]
    assert [json_value(v) for v in (None, True, False, "a", [1, None], {"k": "é"})] == \
        ["null", "true", "false", '"a"', "[1, null]", '{"k": "é"}']
    assert len(json_value("x" * 10_000)) <= 200


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
