"""Constrained output through the services on the default model: OpenAI's response_format on both
gateway routes with the official openai client (outputs validated by jsonschema), the gRPC
grammar field (JSON schema, JSON object, Lark, GBNF), byte identity with speculation on and off
and the grammar draft source in the stats, and the refusals (HTTP 400 / INVALID_ARGUMENT naming
the problem, the matcher's limit)."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from echospec.services.gateway import openai_api as api
from echospec.stack import start_stack
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc

ON, OFF = common_pb2.SPEC_MODE_ON, common_pb2.SPEC_MODE_OFF
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish", "none"]}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
PEOPLE = ["a teacher", "a farmer", "a pilot", "a child", "a doctor", "a painter", "a baker",
          "a sailor", "a student", "a nurse", "a chef", "a writer", "a singer", "a runner",
          "a judge", "a miner", "a poet", "a dancer", "a driver", "a guard"]
SLOW_SCHEMA = {"type": "string", "pattern": "^((a{50}b){50}c){50}$"}


MODEL = "SmolLM2-135M-Instruct.Q4_1"   # the name the gateway serves the default model under


@pytest.fixture(scope="module")
def stack(smollm2_api):
    return smollm2_api.stack


@pytest.fixture(scope="module")
def stub(smollm2_api):
    return smollm2_api.stub


@pytest.fixture(scope="module")
def client(smollm2_api):
    return smollm2_api.openai


def complete(stub, **kw) -> cpb.GenerationResult:
    return stub.Complete(cpb.CompleteRequest(**kw), timeout=120).result


def user(text: str) -> list[cpb.ChatMessage]:
    return [cpb.ChatMessage(role="user", content=text)]


# -- HTTP: response_format with the openai client ------------------------------------------------

def test_json_schema_outputs_validate_on_20_prompts(client):
    for i, who in enumerate(PEOPLE):
        r = client.chat.completions.create(
            model=MODEL, max_tokens=48, response_format=RESPONSE_FORMAT,
            messages=[{"role": "user", "content": f"Describe {who} as JSON: name, age and pet."}],
            extra_body={"spec": "on" if i % 2 else "off"})
        assert r.choices[0].finish_reason == "stop", (who, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_schema_on_completions_route_and_streamed(client):
    prompt = "A person, as JSON with name, age and pet: "
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48,
                                  extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48, stream=True,
                                       extra_body={"response_format": RESPONSE_FORMAT})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=64, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Return a JSON object with the key "capital" for France.'}])
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_response_format_text_is_free_text(client):
    msgs = [{"role": "user", "content": "Count from one to five."}]
    a = client.chat.completions.create(model=MODEL, max_tokens=16, messages=msgs)
    b = client.chat.completions.create(model=MODEL, max_tokens=16, messages=msgs,
                                       response_format={"type": "text"})
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("schema,message", [
    ({"type": "objectx"}, "response_format.json_schema.schema: Invalid type: objectx"),
    (SLOW_SCHEMA, "^(verifier: )?response_format.json_schema.schema: the matcher failed.*too many "
                  "expressions constructed .*limit of 200000 units"),
])
def test_bad_or_slow_schema_is_a_400_naming_the_problem(client, schema, message):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    err = ei.value.body
    assert err["param"] == "response_format" and err["code"] == "invalid_argument"
    assert re.search(message, err["message"]), err["message"]


@pytest.mark.parametrize("rf,message,param", [
    ({"type": "xml"}, 'response_format.type must be "text", "json_object" or "json_schema", got "xml"',
     "response_format"),
    ("json", "response_format.type must be", "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object", "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "json_schema.name must be 1-64 letters",
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "json_schema.name must be",
     "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}},
     "json_schema.schema must be a JSON schema object, got array", "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}, "strict must be a boolean",
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schemas": {}}}, "takes no field \"schemas\"",
     "response_format.json_schema.schemas"),
    ({"type": "json_object", "schema": {}}, 'of type json_object takes no field "schema"',
     "response_format.schema"),
])
@pytest.mark.parametrize("chat", [True, False])
def test_response_format_shape_is_checked_on_both_routes(rf, message, param, chat):
    body = {"response_format": rf, **({"messages": [{"role": "user", "content": "hi"}]} if chat
                                      else {"prompt": "hi"})}
    with pytest.raises(api.ApiError) as ei:
        api.parse_request(body, chat)
    assert ei.value.status == 400 and message in ei.value.message and ei.value.param == param


def test_response_format_maps_to_the_grammar():
    p = api.parse_request({"prompt": "x", "response_format": RESPONSE_FORMAT}, chat=False)
    assert json.loads(p.request.grammar.json_schema) == SCHEMA
    p = api.parse_request({"prompt": "x", "response_format": {"type": "json_object"}}, chat=False)
    assert p.request.grammar.WhichOneof("kind") == "json_object"
    p = api.parse_request({"prompt": "x", "response_format": {"type": "text"}}, chat=False)
    assert not p.request.HasField("grammar")


# -- gRPC: the grammar field ---------------------------------------------------------------------

@pytest.mark.parametrize("grammar", [
    common_pb2.Grammar(json_schema=json.dumps(SCHEMA)),
    common_pb2.Grammar(lark='start: "Name: " /[A-Z][a-z]{1,10}/ ", age " /[0-9]{1,2}/ "."'),
    common_pb2.Grammar(gbnf='root ::= "Answer: " ("yes" | "no") ". Because " [a-z ]{1,20} "."'),
], ids=["json_schema", "lark", "gbnf"])
def test_spec_on_off_byte_identical_with_the_grammar_source(stub, grammar):
    kw = dict(messages=user("Describe a teacher: name, age and pet."), max_tokens=48, grammar=grammar)
    off = complete(stub, spec=OFF, **kw)
    on = complete(stub, spec=ON, **kw)
    assert on.text.encode() == off.text.encode() and list(on.token_ids) == list(off.token_ids)
    assert on.finish_reason == off.finish_reason == common_pb2.FINISH_REASON_EOS
    src = {s.source: s for s in on.stats.sources}
    assert src["grammar"].hits > 0 and src["grammar"].tries > 0
    assert sum(s.draft_tokens for s in on.stats.sources) == on.stats.draft_tokens
    assert not off.stats.sources


def test_grammar_applies_to_sampling(stub):
    g = common_pb2.Grammar(lark='start: ("red" | "green" | "blue") "."')
    texts = {complete(stub, messages=user("A color?"), max_tokens=8, temperature=1.5, seed=s,
                      grammar=g).text for s in range(1, 7)}
    assert texts <= {"red.", "green.", "blue."} and len(texts) >= 2


def test_generate_streams_constrained_output(stub):
    g = common_pb2.Grammar(json_schema=json.dumps(SCHEMA))
    msgs = list(stub.Generate(cpb.GenerateRequest(messages=user("A pilot as JSON."), max_tokens=48,
                                                  grammar=g, spec=ON), timeout=120))
    text = "".join(m.text for m in msgs)
    assert text == msgs[-1].result.text
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("grammar,message", [
    (common_pb2.Grammar(lark="start: nope"), 'grammar.lark: .*unknown name: "nope"'),
    (common_pb2.Grammar(gbnf="root ::= [0-9"), "grammar.gbnf"),
    (common_pb2.Grammar(json_schema="{oops"), "grammar.json_schema is not valid JSON"),
    (common_pb2.Grammar(json_schema='{"type": "strin"}'), "grammar.json_schema: .*strin"),
    (common_pb2.Grammar(json_object=False), "grammar.json_object must be true when set"),
    (common_pb2.Grammar(json_schema=json.dumps({"enum": ["v%05d" % i for i in range(10000)]})),
     "grammar.json_schema is .* bytes, more than the limit of 65536 bytes"),
    (common_pb2.Grammar(json_schema=json.dumps(SLOW_SCHEMA)),
     "grammar.json_schema: the matcher failed.*too many expressions constructed"),
    # was: gRPC UNKNOWN (an uncaught error)
    (common_pb2.Grammar(json_schema='{"enum": [1208925819614629174706176]}'),
     "grammar.json_schema: the matcher cannot take it"),
])
def test_bad_grammars_are_invalid_argument(stub, grammar, message):
    with pytest.raises(grpc.RpcError) as ei:
        complete(stub, messages=user("Hi"), max_tokens=8, grammar=grammar)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, ei.value.details()), ei.value.details()
    # the service goes on
    assert complete(stub, messages=user("Hi"), max_tokens=2).completion_tokens == 2


# -- the Python client and the CLI ---------------------------------------------------------------

def test_client_grammar_argument(stack):
    from echospec_client import Client, ClientError
    with Client(stack.target, timeout=120) as c:
        r = c.complete(messages=[{"role": "user", "content": "Describe a baker as JSON."}],
                       max_tokens=48, spec=True, grammar={"json_schema": SCHEMA})
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.stats.sources["grammar"]["hits"] > 0
        text = "".join(ch.text for ch in c.stream("Yes or no? ", max_tokens=4,
                                                   grammar={"lark": 'start: "yes" | "no"'}))
        assert text in ("yes", "no")
        with pytest.raises(ClientError) as ei:
            c.complete("Hi", max_tokens=4, grammar={"gbnf": "root ::= [0-9"})
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and "grammar.gbnf" in ei.value.details
    with pytest.raises(ValueError, match="grammar must be a dict of one key"):
        Client(stack.target).complete("Hi", grammar={"regex": "a+"})
    with pytest.raises(ValueError, match="json_object must be True"):
        Client(stack.target).complete("Hi", grammar={"json_object": 1})


def test_cli_generate_with_a_json_schema_file(stack, tmp_path):
    import subprocess
    import sys
    f = tmp_path / "person.json"
    f.write_text(json.dumps(SCHEMA), encoding="utf-8")
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Describe a poet as JSON."}]), encoding="utf-8")
    cli = [sys.executable, "-m", "echospec.cli", "generate", "--messages", str(msgs), "--target",
           stack.target, "--max-tokens", "48"]
    r = subprocess.run(cli + ["--json-schema", str(f), "--json", "--spec", "on"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["stats"]["sources"]["grammar"]["hits"] > 0
    r = subprocess.run(cli + ["--json-schema", str(f), "--json-object"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--json-schema and --json-object: give at most one grammar" in r.stderr
    r = subprocess.run(cli + ["--lark", str(tmp_path / "nope.lark")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--lark" in r.stderr and "nope.lark" in r.stderr
    bad = tmp_path / "bad.lark"
    bad.write_text("start: nope", encoding="utf-8")
    r = subprocess.run(cli + ["--lark", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'unknown name: "nope"' in r.stderr


def test_readme_constrained_output_examples(stack):
    """README's grpcurl and curl examples of "Constrained output", with the replies it states."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    block = text.split("### Constrained output", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
    assert grpcurl, "grpcurl not installed (the test extra)"
    i = block.index("grpcurl -plaintext")
    j = block.index("curl -s")
    g_cmd = block[i:j].replace("127.0.0.1:50051", stack.target).replace("grpcurl", grpcurl, 1)
    c_cmd = block[j:].replace("http://127.0.0.1:8000", stack.http_url)
    r = subprocess.run(["bash", "-c", g_cmd], capture_output=True, text=True, timeout=120,
                       env=os.environ)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)["result"]
    assert res["text"] == '{"name":"Marija Kovac","age":20}' and res["completion_tokens"] == 16
    assert res["finish_reason"] == "FINISH_REASON_EOS"
    src = {s["source"]: s for s in res["stats"]["sources"]}
    assert int(src["grammar"]["hits"]) == int(src["grammar"]["draft_tokens"]) > 0
    r = subprocess.run(["bash", "-c", c_cmd], capture_output=True, text=True, timeout=120)
    assert json.loads(r.stdout)["choices"][0]["message"]["content"] == '{"color":"blue"}'


def test_a_verifier_without_the_grammar_capability_is_not_sent_one(tiny_model, monkeypatch):
    """A verifier whose GetConfig lacks ``grammar`` (a version without constrained output) would
    drop the field and answer with free text: the coordinator refuses instead, naming it."""
    from echospec.services.verifier.servicer import VerifierServicer
    real = VerifierServicer.GetConfig

    def old_get_config(self, request, context):
        cfg = real(self, request, context)
        cfg.grammar = False
        return cfg

    monkeypatch.setattr(VerifierServicer, "GetConfig", old_get_config)
    st = start_stack(tiny_model(), spec=False, n_ctx=256, n_threads=1)
    try:
        with grpc.insecure_channel(st.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            with pytest.raises(grpc.RpcError) as ei:
                complete(stub, text="a b", max_tokens=4, grammar=common_pb2.Grammar(json_object=True))
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"the verifier {st.verifier_target} does not take a grammar" in ei.value.details()
            assert complete(stub, text="a b", max_tokens=4).completion_tokens >= 1
    finally:
        st.stop(0.5)


def test_a_verifier_with_grammar_warm_up_builds_the_tokenizer_before_serving(tiny_model, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="echospec.verifier"):
        st = start_stack(tiny_model(), spec=False, n_ctx=256, n_threads=1, grammar_warm_up=True)
    try:
        ready = [r.getMessage() for r in caplog.records if "matcher tokenizer ready" in r.getMessage()]
        listening = [r.getMessage() for r in caplog.records if "verifier listening on" in r.getMessage()]
        assert ready and listening
        msgs = [r.getMessage() for r in caplog.records]
        assert msgs.index(ready[0]) < msgs.index(listening[0])
    finally:
        st.stop(0.5)
