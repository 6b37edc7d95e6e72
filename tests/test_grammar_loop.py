"""Constrained output in the verifier's generation loop (below gRPC) on the default model: the
mask before argmax and sampling, the grammar draft source, byte identity with speculation on and
off, the matcher rolled back with the KV cache, resumed generations, refusals."""
from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from conftest import chatml
from echospec.services.common.config import VerifierConfig
from echospec.services.text.grammar import GrammarSpec
from echospec.services.verifier.generation_loop import (SOURCE_GRAMMAR, DraftUnavailable,
                                                        GenerationRequest, check, run_generation)
from echospec.services.verifier.sessions import InvalidArgument, Sampling, VerifierCore

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}}}
PROMPT = "Describe a person as JSON with name, age and pet."


@pytest.fixture(scope="module")
def core(smollm2_path):
    c = VerifierCore(VerifierConfig(model=smollm2_path, n_ctx=512, n_threads=1, prefix_cache=False))
    yield c
    c.close()


@pytest.fixture(scope="module")
def prompt(smollm2_tokenizer):
    return smollm2_tokenizer.encode(chatml(PROMPT))


def run(core, prompt, grammar, spec=False, link=None, max_tokens=48, sampling=Sampling(), k=4,
        resumed=0, fixed_k=False):
    req = GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, eos_ids=frozenset({0, 2}),
                            sampling=sampling, spec=spec, k=k, grammar=grammar, resumed=resumed,
                            fixed_k=fixed_k)
    check(core, req)
    return list(run_generation(core, req, threading.Event(), (lambda: link) if link else None))


def out_tokens(evs) -> list[int]:
    toks = [t for e in evs for t in e.tokens]
    return toks[:-1] if toks and toks[-1] in (0, 2) else toks


class _WrongDraft:
    """A draft link that proposes the true continuation with its second token replaced by
    another one the grammar allows there (so the verify rejects it), or by one the grammar
    refuses (so the loop cuts the draft before the forward), in turn."""

    def __init__(self, core, grammar, prompt, truth):
        self.core, self.grammar, self.truth = core, grammar, truth
        self.history: list[int] = []   # the loop appends the prompt first
        self.n_prompt = len(prompt)
        self.asked = []

    def append(self, tokens):
        self.history += list(tokens)

    def send_propose(self, append, n):
        self.history += list(append)
        self.asked.append(n)

    def recv_proposal(self):
        out = self.history[self.n_prompt:]
        p = list(self.truth[len(out):len(out) + self.asked[-1]])
        if len(p) >= 2:
            c = self.core.constraint(self.grammar, [0, 2], out + p[:1])
            allowed = [int(t) for t in c.allowed().nonzero()[0] if t != p[1]]
            refused = [t for t in range(3, 100) if not c.allowed()[t]]
            p[1] = allowed[0] if len(self.asked) % 2 and allowed else refused[0]
        return p

    def close(self):
        pass

    def cancel(self):
        pass


def test_greedy_json_schema_output_validates(core, prompt, smollm2_tokenizer):
    evs = run(core, prompt, GrammarSpec("json_schema", json.dumps(SCHEMA)))
    text = smollm2_tokenizer.decode(out_tokens(evs))
    jsonschema.validate(json.loads(text), SCHEMA)
    assert evs[-1].tokens[-1] in (0, 2)   # ended by EOS once the object was complete


@pytest.mark.parametrize("grammar,forces", [
    (GrammarSpec("json_schema", json.dumps(SCHEMA)), True),
    (GrammarSpec("json_object"), False),     # free keys and values: nothing is forced
    (GrammarSpec("lark", 'start: "Name: " /[A-Z][a-z]{1,10}/ ", age " /[0-9]{1,2}/ "."'), True),
])
def test_spec_on_with_the_grammar_source_is_byte_identical_to_off(core, prompt, grammar, forces):
    off = run(core, prompt, grammar)
    on = run(core, prompt, grammar, spec=True)
    assert out_tokens(on) == out_tokens(off)
    assert all(e.source == 0 for e in off)
    if not forces:
        assert all(e.k == 0 for e in on)
        return
    grammar_rounds = [e for e in on if e.source == SOURCE_GRAMMAR]
    assert grammar_rounds and all(e.k >= 1 for e in grammar_rounds)
    assert sum(e.accepted for e in grammar_rounds) > 0
    # fewer forwards than tokens: several tokens per forward where the grammar forces them
    assert len(on) < len(off)


def test_draft_service_drafts_are_cut_by_the_grammar_and_rolled_back(core, prompt, smollm2_tokenizer):
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    off = run(core, prompt, grammar)
    link = _WrongDraft(core, grammar, prompt, out_tokens(off))
    on = run(core, prompt, grammar, spec=True, link=link, k=8, fixed_k=True)
    assert out_tokens(on) == out_tokens(off)
    service = [e for e in on if e.k and e.source != SOURCE_GRAMMAR]
    assert link.asked and service
    assert any(e.accepted < e.k for e in service)   # rejected drafts: KV and matcher rolled back


def test_forced_drafts_may_exceed_k(core, prompt):
    grammar = GrammarSpec("lark", 'start: "The quick brown fox jumps over the lazy dog and keeps running far away." /[0-9]/')
    evs = run(core, prompt, grammar, spec=True, k=1)
    assert max(e.k for e in evs if e.source == SOURCE_GRAMMAR) > 1


def test_sampling_is_masked(core, prompt, smollm2_tokenizer):
    grammar = GrammarSpec("lark", 'start: ("yes" | "no" | "maybe") "!"')
    seen = set()
    for seed in range(1, 7):
        evs = run(core, prompt, grammar, sampling=Sampling(temperature=1.5, seed=seed), max_tokens=8)
        text = smollm2_tokenizer.decode(out_tokens(evs))
        assert text in ("yes!", "no!", "maybe!")
        seen.add(text)
    assert len(seen) >= 2   # the draws differ, among allowed outputs only


def test_a_resumed_generation_continues_under_the_grammar(core, prompt):
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    whole = out_tokens(run(core, prompt, grammar))
    cut = 7
    rest = out_tokens(run(core, list(prompt) + whole[:cut], grammar, resumed=cut,
                          max_tokens=48 - cut))
    assert whole[:cut] + rest == whole


def test_bad_grammars_are_invalid_argument_before_a_session_is_taken(core, prompt):
    active = core.active_sessions
    with pytest.raises(InvalidArgument, match='grammar.lark: .*unknown name: "nope"'):
        run(core, prompt, GrammarSpec("lark", "start: nope"))
    with pytest.raises(InvalidArgument, match="grammar.json_schema is not valid JSON"):
        run(core, prompt, GrammarSpec("json_schema", "{"))
    assert core.active_sessions == active


def test_a_slow_schema_ends_with_the_matchers_limit(core, prompt):
    slow = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "^((a{50}b){50}c){50}$"}))
    with pytest.raises(InvalidArgument, match="too many expressions constructed .*limit of 200000"):
        run(core, prompt, slow, max_tokens=8)
    assert core.active_sessions == 0


def test_resumed_tokens_the_grammar_refuses_are_invalid_argument(core, prompt, smollm2_tokenizer):
    bad = smollm2_tokenizer.encode("hello")
    with pytest.raises(InvalidArgument, match="grammar.json_object"):
        run(core, list(prompt) + bad, GrammarSpec("json_object"), resumed=len(bad))


def test_masks_are_computed_beside_the_forward(core, prompt, monkeypatch):
    """On the generation's own worker thread, submitted before the step's forward and collected
    after it (so the forward and the matcher run at once)."""
    from echospec.services.text.grammar import Constraint
    seen = []
    real = Constraint.masks_along

    def masks_along(self, draft):
        seen.append(threading.current_thread().name)
        return real(self, draft)

    monkeypatch.setattr(Constraint, "masks_along", masks_along)
    evs = run(core, prompt, GrammarSpec("json_object"), max_tokens=8)
    assert len(seen) == len(evs) - 1   # one per round after the prefill
    assert all(name.startswith("grammar-masks") for name in seen)


def test_a_sentencepiece_vocabulary_gemma3(gemma3_path):
    """Gemma 3's SentencePiece vocabulary (262144 ids, byte fallback, EOS ids 1 and 106): the
    matcher's tokenizer is built from it alike, and the output is the same with speculation on."""
    from echospec.services.text.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(gemma3_path)
    core = VerifierCore(VerifierConfig(model=gemma3_path, n_ctx=512, n_threads=1, prefix_cache=False))
    try:
        prompt = tok.prompt_ids("A person described as JSON with name, age and pet: ")
        outs = []
        for spec in (False, True):
            req = GenerationRequest(prompt=prompt, max_tokens=48, eos_ids=frozenset(tok.eos_ids),
                                    sampling=Sampling(), spec=spec, k=4,
                                    grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
            check(core, req)
            evs = list(run_generation(core, req, threading.Event()))
            toks = [t for e in evs for t in e.tokens]
            assert toks[-1] in tok.eos_ids
            jsonschema.validate(json.loads(tok.decode(toks[:-1])), SCHEMA)
            outs.append((toks, sum(e.accepted for e in evs if e.source == SOURCE_GRAMMAR)))
        assert outs[0][0] == outs[1][0] and outs[0][1] == 0 and outs[1][1] > 0
    finally:
        core.close()


def test_constrained_generations_batched_together_give_their_lone_outputs(smollm2_path, prompt,
                                                                         smollm2_tokenizer):
    """With batch_max 2 two constrained generations (one free-text beside) share forwards; each
    one's tokens are those it gets alone (the masked argmax of rows bitwise equal to its own)."""
    core = VerifierCore(VerifierConfig(model=smollm2_path, n_ctx=512, n_threads=1, prefix_cache=False,
                                       batch_max=3))
    try:
        other = smollm2_tokenizer.encode(chatml("Describe a pilot as JSON with name, age and pet."))
        cases = [(prompt, GrammarSpec("json_schema", json.dumps(SCHEMA))),
                 (other, GrammarSpec("json_object")), (other, None)]
        alone = [out_tokens(run(core, p, g, max_tokens=32)) for p, g in cases]
        together: list = [None] * len(cases)

        def go(i):
            together[i] = out_tokens(run(core, cases[i][0], cases[i][1], max_tokens=32))

        core.scheduler.trace = []
        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert together == alone
        assert max(len(b) for b in core.scheduler.trace) >= 2   # forwards were shared
        assert alone[0] != alone[2]
    finally:
        core.close()


def test_warm_up_builds_the_matcher_tokenizer_for_the_ggufs_eos_ids(smollm2_path, caplog):
    """At startup (before SERVING): the first constrained request then builds nothing, so no
    build (which holds the GIL) stalls the verifier's other calls."""
    import logging
    c = VerifierCore(VerifierConfig(model=smollm2_path, n_ctx=256, n_threads=1, prefix_cache=False))
    try:
        assert c._grammar_tokenizers is None
        with caplog.at_level(logging.INFO, logger="echospec.verifier"):
            c.warm_up_grammar()
        assert "grammar: matcher tokenizer ready in" in caplog.text
        cache = c._grammar_tokenizers
        built = dict(cache._by_eos)
        assert list(built) == [(0, 2)]
        c.constraint(GrammarSpec("json_object"), [2, 0])
        assert cache._by_eos == built
    finally:
        c.close()


def test_warm_up_of_a_vocabulary_the_matcher_cannot_take_is_not_fatal(tiny_model, caplog, monkeypatch):
    import logging
    from echospec.services.text import grammar as gmod

    def refuse(*a, **kw):
        raise ValueError("no such vocabulary")

    monkeypatch.setattr(gmod.llguidance, "LLTokenizer", refuse)
    c = VerifierCore(VerifierConfig(model=tiny_model(), n_ctx=256, n_threads=1))
    try:
        with caplog.at_level(logging.WARNING, logger="echospec.verifier"):
            c.warm_up_grammar()
        assert "no matcher tokenizer for this model (no such vocabulary)" in caplog.text
        from echospec.services.verifier.sessions import FailedPrecondition
        with pytest.raises(FailedPrecondition, match="cannot take this model's vocabulary"):
            c.constraint(GrammarSpec("json_object"), [1])
    finally:
        c.close()
