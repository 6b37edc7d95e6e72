"""Log-probabilities of output tokens from the logits row that chose them (pure numpy).

A token's logprob is log_softmax of its position's raw logits row, at temperature 1 whatever the
request's sampling (the model's own distribution, as OpenAI reports it), after the grammar's mask
when one applies (a refused token gets -inf and is never an alternative):

    x = a fresh float32 copy of the row, x[~allowed] = -inf
    m = max(x);  s = sum(float64(exp(x - m)))        (float32 exps, summed in float64)
    logprob(t) = (float64(x[t]) - float64(m)) - log(s)

The exps are float32 (numpy's vectorized exp: about five times faster than float64's on the
AVX2 hosts measured, the vocabulary's exps being the whole cost), which puts about 1e-7 of
relative error in s, so in every logprob at most about 1e-7 absolute. The result depends on
the row's values only (one fixed procedure over a fresh contiguous copy), so a verify's row
and a decode's row for the same position, bitwise equal by the engine's contract, give bitwise
equal logprobs: speculation on or off reports the same values.

The alternatives are the ``n_top`` tokens with the largest logprob, most likely first, equal
logprobs in id order. Example: row [1, 3, 3, 0], n_top 2 -> ids [1, 2] (both
3 - log(e + 2 e^3 + 1) = -0.7817), token 0's -2.7817 is left out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenLogprob:
    """A token's logprob and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple = ()      # ((token id, logprob), ...), most likely first


def _shifted(row: np.ndarray, allowed: np.ndarray | None) -> tuple[np.ndarray, float, float]:
    """(x, m, log s) of the module docstring's procedure.

    Raises:
        ValueError: row is not 1-D and non-empty, or no allowed logit is finite.
    """
    x = np.array(row, dtype=np.float32, copy=True, order="C")
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"a logits row must be 1-D and non-empty, got shape {x.shape}")
    if allowed is not None:
        x[~allowed] = -np.inf
    m = x.max()
    if not np.isfinite(m):
        raise ValueError("no token of the logits row is allowed (or its largest logit is not finite)")
    s = np.sum(np.exp(x - m), dtype=np.float64)
    return x, float(m), math.log(float(s))


def log_softmax(row: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """log_softmax of one logits row (the module docstring's procedure), every token.

    Args:
        row: float32 [n_vocab], finite where allowed.
        allowed: bool [n_vocab] (a grammar's mask), or None: every token.
    Returns:
        float64 [n_vocab]; -inf where not allowed.
    Raises:
        ValueError: row is not 1-D or no token is allowed.
    """
    x, m, log_s = _shifted(row, allowed)
    return (x.astype(np.float64) - m) - log_s


def top_ids(x: np.ndarray, n_top: int) -> np.ndarray:
    """The ids of the ``n_top`` largest finite values of ``x`` (a row, or its log_softmax: the
    order is the same), largest first, ties in id order (fewer when fewer are finite)."""
    n_top = min(n_top, x.size)
    if n_top <= 0:
        return np.empty(0, dtype=np.int64)
    t = np.partition(x, x.size - n_top)[x.size - n_top]   # the n_top-th largest value
    cand = np.flatnonzero(x >= t) if np.isfinite(t) else np.flatnonzero(np.isfinite(x))
    order = np.lexsort((cand, -x[cand]))
    return cand[order][:n_top]


def token_logprob(row: np.ndarray, token: int, n_top: int = 0,
                  allowed: np.ndarray | None = None) -> TokenLogprob:
    """The logprob of ``token`` in ``row`` and its ``n_top`` most likely alternatives.

    Args:
        row: float32 [n_vocab], the logits row that chose ``token``.
        token: the token chosen (by argmax or a draw) from that row.
        n_top: alternatives wanted (0..20).
        allowed: the grammar's mask of that row (bool [n_vocab]), or None.
    Raises:
        ValueError: as log_softmax.
    """
    x, m, log_s = _shifted(row, allowed)

    def lp(i: int) -> float:
        return (float(x[i]) - m) - log_s
    return TokenLogprob(int(token), lp(token), tuple((int(i), lp(i)) for i in top_ids(x, n_top)))
