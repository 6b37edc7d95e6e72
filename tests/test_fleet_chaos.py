"""No generation lost while verifiers die and freeze under load.

Four boards (verifier with 1 engine thread + draft service, tests/test_fleet.py's Board) serve
SmolLM2 on loopback behind one coordinator in this process. 40 generations run at once (greedy,
greedy with speculation, and seeded sampling); every 2 s a random verifier is killed (SIGKILL,
then started again) or frozen (SIGSTOP for 1.5 s, then SIGCONT), 16 times at most. Every stream ends without an
error, and its text and token ids equal its reference from a quiet fleet; the moves are counted.
Afterwards nothing is left behind: no session on any verifier, no generation in flight at the
coordinator, and no file descriptor more in the coordinator, the draft services or the verifiers
that were never killed. Bounded: 40 generations of 40 tokens, at most 240 s.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_fleet import running  # noqa: E402
from test_fleet_resume import Coordinator, SmolBoard  # noqa: E402
from echospec.v1 import common_pb2, coordinator_pb2 as cpb  # noqa: E402
from echospec.v1 import verifier_pb2, verifier_pb2_grpc  # noqa: E402

IPS = ["127.0.0.31", "127.0.0.32", "127.0.0.33", "127.0.0.34"]
N_GEN = 40
MAX_TOKENS = 40
PERIOD_S = 2.0
FREEZE_S = 1.5
N_EVENTS = 16          # 8 kills and 8 freezes at the most, then the generations finish in peace
BOUND_S = 240.0
# more than the default 2: a generation may sit on the verifier hit by any of the N_EVENTS
# faults (a slow host stretches a generation over all of them), and a move whose next verifier
# is hit before its first token counts too
MAX_MOVES = 16
SUBJECTS = ["a lighthouse keeper", "a clockmaker", "a river pilot", "a beekeeper", "an astronomer",
            "a baker", "a glassblower", "a cartographer", "a shepherd", "a violin maker"]


def _request(i: int) -> cpb.GenerateRequest:
    text = (f"<|im_start|>user\nTell story number {i} about {SUBJECTS[i % len(SUBJECTS)]} and "
            f"the {['sea', 'town', 'forest', 'mountain'][i // 10]}.<|im_end|>\n"
            "<|im_start|>assistant\n")
    mode = i % 3
    if mode == 2:
        return cpb.GenerateRequest(text=text, max_tokens=MAX_TOKENS, temperature=0.8, top_k=40,
                                   seed=i, spec=common_pb2.SPEC_MODE_OFF)
    spec = common_pb2.SPEC_MODE_ON if mode == 1 else common_pb2.SPEC_MODE_OFF
    return cpb.GenerateRequest(text=text, max_tokens=MAX_TOKENS, spec=spec)


class ChaosBoard(SmolBoard):
    """A board whose verifier holds all 40 generations' sessions if it must (1 engine thread)."""

    def start_verifier(self) -> None:
        self.verifier = self._spawn("verifier", [
            "--host", self.ip, "--port", str(self.vport), "--model", self.model,
            "--n-ctx", "512", "--n-threads", "1", "--max-sessions", str(N_GEN),
            "--draft-target", f"{self.ip}:{self.dport}"])


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _verifier_config(board) -> verifier_pb2.GetConfigResponse:
    with grpc.insecure_channel(board.address) as ch:
        return verifier_pb2_grpc.VerifierServiceStub(ch).GetConfig(
            verifier_pb2.GetConfigRequest(), timeout=10)


class Chaos:
    """Every PERIOD_S, kill or freeze a verifier that was not hit in the last two periods, N_EVENTS
    times at most; kills and freezes alternate, the verifier is drawn from a seeded RNG. Runs in the main
    thread: a service started from another thread would get its parent-death signal when
    that thread ends (services/rpc/lifecycle.py)."""

    def __init__(self, boards, seed: int):
        self.boards, self.rng = boards, random.Random(seed)
        self.events: list[tuple[float, str, str]] = []     # (seconds from start, what, address)

    def count(self, what: str) -> int:
        return sum(1 for e in self.events if e[1] == what)

    def run(self, until) -> None:
        """Until ``until()`` is true (checked every 0.1 s)."""
        t0 = time.monotonic()
        last_hit = {b.address: -1e9 for b in self.boards}
        nxt = t0 + PERIOD_S
        while not until() and len(self.events) < N_EVENTS:
            now = time.monotonic()
            if now < nxt:
                time.sleep(min(0.1, nxt - now))
                continue
            nxt += PERIOD_S
            cands = [b for b in self.boards if now - last_hit[b.address] > 2 * PERIOD_S]
            b = self.rng.choice(cands)
            last_hit[b.address] = now
            if len(self.events) % 2 == 0:
                b.verifier.kill()
                b.verifier.wait(10)
                b.start_verifier()           # the coordinator's health poll takes it back
                self.events.append((now - t0, "kill", b.address))
            else:
                os.kill(b.verifier.pid, signal.SIGSTOP)
                self.events.append((now - t0, "freeze", b.address))
                time.sleep(FREEZE_S)
                os.kill(b.verifier.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def fleet(smollm2_path):
    with running(ChaosBoard, IPS, smollm2_path) as bs:
        yield bs


def _stream(coord: Coordinator, req: cpb.GenerateRequest):
    """(text, token ids, result) of one streamed generation."""
    text, ids, result = [], [], None
    for msg in coord.stub.Generate(req, timeout=BOUND_S):
        if msg.HasField("result"):
            result = msg.result
            break
        text.append(msg.text)
        ids.extend(msg.token_ids)
    return "".join(text), ids, result


def test_forty_generations_survive_kills_and_freezes_with_identical_output(smollm2_path, fleet):
    coord = Coordinator(smollm2_path, fleet, max_moves=MAX_MOVES)
    chaos = Chaos(fleet, seed=11)
    try:
        reqs = [_request(i) for i in range(N_GEN)]
        with ThreadPoolExecutor(8) as ex:           # references from the quiet fleet
            refs = list(ex.map(lambda r: _stream(coord, r), reqs))
        assert all(r[2] is not None and not r[2].moves for r in refs)
        me = os.getpid()
        fds_before = {"coordinator": _fds(me)}
        fds_before.update({f"draft {b.ip}": _fds(b.draft.pid) for b in fleet})
        verifier_fds = {b.verifier.pid: _fds(b.verifier.pid) for b in fleet}

        t0 = time.monotonic()
        with ThreadPoolExecutor(N_GEN) as ex:
            futs = [ex.submit(_stream, coord, r) for r in reqs]
            chaos.run(until=lambda: all(f.done() for f in futs)
                      or time.monotonic() - t0 > BOUND_S)
            outs = []
            for f in futs:
                try:
                    outs.append(f.result())
                except grpc.RpcError as exc:
                    outs.append(exc)
        elapsed = time.monotonic() - t0

        lost = [(i, o.code(), o.details()) for i, o in enumerate(outs) if isinstance(o, grpc.RpcError)]
        assert not lost, f"{len(lost)} lost: " + "\n".join(f"{i}: {c} {d}" for i, c, d in lost[:6]) \
            + "\nevents: " + ", ".join(f"{t:.1f} s {w} {a}" for t, w, a in chaos.events)
        differ = [i for i, (o, r) in enumerate(zip(outs, refs))
                  if o[0].encode() != r[0].encode() or o[1] != r[1] or o[2] is None
                  or o[2].text != r[2].text]
        assert not differ, differ
        moves = [m for o in outs for m in o[2].moves]
        moved = sum(1 for o in outs if o[2].moves)
        print(f"\nchaos: {N_GEN} generations of {MAX_TOKENS} tokens in {elapsed:.1f} s, "
              f"{chaos.count('kill')} kills, {chaos.count('freeze')} freezes, {len(moves)} moves of "
              f"{moved} generations (at most {max(len(o[2].moves) for o in outs)} for one), "
              f"{N_GEN} of {N_GEN} identical")
        assert elapsed < BOUND_S
        assert chaos.count('kill') and chaos.count('freeze') and moves, chaos.events
        assert any("UNAVAILABLE" in m.reason for m in moves)

        # nothing left behind (a verifier the last event restarted is up first)
        for b in fleet:
            b.wait()
        coord.wait_healthy([b.address for b in fleet], timeout_s=60)
        deadline = time.monotonic() + 20
        while True:
            active = {b.address: _verifier_config(b).active_sessions for b in fleet}
            in_flight = {a: v.in_flight for a, v in coord.info().items()}
            if not any(active.values()) and not any(in_flight.values()):
                break
            assert time.monotonic() < deadline, (active, in_flight)
            time.sleep(0.2)
        assert coord.server.servicer.metrics.running._value.get() == 0
        time.sleep(1.0)          # closed streams' sockets
        fds_after = {"coordinator": _fds(me)}
        fds_after.update({f"draft {b.ip}": _fds(b.draft.pid) for b in fleet})
        grown = {k: (fds_before[k], v) for k, v in fds_after.items() if v > fds_before[k] + 4}
        for b in fleet:
            pid = b.verifier.pid
            if pid in verifier_fds and _fds(pid) > verifier_fds[pid] + 4:
                grown[f"verifier {b.address}"] = (verifier_fds[pid], _fds(pid))
        assert not grown, grown
    finally:
        coord.close()
