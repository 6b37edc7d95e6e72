"""Tool calls: the tools and tool messages through a Hermes-style chat template (the shape of
Qwen3's, tests/data/hermes_tools.jinja), the parser on literal outputs, the streaming filter, the
request checks, and through the services with the official openai client on SmolLM2 served with
that template: a named or required tool_choice parses into tool_calls (plain and streamed), the
arguments valid under the function's schema; a second turn with the tool's result; refusals."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest

from echospec.services.text import tool_calls as tc
from echospec.services.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from echospec.stack import start_stack
from echospec.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc

TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def ids():
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


# -- the chat template ---------------------------------------------------------------------------

def test_tools_render_in_the_system_turn():
    t = ChatTemplate(TEMPLATE.read_text())
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    got = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                   tools=tools)
    assert got == ('<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call functions. Their signatures:\n'
                   '<tools>\n{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}\n'
                   '</tools>\n\nWrite each call as:\n<tool_call>\n{"name": <function-name>, "arguments": '
                   '<args-json-object>}\n</tool_call><|im_end|>\n'
                   '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n')


def test_calls_and_tool_results_render_as_the_template_writes_them():
    t = ChatTemplate(TEMPLATE.read_text())
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "f", "arguments": {"x": 1, "y": "é"}}},
                            {"id": "call_2", "type": "function",
                             "function": {"name": "g", "arguments": '{"z":2}'}}]},
            {"role": "tool", "content": "one", "tool_call_id": "call_1"},
            {"role": "tool", "content": "two", "tool_call_id": "call_2", "name": "g"}]
    assert t.render(msgs) == (
        '<|im_start|>user\nhi<|im_end|>\n'
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1, "y": "é"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"z":2}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>'
        '<|im_end|>\n<|im_start|>assistant\n')


def test_tool_keys_belong_to_their_roles():
    t = ChatTemplate(TEMPLATE.read_text())
    with pytest.raises(ValueError, match=r"messages\[0\] has unsupported field\(s\) tool_calls"):
        t.render([{"role": "user", "content": "hi", "tool_calls": []}])
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\] must be"):
        t.render([{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}])


def test_tool_format_is_read_from_the_template():
    assert tc.tool_format(TEMPLATE.read_text()) == "hermes"
    assert tc.tool_format(CHATML_TEMPLATE) is None          # never reads tools
    assert tc.tool_format("{{ tools }}{{ messages }}") is None   # reads tools, no <tool_call> format


# -- the parser ----------------------------------------------------------------------------------

def test_one_call():
    out = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert tc.parse_tool_calls(out, ids()) == ("", [tc.ToolCall("call_0", "get_time", '{"zone": "UTC"}')])


def test_two_calls():
    out = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
           '<tool_call>\n{"name": "b", "arguments": {"k": [1, 2]}}\n</tool_call>')
    assert tc.parse_tool_calls(out, ids()) == ("", [tc.ToolCall("call_0", "a", "{}"),
                                                    tc.ToolCall("call_1", "b", '{"k": [1, 2]}')])


def test_text_before_a_call_is_the_content():
    out = 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"q": "x"}}\n</tool_call>\n'
    assert tc.parse_tool_calls(out, ids()) == ("Let me check.", [tc.ToolCall("call_0", "a", '{"q": "x"}')])


def test_text_around_calls_is_joined_by_a_newline():
    out = ('Checking.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\nThen \n'
           '<tool_call>{"name": "b", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "c", "argu')
    content, calls = tc.parse_tool_calls(out, ids())
    assert [c.name for c in calls] == ["a", "b"]
    assert content == 'Checking.\nThen\n<tool_call>\n{"name": "c", "argu'


def test_malformed_json_stays_content():
    out = 'Hm <tool_call>\n{"name": "a", "arguments": {"q": }\n</tool_call>'
    assert tc.parse_tool_calls(out, ids()) == (out, [])


def test_an_unclosed_call_stays_content():
    out = '<tool_call>\n{"name": "a", "arguments": {"q": 1}}'
    assert tc.parse_tool_calls(out, ids()) == (out, [])


def test_arguments_as_json_text_are_kept():
    out = '<tool_call>{"name": "a", "arguments": "{\\"q\\": 1}"}</tool_call>'
    assert tc.parse_tool_calls(out, ids()) == ("", [tc.ToolCall("call_0", "a", '{"q": 1}')])


def test_arguments_are_the_models_own_text():
    # was: re-serialized with json.dumps' default separators, so a forced call's compact
    # {"q":1} came back as {"q": 1}
    out = '<tool_call>{"name": "a", "arguments": {"q":1,  "r": [1,2]}}</tool_call>'
    assert tc.parse_tool_calls(out, ids()) == ("", [tc.ToolCall("call_0", "a", '{"q":1,  "r": [1,2]}')])
    out = '<tool_call>{"arguments": {"name":"x"}, "name": "a"}</tool_call>'
    assert tc.parse_tool_calls(out, ids()) == ("", [tc.ToolCall("call_0", "a", '{"name":"x"}')])


def test_a_call_of_a_function_the_request_did_not_declare_stays_content():
    # was: returned as a tool call whatever its name (an echo of the prompt could call anything)
    out = 'ok <tool_call>{"name": "delete_all", "arguments": {}}</tool_call> <tool_call>{"name": "a", "arguments": {}}</tool_call>'
    content, calls = tc.parse_tool_calls(out, ids(), names=["a", "b"])
    assert [c.name for c in calls] == ["a"]
    assert content == 'ok <tool_call>{"name": "delete_all", "arguments": {}}</tool_call>'
    f = tc.ContentFilter(ids(), names=["b"])
    assert f.feed(out) == "ok" and f.finish()[1:] == (out, [])


def test_a_block_without_a_name_stays_content():
    out = '<tool_call>\n{"arguments": {}}\n</tool_call>'
    assert tc.parse_tool_calls(out, ids()) == (out, [])


def test_streamed_content_is_a_prefix_of_the_whole_and_holds_the_call():
    out = 'Sure thing. <tool_call>\n{"name": "a", "arguments": {"q": 1}}\n</tool_call>'
    for size in (1, 2, 5, 11, len(out)):
        f = tc.ContentFilter(ids())
        sent = "".join(f.feed(out[i:i + size]) for i in range(0, len(out), size))
        assert "<" not in sent and sent == "Sure thing."[:len(sent)]
        rest, content, calls = f.finish()
        assert sent + rest == content == "Sure thing." and calls[0].name == "a"


def test_streamed_text_without_a_call_passes_through():
    out = "a < b and <tool is not <tool_call"
    f = tc.ContentFilter(ids())
    sent = "".join(f.feed(ch) for ch in out)
    assert sent == "a < b and <tool is not"   # the tail that may still open a call waits
    rest, content, calls = f.finish()
    assert sent + rest == content == out and calls == []


# -- the request's tools -------------------------------------------------------------------------

@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "function", "function": {"name": "get weather"}}], "", r'tools\[0\].function.name: "get weather" must be'),
    ([{"type": "retrieval"}], "", r"tools\[0\].type must be \"function\""),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "",
     r"tools\[0\].function.parameters \(tool 'f'\) must be a JSON schema of an object"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "", r"tools\[1\].function.name: 'f' names two tools"),
    (TOOLS, "get_news", r"tool_choice 'get_news' is not .* \(get_time, get_weather\)"),
    ([], "required", r"tool_choice 'required' needs tools"),
    # was accepted, though tool_choice could never name them
    ([{"type": "function", "function": {"name": "none"}}], "", r"tools\[0\].function.name: 'none' is a tool_choice keyword"),
    ([{"type": "function", "function": {"name": "required"}}], "", r"'required' is a tool_choice keyword"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, message):
    with pytest.raises(tc.ToolError, match=message):
        tc.parse_tools(json.dumps(tools), choice)


def test_a_schema_the_matcher_cannot_take_names_the_tool():
    tools = [{"type": "function", "function": {"name": "f", "parameters": WEATHER}},
             {"type": "function", "function": {"name": "big", "parameters": {
                 "type": "object", "properties": {"n": {"type": "integer", "minimum": 2 ** 70}}}}}]
    with pytest.raises(tc.ToolError, match=r"^tools\[1\].function.parameters \(tool 'big'\): "):
        tc.check_schemas(tc.parse_tools(json.dumps(tools), "auto"))


def test_the_named_grammar_forces_one_call_of_that_function():
    g = tc.call_grammar(tc.parse_tools(json.dumps(TOOLS), "get_time"))
    assert g.startswith("start: call\ncall: call_0\n") and '\\"get_time\\"' in g and "get_weather" not in g
    g = tc.call_grammar(tc.parse_tools(json.dumps(TOOLS), "required"))
    assert g.startswith('start: call ("\\n" call)*\ncall: call_0 | call_1\n')
    with pytest.raises(tc.ToolError):
        tc.call_grammar(tc.parse_tools(json.dumps(TOOLS), "auto"))


# -- through the services ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(smollm2_path):
    st = start_stack(smollm2_path, spec=False, n_ctx=1024, http_port=0, chat_template=str(TEMPLATE))
    yield st
    st.stop(0.5)


@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.target) as ch:
        yield coordinator_pb2_grpc.CoordinatorServiceStub(ch)


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice_parses_into_tool_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    check_call(call.function.name, call.function.arguments)


def test_a_stop_string_does_not_cut_a_forced_call(client):
    # was: stop ["</tool_call>"] ended the output before the block closed: no tool_calls, the
    # raw call text in the content, finish_reason "stop"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       stop=["</tool_call>", "city"])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments)


def test_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    content, calls, finish = "", {}, None
    for ch in stream:
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            c = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = t.id or c["id"]
            c["name"] += (t.function.name or "") if t.function else ""
            c["arguments"] += (t.function.arguments or "") if t.function else ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and list(calls) == [0], (content, calls)
    assert calls[0]["name"] == "get_time" and calls[0]["id"].startswith("call_")
    check_call("get_time", calls[0]["arguments"])


def test_required_tool_choice_calls_some_tool(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96,
                                       tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0]
    for call in calls:
        assert call.function.name in SCHEMAS
        check_call(call.function.name, call.function.arguments)


def test_auto_with_free_text_is_content(client):
    """tool_choice auto on this model: whatever it writes, the stream and the whole answer agree."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, max_tokens=24)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw))
    assert whole.message.content == streamed and "<tool_call>" not in streamed
    assert (whole.finish_reason == "tool_calls") == bool(whole.message.tool_calls), whole


def test_the_cli_sends_a_tool_history_as_it_is(client, stack, tmp_path):
    # was: `echospec generate --messages` kept role and content only, so the calls and the
    # tool_call_id vanished from the prompt (41 tokens against HTTP's 72), and content null
    # beside tool_calls was refused
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Oslo"}'}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 3}'}]
    want = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=4)
    f = tmp_path / "m.json"
    f.write_text(json.dumps(turn))
    r = subprocess.run([sys.executable, "-m", "echospec.cli", "generate", "--messages", str(f), "--target",
                        stack.target, "--json", "--max-tokens", "4"], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    # the CLI sends no tools, so its prompt is the history alone: longer than the bare question,
    # and holding the call (the HTTP one adds the tools' system turn)
    got = json.loads(r.stdout)
    no_history = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert got["prompt_tokens"] > no_history.usage.prompt_tokens + 20, (got["prompt_tokens"], no_history.usage)
    assert got["prompt_tokens"] < want.usage.prompt_tokens


def test_a_second_turn_with_the_result_goes_through_the_template(client, stub):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=64,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=8)
    # the same prompt written out by the template's rules
    tools_text = "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS)
    args = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    text = ('<|im_start|>system\n# Tools\n\nYou may call functions. Their signatures:\n<tools>\n'
            f'{tools_text}\n</tools>\n\nWrite each call as:\n<tool_call>\n{{"name": <function-name>, '
            '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n'
            f'<|im_start|>assistant\n<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n')
    same = stub.Complete(cpb.CompleteRequest(text=text, max_tokens=8), timeout=120).result
    assert r.usage.prompt_tokens == same.prompt_tokens
    content = r.choices[0].message.content or ""
    assert content == tc.parse_tool_calls(same.text)[0] or r.choices[0].message.tool_calls


def test_grpc_result_carries_the_calls_and_the_deltas_hold_no_call_text(stub):
    req = dict(messages=[cpb.ChatMessage(role="user", content="Time in Berlin?")], max_tokens=48,
               tools=json.dumps(TOOLS), tool_choice="get_time")
    result = stub.Complete(cpb.CompleteRequest(**req), timeout=120).result
    [call] = result.tool_calls
    assert call.name == "get_time" and result.text == ""
    check_call("get_time", call.arguments)
    deltas, last = "", None
    for msg in stub.Generate(cpb.GenerateRequest(**req), timeout=120):
        deltas += msg.text
        last = msg.result if msg.HasField("result") else last
    assert deltas == "" and [c.arguments for c in last.tool_calls] == [call.arguments]


def test_a_forced_call_is_the_same_with_speculation_on_and_off(stub):
    from echospec.v1 import common_pb2
    req = dict(messages=[cpb.ChatMessage(role="user", content="Weather in Rome, in fahrenheit?")],
               max_tokens=48, tools=json.dumps(TOOLS), tool_choice="required")
    on = stub.Complete(cpb.CompleteRequest(spec=common_pb2.SPEC_MODE_ON, **req), timeout=120).result
    off = stub.Complete(cpb.CompleteRequest(spec=common_pb2.SPEC_MODE_OFF, **req), timeout=120).result
    assert on.token_ids == off.token_ids and on.spec_enabled and not off.spec_enabled
    assert [(c.name, c.arguments) for c in on.tool_calls] == [(c.name, c.arguments) for c in off.tool_calls]
    assert on.tool_calls and on.stats.draft_tokens > 0   # the grammar's forced tokens were drafted


def test_tools_apply_to_chat_messages_only(stub):
    with pytest.raises(grpc.RpcError) as ei:
        stub.Complete(cpb.CompleteRequest(text="hi", max_tokens=2, tools=json.dumps(TOOLS)), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("tools apply to messages")


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
])
def test_bad_tools_are_400(client, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as ei:
        client.post("/chat/completions", body=body, cast_to=object)
    err = ei.value.body
    assert err["param"] == param and err["message"], err


def test_a_bad_schema_is_400_naming_the_tool(client):
    tools = [{"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 2 ** 70}}}}}]
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=4)
    assert "tool 'big'" in ei.value.body["message"] and ei.value.body["param"].startswith("tools[0]")


def test_a_template_without_tools_refuses_them(smollm2_path):
    """SmolLM2's own template never reads tools: a request with them is refused, naming why;
    tool_choice none asks for no tools and is served."""
    st = start_stack(smollm2_path, spec=False, n_ctx=256)
    try:
        with grpc.insecure_channel(st.target) as ch:
            s = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            msgs = [cpb.ChatMessage(role="user", content="hi")]
            with pytest.raises(grpc.RpcError) as ei:
                s.Complete(cpb.CompleteRequest(messages=msgs, max_tokens=2, tools=json.dumps(TOOLS)), timeout=60)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert ei.value.details().startswith("tools: the model's chat template does not render tools")
            r = s.Complete(cpb.CompleteRequest(messages=msgs, max_tokens=2, tools=json.dumps(TOOLS),
                                               tool_choice="none"), timeout=60).result
            plain = s.Complete(cpb.CompleteRequest(messages=msgs, max_tokens=2), timeout=60).result
            assert r.prompt_tokens == plain.prompt_tokens and r.token_ids == plain.token_ids
    finally:
        st.stop()


def test_the_python_client_sends_tools_and_a_tool_history(stack):
    from echospec_client import Client, Message
    with Client(stack.target) as c:
        r = c.chat([{"role": "user", "content": "Time in Tokyo?"}], tools=TOOLS, tool_choice="get_time",
                   max_tokens=48)
        [call] = r.tool_calls
        assert call.name == "get_time" and r.text == ""
        check_call("get_time", call.arguments)
        turn = [Message("user", "Time in Tokyo?"), Message("assistant", "", tool_calls=(call,)),
                Message("tool", "09:00", tool_call_id=call.id)]
        again = c.chat(turn, tools=TOOLS, max_tokens=4)
        args = json.dumps(json.loads(call.arguments))
        assert again.prompt_tokens == len(c.tokenize(ChatTemplate(TEMPLATE.read_text()).render(
            [{"role": "user", "content": "Time in Tokyo?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": json.loads(args)}}]},
             {"role": "tool", "content": "09:00", "tool_call_id": call.id}], tools=TOOLS)))
