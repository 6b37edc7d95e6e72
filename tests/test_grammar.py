"""Constrained output's matcher (services/text/grammar.py) over the default model's vocabulary:
the grammar kinds, the refusals and their messages, the limits, the mask layout, forced tokens,
and rollback equal to a matcher that never saw the rolled-back tokens."""
from __future__ import annotations

import json

import numpy as np
import pytest

from echospec.services.text import grammar as g
from echospec.services.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "color"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green"]}}}
# regular expressions whose lexer blows up: over LEXER_FUEL
SLOW_SCHEMA = {"type": "string", "pattern": "^((a{50}b){50}c){50}$"}


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def cache(tok):
    return g.TokenizerCache(tok.hf.to_str(), n_vocab=49152)


def constraint(cache, tok, kind, text=""):
    return g.Constraint(cache.get(tok.eos_ids), g.GrammarSpec(kind, text), 49152)


def walk(c: g.Constraint, text: str, tok) -> list[int]:
    """Consume the greedy tokenization of text (as the matcher allows it) and return the ids."""
    ids = tok.encode(text)
    c.consume(ids)
    return ids


def state(c: g.Constraint) -> tuple:
    """What a matcher's state decides: the next mask, the forced tokens, accepting."""
    return (c.allowed().tobytes(), tuple(c.forced(64)), c.is_accepting())


# -- what each kind accepts -----------------------------------------------------------------------

def test_json_schema_forces_keys_and_allows_only_the_schema(cache, tok):
    c = constraint(cache, tok, "json_schema", json.dumps(SCHEMA))
    first = c.allowed()
    assert [tok.token_text(int(i)) for i in np.nonzero(first)[0]] == ['{"']
    forced = c.forced(16)
    assert tok.decode(forced) == '{"name'
    walk(c, '{"name":"ab","ok":true,"color":"', tok)
    allowed = {tok.decode([int(i)]) for i in np.nonzero(c.allowed())[0]}
    assert allowed and all("red".startswith(a) or "green".startswith(a) for a in allowed)
    walk(c, 'red"}', tok)
    assert c.is_accepting()
    # complete: only the EOS ids are allowed
    assert set(np.nonzero(c.allowed())[0]) == set(tok.eos_ids)


def test_eos_is_not_allowed_before_the_output_is_complete(cache, tok):
    c = constraint(cache, tok, "json_object")
    walk(c, '{"a":1', tok)
    mask = c.allowed()
    assert not any(mask[t] for t in tok.eos_ids)
    assert not c.is_accepting()


def test_lark_and_gbnf(cache, tok):
    c = constraint(cache, tok, "lark", 'start: "yes" | "no"')
    assert c.valid_prefix(tok.encode("yes")) == len(tok.encode("yes"))
    assert c.valid_prefix(tok.encode("maybe")) == 0
    c = constraint(cache, tok, "gbnf", 'root ::= "[" [0-9]+ "]"')
    ids = walk(c, "[42]", tok)
    assert ids and c.is_accepting()


def test_json_output_is_compact(cache, tok):
    c = constraint(cache, tok, "json_object")
    walk(c, '{"a":', tok)
    assert not c.allowed()[tok.encode(" ")[0]]


def test_mask_layout_is_llguidance_bitmask():
    words = np.array([0b101, 1 << 31, 1], dtype=np.uint32)
    mask = g.bitmask_to_bool(words, 70)
    assert list(np.nonzero(mask)[0]) == [0, 2, 63, 64]
    # a vocabulary larger than the mask's words: the extra ids are not allowed
    assert g.bitmask_to_bool(np.array([1], dtype=np.uint32), 40).tolist() == [True] + [False] * 39


def test_masked_argmax_takes_the_first_largest_allowed():
    row = np.array([5.0, 1.0, 3.0, 3.0, 9.0], dtype=np.float32)
    allowed = np.array([False, True, True, True, False])
    assert g.masked_argmax(row, allowed) == 2
    m = g.masked(row, allowed)
    assert m[0] == -np.inf and m[4] == -np.inf and m[2] == 3.0
    with pytest.raises(g.GrammarError, match="no token is allowed"):
        g.masked_argmax(row, np.zeros(5, dtype=bool))


# -- rollback -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,text,prefix,rejected", [
    ("json_schema", json.dumps(SCHEMA), '{"name":"', 'ab","ok":true'),
    ("json_object", "", '{"x":[1,', '2,3],"y":"z'),
    ("lark", 'start: "alpha" " beta" " gamma" " delta" /[0-9]+/', "alpha", " beta gamma"),
])
def test_rollback_equals_a_matcher_that_never_saw_the_tokens(cache, tok, kind, text, prefix, rejected):
    c = constraint(cache, tok, kind, text)
    walk(c, prefix, tok)
    fresh = constraint(cache, tok, kind, text)
    walk(fresh, prefix, tok)
    n = len(walk(c, rejected, tok))
    assert n >= 2 and state(c) != state(fresh)
    c.rollback(n)
    assert c.consumed == fresh.consumed
    assert state(c) == state(fresh)
    # and both go on alike
    nxt = int(np.nonzero(fresh.allowed())[0][0])
    c.consume([nxt])
    fresh.consume([nxt])
    assert state(c) == state(fresh)


def test_masks_along_a_draft_then_rollback(cache, tok):
    c = constraint(cache, tok, "json_schema", json.dumps(SCHEMA))
    fresh = constraint(cache, tok, "json_schema", json.dumps(SCHEMA))
    draft = tok.encode('{"name":"x')
    masks = c.masks_along(draft)
    assert len(masks) == len(draft) + 1
    for i, t in enumerate(draft):
        assert masks[i][t]
        assert masks[i].tobytes() == fresh.allowed().tobytes()
        fresh.consume([t])
    c.rollback(len(draft) - 1)
    assert c.consumed == draft[:1]


def test_rollback_past_the_start_is_refused(cache, tok):
    c = constraint(cache, tok, "json_object")
    walk(c, '{"', tok)
    with pytest.raises(g.GrammarError, match="rollback of 5 tokens: the matcher holds 1"):
        c.rollback(5)


def test_a_token_the_grammar_refuses_names_it(cache, tok):
    c = constraint(cache, tok, "json_object")
    bad = tok.encode("hello")[0]
    with pytest.raises(g.GrammarError, match=f"grammar.json_object: .*token {bad}|the matcher failed"):
        c.consume([bad])


# -- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,message", [
    (g.GrammarSpec("json_schema", '{"type": "objectx"}'), "grammar.json_schema: Invalid type: objectx"),
    (g.GrammarSpec("json_schema", "{not json"), "grammar.json_schema is not valid JSON"),
    (g.GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object .*got a JSON list"),
    (g.GrammarSpec("json_schema", "  "), "grammar.json_schema is empty"),
    (g.GrammarSpec("lark", "start: foo"), 'grammar.lark: .*unknown name: "foo"'),
    (g.GrammarSpec("gbnf", "root ::= [0-9"), "grammar.gbnf"),
    (g.GrammarSpec("json_object", "{}"), "json_object takes no text"),
    (g.GrammarSpec("regex", "a+"), "grammar kind must be one of json_object, json_schema, lark, gbnf"),
    # was: the matcher's ValueError uncaught, gRPC UNKNOWN / HTTP 500
    (g.GrammarSpec("json_schema", '{"enum": [1208925819614629174706176]}'),
     "grammar.json_schema: the matcher cannot take it: .*not JSON serializable"),
    (g.GrammarSpec("json_schema", '{"type": "integer", "maximum": 100000000000000000000000}'),
     "grammar.json_schema: the matcher cannot take it"),
])
def test_bad_grammars_are_refused_naming_the_problem(spec, message):
    with pytest.raises(g.GrammarError, match=message):
        g.check_grammar(spec)


def test_grammar_size_limit():
    big = json.dumps({"enum": ["v%05d" % i for i in range(10000)]})
    assert len(big) > g.MAX_GRAMMAR_BYTES
    with pytest.raises(g.GrammarError, match=f"more than the limit of {g.MAX_GRAMMAR_BYTES} bytes"):
        g.check_grammar(g.GrammarSpec("json_schema", big))


def test_valid_grammars_pass_the_check():
    for spec in (g.GrammarSpec("json_object"), g.GrammarSpec("json_schema", json.dumps(SCHEMA)),
                 g.GrammarSpec("lark", 'start: "a"+'), g.GrammarSpec("gbnf", 'root ::= "a" | "b"')):
        assert g.check_grammar(spec)


def test_a_schema_that_makes_the_matcher_slow_hits_the_lexer_limit(cache, tok):
    c = constraint(cache, tok, "json_schema", json.dumps(SLOW_SCHEMA))
    with pytest.raises(g.GrammarError, match="matcher failed.*too many expressions constructed "
                       f".*over the matcher's limit of {g.LEXER_FUEL} units"):
        for _ in range(8):   # the lexer builds its expressions as the output goes
            c.consume([int(np.nonzero(c.allowed())[0][0])])


def test_tokenizer_cache_needs_an_eos(cache):
    with pytest.raises(g.GrammarError, match="needs at least one EOS id"):
        cache.get([])
    assert cache.get([2, 0]) is cache.get([0, 2])
