"""Checks shared by the tests of the fixture models in tests/data/models (a GGUF and its .ref.npz).

The .ref.npz holds, per prompt p: p{p}_tokens, transformers' float32 logits on a subset of the
vocabulary (p{p}_subset_logits, the ids in "subset") and llama.cpp's on the same subset
(p{p}_llama_subset_logits), and transformers' top logits (p{p}_top_ids, p{p}_top_logits, and
llama.cpp's at those ids, p{p}_llama_top_logits).
"""
from __future__ import annotations

import numpy as np

MARGIN = 0.5        # transformers' top-2 margin above which the argmax must agree


def prompts(z):
    """(p, token ids) for every prompt in a .ref.npz."""
    i = 0
    while f"p{i}_tokens" in z:
        yield i, [int(t) for t in z[f"p{i}_tokens"]]
        i += 1


def check_logits_on_par_with_llama_cpp(m, z, label: str = "", top_logits: bool = False) -> None:
    """Per prompt: max and median |ours - transformers| within 1.25 times llama.cpp's (+ 0.1 and
    + 0.02), the argmax transformers' wherever its top-2 margin exceeds MARGIN; with top_logits, the
    logits at transformers' top ids within the same bound as the max. label prefixes the messages."""
    sub = z["subset"]
    n_clear = 0
    for p, toks in prompts(z):
        s = m.new_session(n_ctx=64, n_threads=2)
        am, lg = s.forward(toks, logits="all")
        s.close()
        tf, ll = z[f"p{p}_subset_logits"], z[f"p{p}_llama_subset_logits"]
        err = np.abs(lg[:, sub] - tf)
        bound = 1.25 * float(np.abs(ll - tf).max()) + 0.1
        assert err.max() <= bound, f"{label}prompt {p}: max |ours - transformers| {err.max():.3f} > {bound:.3f}"
        mbound = 1.25 * float(np.median(np.abs(ll - tf))) + 0.02
        assert np.median(err) <= mbound, f"{label}prompt {p}: median error {np.median(err):.3f} > {mbound:.3f}"
        top_ids, top = z[f"p{p}_top_ids"], z[f"p{p}_top_logits"]
        if top_logits:          # the subset rarely holds the winners
            terr = np.abs(np.take_along_axis(lg, top_ids, axis=-1) - top)
            tll = np.abs(z[f"p{p}_llama_top_logits"] - top)
            assert terr.max() <= 1.25 * float(tll.max()) + 0.1, f"{label}prompt {p}: top logits {terr.max():.3f}"
        clear = top[:, 0] - top[:, 1] > MARGIN
        n_clear += int(clear.sum())
        np.testing.assert_array_equal(am[clear], top_ids[clear, 0], err_msg=f"{label}prompt {p}")
    assert n_clear >= 8          # enough positions with a clear winner for the argmax check to mean something


def check_one_call_is_single_steps(m, toks, label: str = "", then=None) -> None:
    """toks in one call, on 1, 2 and 3 threads, gives bitwise the rows of one token a call on one
    thread; then(session, rows, threads), where given, checks more on each session before it closes."""
    ref = m.new_session(n_ctx=64, n_threads=1)
    rows = [ref.forward([t], logits="last")[1][0] for t in toks]
    ref.close()
    for threads in (1, 2, 3):
        s = m.new_session(n_ctx=64, n_threads=threads)
        _, lg = s.forward(toks, logits="all")
        for i, row in enumerate(rows):
            assert np.array_equal(lg[i], row), f"{label}row {i} differs on {threads} threads"
        if then is not None:
            then(s, rows, threads)
        s.close()


def check_batch_is_each_session_alone(m, prompt_ids, label: str = "") -> None:
    """forward_batch over one session a prompt gives each session's logits bitwise as alone."""
    from echospec.services.verifier.engine import EngineError, forward_batch

    alone = []
    for toks in prompt_ids:
        s = m.new_session(n_ctx=64, n_threads=2)
        alone.append(s.forward(toks, logits="all")[1])
        s.close()
    sessions = [m.new_session(n_ctx=64, n_threads=2) for _ in prompt_ids]
    out = forward_batch([(s, toks, "all", "all") for s, toks in zip(sessions, prompt_ids)])
    for i, (res, want) in enumerate(zip(out, alone)):
        assert not isinstance(res, EngineError)
        assert np.array_equal(res[1], want), f"{label}session {i} differs in the batch"
    for s in sessions:
        s.close()
