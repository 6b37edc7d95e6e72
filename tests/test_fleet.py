"""Several verifiers per coordinator, on loopback.

Three boards, each a verifier + draft service pair as two processes, bound to their own
loopback address (127.0.0.11, .12, .13; a fourth, .14, joins by DNS) on the same ports, as
pods of a headless Service are. One coordinator in this process balances over them.

- 12 concurrent generations spread over all three (each serves >= 2), with the same
  output as a run on one verifier, each verifier consulting its own draft service.
- DNS: a dns:/// target picks up an added address (the resolver is a test double passed
  to the coordinator's start(); the product resolves with getaddrinfo) and drops a removed one.
- Prefix-aware routing: a chat's second turn goes to the verifier that served its first and
  reuses prompt + output of turn 1 less one token (against a least-loaded-only run that
  misses).
- A verifier killed mid-run: generations it had not started move to the others, started
  ones resume on the others (the result's moves name it), new ones avoid it until its health
  returns, and it serves again after a restart. (tests/test_fleet_resume.py checks the resumed
  text byte for byte, and stalls.)
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ggufgen import write_tiny_model  # noqa: E402
from ports import unused_ports  # noqa: E402
from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc  # noqa: E402
from echospec.services.common.config import CoordinatorConfig  # noqa: E402
from echospec.services.rpc.lifecycle import PARENT_ENV  # noqa: E402
from echospec.services.coordinator import server as cserver  # noqa: E402
from echospec.services.coordinator.balancer import rendezvous_rank  # noqa: E402
from echospec.services.coordinator.server import wait_serving  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IPS = ["127.0.0.11", "127.0.0.12", "127.0.0.13", "127.0.0.14"]
N_CTX = 4096
ON = common_pb2.SPEC_MODE_ON
PROMPTS = [f"{w} the cat sat on the mat. {w} the cat" for w in
           ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "eleven", "twelve")]


def _ports_free_on_all(n: int) -> list[int]:
    """n ports that are free on every address of IPS (outside the ephemeral range: tests/ports.py)."""
    return unused_ports(n, tuple(IPS))


class Board:
    """A verifier + draft pair on one loopback address, as two processes."""

    def __init__(self, ip: str, vport: int, dport: int, model: str):
        self.ip, self.vport, self.dport, self.model = ip, vport, dport, model
        self.address = f"{ip}:{vport}"
        self.draft: subprocess.Popen | None = None
        self.verifier: subprocess.Popen | None = None

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env[PARENT_ENV] = str(os.getpid())
        env["OPENBLAS_NUM_THREADS"] = "1"
        return subprocess.Popen([sys.executable, "-m", f"echospec.services.{name}", *args,
                                 "--log-level", "WARNING"], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL)

    def start_draft(self) -> None:
        self.draft = self._spawn("draft", ["--host", self.ip, "--port", str(self.dport)])

    def start_verifier(self) -> None:
        self.verifier = self._spawn("verifier", [
            "--host", self.ip, "--port", str(self.vport), "--model", self.model,
            "--n-ctx", str(N_CTX), "--n-threads", "1", "--max-sessions", "16",
            # room for every chat's first turn of the routing test on one verifier: with the
            # default 4 a split of 5 to 2 (a health poll missed on a busy host) evicts one
            "--prefix-cache-sessions", "8",
            "--draft-target", f"{self.ip}:{self.dport}"])

    def wait(self, timeout_s: float = 90.0) -> None:
        for proc, port, svc in ((self.draft, self.dport, "echospec.v1.DraftService"),
                                (self.verifier, self.vport, "echospec.v1.VerifierService")):
            with grpc.insecure_channel(f"{self.ip}:{port}") as ch:
                deadline = time.monotonic() + timeout_s
                while True:
                    assert proc.poll() is None, f"{svc} on {self.ip}:{port} exited {proc.returncode}"
                    try:
                        wait_serving(ch, svc, 1.0)
                        break
                    except TimeoutError:
                        assert time.monotonic() < deadline, f"{svc} on {self.ip}:{port} not SERVING"

    def stop(self) -> None:
        for p in (self.verifier, self.draft):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fleet") / "tiny-4k.gguf"
    write_tiny_model(path, arch="llama", n_vocab=320, n_ctx_train=N_CTX, seed=0)
    return str(path)


@contextlib.contextmanager
def running(cls: type[Board], ips: list[str], model: str):
    """Boards of class ``cls`` on ``ips`` (same ports on each), started and SERVING; stopped
    after (a frozen verifier continued first)."""
    vport, dport = _ports_free_on_all(2)
    bs = [cls(ip, vport, dport, model) for ip in ips]
    try:
        for b in bs:
            b.start_draft()
            b.start_verifier()
        for b in bs:
            b.wait()
        yield bs
    finally:
        for b in bs:
            if b.verifier is not None and b.verifier.poll() is None:
                os.kill(b.verifier.pid, signal.SIGCONT)
            b.stop()


@pytest.fixture(scope="module")
def boards(model):
    with running(Board, IPS, model) as bs:
        yield bs


class Coordinator:
    """An in-process coordinator over some verifier targets, with a stub to it."""

    def __init__(self, model: str, targets, poll_s: float = 0.2, resolve_s: float = 10.0,
                 resolver=None, **settings):
        cfg = CoordinatorConfig(model=model, port=0, verifier=tuple(targets), verifier_poll_s=poll_s,
                                verifier_resolve_s=resolve_s, metrics_port=-1, log_level="WARNING",
                                **settings)
        self.server = cserver.start(cfg, verifier_wait_s=60, resolver=resolver)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)

    def info(self) -> dict:
        r = self.stub.GetInfo(cpb.GetInfoRequest(), timeout=10)
        return {v.address: v for v in r.verifiers}

    def wait_for(self, pred, what: str, timeout_s: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            if pred(info):
                return info
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {info}"
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


def _complete(stub, prompt: str, max_tokens: int = 48, namespace: str = "", timeout: float = 60):
    return stub.Complete(cpb.CompleteRequest(text=prompt, max_tokens=max_tokens, spec=ON,
                                             draft_namespace=namespace), timeout=timeout).result


def _owned_namespace(address: str, addresses: list[str]) -> str:
    """A draft_namespace whose rendezvous owner among ``addresses`` is ``address``."""
    for i in range(1000):
        ns = f"tenant-{i}"
        if rendezvous_rank(ns, addresses)[0] == address:
            return ns
    raise AssertionError("no namespace found")


def test_generations_spread_over_three_verifiers_with_single_verifier_output(model, boards):
    three = boards[:3]
    single = Coordinator(model, [three[0].address])
    try:
        with ThreadPoolExecutor(12) as ex:
            alone = list(ex.map(lambda p: _complete(single.stub, p), PROMPTS))
    finally:
        single.close()
    assert {r.verifier for r in alone} == {three[0].address}

    fleet = Coordinator(model, [b.address for b in three])
    try:
        info = fleet.info()
        assert set(info) == {b.address for b in three}
        # each verifier's load report: 16 sessions of n_ctx positions, all free when idle
        for v in info.values():
            assert v.healthy and v.max_sessions == 16
            assert v.free_kv_tokens == (16 - v.active_sessions) * N_CTX
        with ThreadPoolExecutor(12) as ex:
            spread = list(ex.map(lambda p: _complete(fleet.stub, p), PROMPTS))
    finally:
        fleet.close()
    by_verifier: dict[str, list] = {}
    for r in spread:
        by_verifier.setdefault(r.verifier, []).append(r)
    assert set(by_verifier) == {b.address for b in three}, by_verifier.keys()
    assert all(len(rs) >= 2 for rs in by_verifier.values()), {a: len(rs) for a, rs in by_verifier.items()}
    for a, b in zip(alone, spread):
        assert b.text.encode() == a.text.encode() and list(b.token_ids) == list(a.token_ids)
        assert b.completion_tokens == 48
    # each verifier reached the draft service of its own board (speculation ran there)
    for addr, rs in by_verifier.items():
        assert all(r.spec_enabled for r in rs)
        assert sum(r.stats.proposals for r in rs) > 0, f"{addr} never consulted its draft service"


def test_dns_name_picks_up_an_added_verifier_and_drops_a_removed_one(model, boards):
    port = boards[0].vport
    answers = [boards[0].ip, boards[1].ip]
    asked: list[tuple[str, int]] = []

    def fake_resolver(host: str, p: int) -> list[str]:   # test double for getaddrinfo
        asked.append((host, p))
        return [f"{ip}:{p}" for ip in answers]

    c = Coordinator(model, [f"dns:///verifiers.fleet.test:{port}"], poll_s=0.1, resolve_s=0.2,
                    resolver=fake_resolver)
    try:
        assert asked[0] == ("verifiers.fleet.test", port)
        assert set(c.info()) == {boards[0].address, boards[1].address}
        answers.append(boards[3].ip)        # a fourth board joins the Service
        c.wait_for(lambda i: boards[3].address in i and i[boards[3].address].healthy,
                   "the added verifier to be healthy")
        with ThreadPoolExecutor(6) as ex:
            rs = list(ex.map(lambda p: _complete(c.stub, p, 16), PROMPTS[:6]))
        assert boards[3].address in {r.verifier for r in rs}
        answers.remove(boards[0].ip)        # and the first one leaves it
        c.wait_for(lambda i: set(i) == {boards[1].address, boards[3].address},
                   "the removed verifier to leave")
        rs = [_complete(c.stub, p, 8) for p in PROMPTS[:4]]
        assert boards[0].address not in {r.verifier for r in rs}
    finally:
        c.close()


class _RequestLines(logging.Handler):
    """The coordinator's per-request log lines' fields."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.fields: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "request":
            self.fields.append(record.fields)


def _two_turn_chats(model: str, targets: list[str], slack: int, seed: int, n: int = 7):
    """n chats of two turns by token ids, every first turn, then every second turn in order.

    Turn 2's prompt is turn 1's prompt + its output + 8 new tokens. Returns, per chat,
    (turn 1 result, turn 2 result, turn 1 prompt length) and the request log lines' fields.
    """
    rng = random.Random(seed)
    firsts = [[rng.randrange(3, 320) for _ in range(40 + 3 * i)] for i in range(n)]
    lines = _RequestLines()
    clog = logging.getLogger("echospec.coordinator")
    level = clog.level
    clog.addHandler(lines)
    clog.setLevel(logging.INFO)
    c = Coordinator(model, targets, prefix_route_slack=slack)
    try:
        def turn(ids):
            return c.stub.Complete(cpb.CompleteRequest(token_ids=ids, max_tokens=24, spec=ON),
                                   timeout=60).result
        ones = [turn(p) for p in firsts]
        twos = [turn(p + list(r.token_ids) + [rng.randrange(3, 320) for _ in range(8)])
                for p, r in zip(firsts, ones)]
    finally:
        c.close()
        clog.removeHandler(lines)
        clog.setLevel(level)
    return [(a, b, len(p)) for a, b, p in zip(ones, twos, firsts)], lines.fields


def test_second_chat_turn_goes_to_its_prefix_holder_and_reuses_turn_one(model, boards):
    targets = [boards[0].address, boards[1].address]
    # least loaded only: equal verifiers take turns, so second turns mostly land elsewhere
    off, _ = _two_turn_chats(model, targets, slack=-1, seed=1)
    off_hits = sum(t2.verifier == t1.verifier for t1, t2, _ in off)
    on, fields = _two_turn_chats(model, targets, slack=2, seed=2)
    on_hits = sum(t2.verifier == t1.verifier for t1, t2, _ in on)
    print(f"second turns on the prefix holder: least loaded {off_hits}/{len(off)}, "
          f"prefix-aware {on_hits}/{len(on)}")
    assert off_hits < len(off)
    assert {t1.verifier for t1, _, _ in on} == set(targets)
    for t1, t2, n1 in on:
        assert t1.finish_reason == common_pb2.FINISH_REASON_LENGTH and t1.completion_tokens == 24
        assert t2.verifier == t1.verifier
        # the verifier's prefix cache keeps the KV of prompt + output less the last token
        # (never fed back): turn 2 reuses exactly that, no more, no less
        assert t2.stats.cached_prompt_tokens == n1 + t1.completion_tokens - 1
    # the request log says why: turn 1 had no prefix anywhere, turn 2 the predicted whole blocks
    assert len(fields) == 2 * len(on)
    for f in fields[:len(on)]:
        assert f["route"] == "least loaded"
    for f, (t1, _, n1) in zip(fields[len(on):], on):
        assert f["route"] == f"prefix {(n1 + 24 - 1) // 16 * 16} tokens", f
        assert f["cached_tokens"] == n1 + 24 - 1


def test_killed_verifier_moves_unstarted_resumes_started_and_returns_after_restart(model, boards):
    three = boards[:3]
    addrs = [b.address for b in three]
    victim = three[1]
    ns = _owned_namespace(victim.address, addrs)
    # poll_s 1: a health poll of the stopped process times out after 2 s, so the pool still
    # counts the victim healthy while the generations below are sent to it; no stall detection,
    # so the SIGKILL, not the freeze before it, is what moves them
    c = Coordinator(model, addrs, poll_s=1.0, stall_floor_s=0.0)
    try:
        # started generations: long ones on the victim (its namespace), each past its first message
        started = [c.stub.Generate(cpb.GenerateRequest(text=p, max_tokens=N_CTX - 64, spec=ON,
                                                       draft_namespace=ns), timeout=60)
                   for p in PROMPTS[:2]]
        for it in started:
            assert next(it).token_ids
        assert c.info()[victim.address].in_flight == 2
        os.kill(victim.verifier.pid, signal.SIGSTOP)
        try:
            # not started: sent to the (frozen) victim, no first token yet
            ex = ThreadPoolExecutor(3)
            pending = [ex.submit(_complete, c.stub, p, 24, ns) for p in PROMPTS[2:5]]
            c.wait_for(lambda i: i[victim.address].in_flight == 5, "3 more generations on the victim",
                       timeout_s=1.5)
        finally:
            os.kill(victim.verifier.pid, signal.SIGKILL)
            victim.verifier.wait(10)
        for it in started:   # resumed on another verifier: no error, the move in the result
            [result] = [m.result for m in it if m.HasField("result")]
            [move] = result.moves
            assert move.from_verifier == victim.address and move.to_verifier in addrs
            assert move.at_token >= 1 and result.verifier == move.to_verifier
        moved = [f.result(timeout=60) for f in pending]
        ex.shutdown()
        assert all(r.verifier in addrs and r.verifier != victim.address for r in moved)
        assert all(r.completion_tokens == 24 for r in moved)
        retries = c.server.servicer.metrics.v_retries.labels(verifier=victim.address)._value.get()
        assert retries == 3
        # new generations avoid the dead verifier, namespace or not
        info = c.info()
        assert not info[victim.address].healthy and info[victim.address].last_error
        with ThreadPoolExecutor(6) as ex2:
            rs = list(ex2.map(lambda i: _complete(c.stub, PROMPTS[i], 8, ns if i % 2 else ""),
                              range(6)))
        assert victim.address not in {r.verifier for r in rs}
        # restart: its health returns, and its namespace comes back to it
        victim.start_verifier()
        victim.wait()
        c.wait_for(lambda i: i[victim.address].healthy, "the restarted verifier to be healthy")
        # (a prompt no verifier holds a prefix of: a held prefix would outrank the namespace)
        r = _complete(c.stub, PROMPTS[6], 8, ns)
        assert r.verifier == victim.address
    finally:
        c.close()
