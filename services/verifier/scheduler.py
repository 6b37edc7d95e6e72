"""The scheduler that owns the engine: every forward of a generation goes through it.

Each generation (generation_loop.py) submits one engine step at a time (a
prefill chunk, a decode step, or a verify of [pending] + K drafts) and waits
for its result. Each iteration the scheduler takes, in arrival order, the
steps waiting at that moment:

    at most ``batch_max`` steps (sessions), and at most ``batch_tokens``
    tokens in all (the first step is always taken, whatever its size);

then runs them under the engine lock (``_execute``). A session has at most one
step waiting, and a served session queues its next step behind the others, so
the order is round-robin: fair across sessions. Prompts are prefilled in
chunks of ``prefill_chunk`` tokens, one step each, so a short request that
arrives during a long prefill waits for one chunk, not for the whole prompt.

An iteration is one engine call, ``es_forward_batch`` (``_execute``): the
rows of every step go through each matmul together, so the weights are read
once per iteration, not once per session. Every step is bitwise what its
session gets alone (the engine's batch-invariance contract, across sessions
and chunked prefill), and a step whose input is bad fails alone.

The step-by-step sessions (VerifyStream and the unary RPCs, for debugging and
bench/round_overhead.py) do not queue here: they take the engine lock
directly, between iterations.

No thread of its own: a waiting generation whose turn comes runs the
iteration itself (flat combining), so a lone generation pays no thread
hand-off per step.

Gathering (batch_max >= 2): the sessions of an iteration come back with their
next steps one by one, as their loops take the results, and the first one
back would otherwise start the next iteration alone, halving the batch. So an
iteration waits, for at most ``gather`` x the last iteration's forward time,
until every session of the last iteration has queued its next step or left
(``leave``: its generation ended), or the queue holds batch_max steps. A
lone generation is never kept waiting: it is the only session it expects. Cancellation: ``run`` gives up a step that has not started
as soon as the generation's cancel event is set and ``wake`` is called; a step
that has started finishes first (one forward).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from echospec.services.common.engine import forward_batch


class Cancelled(Exception):
    """The generation was cancelled while its step waited (the step did not run)."""


@dataclass
class Step:
    """One session's engine step: feed ``tokens`` at positions [n_past, n_past + N).

    head:
        "last"  the output head on the last position only (prefill chunks):
                argmax has one element; logits float32 [1, n_vocab] when
                ``logits`` is "last".
        "all"   argmax of every position (decode / verify); logits per ``logits``
                ("none" or "last").
    Results (set by the scheduler): argmax, logits, forward_ms (the iteration's
    forward, shared by every step of the batch), queued_ms, error.
    """

    session: Any                      # services.common.engine.Session
    tokens: list[int]
    head: str = "all"
    logits: str = "none"
    argmax: Any = None
    logits_out: Any = None
    forward_ms: float = 0.0           # this step's forward
    queued_ms: float = 0.0            # from submit to the start of its iteration
    error: BaseException | None = None
    done: bool = False
    _t_submit: float = field(default=0.0, repr=False)


def select(queue: Sequence[Step], batch_max: int, batch_tokens: int) -> list[int]:
    """The indices of the queued steps the next iteration runs (a pure policy).

    Arrival order; at most batch_max steps and batch_tokens tokens, the first
    step always (so a chunk larger than the budget still runs); stops at the
    first step that does not fit, so no later step overtakes it.
    """
    picked: list[int] = []
    tokens = 0
    for i, s in enumerate(queue):
        if len(picked) >= max(1, batch_max):
            break
        if picked and tokens + len(s.tokens) > batch_tokens:
            break
        picked.append(i)
        tokens += len(s.tokens)
    return picked


class Scheduler:
    """Owns the engine for generations (see the module docstring).

    Args:
        engine_lock: held while a batch runs (the unary/stream sessions of
            sessions.py take it too).
        batch_max: sessions per iteration (>= 1).
        batch_tokens: tokens per iteration (>= 1).
        prefill_chunk: most prompt tokens per prefill step (>= 1).
        run_batch: the engine call of an iteration, with engine.forward_batch's
            arguments and results (tests pass a fake one).
        gather: the longest wait for the last iteration's sessions, as a share of
            its forward time (0: none; see the module docstring).
    """

    def __init__(self, engine_lock: threading.Lock, batch_max: int = 1, batch_tokens: int = 512,
                 prefill_chunk: int = 256,
                 run_batch: Callable[[list[tuple[Any, list[int], str, str]]], list[Any]] = forward_batch,
                 gather: float = 0.5):
        if batch_max < 1 or batch_tokens < 1 or prefill_chunk < 1:
            raise ValueError(f"batch_max {batch_max}, batch_tokens {batch_tokens} and prefill_chunk"
                             f" {prefill_chunk} must be >= 1")
        self.engine_lock = engine_lock
        self.batch_max = batch_max
        self.batch_tokens = batch_tokens
        self.prefill_chunk = prefill_chunk
        self._run_batch = run_batch
        self.gather = gather
        self._expect: set[int] = set()    # id(session) of the last iteration's steps not queued again
        self._gather_until = 0.0          # perf_counter() deadline of the wait for them
        self._cv = threading.Condition()
        self._queue: list[Step] = []
        self._busy = False
        self.iterations = 0               # batches run (for tests and the bench)
        self.trace: list[list[int]] | None = None   # when a list: id(session) per step of each batch

    @property
    def waiting(self) -> int:
        """Steps queued and not started."""
        with self._cv:
            return len(self._queue)

    def wake(self) -> None:
        """Wake every waiting generation (call after setting a cancel event)."""
        with self._cv:
            self._cv.notify_all()

    def leave(self, session: Any) -> None:
        """``session``'s generation ended: the next iteration does not wait for it."""
        with self._cv:
            if id(session) in self._expect:
                self._expect.discard(id(session))
                self._cv.notify_all()

    def _gather_wait(self) -> float:
        """Seconds the next iteration still waits for the last one's sessions (0: start now)."""
        if self.batch_max < 2 or not self._expect or len(self._queue) >= self.batch_max:
            return 0.0
        return max(0.0, self._gather_until - time.perf_counter())

    def run(self, step: Step, cancel: threading.Event | None = None) -> Step:
        """Queue ``step`` and wait for its result.

        Returns:
            The step with its results.
        Raises:
            Cancelled: ``cancel`` was set before the step started (it never runs).
            The step's own error (e.g. EngineError) when its forward failed.
        """
        step._t_submit = time.perf_counter()
        with self._cv:
            self._queue.append(step)
            if id(step.session) in self._expect:
                self._expect.discard(id(step.session))
                self._cv.notify_all()
            while True:
                if step.done:
                    break
                if cancel is not None and cancel.is_set() and step in self._queue:
                    self._queue.remove(step)
                    raise Cancelled()
                if not self._busy and self._queue:
                    wait = self._gather_wait()
                    if wait > 0:
                        self._cv.wait(wait)
                        continue
                    idx = select(self._queue, self.batch_max, self.batch_tokens)
                    batch = [self._queue[i] for i in idx]
                    for i in reversed(idx):
                        del self._queue[i]
                    self._busy = True
                    self._cv.release()
                    t0 = time.perf_counter()
                    try:
                        self._execute(batch)
                    finally:
                        self._cv.acquire()
                        t1 = time.perf_counter()
                        self._expect = {id(s.session) for s in batch}
                        self._expect.difference_update(id(s.session) for s in self._queue)
                        self._gather_until = t1 + self.gather * (t1 - t0)
                        self._busy = False
                        self.iterations += 1
                        self._cv.notify_all()
                    continue
                self._cv.wait()
        if step.error is not None:
            raise step.error
        return step

    def _execute(self, batch: list[Step]) -> None:
        """One iteration: one es_forward_batch over the steps of ``batch``, under the engine lock.

        Each step gets its own result or its own error (a bad step fails alone;
        the others run).
        """
        if self.trace is not None:
            self.trace.append([id(s.session) for s in batch])
        with self.engine_lock:
            t_start = time.perf_counter()
            for s in batch:
                s.queued_ms = (t_start - s._t_submit) * 1e3
            try:
                results = self._run_batch([(s.session, s.tokens, s.head, s.logits) for s in batch])
            except Exception as exc:  # every step's owner re-raises it
                results = [exc] * len(batch)
            ms = (time.perf_counter() - t_start) * 1e3
        for s, r in zip(batch, results):
            if isinstance(r, BaseException):
                s.error = r
            elif s.head == "last":
                s.argmax, s.logits_out = [int(r[0][0])], r[1]
            else:
                s.argmax, s.logits_out = r
            s.forward_ms = ms
            s.done = True
