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

The verifier's warm-up does not queue here: it takes the engine lock
directly, before any generation starts.

A step that waits (``run``) needs no thread of the scheduler's: a waiting
generation whose turn comes runs the iteration itself (flat combining), so a
lone generation pays no thread hand-off per step.

Continuing steps (``start``; plain decoding): a step with a ``stream`` is not
waited for. Right after its forward, in the iteration's own thread, the
scheduler calls ``stream.advance(step)``, which takes the result (the next
token, its checks, the output for the generation's reader) and returns the
next step's tokens, or None when the generation ended. The next step goes to
the back of the queue before the iteration ends, so a batch of decoding
sessions runs back to back without waiting for any generation's thread: the
readers take their tokens while the next forward runs. While any stream is
active a thread of the scheduler's runs the iterations (it ends with the last
stream); ``stop`` takes a stream out (cancel, its reader gone) and returns once
no forward of it runs.

A token tree (Step.parents; generation_loop's tree rounds) runs alone in its iteration:
``Session.forward_tree``, then its greedy path (tree_accept.accept) kept with ``keep_path`` before
the engine lock is let go, so no other call of the session comes between them.

In-engine decoding (``decode_steps`` > 1): an iteration whose steps are all
greedy decode steps (a plain stream's, or the back-off rounds of a speculative
generation, generation_loop._rounds), while nothing but such steps waits, may become
one engine.decode_batch call of up to ``decode_steps`` greedy steps of each
(a stream's ``decode_max`` caps it below max_tokens and the KV capacity; its
EOS ids end it for that stream), so decoding generations pay no Python
between their tokens; streams left out by batch_max take their runs in
turn. Anything that arrives meanwhile (a step queued, a stream stopped,
``wake`` after a cancel) sets the run's interrupt, and the engine returns
after the step that runs. The tokens are bitwise one forward per token
(es_decode's contract).

Verify runs (Step.verify_run; generation_loop's chain rounds drafted from a proposal longer than
the round): when the step is alone in its iteration and nothing else waits, the engine runs the
round and the rounds after it while every draft is kept and the proposal still continues the
output (Session.verify_run, es_verify_run), so those rounds pay no Python between them; anything
that arrives meanwhile sets the run's interrupt and the engine returns after its current round.
Otherwise the step is one verify like any other. The tokens are those of one verify per round.

Engine threads (``threads`` = (one, many)): an iteration over one session
runs on ``one`` thread(s) of the sessions' pools, one that batches two or
more sessions (a decode run over them too), or feeds one session MANY_TOKENS
or more (a prefill chunk) or MANY_VERIFY or more in a verify (a token tree and a
verify run by their first round), on ``many`` (set on the batch's sessions before the
call; es_forward_batch runs on its first item's pool and count). A lone
session's steps, decode runs and short verifies keep to ``one``: the default leaves a core to
the services' Python and the clients, and a step on every core waits for its
slowest thread whenever anything else runs (bench/README.md, serve_bench,
"Engine threads"). A prefill chunk or a verify of several drafts is bound by arithmetic (SmolLM2 at
one thread: 4 rows cost 1.17 T, 17 rows 3.7 T; on two: 0.75 T and 2.0 T), so the second core pays
for itself there. Results do not depend on the count (the engine's contract), only the speed does.

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

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from echospec.services.verifier.engine import (EngineError, decode_batch, ffi, forward_batch, last_call_ms,
                                               reset_call_ms)
from echospec.services.verifier.tree_accept import accept


MANY_TOKENS = 16   # a prefill chunk of this many tokens (one session) runs on ``many`` threads
MANY_VERIFY = 4    # ... and a verify of this many (the pending token and 3 or more drafts)


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
    decode > 1 (a greedy step of one token, no logits): when every
    step of its iteration is one and nothing else waits, the engine may run
    up to ``decode`` greedy steps of it in one call (engine.decode_batch),
    each fed the last one's token, ending after a token of ``stop_ids``;
    argmax is then every step's token and step_ms each step's time.
    Results (set by the scheduler): argmax, logits, forward_ms (the iteration's
    forward, shared by every step of the batch: the engine's C call alone, the Python that
    prepares it and reads its results left to the round), queued_ms, error.
    """

    session: Any                      # services.verifier.engine.Session
    tokens: list[int]
    head: str = "all"
    logits: str = "none"
    argmax: Any = None
    logits_out: Any = None
    forward_ms: float = 0.0           # this step's forward (the engine call)
    queued_ms: float = 0.0            # from submit to the start of its iteration
    error: BaseException | None = None
    done: bool = False
    stream: Any = None                # a continuing step's owner (see ``start``); None: ``run`` waits
    cancel: threading.Event | None = None   # a stream's cancel event (set: it is dropped)
    decode: int = 0                   # most greedy steps in one engine call (see above)
    stop_ids: tuple = ()
    step_ms: list | None = None       # an in-engine run's per-step times
    shared: bool = False              # its iteration ran other sessions' steps too (a batch)
    # a token tree (tree_accept.verify_tree's): verified alone in its iteration by forward_tree,
    # whose greedy path (tree_accept.accept) is kept at once, under the engine lock
    parents: list | None = None
    path: list | None = None          # the tree's kept path (node indices from node 0)
    # a verify run (generation_loop's chain rounds over a longer cached proposal): (drafts, k,
    # max_out, stop_ids, max_ms), the drafts continuing after tokens[0] (tokens[1:] first). Alone in
    # the queue, its iteration runs Session.verify_run (the result in ``run``); else one verify of
    # ``tokens`` as any step (``run`` None)
    verify_run: tuple | None = None
    run: Any = None                   # engine.VerifyRun of a verify run that ran
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
        if picked and (s.parents is not None or queue[picked[0]].parents is not None
                       or s.verify_run is not None or queue[picked[0]].verify_run is not None):
            break     # a token tree or a verify run runs alone (one session's engine call)
        if picked and tokens + len(s.tokens) > batch_tokens:
            break
        picked.append(i)
        tokens += len(s.tokens)
    return picked


class Scheduler:
    """Owns the engine for generations (see the module docstring).

    Args:
        engine_lock: held while a batch runs (VerifierCore.warm_up takes it too).
        batch_max: sessions per iteration (>= 1).
        batch_tokens: tokens per iteration (>= 1).
        prefill_chunk: most prompt tokens per prefill step (>= 1).
        run_batch: the engine call of an iteration, with engine.forward_batch's
            arguments and results (tests pass a fake one).
        gather: the longest wait for the last iteration's sessions, as a share of
            its forward time (0: none; see the module docstring).
        threads: (engine threads of an iteration over one session, of one over two or
            more), set on the sessions (Session.threads) before each call; None: the
            sessions' counts are left as they are.
        decode_steps: most greedy steps one engine call runs for each of the greedy streams
            of an iteration when nothing else waits (engine.decode_batch; 1: one forward per
            call). The call ends early when anything else arrives (a step, a stop, a cancel:
            ``wake``), after the step that runs.
    """

    def __init__(self, engine_lock: threading.Lock, batch_max: int = 1, batch_tokens: int = 512,
                 prefill_chunk: int = 256,
                 run_batch: Callable[[list[tuple[Any, list[int], str, str]]], list[Any]] = forward_batch,
                 gather: float = 0.5, threads: tuple[int, int] | None = None, decode_steps: int = 1):
        if batch_max < 1 or batch_tokens < 1 or prefill_chunk < 1 or decode_steps < 1:
            raise ValueError(f"batch_max {batch_max}, batch_tokens {batch_tokens}, prefill_chunk"
                             f" {prefill_chunk} and decode_steps {decode_steps} must be >= 1")
        self.decode_steps = decode_steps
        # set (under _cv) whenever other work arrives; an in-engine decode run reads it after each step
        self._interrupt = ffi.new("int32_t *")
        self.engine_lock = engine_lock
        self.batch_max = batch_max
        self.batch_tokens = batch_tokens
        self.prefill_chunk = prefill_chunk
        self._run_batch = run_batch
        self.gather = gather
        self.threads = threads
        self.threads_used: dict[int, int] = {}   # engine threads -> iterations run on that many
        self._expect: set[int] = set()    # id(session) of the last iteration's steps not queued again
        self._gather_until = 0.0          # perf_counter() deadline of the wait for them
        self._cv = threading.Condition()
        self._queue: list[Step] = []
        self._busy = False
        self._streams = 0                 # active streams (queued or running)
        self._running: list[Step] = []    # the steps of the iteration that runs
        self._thread: threading.Thread | None = None   # runs iterations while streams are active
        self.iterations = 0               # batches run (for tests and the bench)
        self.trace: list[list[int]] | None = None   # when a list: id(session) per step of each batch

    @property
    def waiting(self) -> int:
        """Steps queued and not started."""
        with self._cv:
            return len(self._queue)

    def wake(self) -> None:
        """Wake every waiting generation (call after setting a cancel event); ends a running
        in-engine decode run after its current step."""
        with self._cv:
            self._interrupt[0] = 1
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
            self._interrupt[0] = 1
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
                    self._iterate_locked()
                    continue
                self._cv.wait()
        if step.error is not None:
            raise step.error
        return step

    def start(self, step: Step) -> None:
        """Queue a continuing step (``step.stream`` set; see the module docstring) and return.

        ``step.stream.advance(step)`` is called after each of its forwards (its
        error, a Cancelled when its cancel event was set first, in ``step.error``)
        and returns the next step's tokens or None (the stream ends).
        """
        step._t_submit = time.perf_counter()
        with self._cv:
            self._queue.append(step)
            self._interrupt[0] = 1
            self._streams += 1
            if id(step.session) in self._expect:
                self._expect.discard(id(step.session))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def stop(self, stream: Any) -> None:
        """End ``stream``: it gets no further step; returns once none of its forwards runs."""
        with self._cv:
            stream.stopped = True
            self._interrupt[0] = 1
            while True:
                for i, s in enumerate(self._queue):
                    if s.stream is stream:
                        del self._queue[i]
                        self._streams -= 1
                        self._cv.notify_all()
                        return
                if not any(s.stream is stream for s in self._running):
                    return
                self._cv.wait()

    def wait_for(self, ready: Callable[[], bool], timeout: float | None = None) -> None:
        """Wait until ``ready()`` (checked after each iteration and on ``wake``) or the timeout."""
        with self._cv:
            if not ready():
                self._cv.wait(timeout)

    def _loop(self) -> None:
        """The streams' thread: runs iterations while any stream is active."""
        with self._cv:
            try:
                while self._streams > 0:
                    if self._busy or not self._queue:
                        self._cv.wait()
                        continue
                    wait = self._gather_wait()
                    if wait > 0:
                        self._cv.wait(wait)
                        continue
                    self._iterate_locked()
            finally:
                self._thread = None

    def _iterate_locked(self) -> None:
        """One iteration; called with the condition held, not busy, the queue not empty."""
        for i in range(len(self._queue) - 1, -1, -1):   # cancelled streams leave before selection
            s = self._queue[i]
            if s.stream is not None and s.cancel is not None and s.cancel.is_set():
                del self._queue[i]
                self._streams -= 1
                s.error, s.done = Cancelled(), True
                self._advance(s)
        if not self._queue:
            self._cv.notify_all()
            return
        idx = select(self._queue, self.batch_max, self.batch_tokens)
        batch = [self._queue[i] for i in idx]
        for i in reversed(idx):
            del self._queue[i]
        # every step of the batch, and every step still waiting, a greedy decode step:
        # the engine may run several steps of each in one call (the waiting streams take their
        # runs in turn)
        run_decode = self.decode_steps > 1 and all(s.decode > 1 and len(s.tokens) == 1
                                                   for s in itertools.chain(batch, self._queue))
        # a verify run only with nothing else waiting (what arrives meanwhile interrupts it)
        run_verify = len(batch) == 1 and batch[0].verify_run is not None and not self._queue
        self._interrupt[0] = 0
        self._busy = True
        self._running = batch
        self._cv.release()
        t0 = time.perf_counter()
        nexts: list[Any] | None = None
        try:
            self._execute(batch, run_decode, run_verify)
            nexts = [self._advance(s) if s.stream is not None else None for s in batch]
        finally:
            self._cv.acquire()
            t1 = time.perf_counter()
            if nexts is None:   # the iteration itself failed: its streams end with it
                nexts = [None] * len(batch)
                for s in batch:
                    if s.stream is not None:
                        s.stream.fail(RuntimeError("the scheduler's iteration failed"))
            for s, nxt in zip(batch, nexts):
                if s.stream is None:
                    continue
                if nxt is None or getattr(s.stream, "stopped", False):
                    self._streams -= 1
                    continue
                n = Step(s.session, nxt, s.head, s.logits, stream=s.stream, cancel=s.cancel,
                         decode=getattr(s.stream, "decode_max", 0), stop_ids=s.stop_ids)
                n._t_submit = t1
                self._queue.append(n)
            self._expect = {id(s.session) for s in batch if s.stream is None}
            self._expect.difference_update(id(s.session) for s in self._queue)
            self._gather_until = t1 + self.gather * (t1 - t0)
            self._busy = False
            self._running = []
            self.iterations += 1
            self._cv.notify_all()

    @staticmethod
    def _advance(step: Step) -> list[int] | None:
        try:
            return step.stream.advance(step)
        except Exception as exc:  # noqa: BLE001 - the stream's reader re-raises it
            step.stream.fail(exc)
            return None

    @staticmethod
    def _run_tree(s: Step) -> Any:
        """A token tree's verify and its kept path (Step.parents); an EngineError is the step's."""
        try:
            argmax, logits = s.session.forward_tree(s.tokens, s.parents, s.logits)
            s.path = accept(s.tokens, s.parents, argmax)[0]
            s.session.keep_path(s.path)
            return argmax, logits
        except EngineError as exc:
            return exc

    def _run_verify(self, s: Step) -> Any:
        """A verify run (Step.verify_run) in the engine; an EngineError is the step's."""
        drafts, k, max_out, stop_ids, max_ms = s.verify_run
        try:
            s.run = s.session.verify_run(s.tokens[0], drafts, k, max_out, stop_ids, max_ms, self._interrupt)
        except EngineError as exc:
            return exc
        return [], None

    def _execute(self, batch: list[Step], run_decode: bool = False, run_verify: bool = False) -> None:
        """One iteration: one es_forward_batch over the steps of ``batch``, under the engine lock
        (run_decode: the steps' in-engine decode run instead, engine.decode_batch; run_verify: the
        lone step's verify run, Session.verify_run).

        Each step gets its own result or its own error (a bad step fails alone;
        the others run).
        """
        if self.trace is not None:
            self.trace.append([id(s.session) for s in batch])
        with self.engine_lock:
            t_start = time.perf_counter()
            for s in batch:
                s.queued_ms = (t_start - s._t_submit) * 1e3
            reset_call_ms()
            try:
                if self.threads is not None:
                    one = len(batch) == 1 and len(batch[0].tokens) < (
                        MANY_VERIFY if batch[0].head == "all" else MANY_TOKENS)
                    n = self.threads[0] if one else self.threads[1]
                    self.threads_used[n] = self.threads_used.get(n, 0) + 1
                    for s in batch:
                        try:
                            s.session.threads = n
                        except EngineError:   # a closed session: its own item fails below
                            pass
                if run_decode:
                    runs = decode_batch([(s.session, s.tokens[0], min(s.decode, self.decode_steps), s.stop_ids)
                                         for s in batch], self._interrupt)
                    results = []
                    for s, r in zip(batch, runs):
                        if isinstance(r, EngineError):
                            results.append(r)
                        else:
                            s.step_ms = r[1]
                            results.append((r[0], None))
                    if self.trace is not None:   # one entry per engine step
                        lens = [len(r[0]) for r in results if not isinstance(r, EngineError)]
                        for k in range(1, max(lens, default=1)):
                            self.trace.append([id(s.session) for s, r in zip(batch, results)
                                               if not isinstance(r, EngineError) and len(r[0]) > k])
                elif batch[0].parents is not None:
                    results = [self._run_tree(batch[0])]
                elif run_verify:
                    results = [self._run_verify(batch[0])]
                else:
                    results = self._run_batch([(s.session, s.tokens, s.head, s.logits) for s in batch])
            except Exception as exc:  # every step's owner re-raises it
                results = [exc] * len(batch)
            # the engine's own time where the call was timed alone (the Python around it is the
            # scheduler's part of a round), else the whole call's (a decode run: its steps' times
            # are step_ms; a run_batch of tests)
            call = last_call_ms()
            ms = call if call is not None and not run_decode else (time.perf_counter() - t_start) * 1e3
        for s, r in zip(batch, results):
            if isinstance(r, BaseException):
                s.error = r
            elif s.head == "last":
                s.argmax, s.logits_out = [int(r[0][0])], r[1]
            else:
                s.argmax, s.logits_out = r
            s.forward_ms = ms
            s.shared = len(batch) > 1
            s.done = True
