"""The progress deadline of a generation on its verifier (stall detection), and the move cap.

No gRPC here. A verifier streams a generation's rounds; a verifier that is alive
but frozen (SIGSTOP, a hung host, a network that drops packets without a reset)
sends nothing and ends nothing. The coordinator gives each wait for the next
message a deadline derived from that verifier's own reported costs, so a slow
board under honest load is never flagged:

    round_ms  = max(T, the largest per-message wall time lately)    (decays 10 % a message)
    load_ms   = others * prefill_chunk * T   (others: the verifier's other active sessions,
                each of which may run a prefill chunk of prefill_chunk tokens, costing at most
                prefill_chunk decode steps, before this generation's next step)
    deadline  = max(floor_s, STALL_FACTOR * (round_ms + load_ms) / 1000)

The per-message wall time is the sum of the message's rounds' ``wall_ms``: the
verifier's own time for those rounds, queueing behind other sessions and the
draft hop included (the prefill's round is left out: it is no round's cost). The first message (the prefill, at the start or after a
move) waits for ``prompt_tokens`` tokens at no more than T each (a prefill
costs less per token than a decode step), plus the same load term.

Example: T = 20 ms, one generation alone, messages every 50 ms (a decode run):
round_ms = 50, load_ms = 0, deadline = max(1.0, 8 * 0.05) = 1.0 s (the floor).
With 3 other sessions and prefill_chunk 256: load_ms = 3 * 256 * 20 = 15360 ms,
deadline = 8 * 15.41 = 123 s: a loaded board is given all the time its queue
could honestly take.

``floor_s <= 0`` turns stall detection off (None: no deadline). T = 0 (not
measured yet) gives no deadline either: nothing to base one on. A call that
misses its deadline while no other healthy verifier could take the generation
is left to run (a lone slow verifier is still the best there is), and looked at
again one deadline later: once another verifier is healthy, it is moved there.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("echospec.coordinator")

STALL_FACTOR = 8.0   # a round this many times slower than the verifier's own costs is a stall
DECAY = 0.9          # the per-message wall estimate forgets 10 % a message


class ProgressClock:
    """The deadlines of one generation on one verifier.

    Args:
        floor_s: the shortest deadline (seconds); <= 0: stall detection off.
        t_ms: the verifier's T (ms per decode step) from its last GetConfig; 0: unknown.
        prefill_chunk: the verifier's prefill chunk (tokens).
        prompt_tokens: tokens its first message's prefill covers at most (the uncached ones
            are fewer).
    """

    def __init__(self, floor_s: float, t_ms: float, prefill_chunk: int, prompt_tokens: int):
        self.floor_s = floor_s
        self.t_ms = max(0.0, t_ms)
        self.prefill_chunk = max(1, prefill_chunk)
        self.prompt_tokens = max(1, prompt_tokens)
        self.round_ms = 0.0
        self.first = True

    def observe(self, wall_ms: float, t_ms: float) -> None:
        """A message arrived: its rounds took ``wall_ms`` at the verifier; T is now ``t_ms``."""
        self.first = False
        if t_ms > 0:
            self.t_ms = t_ms
        self.round_ms = max(wall_ms, self.round_ms * DECAY)

    def deadline_s(self, others: int) -> float | None:
        """Seconds to wait for the next message; None: no deadline.

        Args:
            others: the verifier's other active sessions (its report corrected by this
                coordinator's own generations), >= 0.
        """
        if self.floor_s <= 0 or self.t_ms <= 0:
            return None
        load_ms = max(0, others) * self.prefill_chunk * self.t_ms
        if self.first:
            work_ms = self.prompt_tokens * self.t_ms
        else:
            work_ms = max(self.t_ms, self.round_ms)
        return max(self.floor_s, STALL_FACTOR * (work_ms + load_ms) / 1e3)


def move_cap_text(moves: int, cap: int) -> str:
    """How a generation's moves stand against the cap, for an error message (``moves``: those
    tried, the ones whose next verifier failed before its first token too)."""
    return f"{moves} move(s) tried of at most {cap} per generation"


class StallWatch:
    """One thread that ends the calls whose progress deadline passed.

    ``arm(link, seconds, why)`` sets (or moves) a link's deadline; ``disarm(link)`` clears it.
    When a deadline passes, ``link.stall(why)`` is called once (on this thread) and the link is
    disarmed. The thread sleeps while nothing is armed and wakes at the earliest deadline.
    ``arm(..., movable=f)``: when the deadline passes, the link is stalled only if ``f()`` is
    true (another verifier could take the generation); else the same deadline runs again from
    then, so a call that stopped while it had nowhere to go is ended once somewhere is back.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._armed: dict[Any, tuple[float, str, float, Callable[[], bool] | None]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def arm(self, link: Any, seconds: float | None, why: str,
            movable: Callable[[], bool] | None = None) -> None:
        """Stall ``link`` unless re-armed or disarmed within ``seconds`` (None: disarm), and
        then only when ``movable()`` says so (None: always)."""
        with self._cv:
            if seconds is None:
                self._armed.pop(link, None)
                return
            self._armed[link] = (time.monotonic() + seconds, why, seconds, movable)
            self._cv.notify()

    def disarm(self, link: Any) -> None:
        with self._cv:
            self._armed.pop(link, None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._armed.clear()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            due: list[tuple[Any, tuple]] = []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                for link, entry in list(self._armed.items()):
                    if entry[0] <= now:
                        due.append((link, entry))
                        del self._armed[link]
                if not due:
                    nxt = min((e[0] for e in self._armed.values()), default=None)
                    self._cv.wait(None if nxt is None else max(0.0, nxt - now))
                    continue
            for link, (_, why, seconds, movable) in due:
                if movable is not None and not self._movable(movable):
                    with self._cv:   # nowhere to go: look again after the same deadline
                        if link not in self._armed and not self._closed:
                            self._armed[link] = (time.monotonic() + seconds, why, seconds, movable)
                    continue
                link.stall(why)

    @staticmethod
    def _movable(movable: Callable[[], bool]) -> bool:
        try:
            return bool(movable())
        except Exception:   # a broken check must not end the watch's thread (nor the call)
            log.exception("stall watch: the movable check failed; the call is left to run")
            return False
