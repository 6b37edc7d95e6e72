"""Tests for services/text/chat_template.py."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from echospec.services.text.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError, validate_messages
from echospec.services.text.tokenizer import Tokenizer, read_tokenizer_metadata
from ggufgen import write_tokenizer_gguf

ROOT = Path(__file__).resolve().parent.parent
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _model_path() -> Path:
    spec = importlib.util.spec_from_file_location("fetch_model", ROOT / "scripts" / "fetch_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.fetch(verbose=False)


@pytest.fixture(scope="module")
def smol_meta():
    return read_tokenizer_metadata(_model_path())


@pytest.fixture(scope="module")
def smol(smol_meta) -> ChatTemplate:
    return ChatTemplate.from_metadata(smol_meta)


def _write_gguf(path: Path, chat_template: str | None) -> Path:
    """A tokenizer-only GGUF: byte tokens plus ChatML control tokens, optional chat template."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + sorted(ByteLevel.alphabet())
    return write_tokenizer_gguf(path, tokens, [3, 3, 3] + [1] * (len(tokens) - 3), [], pre="qwen2",
                                bos_id=0, eos_id=2, chat_template=chat_template)


# --- SmolLM2's own template ------------------------------------------------------------------------


def test_smollm2_inserts_default_system_message(smol: ChatTemplate):
    assert not smol.is_fallback
    text = smol.render([{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_keeps_given_system_message_and_turns(smol: ChatTemplate):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert smol.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    assert smol.render(msgs).endswith("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_rendered_prompt_tokenizes_with_special_tokens(smol: ChatTemplate, smol_meta):
    tok = Tokenizer(smol_meta)
    ids = tok.encode(smol.render([{"role": "user", "content": "hi"}]))
    assert ids[0] == 1  # <|im_start|>
    assert ids.count(1) == 3 and ids.count(2) == 2  # three turns opened, two closed
    tail = tok.encode("<|im_start|>assistant\n")
    assert tail[0] == 1 and ids[-len(tail):] == tail
    assert smol.bos_token == "<|im_start|>" and smol.eos_token == "<|im_end|>"


def test_smollm2_template_matches_chatml_fallback_after_system(smol: ChatTemplate):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert smol.render(msgs) == ChatTemplate(None).render(msgs)


# --- message validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, pattern",
    [
        ("hello", r"messages must be a list"),
        (None, r"messages must be a list"),
        ({"role": "user", "content": "x"}, r"messages must be a list"),
        ([], r"messages is empty"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role is missing"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": "a"}, {"role": 3, "content": "b"}], r"messages\[1\]\.role must be a string"),
        ([{"role": "robot", "content": "b"}], r"messages\[0\]\.role: 'robot' is not one of"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string, got NoneType"),
        ([{"role": "user", "content": ["a"]}], r"messages\[0\]\.content must be a string, got list"),
        ([{"role": "user", "content": "x", "name": "bob"}], r"messages\[0\] has unsupported field\(s\) name"),
    ],
)
def test_malformed_messages_are_refused(smol: ChatTemplate, messages, pattern):
    with pytest.raises(ChatTemplateError, match=pattern):
        smol.render(messages)


def test_chat_template_error_is_a_value_error():
    assert issubclass(ChatTemplateError, ValueError)


def test_validate_messages_copies():
    src = [{"role": "tool", "content": ""}]
    out = validate_messages(src)
    assert out == src and out[0] is not src[0]


# --- fallback, template errors, sandbox -----------------------------------------------------------


def test_missing_template_uses_chatml_fallback(tmp_path):
    t = ChatTemplate.from_gguf(_write_gguf(tmp_path / "none.gguf", None))
    assert t.is_fallback and t.source == CHATML_TEMPLATE
    assert t.render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_gguf_template_sees_bos_eos_and_trims_blocks(tmp_path):
    src = "{{ bos_token }}\n{% for m in messages %}\n  {{ m['content'] }}|\n{% endfor %}\n{{ eos_token }}"
    t = ChatTemplate.from_gguf(_write_gguf(tmp_path / "t.gguf", src))
    # trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before one.
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == (
        "<|endoftext|>\n  a|\n  b|\n<|im_end|>"
    )


def test_raise_exception_becomes_chat_template_error():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        t.render([{"role": "system", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}",
        "{% set _ = messages[0].update({'role': 'x'}) %}",
    ],
)
def test_sandbox_violations_are_refused(source: str):
    with pytest.raises(ChatTemplateError, match="sandbox"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "source, pattern",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         "work budget"),
        ("{% for i in range(10**9) %}{% endfor %}", "passed 1000000000 to range"),
        ("{% for i in range(10**6) %}{% endfor %}", "range\\(\\) for 1000000 items"),
        ("{{ 'x' * 10**9 }}", "repeat a sequence"),
        ("{{ [0] * 10**9 }}", "repeat a sequence"),
        ("{% set s = 'x' * 900000 %}{{ s + s }}", "build a sequence"),
        ("{{ 2 ** 10000000 }}", "bits"),
        ("{% for c in messages[0].content %}{% for d in messages[0].content %}{% endfor %}{% endfor %}",
         "ran for more than 1 s"),
        ("{% set ns = namespace(s='xx') %}{% for c in messages[0].content %}{% set ns.s = ns.s ~ 'x' %}"
         "{% for d in messages[0].content %}{% endfor %}{% endfor %}", "ran for more than"),
        ("{{ 'x'.ljust(10**9) }}", "passed 1000000000 to ljust"),
        ("{{ 'x' | center(10**9) }}", "the center filter"),
        ("{{ messages | tojson(indent=10**9) }}", "the tojson filter"),
        ("{{ '{:>300000000}'.format(1) }}", "width or precision"),
        ("{{ '{:>{w}}'.format(1, w=10**9) }}", "passed 1000000000"),
        ("{{ '%1000000000d' % 1 }}", "width or precision"),
        ("{{ '%*d' % (10**9, 1) }}", "a % format"),
    ],
)
def test_a_template_that_would_run_for_minutes_is_stopped_at_its_budget(source, pattern):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=pattern):
        ChatTemplate(source).render([{"role": "user", "content": "x" * 30000}])
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("source", ['{{ "%1000000000d" % 1 }}', '{{ "x"|center(1000000000) }}',
                                    '{% if false %}{{ "x" * 10**10 }}{% endif %}ok'])
def test_compiling_a_template_evaluates_none_of_it(source):
    t0 = time.monotonic()
    t = ChatTemplate(source)          # no constant folding: compiling is instant
    assert time.monotonic() - t0 < 2
    if source.endswith("ok"):
        assert t.render([{"role": "user", "content": "x"}]) == "ok"
    else:
        with pytest.raises(ChatTemplateError):
            t.render([{"role": "user", "content": "x"}])


def test_the_budget_is_per_render_and_leaves_real_work_alone():
    t = ChatTemplate("{% for i in range(6) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
                     "{{ 'ab' * 3 + 'c' }}{{ 2 ** 10 }}")
    for _ in range(3):   # each render has its own budget
        assert t.render([{"role": "user", "content": "x"}]) == "abababc1024"


def test_template_that_does_not_compile_is_refused():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}no end")


def test_python_errors_inside_template_are_wrapped():
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ 1 + messages[0]['content'] }}").render([{"role": "user", "content": "x"}])


def test_helpers_strftime_now_tojson_loopcontrols():
    t = ChatTemplate(
        "{{ strftime_now('%Y') }} {{ messages[0] | tojson }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}[{{ m.role }}]{% endfor %}"
    )
    out = t.render([{"role": "user", "content": "é"}, {"role": "assistant", "content": "y"}])
    assert out == time.strftime("%Y") + ' {"role": "user", "content": "é"}[user]'


# A template in the style of Qwen3's: the last user turn found with a namespace, reasoning split off earlier assistant turns at "</think>" (only turns after the
# last user turn keep it), and ``enable_thinking`` false closing an empty think block at the
# generation prompt. Written for this test; it uses the Jinja constructs such templates use.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=messages|length - 1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user and reasoning %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def test_thinking_template_gets_enable_thinking_only_when_given():
    t = ChatTemplate(THINKING_TEMPLATE)
    msgs = [{"role": "user", "content": "2+2?"}]
    assert t.render(msgs) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert t.render(msgs, enable_thinking=True) == t.render(msgs)
    assert t.render(msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_thinking_template_drops_reasoning_of_earlier_turns():
    t = ChatTemplate(THINKING_TEMPLATE)
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "and 3+3?"}]
    out = t.render(msgs)
    assert "add them" not in out and "<|im_start|>assistant\n4<|im_end|>\n" in out


# --- a model without a template that is not a ChatML model ---------------------------------------


def _write_plain_gguf(path: Path, chat_template: str | None = None) -> Path:
    """A tokenizer-only GGUF without the ChatML tokens (and without a template unless given)."""
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<pad>", "<bos>", "<eos>"] + sorted(ByteLevel.alphabet())
    return write_tokenizer_gguf(path, tokens, [3, 3, 3] + [1] * (len(tokens) - 3), [], pre="gpt2",
                                bos_id=1, eos_id=2, chat_template=chat_template, arch="llama")


def test_missing_template_without_chatml_tokens_refuses_chat(tmp_path):
    from echospec.services.text.chat_template import MissingChatTemplateError
    t = ChatTemplate.from_gguf(_write_plain_gguf(tmp_path / "plain.gguf"))
    assert t.missing and not t.is_fallback and t.source == ""
    with pytest.raises(MissingChatTemplateError, match=r"no chat template.*--chat-template FILE"):
        t.render([{"role": "user", "content": "hi"}])
    # a MissingChatTemplateError is a ChatTemplateError (callers that catch those still do)
    assert issubclass(MissingChatTemplateError, ChatTemplateError)


def test_template_given_in_place_of_the_gguf_one(tmp_path):
    src = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    for gguf_template in (None, "{{ 'the file own' }}"):
        p = _write_plain_gguf(tmp_path / f"p{gguf_template is None}.gguf", gguf_template)
        t = ChatTemplate.from_metadata(read_tokenizer_metadata(p), src)
        assert t.missing is None and not t.is_fallback
        assert t.render([{"role": "user", "content": "hi"}]) == "<bos>[user] hi\n"


def test_gemma3_has_no_chat_template(gemma3_path):
    t = ChatTemplate.from_gguf(gemma3_path)
    assert t.missing is not None and "no chat template" in t.missing


def test_missing_template_is_invalid_argument_over_grpc_and_400_over_http(tmp_path):
    """End to end on a tiny model whose vocabulary has no ChatML tokens: chat messages are refused
    (gRPC INVALID_ARGUMENT, HTTP 400) naming the missing template; text prompts still work; with
    a --chat-template file chat works."""
    import json as json_
    import urllib.error
    import urllib.request

    import grpc
    from ggufgen import write_tiny_model

    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2 as cpb
    from echospec.v1 import coordinator_pb2_grpc

    model = tmp_path / "tiny-plain.gguf"
    write_tiny_model(model, n_vocab=320, special_tokens=("<|endoftext|>", "<|turn|>", "<|end|>"))
    msgs = [cpb.ChatMessage(role="user", content="hi")]
    st = start_stack(str(model), n_ctx=256, n_threads=1, http_port=0, model_name="m")
    try:
        with grpc.insecure_channel(st.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            with pytest.raises(grpc.RpcError) as ei:
                stub.Complete(cpb.CompleteRequest(messages=msgs, max_tokens=2), timeout=30)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no chat template" in ei.value.details() and "--chat-template" in ei.value.details()
            r = stub.Complete(cpb.CompleteRequest(text="the", max_tokens=2), timeout=30).result
            assert r.prompt_tokens > 0 and r.completion_tokens >= 1
        body = json_.dumps({"model": "m", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{st.http_port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(req, timeout=30)
        assert he.value.code == 400
        err = json_.loads(he.value.read())["error"]
        assert "no chat template" in err["message"] and err["param"] == "messages", err
    finally:
        st.stop()
    tpl = tmp_path / "chat.jinja"
    tpl.write_text("{% for m in messages %}<|turn|>{{ m['role'] }}\n{{ m['content'] }}<|end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|turn|>assistant\n{% endif %}")
    st = start_stack(str(model), n_ctx=256, n_threads=1, chat_template=str(tpl))
    try:
        with grpc.insecure_channel(st.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            r = stub.Complete(cpb.CompleteRequest(messages=msgs, max_tokens=2), timeout=30).result
            same = stub.Complete(cpb.CompleteRequest(text="<|turn|>user\nhi<|end|>\n<|turn|>assistant\n",
                                                     max_tokens=2), timeout=30).result
            assert r.prompt_tokens == same.prompt_tokens and r.token_ids == same.token_ids
    finally:
        st.stop()


def test_a_hostile_template_costs_one_refused_request_not_the_server(tmp_path):
    """A --chat-template whose loops would run for minutes on some messages: those requests get
    INVALID_ARGUMENT naming the budget within seconds, others are served, and the stack stops at
    once."""
    import grpc
    from ggufgen import write_tiny_model

    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2 as cpb
    from echospec.v1 import coordinator_pb2_grpc

    model = tmp_path / "tiny-plain.gguf"
    write_tiny_model(model, n_vocab=320, special_tokens=("<|endoftext|>", "<|turn|>", "<|end|>"))
    tpl = tmp_path / "hostile.jinja"
    tpl.write_text("{% for m in messages %}{% if m['content'] == 'spin' %}"
                   "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                   "{% endif %}<|turn|>{{ m['content'] }}<|end|>{% endfor %}<|turn|>")
    st = start_stack(str(model), n_ctx=256, n_threads=1, chat_template=str(tpl))
    try:
        with grpc.insecure_channel(st.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as ei:
                stub.Complete(cpb.CompleteRequest(messages=[cpb.ChatMessage(role="user", content="spin")],
                                                  max_tokens=2), timeout=60)
            assert time.monotonic() - t0 < 20
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = ei.value.details()
            assert details.startswith("messages: chat template ") and "work budget" in details, details
            r = stub.Complete(cpb.CompleteRequest(messages=[cpb.ChatMessage(role="user", content="hi")],
                                                  max_tokens=2), timeout=30).result
            assert r.prompt_tokens > 0 and r.completion_tokens >= 1
    finally:
        t0 = time.monotonic()
        st.stop()
        assert time.monotonic() - t0 < 20
