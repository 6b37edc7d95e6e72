"""The draft prior (services/draft/prior.py): its table, its file, its place in the generation loop
and `echospec prior`, which builds it from a model's own answers."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import zipfile

import numpy as np
import pytest

from echospec.services.common.config import VerifierConfig
from echospec.services.draft.prior import (DraftPrior, PriorError, PriorStats, default_path, priors_dir,
                                           resolve)
from echospec.services.verifier.generation_loop import (SOURCE_PRIOR, GenerationRequest, check,
                                                        run_generation)
from echospec.services.verifier.sessions import InvalidArgument, Sampling, VerifierCore

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the table -----------------------------------------------------------------------------------

def test_the_docstring_example():
    p = DraftPrior([[1, 2, 3], [1, 2, 4], [5, 2, 3]], n_vocab=10, max_n=2)
    assert p.next([9, 1, 2]) == 3 and p.next([7, 2]) == 3 and p.next([6]) is None
    assert p.n_tokens == 9 and len(p) == 5


def test_the_longest_known_context_wins():
    # after (2,) alone 7 is most frequent; after (1, 2) it is 8
    p = DraftPrior([[2, 7], [2, 7], [2, 7], [1, 2, 8]], n_vocab=10, max_n=4)
    assert p.next([2]) == 7 and p.next([5, 2]) == 7 and p.next([1, 2]) == 8 and p.next([0, 1, 2]) == 8


def test_the_most_frequent_wins_and_a_tie_goes_to_the_first_seen():
    p = DraftPrior([[4, 6], [4, 5], [4, 5], [3, 9], [3, 8]], n_vocab=10, max_n=1)
    assert p.next([4]) == 5 and p.next([3]) == 9


def test_contexts_stop_at_max_n_and_never_span_two_sequences():
    p = DraftPrior([[1, 2, 3, 4, 5]], n_vocab=10, max_n=2)
    assert p.next([9, 3, 4]) == 5                      # (3, 4) and (4,) are known, (2, 3, 4) is not kept
    q = DraftPrior([[1, 2], [3, 4]], n_vocab=10, max_n=3)
    assert q.next([2, 3]) == 4 and q.next([2]) is None   # nothing follows 2: the sequence ends there


def test_an_empty_history_or_prior_drafts_nothing():
    assert DraftPrior([[1, 2]], n_vocab=4).next([]) is None
    assert DraftPrior([], n_vocab=4).next([1, 2]) is None


@pytest.mark.parametrize("seqs,n_vocab,max_n,msg", [
    ([[1, 10]], 10, 4, "token id 10, outside [0, 10)"),
    ([[-1, 2]], 10, 4, "token id -1"),
    ([[1]], 0, 4, "n_vocab must be >= 1"),
    ([[1]], 10, 0, "max_n must be in [1, 8]"),
    ([[1]], 10, 9, "max_n must be in [1, 8]"),
])
def test_bad_tables_are_refused(seqs, n_vocab, max_n, msg):
    with pytest.raises(PriorError, match=msg.replace("[", r"\[").replace(")", r"\)")):
        DraftPrior(seqs, n_vocab, max_n)


def test_prior_stats_follow_the_docstring_example_and_drift_back():
    s = PriorStats(alpha=0.25)
    s.record(False)
    s.record(False)
    assert (round(s.p, 2), s.tries, s.hits) == (0.14, 2, 0)
    s.record(True)
    assert round(s.p, 2) == 0.36 and s.hits == 1
    low = PriorStats(p=0.0, drift=1 / 64)
    for _ in range(64):
        low.idle()
    assert 0.15 < low.p < 0.17       # 1 - (63/64)^64 of the way back to the seed


def _drafted(q: float, rounds: int = 20000) -> float:
    """The share of rounds the loop's rule (draft while p >= min_p) drafts on text whose prior
    drafts are kept with probability q (a fixed pseudo-random sequence)."""
    import random
    rng, s, n = random.Random(1), PriorStats(), 0
    for _ in range(rounds):
        if s.p >= s.min_p:
            n += 1
            s.record(rng.random() < q)
        else:
            s.idle()
    return n / rounds


def test_prior_stats_draft_where_it_pays_and_probe_where_it_does_not():
    """The docstring's figures: kept 30 % of the time -> every round; 15 % -> about 9 in 10;
    never -> about 3 in 10 (each a few % of T lost); the first 25 misses from the seed all draft."""
    assert _drafted(0.3) >= 0.97 and 0.8 <= _drafted(0.15) <= 0.97 and 0.15 <= _drafted(0.0) <= 0.4
    s = PriorStats()
    for _ in range(25):
        assert s.p >= s.min_p
        s.record(False)
    assert s.p < s.min_p


# -- the file ------------------------------------------------------------------------------------

def test_save_then_load_gives_the_same_table(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 50, size=n).tolist() for n in (0, 1, 30, 200)]
    p = DraftPrior(seqs, n_vocab=50, max_n=3, model="m.gguf")
    path = str(tmp_path / "p.npz")
    p.save(path)
    q = DraftPrior.load(path, n_vocab=50)
    assert q._next == p._next and q.model == "m.gguf" and q.max_n == 3 and q.n_tokens == p.n_tokens
    assert [s.tolist() for s in q.seqs] == seqs
    assert os.listdir(tmp_path) == ["p.npz"]            # no temporary file left


def test_a_save_interrupted_leaves_no_temporary_file(tmp_path, monkeypatch):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(np, "savez_compressed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        DraftPrior([[1, 2]], 4).save(str(tmp_path / "p.npz"))
    assert os.listdir(tmp_path) == []


def _write(path, **arrays):
    base = dict(tokens=np.array([1, 2, 3], np.int32), ends=np.array([3], np.int64), n_vocab=np.int64(10),
                max_n=np.int64(4), version=np.int64(1))
    base.update(arrays)
    with open(path, "wb") as f:
        np.savez(f, **{k: v for k, v in base.items() if v is not None})


@pytest.mark.parametrize("arrays,msg", [
    (dict(version=np.int64(2)), "version 2, this build reads 1"),
    (dict(ends=None), "not a draft prior \\(no ends\\)"),
    (dict(ends=np.array([2], np.int64)), "ends must rise to the token count 3"),
    (dict(ends=np.array([2, 1, 3], np.int64)), "ends must rise"),
    (dict(ends=np.zeros(0, np.int64)), "3 tokens but no sequence ends"),
    (dict(tokens=np.array([1, 2, 30], np.int32)), "token id 30, outside \\[0, 10\\)"),
    (dict(tokens=np.array([1.0, 2.0, 3.0])), "1-D integer arrays"),
    (dict(max_n=np.int64(0)), "max_n must be in"),
    (dict(version=np.array([1, 1])), "version must be an integer scalar"),
    (dict(n_vocab=np.array([10, 10])), "n_vocab must be an integer scalar"),
    (dict(max_n=np.float64(4.0)), "max_n must be an integer scalar"),
    (dict(n_vocab=np.float64("nan")), "n_vocab must be an integer scalar"),
    (dict(tokens=np.array([1, 2, 2**32 + 3], np.int64)), "token id 4294967299, outside \\[0, 10\\)"),
    (dict(tokens=np.array([1, "a"], dtype=object)), "not a readable .npz file"),
])
def test_a_bad_prior_file_is_refused_with_its_reason(tmp_path, arrays, msg):
    path = str(tmp_path / "p.npz")
    _write(path, **arrays)
    with pytest.raises(PriorError, match=msg):
        DraftPrior.load(path)


def test_a_prior_of_another_vocabulary_missing_or_unreadable_file_is_refused(tmp_path):
    path = str(tmp_path / "p.npz")
    _write(path)
    with pytest.raises(PriorError, match="vocabulary of 10 tokens .* the model has 320"):
        DraftPrior.load(path, n_vocab=320)
    with pytest.raises(PriorError, match="no such file"):
        DraftPrior.load(str(tmp_path / "none.npz"))
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(PriorError, match="not a readable .npz file"):
        DraftPrior.load(str(junk))


def test_a_truncated_corrupt_or_npy_file_is_refused_with_its_reason(tmp_path):
    good = tmp_path / "good.npz"
    DraftPrior([[1, 2, 3], [1, 2, 4]], 10).save(str(good))
    raw = good.read_bytes()
    cut = tmp_path / "cut.npz"
    cut.write_bytes(raw[:len(raw) // 2])
    corrupt = tmp_path / "corrupt.npz"                  # the zip's directory intact, a member's data not
    corrupt.write_bytes(raw[:60] + bytes(20) + raw[80:])
    npy = tmp_path / "a.npy"
    np.save(npy, np.zeros(3))
    text = tmp_path / "text.npz"
    text.write_text("hello")
    for path in (cut, corrupt, npy, text, tmp_path):
        with pytest.raises(PriorError, match="not a readable .npz file") as err:
            DraftPrior.load(str(path))
        assert "pickle" not in str(err.value)
    raw_members = tmp_path / "raw.npz"                  # members that are no .npy: np.load gives bytes
    with zipfile.ZipFile(raw_members, "w") as z:
        for name in ("tokens", "ends", "n_vocab", "max_n", "version"):
            z.writestr(f"{name}.npy", b"garbage")
    with pytest.raises(PriorError, match="version must be an integer scalar, got no array"):
        DraftPrior.load(str(raw_members))
    _write(str(raw_members), tokens=None)
    with zipfile.ZipFile(raw_members, "a") as z:
        z.writestr("tokens.npy", b"garbage")
    with pytest.raises(PriorError, match="1-D integer arrays"):
        DraftPrior.load(str(raw_members))


def test_resolve_off_auto_and_a_path(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 123)
    monkeypatch.setenv("ECHOSPEC_PRIORS", str(tmp_path / "priors"))
    assert priors_dir() == str(tmp_path / "priors")
    assert default_path(str(model)) == str(tmp_path / "priors" / "m.gguf.123.prior.npz")
    assert resolve("off", str(model)) == "" and resolve("", str(model)) == ""
    assert resolve("auto", str(model)) == ""             # none built yet
    os.makedirs(tmp_path / "priors")
    DraftPrior([[1, 2]], 4).save(default_path(str(model)))
    assert resolve("AUTO", str(model)) == default_path(str(model))
    assert resolve("/some/file.npz", str(model)) == "/some/file.npz"
    monkeypatch.setenv("ECHOSPEC_PRIORS", "")
    monkeypatch.setenv("ECHOSPEC_CACHE", str(tmp_path / "cache"))
    assert priors_dir() == str(tmp_path / "cache" / "priors")
    with pytest.raises(PriorError, match="model .*nothing.gguf"):
        default_path(str(tmp_path / "nothing.gguf"))


# -- in the generation loop ----------------------------------------------------------------------

N_CTX = 512


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(arch="llama", n_vocab=320, n_ctx_train=512, seed=0)


class _NoDrafts:
    """A draft link that finds nothing (free text)."""

    def __init__(self):
        self.history: list[int] = []
        self.asked = 0
        self.closed = False

    def append(self, tokens):
        self.history += list(tokens)

    def send_propose(self, append, n):
        self.history += list(append)
        self.asked += 1

    def recv_proposal(self):
        return []

    def close(self):
        self.closed = True

    cancel = close


def _core(path, prior_file="off", **kw) -> VerifierCore:
    return VerifierCore(VerifierConfig(model=path, n_ctx=N_CTX, n_threads=1, prefix_cache=False,
                                       draft_prior=prior_file, **kw))


def _run(core, prompt, max_tokens, link=None, **kw):
    req = GenerationRequest(prompt=list(prompt), max_tokens=max_tokens, eos_ids=frozenset(),
                            sampling=kw.pop("sampling", Sampling()), spec=link is not None, k=4, **kw)
    check(core, req)
    return list(run_generation(core, req, threading.Event(), (lambda: link) if link is not None else None))


def _tokens(evs):
    return [t for e in evs for t in e.tokens]


PROMPT = [(i * 7) % 300 + 3 for i in range(10)]


@pytest.fixture(scope="module")
def plain(model_path):
    core = _core(model_path)
    try:
        return _tokens(_run(core, PROMPT, 120))
    finally:
        core.close()


def _board_costs():
    """A cost model at SmolLM2's figures (T 3 ms, V(1) 3.06 ms, 0.1 ms a round beside the forward),
    where one draft pays from an acceptance of about 0.05; the tiny fixture's own T (tens of us)
    is below the loop's overhead, and there no draft pays."""
    from echospec.services.verifier.controller import CostModel
    c = CostModel()
    c.observe(0, 3.0, 3.1, 3.0)
    c.observe(1, 3.06, 3.16, 3.0)
    return c


def test_one_prior_draft_pays_by_the_live_costs_and_its_acceptance():
    from echospec.services.verifier.controller import CostModel, best_k
    board = _board_costs()
    assert best_k(0.25, 1, board, hop=False) == 1 and best_k(0.01, 1, board, hop=False) == 0
    tiny = CostModel()
    tiny.observe(0, 0.03, 0.5, 0.03)
    tiny.observe(1, 0.035, 0.5, 0.03)
    assert best_k(0.9, 1, tiny, hop=False) == 0


@pytest.mark.parametrize("fixed_k", [False, True])
@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("kind", ["own", "shifted"])
def test_prior_drafts_give_the_plain_output(model_path, plain, tmp_path, monkeypatch, kind, eager, fixed_k):
    """A prior built from the model's own output (most drafts right) or from that output shifted by
    one token id after each token (drafts wrong but where a token had several successors): the output is plain decoding's; each prior round verifies one
    draft with source DRAFT_SOURCE_PRIOR, and the counters add up. With a cost model (at the
    board's costs, _board_costs) a prior that keeps missing stops drafting; a fixed K drafts it
    every round."""
    from echospec.services.verifier import controller, generation_loop
    board = _board_costs()
    monkeypatch.setattr(generation_loop, "best_k", lambda p, n, cost, hop: controller.best_k(p, n, board, hop))
    truth = PROMPT + plain
    # "shifted": after each token, the id one above the one that follows it (one-token contexts)
    seqs = [truth] if kind == "own" else [[a, (b + 1) % 320] for a, b in zip(truth, truth[1:])]
    path = str(tmp_path / "p.npz")
    DraftPrior(seqs, 320, model="tiny").save(path)
    core = _core(model_path, path)
    try:
        assert core.prior is not None and core.prior_path == path
        link = _NoDrafts()
        evs = _run(core, PROMPT, 120, link, eager=eager, fixed_k=fixed_k)
        assert _tokens(evs) == plain
        rounds = [e for e in evs[1:] if e.source == SOURCE_PRIOR]
        assert all(e.k == 1 and e.accepted in (0, 1) and len(e.tokens) == e.accepted + 1 for e in rounds)
        assert all(e.k == 0 for e in evs[1:] if e.source != SOURCE_PRIOR)
        hits = sum(e.accepted for e in rounds)
        if kind == "own":
            assert len(rounds) >= 20 and hits >= len(rounds) // 2, (len(rounds), hits)
        else:
            assert rounds and hits <= len(rounds) // 4, (len(rounds), hits)
            if not fixed_k:   # the cost model stops drafting what keeps missing
                assert len(rounds) < len(evs) // 2, (len(rounds), len(evs))
        assert [e.n_past for e in evs] == [len(PROMPT) + n - 1 for n in np.cumsum([len(e.tokens) for e in evs])]
        assert link.closed
    finally:
        core.close()


def test_no_prior_rounds_without_speculation_or_with_logprobs_or_penalties(model_path, plain, tmp_path):
    path = str(tmp_path / "p.npz")
    DraftPrior([PROMPT + plain], 320).save(path)
    core = _core(model_path, path)
    try:
        from echospec.services.common.penalties import Penalties
        cases = [dict(), dict(link=_NoDrafts(), logprobs=1),
                 dict(link=_NoDrafts(), sampling=Sampling(penalties=Penalties(repeat=1.1)))]
        for kw in cases:
            evs = _run(core, PROMPT, 40, **kw)
            assert not any(e.source == SOURCE_PRIOR or e.k for e in evs), kw
    finally:
        core.close()


def test_without_a_prior_free_text_rounds_draft_nothing(model_path, plain):
    core = _core(model_path, "off")
    try:
        assert core.prior is None and core.prior_path == ""
        evs = _run(core, PROMPT, 120, _NoDrafts(), eager=True)
        assert _tokens(evs) == plain and not any(e.k for e in evs)
    finally:
        core.close()


def test_the_verifier_refuses_a_bad_prior_at_startup(model_path, tmp_path):
    with pytest.raises(InvalidArgument, match="draft_prior: draft prior .*no such file"):
        _core(model_path, str(tmp_path / "none.npz"))
    path = str(tmp_path / "p.npz")
    DraftPrior([[1, 2]], 49152).save(path)
    with pytest.raises(InvalidArgument, match=r"vocabulary of 49152 tokens \(unnamed model\), the model has 320"):
        _core(model_path, path)


@pytest.mark.parametrize("setting", ["file", "auto"])
def test_serve_processes_reads_relative_model_and_prior_paths_from_the_callers_directory(tiny_model,
                                                                                        tmp_path, setting):
    # was: `echospec serve --processes --model m.gguf --draft-prior p.npz` started its verifier in
    # another directory, which refused to start: "draft prior p.npz: no such file" (and "gguf:
    # cannot open 'm.gguf'"); with a relative ECHOSPEC_PRIORS, auto looked in that other directory
    import signal

    from echospec.services.verifier.engine import Model

    model = tiny_model()
    os.symlink(model, tmp_path / "m.gguf")
    (tmp_path / "priors").mkdir()
    env = {**os.environ, "PYTHONPATH": REPO, "ECHOSPEC_PRIORS": "priors"}
    file = tmp_path / "p.npz" if setting == "file" else tmp_path / "priors" / os.path.basename(
        default_path(str(tmp_path / "m.gguf")))
    with Model(model) as m:
        DraftPrior([[1, 2, 3]], m.info.n_vocab).save(str(file))
    cmd = [sys.executable, "-m", "echospec.cli", "serve", "--model", "m.gguf", "--port", "0", "--n-ctx", "256",
           "--threads", "1", "--processes", "--draft-prior", "p.npz" if setting == "file" else "auto"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, cwd=tmp_path, env=env)
    err = []
    try:
        for line in p.stderr:
            err.append(line)
            if "coordinator      listening" in line:
                break
        assert p.poll() is None, "".join(err)
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert f"draft prior: {file}, 3 tokens" in "".join(err), "".join(err)


@pytest.mark.parametrize("kind,msg", [
    ("missing", "no such file"),
    ("junk", "not a"),
    ("vocab", "vocabulary of 49152 tokens"),
])
def test_serve_refuses_a_bad_draft_prior_file_before_it_starts_the_services(model_path, tmp_path, kind, msg):
    """--draft-prior FILE is read before the services start, as --chat-template and --mmproj are:
    exit 2 with the reason, no service started (was: exit 1 after the model had loaded)."""
    path = tmp_path / "p.npz"
    if kind == "junk":
        path.write_bytes(b"this is no prior")
    elif kind == "vocab":
        DraftPrior([[1, 2]], 49152).save(str(path))
    r = subprocess.run([sys.executable, "-m", "echospec.cli", "serve", "--model", model_path, "--port", "0",
                        "--n-ctx", "256", "--threads", "1", "--draft-prior", str(path)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "--draft-prior" in r.stderr and msg in r.stderr, r.stderr
    assert "loading" not in r.stderr and "listening" not in r.stderr, r.stderr


def test_auto_loads_the_prior_cached_for_the_model_file(model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("ECHOSPEC_PRIORS", str(tmp_path))
    core = _core(model_path, "auto")
    try:
        assert core.prior is None
    finally:
        core.close()
    DraftPrior([[1, 2, 3]], 320).save(default_path(model_path))
    core = _core(model_path, "auto")
    try:
        assert core.prior is not None and core.prior_path == default_path(model_path)
        assert core.prior.n_tokens == 3
    finally:
        core.close()
    # a cached file gone bad: refused, saying how to build it again or start without one
    with open(default_path(model_path), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(InvalidArgument) as e:
        _core(model_path, "auto")
    assert "not a readable .npz file" in str(e.value) and "--if-missing" in str(e.value) \
        and "--draft-prior off" in str(e.value)


# -- echospec prior ------------------------------------------------------------------------------

def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "echospec.cli", "prior", *args], capture_output=True,
                          text=True, cwd=REPO, env={**os.environ, **(env or {})}, timeout=300)


def test_echospec_prior_builds_the_models_greedy_answers(model_path, tmp_path):
    """The prior's sequences are the engine's greedy answers to each prompt, asked as a user
    message through the model's chat template, EOS excluded; --if-missing then leaves it alone."""
    from echospec.cli.prior import answers
    from echospec.services.text.chat_template import ChatTemplate
    from echospec.services.text.tokenizer import Tokenizer
    from echospec.services.verifier.engine import Model

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the first prompt\n\n  a second one  \n", encoding="utf-8")
    out = tmp_path / "sub" / "p.npz"
    r = _cli("--model", model_path, "--out", str(out), "--prompts", str(prompts), "--max-tokens", "20",
             "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and "2/2 answers" in r.stderr
    prior = DraftPrior.load(str(out), 320)
    tok = Tokenizer.from_gguf(model_path)
    want = []
    with Model(model_path) as m:
        for text in ("the first prompt", "a second one"):
            msgs = [{"role": "user", "content": text}]
            ids = tok.encode(ChatTemplate.from_gguf(model_path).render(msgs, add_generation_prompt=True))
            with m.new_session(n_ctx=128, n_threads=1) as s:
                first, _ = s.prefill(ids)
                seq = [first] + s.decode(first, 19)[0]
            want.append([t for t in seq if t not in tok.eos_ids])
    assert [s.tolist() for s in prior.seqs] == want
    assert answers(model_path, ["a second one"], 20, 1)[0] == [want[1]]
    mtime = out.stat().st_mtime_ns
    r = _cli("--model", model_path, "--out", str(out), "--prompts", str(prompts), "--if-missing")
    assert r.returncode == 0 and "there already" in r.stderr and out.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("args,msg", [
    (["--prompts", "/nonexistent/prompts.txt"], "--prompts /nonexistent/prompts.txt: No such file"),
    (["--max-tokens", "0"], "--max-tokens must be in [1, 4096], got 0"),
    (["--threads", "-1"], "--threads must be in [0, 256], got -1"),
    (["--threads", "100000"], "--threads must be in [0, 256], got 100000"),
    (["--out", ""], "--out: an empty path"),
    (["--model", "no-such-model"], "not a model name"),
])
def test_echospec_prior_refuses_bad_arguments(args, msg):
    r = _cli(*args)
    assert r.returncode == 2 and msg in r.stderr and "answers" not in r.stderr, r.stderr


def test_echospec_prior_refuses_an_empty_or_binary_prompt_file(tmp_path, model_path):
    empty = tmp_path / "e.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    binary = tmp_path / "b.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    for f, msg in ((empty, "no prompt in it"), (binary, "not UTF-8 text")):
        r = _cli("--model", model_path, "--prompts", str(f), "--out", str(tmp_path / "p.npz"))
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_echospec_prior_refuses_an_unwritable_out_before_answering(tmp_path, model_path):
    """--out that is a directory or under a file is refused at once (not after every answer), and
    leaves nothing behind."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n", encoding="utf-8")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    under_a_file = f"cannot write there ({tmp_path / 'file'} is not a directory)"
    for out, msg in ((tmp_path / "dir", "is a directory"), (tmp_path / "file" / "sub" / "p.npz", under_a_file)):
        r = _cli("--model", model_path, "--out", str(out), "--prompts", str(prompts), "--max-tokens", "4",
                 "--threads", "1")
        assert r.returncode == 2 and msg in r.stderr and "answers" not in r.stderr, r.stderr
        assert "echospec prior: echospec" not in r.stderr and "echospec: echospec" not in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["dir", "file", "prompts.txt"] and not os.listdir(tmp_path / "dir")


def test_echospec_prior_refuses_a_prompt_longer_than_the_context_before_answering(tmp_path, model_path):
    """A prompt whose tokens and --max-tokens do not fit the model's trained context (512 here) is
    named at once, before any answer is computed."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short\n\n" + "word " * 2000 + "\n", encoding="utf-8")
    r = _cli("--model", model_path, "--out", str(tmp_path / "p.npz"), "--prompts", str(prompts),
             "--max-tokens", "4", "--threads", "1")
    assert r.returncode == 2 and "prompt 2 (line 3)" in r.stderr and "context of 512" in r.stderr, r.stderr
    assert "1/2 answers" not in r.stderr and not (tmp_path / "p.npz").exists()


def test_echospec_prior_refuses_an_empty_prompts_path(tmp_path, model_path):
    r = _cli("--model", model_path, "--out", str(tmp_path / "p.npz"), "--prompts", "", "--max-tokens", "4")
    assert r.returncode == 2 and "--prompts" in r.stderr and not (tmp_path / "p.npz").exists(), r.stderr


def test_echospec_prior_if_missing_builds_again_over_an_unreadable_file(tmp_path, model_path):
    """--if-missing leaves a readable prior alone, but one a verifier would refuse (damaged,
    another vocabulary) is built again: `serve --draft-prior auto` would not start on it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n", encoding="utf-8")
    out = tmp_path / "p.npz"
    for junk in (b"PK\x03\x04 cut short", None):
        if junk is None:
            DraftPrior([[1, 2]], 4).save(str(out))       # a prior of another vocabulary
        else:
            out.write_bytes(junk)
        r = _cli("--model", model_path, "--out", str(out), "--prompts", str(prompts), "--max-tokens", "4",
                 "--threads", "1", "--if-missing")
        assert r.returncode == 0 and "building it again" in r.stderr and "1/1 answers" in r.stderr, r.stderr
        assert DraftPrior.load(str(out), 320).n_tokens > 0


def test_a_short_prompt_and_answer_fit_the_engines_smallest_context(tmp_path, model_path):
    # was: "ES_ERR_INVALID_ARG: n_ctx 8 out of range [16, ...]" for a base model (prompts continued
    # as text) asked for 4 tokens after a 3-token prompt: the session was sized to the prompt
    from echospec.cli.prior import answers
    from echospec.services.text.tokenizer import Tokenizer

    bare = tmp_path / "bare.jinja"                      # the prompt as it is, as a base model sees it
    bare.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    assert len(Tokenizer.from_gguf(model_path).encode("a")) < 4
    seqs, n_vocab = answers(model_path, ["a"], max_tokens=4, n_threads=1, chat_template=str(bare))
    assert n_vocab == 320 and len(seqs) == 1 and len(seqs[0]) <= 4


def test_the_shipped_prompts_share_nothing_with_the_benchmark_workloads():
    """The default model's prior answers general prompts, none of them a benchmark's (a prior
    built from the workloads' own answers would draft the benchmark's text)."""
    import json
    from echospec.cli.prior import default_prompts, read_prompts

    prompts = read_prompts(default_prompts())
    assert len(prompts) == len(set(prompts)) >= 300
    texts = []
    for name in os.listdir(os.path.join(REPO, "workloads")):
        with open(os.path.join(REPO, "workloads", name), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    w = json.loads(line)
                    texts += [m["content"] for m in w.get("messages", []) if isinstance(m.get("content"), str)]
                    texts += [w.get("prompt", "")] if w.get("prompt") else []
    assert texts
    lowered = [t.lower() for t in texts]
    for p in prompts:
        assert not any(p.lower() in t or t in p.lower() for t in lowered), p


def test_a_prior_that_keeps_missing_drafts_rarely_even_where_one_draft_looks_free(model_path, plain, tmp_path,
                                                                                 monkeypatch):
    """A V(1) measured below T (noise: two rows cost about one) passes the gain condition at any
    acceptance; the prior's own floor (PriorStats.min_p) still stops a prior that keeps missing
    after its first misses and then probes it in about 3 rounds of 10."""
    from echospec.services.verifier import controller, generation_loop
    free = controller.CostModel()
    free.observe(0, 3.0, 3.05, 3.0)
    free.observe(1, 2.9, 2.95, 3.0)
    free.overhead_ms = 0.05
    assert controller.best_k(0.0, 1, free, hop=False) == 1
    monkeypatch.setattr(generation_loop, "best_k", lambda p, n, cost, hop: controller.best_k(p, n, free, hop))
    truth = PROMPT + plain
    path = str(tmp_path / "p.npz")
    DraftPrior([[a, (b + 1) % 320] for a, b in zip(truth, truth[1:])], 320).save(path)
    core = _core(model_path, path)
    try:
        evs = _run(core, PROMPT, 120, _NoDrafts(), eager=True)
        assert _tokens(evs) == plain
        rounds = [e for e in evs if e.source == SOURCE_PRIOR]
        late = [e for e in evs[60:] if e.source == SOURCE_PRIOR]
        assert len(late) <= len(evs[60:]) // 2, (len(late), len(evs[60:]))
    finally:
        core.close()


def test_echospec_prior_says_when_a_model_without_a_chat_template_continues_the_default_prompts(
        tiny_model, tmp_path):
    """A base model (no chat template, no ChatML tokens) continues each prompt as text; with the
    default prompts, which are chat instructions, the command says so and how to do better."""
    from echospec.cli.prior import chat_template_of
    base = tiny_model(arch="llama", n_vocab=320, n_ctx_train=512, seed=0,
                      special_tokens=("<eos>", "<start_of_turn>", "<end_of_turn>"))
    assert chat_template_of(base).missing is not None
    r = _cli("--model", base, "--out", str(tmp_path / "p.npz"), "--max-tokens", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "has no chat template" in r.stderr and "continued as text" in r.stderr


def test_echospec_prior_refuses_a_model_that_is_no_file_as_serve_does(tmp_path):
    (tmp_path / "adir").mkdir()
    for model, msg in ((tmp_path / "adir", "is a directory, not a GGUF file"),
                       (tmp_path / "none.gguf", "model file not found")):
        r = _cli("--model", str(model), "--out", str(tmp_path / "p.npz"))
        assert r.returncode == 2 and msg in r.stderr and "answers" not in r.stderr, r.stderr
        assert "echospec: echospec" not in r.stderr
    assert not (tmp_path / "p.npz").exists()


def test_echospec_prior_refuses_a_model_whose_logits_serve_refuses(smollm2_path, tmp_path):
    """Finite output-norm weights whose products overflow load, but every logits row is NaN: the
    verifier's warm-up refuses the model, so `echospec prior` (which runs the same probe) builds
    no prior of it (was: exit 0 with a prior of empty answers)."""
    from test_weights_check import overflow_copy

    bad = tmp_path / "overflow.gguf"
    overflow_copy(smollm2_path, bad)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n", encoding="utf-8")
    out = tmp_path / "p.npz"
    r = _cli("--model", str(bad), "--out", str(out), "--prompts", str(prompts), "--max-tokens", "4",
             "--threads", "1")
    assert r.returncode == 1 and "ES_ERR_BAD_WEIGHTS" in r.stderr and "serve` would too" in r.stderr, r.stderr
    assert not out.exists()


def test_echospec_prior_out_refuses_a_pipe_and_writes_a_links_file(tmp_path, model_path):
    """The prior is written beside --out and renamed onto it: a pipe (or a device) there is
    refused, not replaced by a file; a symbolic link's file is written and the link kept."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a prompt\n", encoding="utf-8")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = _cli("--model", model_path, "--out", str(fifo), "--prompts", str(prompts), "--max-tokens", "4",
             "--threads", "1")
    assert r.returncode == 2 and "not a regular file" in r.stderr and "answers" not in r.stderr, r.stderr
    assert os.path.exists(fifo) and not os.path.isfile(fifo)
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "p.npz"
    link = tmp_path / "link.npz"
    link.symlink_to(target)
    r = _cli("--model", model_path, "--out", str(link), "--prompts", str(prompts), "--max-tokens", "4",
             "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and target.is_file()
    assert DraftPrior.load(str(link)).n_tokens == DraftPrior.load(str(target)).n_tokens > 0


def test_a_blank_draft_prior_setting_is_refused_not_taken_for_off(model_path):
    """An unset $VAR on the command line (`--draft-prior ""`) would have turned the prior off
    unsaid: refused with exit 2, as a blank --model or --host is."""
    from echospec.services.common.config import check_ranges

    with pytest.raises(ValueError, match="is empty: auto"):
        check_ranges(VerifierConfig(model="m.gguf", draft_prior="  "))
    r = subprocess.run([sys.executable, "-m", "echospec.cli", "serve", "--model", model_path, "--port", "0",
                        "--draft-prior", ""], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "--draft-prior" in r.stderr and "is empty" in r.stderr, r.stderr
    assert "listening" not in r.stderr
