"""Repetition penalties (frequency, presence, llama.cpp's repeat penalty and its window): the rule
on literal rows, one rule per case; the verifier's loop on a tiny model against a numpy loop over
the engine's logits (greedy and sampled); speculation on and off byte identical; the refusals;
then through the services on the default model: gRPC, the official openai client, the Python
client and `echospec generate`."""
from __future__ import annotations

import threading
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest

from echospec.services.common.config import VerifierConfig
from echospec.services.common.penalties import DEFAULT_LAST_N, Penalties, PenaltyError
from echospec.services.gateway import openai_api as api
from echospec.services.verifier.engine import Model, sample
from echospec.services.verifier.generation_loop import GenerationRequest, check, run_generation
from echospec.services.verifier.sessions import InvalidArgument, Sampling, VerifierCore
from echospec.v1 import common_pb2, coordinator_pb2 as cpb

ROW = np.array([3.0, -1.0, 0.0, 2.0, 5.0], dtype=np.float32)


# -- the rule on literal rows ----------------------------------------------------------------------

def test_no_token_in_the_window_leaves_the_row():
    assert np.array_equal(Penalties(frequency=1.0, presence=1.0, repeat=2.0).apply(ROW, []), ROW)


def test_frequency_is_subtracted_once_per_occurrence():
    got = Penalties(frequency=0.5).apply(ROW, [3, 3, 3])
    assert got.tolist() == [3.0, -1.0, 0.0, 0.5, 5.0]


def test_presence_is_subtracted_once_per_token_seen():
    got = Penalties(presence=0.25).apply(ROW, [0, 0, 4])
    assert got.tolist() == [2.75, -1.0, 0.0, 2.0, 4.75]


def test_repeat_divides_a_positive_logit():
    assert Penalties(repeat=2.0).apply(ROW, [0]).tolist() == [1.5, -1.0, 0.0, 2.0, 5.0]


def test_repeat_multiplies_a_negative_or_zero_logit():
    assert Penalties(repeat=2.0).apply(ROW, [1, 2]).tolist() == [3.0, -2.0, 0.0, 2.0, 5.0]


def test_negative_penalties_raise_the_logit():
    assert Penalties(frequency=-1.0, presence=-0.5).apply(ROW, [2, 2]).tolist() == \
        [3.0, -1.0, 2.5, 2.0, 5.0]


def test_worked_example_of_the_docstring():
    row = np.zeros(8, dtype=np.float32)
    row[5], row[7] = 3.0, -1.0
    got = Penalties(frequency=0.5, presence=0.25, repeat=2.0).apply(row, [5, 7, 5])
    assert got[5] == 0.25 and got[7] == -2.75


def test_the_window_counts_the_last_n_tokens_only():
    # token 0 is 3 back: outside a window of 2
    assert Penalties(presence=1.0, last_n=2).apply(ROW, [0, 3, 4]).tolist() == [3.0, -1.0, 0.0, 1.0, 4.0]


def test_last_n_minus_one_counts_the_whole_context():
    ctx = [0] + [1] * 500
    assert Penalties(presence=1.0, last_n=-1).apply(ROW, ctx)[0] == 2.0


def test_last_n_zero_is_the_default_window_of_64():
    assert DEFAULT_LAST_N == 64
    p = Penalties(presence=1.0)
    assert p.apply(ROW, [0] + [1] * 63)[0] == 2.0       # 64 back: inside
    assert p.apply(ROW, [0] + [1] * 64)[0] == 3.0       # 65 back: outside


def test_drafts_follow_the_context_in_the_window():
    p = Penalties(frequency=1.0, last_n=3)
    # window = [3, 4] + drafts [4, 2][-3:] -> [4, 4, 2]: token 3 fell out
    assert p.apply(ROW, [0, 3, 4], extra=[4, 2]).tolist() == [3.0, -1.0, -1.0, 2.0, 3.0]


def test_apply_returns_a_new_float32_row():
    row = ROW.copy()
    got = Penalties(repeat=3.0).apply(row, [0])
    assert got.dtype == np.float32 and np.array_equal(row, ROW)
    assert got[0] == np.float32(3.0) / np.float32(3.0)


@pytest.mark.parametrize("pen,active", [
    (Penalties(), False), (Penalties(repeat=0.0), False), (Penalties(repeat=1.0, last_n=-1), False),
    (Penalties(frequency=0.1), True), (Penalties(presence=-0.1), True), (Penalties(repeat=0.9), True),
])
def test_active(pen, active):
    assert pen.active is active


@pytest.mark.parametrize("pen,field", [
    (Penalties(frequency=2.5), "frequency_penalty"), (Penalties(frequency=float("nan")), "frequency_penalty"),
    (Penalties(presence=-2.01), "presence_penalty"), (Penalties(repeat=-1.0), "repeat_penalty"),
    (Penalties(repeat=float("inf")), "repeat_penalty"), (Penalties(last_n=-2), "repeat_last_n"),
    (Penalties(last_n=(1 << 20) + 1), "repeat_last_n"),
    # was accepted: 1e-40 divided a repeated token's logit to +inf (a sampled request then failed)
    (Penalties(repeat=1e-40), "repeat_penalty"), (Penalties(repeat=1001.0), "repeat_penalty"),
])
def test_check_names_the_field(pen, field):
    with pytest.raises(PenaltyError, match=f"^x.{field} must"):
        pen.check("x.")


def test_check_takes_the_edges():
    Penalties(frequency=2.0, presence=-2.0, repeat=1e-3, last_n=-1).check()
    Penalties(repeat=1e3).check()
    Penalties(last_n=1 << 20).check()


# -- the verifier's loop on a tiny model ------------------------------------------------------------

N_CTX = 256
REPETITIVE = [7, 8, 9, 10] * 6 + [7, 8]


def reference_penalise(row: np.ndarray, before: list[int], freq: float, pres: float, rep: float,
                       last_n: int) -> np.ndarray:
    """llama.cpp's penalties sampler written out token by token (independent of penalties.py)."""
    out = row.astype(np.float32).copy()
    n = len(before) if last_n == -1 else (64 if last_n == 0 else last_n)
    window = before[len(before) - n:] if n < len(before) else before
    counts: dict[int, int] = {}
    for t in window:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        x = out[t]
        if rep != 1.0:
            x = x * np.float32(rep) if x <= 0 else x / np.float32(rep)
        out[t] = x - (np.float32(c) * np.float32(freq) + np.float32(1.0) * np.float32(pres))
    return out


def reference_run(path: str, prompt: list[int], n: int, pen: Penalties,
                  temperature: float = 0.0, seed: int = 0) -> list[int]:
    """Plain decoding over the engine's logits rows with the penalties applied by hand."""
    m = Model(path)
    try:
        s = m.new_session(n_ctx=N_CTX, n_threads=1)
        _, logits = s.prefill(prompt, logits=True)
        seq, out, rng = list(prompt), [], seed
        for _ in range(n):
            row = reference_penalise(logits[-1], seq, pen.frequency, pen.presence,
                                     pen.repeat if pen.repeat else 1.0, pen.last_n)
            if temperature > 0:
                tok, rng = sample(row, temperature=temperature, rng=rng)
            else:
                tok = int(np.argmax(row))
            out.append(tok)
            seq.append(tok)
            _, logits = s.forward([tok], "last")
        return out
    finally:
        m.close()


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(arch="llama", n_vocab=320, n_ctx_train=512, seed=0)


@pytest.fixture(scope="module")
def core(model_path):
    c = VerifierCore(VerifierConfig(model=model_path, n_ctx=N_CTX, n_threads=1, prefix_cache=False))
    yield c
    c.close()


def generate(core, prompt, max_tokens, pen=Penalties(), spec=False, link=None, k=4,
             temperature=0.0, seed=0):
    req = GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, eos_ids=frozenset(),
                            sampling=Sampling(temperature=temperature, seed=seed, penalties=pen),
                            spec=spec, k=k, fixed_k=True)
    check(core, req)
    evs = list(run_generation(core, req, threading.Event(), (lambda: link) if link else None))
    return [t for e in evs for t in e.tokens], evs


PENALTIES = [Penalties(frequency=1.5), Penalties(presence=2.0, last_n=8),
             Penalties(repeat=1.8, last_n=-1), Penalties(frequency=0.7, presence=0.4, repeat=1.3)]


@pytest.mark.parametrize("pen", PENALTIES, ids=str)
def test_greedy_output_is_the_reference_loop_over_the_engine_logits(core, model_path, pen):
    got, _ = generate(core, REPETITIVE, 40, pen)
    assert got == reference_run(model_path, REPETITIVE, 40, pen)


def test_penalties_change_the_greedy_output_on_a_repetitive_prompt(core):
    plain, _ = generate(core, REPETITIVE, 40)
    for pen in PENALTIES:
        assert generate(core, REPETITIVE, 40, pen)[0] != plain, pen
    # the tiny model repeats one token; a frequency penalty grows with each repeat until another
    # token wins (a flat presence penalty may not: the first repeated token can stay on top)
    pen = Penalties(frequency=1.5, last_n=-1)
    penalised, _ = generate(core, REPETITIVE, 40, pen)
    assert len(set(penalised)) > len(set(plain))


def test_sampled_output_is_the_reference_draws_from_penalised_rows(core, model_path):
    pen = Penalties(frequency=1.0, repeat=1.5)
    got, _ = generate(core, REPETITIVE, 30, pen, temperature=0.8, seed=1234)
    assert got == reference_run(model_path, REPETITIVE, 30, pen, temperature=0.8, seed=1234)
    assert got != generate(core, REPETITIVE, 30, temperature=0.8, seed=1234)[0]


class _Draft:
    """A draft link proposing ``truth`` (prompt + output), every ``wrong_every``-th proposal with
    its second token changed; or, with ``truth`` the unpenalised output, drafts the penalties
    mostly reject."""

    def __init__(self, truth: list[int], wrong_every: int = 0):
        self.truth, self.wrong_every = truth, wrong_every
        self.history: list[int] = []
        self.asked: list[int] = []

    def append(self, tokens):
        self.history += list(tokens)

    def send_propose(self, append, n):
        self.history += list(append)
        self.asked.append(n)

    def recv_proposal(self):
        p = list(self.truth[len(self.history):len(self.history) + self.asked[-1]])
        if self.wrong_every and len(self.asked) % self.wrong_every == 0 and len(p) >= 2:
            p[1] = (p[1] + 1) % 320
        return p

    def close(self):
        pass

    def cancel(self):
        pass


@pytest.mark.parametrize("pen", PENALTIES, ids=str)
def test_spec_on_is_byte_identical_to_off(core, pen):
    off, _ = generate(core, REPETITIVE, 48, pen)
    # drafts of the true output are all accepted: each verify row is penalised with the counts of
    # its own prefix, the drafts before it included (without them a repeated draft is refused)
    on, evs = generate(core, REPETITIVE, 48, pen, spec=True, link=_Draft(REPETITIVE + off), k=4)
    assert on == off
    assert sum(e.k for e in evs) > 0 and all(e.accepted == e.k for e in evs)
    on, evs = generate(core, REPETITIVE, 48, pen, spec=True,
                       link=_Draft(REPETITIVE + off, wrong_every=3), k=4)
    assert on == off and sum(e.accepted for e in evs) > 0
    # drafts of the unpenalised output: mostly rejected, the output is still the penalised one
    plain, _ = generate(core, REPETITIVE, 48)
    on2, evs2 = generate(core, REPETITIVE, 48, pen, spec=True, link=_Draft(REPETITIVE + plain), k=4)
    assert on2 == off
    assert any(e.accepted < e.k for e in evs2)


@pytest.mark.parametrize("pen,field", [(Penalties(frequency=3.0), "frequency_penalty"),
                                       (Penalties(repeat=float("nan")), "repeat_penalty"),
                                       (Penalties(last_n=-5), "repeat_last_n")])
def test_the_verifier_refuses_bad_values(core, pen, field):
    req = GenerationRequest(prompt=[5, 6], max_tokens=4, eos_ids=frozenset(),
                            sampling=Sampling(penalties=pen))
    with pytest.raises(InvalidArgument, match=f"sampling.{field} must"):
        check(core, req)


# -- the gateway's fields (no server) ----------------------------------------------------------------

@pytest.mark.parametrize("chat", [True, False])
def test_gateway_maps_the_four_fields(chat):
    body = {"frequency_penalty": 0.5, "presence_penalty": -1, "repeat_penalty": 1.2, "repeat_last_n": -1,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    req = api.parse_request(body, chat).requests[0]
    assert (req.frequency_penalty, req.presence_penalty, req.repeat_last_n) == (0.5, -1.0, -1)
    assert req.HasField("repeat_penalty") and abs(req.repeat_penalty - 1.2) < 1e-6
    bare = api.parse_request({k: v for k, v in body.items() if "penalty" not in k and "last_n" not in k},
                             chat).requests[0]
    assert not bare.HasField("repeat_penalty") and bare.frequency_penalty == 0 and bare.repeat_last_n == 0


def test_gateway_repeat_last_n_zero_turns_every_penalty_off():
    req = api.parse_request({"prompt": "hi", "frequency_penalty": 1, "repeat_penalty": 1.5,
                             "repeat_last_n": 0}, False).requests[0]
    assert req.frequency_penalty == 0 and not req.HasField("repeat_penalty")


@pytest.mark.parametrize("field,value", [("frequency_penalty", 2.5), ("presence_penalty", -3),
                                         ("presence_penalty", "1"), ("repeat_penalty", 0),
                                         ("repeat_penalty", -1.0), ("repeat_penalty", 1e39),
                                         ("repeat_penalty", 1e-40), ("repeat_penalty", 1e4),
                                         ("repeat_last_n", -2), ("repeat_last_n", 1.5)])
@pytest.mark.parametrize("chat", [True, False])
def test_gateway_refuses_bad_values_naming_the_field(field, value, chat):
    body = {field: value, **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    with pytest.raises(api.ApiError) as ei:
        api.parse_request(body, chat)
    assert ei.value.status == 400 and ei.value.param == field and field in ei.value.message


# -- through the services on the default model -------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
ON, OFF = common_pb2.SPEC_MODE_ON, common_pb2.SPEC_MODE_OFF
MODEL = "SmolLM2-135M-Instruct.Q4_1"
LOOP_PROMPT = "one two three one two three one two three one two three one two three"


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
    return stub.Complete(cpb.CompleteRequest(text=LOOP_PROMPT, max_tokens=32, **kw), timeout=120).result


def test_grpc_penalties_change_the_output_and_keep_speculation_exact(stub):
    plain = complete(stub, spec=OFF)
    pen = dict(frequency_penalty=0.8, presence_penalty=0.5, repeat_penalty=1.3, repeat_last_n=-1)
    off = complete(stub, spec=OFF, **pen)
    assert off.token_ids != plain.token_ids
    # drafts from a prediction: the penalised output itself (accepted), then the unpenalised one
    # (rejected where the penalties part from it)
    for prediction in (off.text, plain.text):
        on = complete(stub, spec=ON, prediction=prediction, **pen)
        assert list(on.token_ids) == list(off.token_ids) and on.text == off.text
        assert on.spec_enabled and on.spec_reason == ""
        assert on.stats.draft_tokens > 0
    assert on.stats.rejected_prediction_tokens > 0


@pytest.mark.parametrize("kw,field", [({"frequency_penalty": 2.5}, "frequency_penalty"),
                                      ({"presence_penalty": -2.5}, "presence_penalty"),
                                      ({"repeat_penalty": 0.0}, "repeat_penalty"),
                                      ({"repeat_penalty": float("inf")}, "repeat_penalty"),
                                      ({"repeat_penalty": 1e-40}, "repeat_penalty"),
                                      ({"repeat_penalty": 2000.0}, "repeat_penalty"),
                                      ({"repeat_last_n": -2}, "repeat_last_n"),
                                      ({"repeat_last_n": (1 << 20) + 1}, "repeat_last_n")])
def test_grpc_refuses_bad_values_naming_the_field(stub, kw, field):
    with pytest.raises(grpc.RpcError) as ei:
        complete(stub, **kw)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith(f"{field} must"), ei.value.details()


def test_openai_client_on_both_routes_matches_grpc(client, stub):
    want = complete(stub, frequency_penalty=1.0, presence_penalty=0.5, repeat_penalty=1.2)
    r = client.completions.create(model=MODEL, prompt=LOOP_PROMPT, max_tokens=32, frequency_penalty=1.0,
                                  presence_penalty=0.5, extra_body={"repeat_penalty": 1.2})
    assert r.choices[0].text == want.text
    msgs = [{"role": "user", "content": "Say 'yes yes yes yes yes yes yes yes'."}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24)
    pen = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, frequency_penalty=2,
                                         presence_penalty=2, extra_body={"spec": "on", "repeat_last_n": -1})
    assert pen.choices[0].message.content != plain.choices[0].message.content
    ext = pen.model_extra["echospec"]
    assert ext["spec_enabled"] is True and ext["spec_reason"] == ""


@pytest.mark.parametrize("field,value", [("frequency_penalty", 2.5), ("presence_penalty", -2.5)])
def test_openai_client_bad_value_is_a_400_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                       **{field: value})
    assert ei.value.body["param"] == field


def test_python_client_and_cli_send_the_penalties(stack, stub):
    import json
    import subprocess
    import sys

    from echospec_client import Client

    kw = dict(frequency_penalty=1.0, presence_penalty=0.5, repeat_penalty=1.2, repeat_last_n=-1)
    want = complete(stub, **kw)
    assert want.text != complete(stub).text
    with Client(stack.target, timeout=120) as c:
        assert c.complete(prompt=LOOP_PROMPT, max_tokens=32, **kw).text == want.text
    cli = [sys.executable, "-m", "echospec.cli", "generate", LOOP_PROMPT, "--target", stack.target,
           "--json", "--max-tokens", "32"]
    r = subprocess.run(cli + ["--frequency-penalty", "1", "--presence-penalty", "0.5",
                              "--repeat-penalty", "1.2", "--repeat-last-n", "-1"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] == want.text
    r = subprocess.run(cli + ["--presence-penalty", "3"], capture_output=True, text=True, timeout=120,
                       cwd=REPO)
    assert r.returncode == 2 and "--presence-penalty 3: must be in [-2, 2]" in r.stderr, r.stderr
    r = subprocess.run(cli + ["--repeat-penalty", "1e-40"], capture_output=True, text=True, timeout=120,
                       cwd=REPO)
    assert r.returncode == 2 and "--repeat-penalty 1e-40: must be in [0.001, 1000]" in r.stderr, r.stderr
