"""A stack stopped (SIGTERM, with a grace period) while calls are in flight.

Each test starts its own tiny-model stack in this process and stops it mid-generation. The gRPC
calls still running end with UNAVAILABLE saying which service stopped and why, the shutdown log
line counts them, the request log line counts only the tokens the client got, and a generation
that ends after the verifier closed gives its session back quietly. The HTTP gateway ends a
stream with an error event after its grace period, and answers 503 to one still waiting for its
first token. In process mode the children get SIGTERM in order and one deadline, then SIGKILL
(stand-in children, no model)."""
from __future__ import annotations

import pytest


# -- the gRPC services -----------------------------------------------------------------------------

def test_stop_ends_calls_in_flight_with_unavailable_saying_why(tiny_model, caplog):
    # was: UNAVAILABLE "Cancelling all calls" (grpcio's words) for every stream and Complete in
    # flight, and no log line saying what stopped or what became of the calls
    import logging
    import threading
    import time

    import grpc

    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc

    st = start_stack(tiny_model(n_ctx_train=8192), n_ctx=8192, n_threads=1)
    got, started = {}, threading.Barrier(3)
    try:
        with grpc.insecure_channel(st.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)

            def stream():
                try:
                    for i, _ in enumerate(stub.Generate(cpb.GenerateRequest(text="a b", max_tokens=8000),
                                                        timeout=60)):
                        if i == 0:
                            started.wait(30)
                    got["Generate"] = "finished"
                except grpc.RpcError as e:
                    got["Generate"] = (e.code(), e.details())

            def unary():
                started.wait(30)
                try:
                    stub.Complete(cpb.CompleteRequest(text="a b", max_tokens=8000), timeout=60)
                    got["Complete"] = "finished"
                except grpc.RpcError as e:
                    got["Complete"] = (e.code(), e.details())

            threads = [threading.Thread(target=f) for f in (stream, unary)]
            for t in threads:
                t.start()
            started.wait(30)
            time.sleep(0.2)   # the Complete is under way too
            port = int(st.target.rpartition(":")[2])
            with caplog.at_level(logging.INFO, logger="echospec.shutdown"):
                st.stop(0.3, "SIGTERM")
            for t in threads:
                t.join(30)
    finally:
        st.stop(0)
    for rpc in ("Generate", "Complete"):
        code, details = got[rpc]
        assert code == grpc.StatusCode.UNAVAILABLE, (rpc, got[rpc])
        assert details.startswith("the coordinator service is shutting down (SIGTERM); this call "
                                  "was still running when its 0.3 s grace period"), details
    lines = [r.getMessage() for r in caplog.records if r.name == "echospec.shutdown"]
    assert (f"coordinator service on port {port} stopped (SIGTERM): 2 call(s) were in flight; 0 "
            f"finished within the 0.3 s grace period, 2 cancelled with UNAVAILABLE (shutting down)"
            in lines), lines
    assert any(ln.startswith("verifier service on port ") and "stopped (SIGTERM)" in ln
               for ln in lines), lines


def test_stream_ended_by_shutdown_logs_the_tokens_the_client_got(tiny_model, caplog):
    # was: tokens_out counted each message before the shutdown check that then refused to send
    # it, so a stream still running at the end of the grace period logged more than it sent
    import logging
    import threading

    import grpc

    from echospec.stack import start_stack
    from echospec.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc

    st = start_stack(tiny_model(n_ctx_train=8192), n_ctx=8192, n_threads=1)
    received = 0
    try:
        with caplog.at_level(logging.INFO), grpc.insecure_channel(st.target) as ch:
            call = coordinator_pb2_grpc.CoordinatorServiceStub(ch).Generate(
                cpb.GenerateRequest(text="a b", max_tokens=8000), timeout=60,
                metadata=[("x-request-id", "shutdown-count")])
            stopper = None
            with pytest.raises(grpc.RpcError) as err:
                for msg in call:
                    received += len(msg.token_ids)
                    if stopper is None:
                        stopper = threading.Thread(target=st.stop, args=(0.3, "SIGTERM"))
                        stopper.start()
            stopper.join(30)
    finally:
        st.stop(0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    recs = [r for r in caplog.records if r.name == "echospec.coordinator" and r.getMessage() == "request"
            and r.fields.get("request_id") == "shutdown-count"]
    assert len(recs) == 1 and recs[0].fields["code"] == "UNAVAILABLE", [r.fields for r in recs]
    assert 0 < recs[0].fields["tokens_out"] == received < 8000, (recs[0].fields, received)


def test_a_generation_ending_after_the_verifier_closed_gives_its_session_back_quietly(tiny_model):
    # was (seen once in a stop with generations in flight): an EngineError "session is closed"
    # traceback from the generation's thread, which released its session after close()
    from echospec.services.common.config import VerifierConfig
    from echospec.services.verifier.sessions import VerifierCore

    core = VerifierCore(VerifierConfig(model=tiny_model(), n_ctx=64, n_threads=1))
    session, _ = core.acquire([1, 2, 3])
    core.close()
    core.release(session, [1, 2])   # no EngineError
    assert core.active_sessions == 0


# -- the HTTP gateway ------------------------------------------------------------------------------

def test_gateway_stop_ends_a_stream_with_an_error_event_after_the_grace(tiny_model, caplog):
    # was: SIGTERM cut HTTP streams off after uvicorn's own 2 s (no error event, no clean end of
    # the chunked body: curl exit 18) and logged "Cancel 1 running task(s)" with a traceback
    import json
    import logging
    import threading
    import time

    import httpx

    from echospec.stack import start_stack

    st = start_stack(tiny_model(n_ctx_train=8192), n_ctx=8192, n_threads=1, http_port=0)
    events = []
    try:
        with caplog.at_level(logging.INFO), httpx.Client(timeout=30) as c:
            with c.stream("POST", st.http_url + "/v1/completions",
                          json={"prompt": "a b", "max_tokens": 8000, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                events.append(next(line for line in lines if line))
                t0 = time.monotonic()
                stopper = threading.Thread(target=st.stop, args=(0.5, "SIGTERM"))
                stopper.start()
                events += [line for line in lines if line]   # raises if the body is cut off
                waited = time.monotonic() - t0
                stopper.join(30)
    finally:
        st.stop(0)
    assert 0.4 < waited < 3, waited
    last = events[-1]
    assert last.startswith("data: {"), events[-3:]
    err = json.loads(last[len("data: "):])["error"]
    assert err["code"] == "unavailable"
    assert err["message"].startswith("the gateway is shutting down (SIGTERM); this stream was still "
                                     "running when its 0.5 s grace period"), err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_gateway_stop_answers_503_to_a_stream_still_waiting_for_its_first_token(tiny_model, held_prefill):
    # a stream whose prefill outlasts the shutdown grace: no event was sent yet, so it gets the
    # HTTP 503 an unanswered request gets, not a 200 cut off
    import threading
    import time

    import httpx

    from echospec.stack import start_stack

    entered, release = held_prefill
    st = start_stack(tiny_model(), n_threads=1, http_port=0)
    answer = {}

    def post():
        try:
            answer["r"] = httpx.post(st.http_url + "/v1/completions", timeout=30,
                                     json={"prompt": "a b", "max_tokens": 8, "stream": True})
        except httpx.HTTPError as exc:
            answer["error"] = exc

    try:
        client = threading.Thread(target=post)
        client.start()
        assert entered.wait(30), "the prefill never started"
        t0 = time.monotonic()
        stopper = threading.Thread(target=st.stop, args=(0.5, "SIGTERM"))
        stopper.start()
        client.join(20)
        waited = time.monotonic() - t0
        release.set()
        stopper.join(30)
    finally:
        release.set()
        st.stop(0)
    r = answer.get("r")
    assert r is not None, answer
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"].startswith("the gateway is shutting down (SIGTERM)"), r.text
    assert 0.4 < waited < 10, waited


# -- process mode: the stop of the child processes -------------------------------------------------

# A stand-in for a service child (no model: these tests take about a second). It notes in a file
# when it is up, gets SIGTERM and exits; "slow" takes 0.3 s to exit, "hung" ignores SIGTERM.
_CHILD = r"""
import os, signal, sys, time
name, log, mode = sys.argv[1:4]
def note(what):
    with open(log, "a") as f:
        f.write(f"{name} {what}\n")
def term(*_):
    note("term")
    if mode == "slow":
        time.sleep(0.3)
    note("exit")
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "hung" else term)
note("up")
while True:
    time.sleep(1)
"""


def _fake_stack(tmp_path, modes: dict):
    """A process-mode Stack whose children are _CHILD, each up (its SIGTERM handler set)."""
    import os
    import sys
    import time

    from echospec.stack import Stack

    log = tmp_path / "children.log"
    log.write_text("")
    st = Stack("127.0.0.1", 0, 0, 0, processes=True)
    for name, mode in modes.items():
        st._launch[name] = ([sys.executable, "-c", _CHILD, name, str(log), mode], dict(os.environ))
        st._spawn(name)
    deadline = time.monotonic() + 20
    while sum(ln.endswith(" up") for ln in log.read_text().splitlines()) < len(modes):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    return st, log


def test_process_stop_signals_each_child_once_the_one_before_it_has_exited(tmp_path):
    # the gateway's and the coordinator's calls in flight keep the services below them during
    # their grace: SIGTERM goes to the next child only when the one before it has exited
    st, log = _fake_stack(tmp_path, {n: "slow" for n in ("draft", "verifier", "coordinator", "gateway")})
    procs = dict(st._procs)
    st.stop(5, "SIGTERM")
    events = [ln for ln in log.read_text().splitlines() if not ln.endswith(" up")]
    assert events == [f"{n} {what}" for n in ("gateway", "coordinator", "verifier", "draft")
                      for what in ("term", "exit")], events
    assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}
    assert not st._procs


def test_process_stop_kills_hung_children_at_one_shared_deadline_and_wakes_stopped_ones(
        tmp_path, capfd, monkeypatch):
    # was: `kill -STOP` on the draft and verifier children, then SIGTERM to `echospec serve`:
    # stop() waited grace + 10 s on each child in turn (SIGTERM does not wake a stopped process)
    # before SIGKILL, and the serve process took about 27 s to exit, without a word
    import os
    import re
    import signal
    import time

    from echospec import stack

    monkeypatch.setattr(stack, "EXIT_AFTER_GRACE_S", 0.2)
    st, log = _fake_stack(tmp_path, {"draft": "stopped", "verifier": "stopped",
                                     "coordinator": "hung", "gateway": "hung"})
    procs = dict(st._procs)
    for name in ("draft", "verifier"):
        os.kill(procs[name].pid, signal.SIGSTOP)
    capfd.readouterr()
    t0 = time.monotonic()
    st.stop(0.3, "SIGTERM", slack_s=1.5)
    took = time.monotonic() - t0
    assert 1.7 < took < 3.5, took   # one deadline, 0.3 + 1.5 s, for all four children
    codes = {n: p.returncode for n, p in procs.items()}
    # the hung ones are killed; the stopped ones, woken by SIGCONT, exit on their SIGTERM
    assert codes == {"gateway": -9, "coordinator": -9, "verifier": 0, "draft": 0}, codes
    events = [ln for ln in log.read_text().splitlines() if not ln.endswith(" up")]
    assert events == ["verifier term", "verifier exit", "draft term", "draft exit"], events
    notes = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("echospec: ")]
    assert len(notes) == 1, notes
    assert re.fullmatch(
        rf"echospec: still waiting for the gateway service \(pid {procs['gateway'].pid}, SIGTERM "
        rf"0\.\d s ago\), the coordinator service \(pid {procs['coordinator'].pid}, SIGTERM "
        r"0\.\d s ago\) to exit; SIGKILL to every child still running in 1\.\d s", notes[0]), notes


def test_process_stop_cut_short_is_finished_by_the_next_stop(tmp_path, monkeypatch):
    # `echospec serve` stops the stack when a child dies; a SIGTERM then raises in the middle of
    # that stop, and its `finally` stops again: the children not yet reaped are still there, and
    # the one already signalled gets no second SIGTERM (a service takes it as the end of its grace)
    from echospec import stack

    class Cut(BaseException):
        pass

    terminate = stack._terminate

    def cut_after_the_first(p):
        terminate(p)
        monkeypatch.setattr(stack, "_terminate", terminate)
        raise Cut()

    st, log = _fake_stack(tmp_path, {n: "slow" for n in ("draft", "verifier", "coordinator", "gateway")})
    procs = dict(st._procs)
    monkeypatch.setattr(stack, "_terminate", cut_after_the_first)
    try:
        st.stop(5, "SIGTERM")
    except Cut:
        pass
    assert set(st._procs) == {"gateway", "coordinator", "verifier", "draft"}
    st.stop(5, "SIGTERM")
    assert not st._procs
    assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}
    events = [ln for ln in log.read_text().splitlines() if not ln.endswith(" up")]
    assert events == [f"{n} {what}" for n in ("gateway", "coordinator", "verifier", "draft")
                      for what in ("term", "exit")], events
