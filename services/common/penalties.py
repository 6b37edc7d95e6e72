"""Repetition penalties: llama.cpp's penalties sampler as a pure function of a logits row.

Over the window, the last ``last_n`` tokens of the context (prompt + output) before the row's
position, every token t seen count[t] > 0 times gets, in float32 as llama.cpp computes it:

    logit[t] = logit[t] / repeat     if logit[t] > 0
               logit[t] * repeat     otherwise            (a penalty > 1 always lowers it)
    logit[t] -= count[t] * frequency + presence

Tokens not in the window keep their logit. ``last_n`` -1 counts the whole context; 0 is the
default window, DEFAULT_LAST_N = 64 tokens (llama.cpp's repeat_last_n; its 0 "off" is said
here by leaving every penalty off). The counts include the prompt, as llama-server's do
(OpenAI's frequency and presence penalties count the output only).

Worked example: window [5, 7, 5], frequency 0.5, presence 0.25, repeat 2, row[5] = 3.0,
row[7] = -1.0: row[5] = 3.0 / 2 - (2 * 0.5 + 0.25) = 0.25; row[7] = -1.0 * 2 - (0.5 + 0.25) = -2.75.

A greedy row's token depends only on the tokens before its position, so a speculative
verify penalises each of its rows with the window of its own prefix (the context, then the
drafts before the row) and the accept rule stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from echospec.services.common.floats import f32_str
from echospec_client.limits import MAX_REPEAT_PENALTY, MIN_REPEAT_PENALTY

DEFAULT_LAST_N = 64          # llama.cpp's repeat_last_n default
MAX_LAST_N = 1 << 20         # the largest window a request may name (-1 counts the whole context)
MAX_ADDITIVE = 2.0           # frequency and presence penalties lie in [-2, 2] (OpenAI's range)


class PenaltyError(ValueError):
    """A penalty parameter out of its range; the message names the field."""


@dataclass(frozen=True)
class Penalties:
    """A request's repetition penalties (``check`` them first).

    frequency, presence: subtracted per occurrence and once per token seen; 0: off.
    repeat: divides a positive logit, multiplies a negative one; 1 (or 0, the wire's unset): off.
    last_n: the window in tokens; -1: the whole context; 0: DEFAULT_LAST_N.
    """

    frequency: float = 0.0
    presence: float = 0.0
    repeat: float = 1.0
    last_n: int = 0

    @property
    def active(self) -> bool:
        """Some penalty changes a row."""
        return self.frequency != 0.0 or self.presence != 0.0 or self.repeat not in (0.0, 1.0)

    @property
    def window(self) -> int:
        """Tokens counted (-1: all)."""
        return DEFAULT_LAST_N if self.last_n == 0 else self.last_n

    def check(self, prefix: str = "") -> None:
        """Refuse values out of range.

        Raises:
            PenaltyError: frequency or presence outside [-2, 2] (or NaN), repeat outside
                [MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY] (0 reads as off), last_n outside [-1, MAX_LAST_N]; the message starts with
                the field's name (``prefix`` + frequency_penalty, ...).
        """
        for name, v in (("frequency_penalty", self.frequency), ("presence_penalty", self.presence)):
            if not -MAX_ADDITIVE <= v <= MAX_ADDITIVE:
                raise PenaltyError(f"{prefix}{name} must be in [-2, 2] (0: off), got {f32_str(v)}")
        if self.repeat != 0 and not MIN_REPEAT_PENALTY <= self.repeat <= MAX_REPEAT_PENALTY:
            raise PenaltyError(f"{prefix}repeat_penalty must be in [{MIN_REPEAT_PENALTY:g}, "
                               f"{MAX_REPEAT_PENALTY:g}] (1: off), got {f32_str(self.repeat)}")
        if not -1 <= self.last_n <= MAX_LAST_N:
            raise PenaltyError(f"{prefix}repeat_last_n must be in [-1, {MAX_LAST_N}] (-1: the whole "
                               f"context, 0: {DEFAULT_LAST_N}), got {self.last_n}")

    def apply(self, row: np.ndarray, context: Sequence[int], extra: Sequence[int] = ()) -> np.ndarray:
        """The penalised row (a new float32 array; ``row`` itself is not changed).

        Args:
            row: logits float32 [n_vocab] of the position after ``context`` + ``extra``.
            context: the tokens before that position (prompt + output); only its last
                ``window`` tokens (with ``extra``) are read.
            extra: tokens after ``context`` (a verify row's earlier drafts).
        Returns:
            float32 [n_vocab].
        """
        out = np.array(row, dtype=np.float32, copy=True)
        n = self.window
        if n < 0:
            tail = list(context) + list(extra)
        else:
            tail = (list(context[max(0, len(context) - n):]) + list(extra))[-n:] if n else []
        if not tail:
            return out
        ids, counts = np.unique(np.asarray(tail, dtype=np.int64), return_counts=True)
        vals = out[ids]
        if self.repeat not in (0.0, 1.0):
            rep = np.float32(self.repeat)
            vals = np.where(vals <= 0, vals * rep, vals / rep).astype(np.float32)
        vals = vals - (counts.astype(np.float32) * np.float32(self.frequency)
                       + np.float32(self.presence))
        out[ids] = vals
        return out
