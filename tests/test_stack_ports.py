"""The ports a stack is told to use stay its own while it starts.

The draft service and the verifier start first, on free ports the kernel picks (port 0). A port
given for a later service (the verifier, the coordinator, its /metrics, the gateway) is free
until that service binds it, so the kernel could hand it to a service started before; the later
one then failed with "cannot bind". The stack now holds the given ports with a bare socket until
their service starts, in both modes."""
from __future__ import annotations

import errno
import socket

import pytest


def _bind_error(host: str, port: int) -> int:
    """0 if (host, port) can be bound now as gRPC binds (SO_REUSEPORT), else the errno."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        s.bind((host, port))
        return 0
    except OSError as exc:
        return exc.errno
    finally:
        s.close()


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_held_port_cannot_be_bound_until_it_is_released():
    from echospec.stack import _PortHold

    a, b = _free(), _free()
    hold = _PortHold([("127.0.0.1", a), ("127.0.0.1", b), ("127.0.0.1", 0), ("127.0.0.1", -1)])
    try:
        assert hold.held() == sorted({a, b})
        assert _bind_error("127.0.0.1", a) == errno.EADDRINUSE
        hold.release(a)
        assert _bind_error("127.0.0.1", a) == 0
        assert _bind_error("127.0.0.1", b) == errno.EADDRINUSE
    finally:
        hold.close()
    assert hold.held() == []
    assert _bind_error("127.0.0.1", b) == 0


def test_a_port_another_program_has_is_left_alone():
    from echospec.stack import _PortHold

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        hold = _PortHold([("127.0.0.1", taken)])
        assert hold.held() == []
        hold.close()


def test_the_coordinator_and_gateway_ports_are_held_while_the_services_before_them_start(
        tiny_model, monkeypatch):
    from echospec.services.draft import server as dserver
    from echospec.services.verifier import server as vserver
    from echospec.stack import start_stack

    port, http = _free(), _free()
    seen = {}
    real_d, real_v = dserver.start, vserver.start

    def draft_start(cfg, *a, **kw):
        seen["draft"] = (_bind_error("127.0.0.1", port), _bind_error("127.0.0.1", http))
        return real_d(cfg, *a, **kw)

    def verifier_start(cfg, *a, **kw):
        seen["verifier"] = (_bind_error("127.0.0.1", port), _bind_error("127.0.0.1", http))
        return real_v(cfg, *a, **kw)

    monkeypatch.setattr(dserver, "start", draft_start)
    monkeypatch.setattr(vserver, "start", verifier_start)
    st = start_stack(tiny_model(), port=port, http_port=http, n_threads=1, n_ctx=128)
    try:
        assert st.coordinator_port == port and st.http_port == http
        assert seen == {"draft": (errno.EADDRINUSE, errno.EADDRINUSE),
                        "verifier": (errno.EADDRINUSE, errno.EADDRINUSE)}
    finally:
        st.stop(0)
    assert _bind_error("127.0.0.1", port) == 0


def test_a_stack_told_a_taken_port_fails_saying_so_and_frees_the_rest(tiny_model):
    from echospec.stack import StackError, start_stack

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        http = _free()
        with pytest.raises(StackError, match="coordinator"):
            start_stack(tiny_model(), port=taken, http_port=http, n_threads=1, n_ctx=128)
    assert _bind_error("127.0.0.1", http) == 0


def test_in_process_mode_the_free_ports_picked_for_the_children_avoid_the_given_ones(
        tiny_model, monkeypatch):
    # no child is started: the stack stops at the first spawn, after every port was picked
    from echospec import stack as stackmod

    port, http = _free(), _free()
    picks, spawned = [], []
    real_free = stackmod._free_port

    def free_port(host):
        picks.append((_bind_error("127.0.0.1", port), _bind_error("127.0.0.1", http)))
        return real_free(host)

    def spawn(self, name):
        spawned.append(name)
        raise stackmod.StackError(f"{name}: not started in this test")

    monkeypatch.setattr(stackmod, "_free_port", free_port)
    monkeypatch.setattr(stackmod.Stack, "_spawn", spawn)
    with pytest.raises(stackmod.StackError, match="not started"):
        stackmod.start_stack(tiny_model(), port=port, http_port=http, processes=True)
    assert spawned == ["draft"]
    assert len(picks) >= 2   # the draft service's and the verifier's
    assert set(picks) == {(errno.EADDRINUSE, errno.EADDRINUSE)}
    assert _bind_error("127.0.0.1", port) == 0 and _bind_error("127.0.0.1", http) == 0


def test_a_given_verifier_port_is_held_while_the_draft_service_starts(tiny_model, monkeypatch):
    from echospec.services.draft import server as dserver
    from echospec.stack import start_stack

    vport = _free()
    seen = []
    real_d = dserver.start

    def draft_start(cfg, *a, **kw):
        seen.append(_bind_error("127.0.0.1", vport))
        return real_d(cfg, *a, **kw)

    monkeypatch.setattr(dserver, "start", draft_start)
    st = start_stack(tiny_model(), verifier_port=vport, n_threads=1, n_ctx=128)
    try:
        assert st.verifier_port == vport
        assert seen == [errno.EADDRINUSE]
    finally:
        st.stop(0)


def test_the_tests_own_ports_are_outside_the_kernels_ephemeral_range(monkeypatch):
    # the ports the tests pick for servers they start (tests/ports.py): never one the kernel
    # hands out for port 0 or an outgoing connection meanwhile, and never one in use
    import ports as ports_mod

    lo, hi = ports_mod.ephemeral_range()
    ports = ports_mod.unused_ports(20) + [ports_mod.unused_port()]
    assert len(set(ports[:20])) == 20
    assert all(not lo <= p <= hi and p >= 1024 for p in ports)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))
        taken.listen()
        monkeypatch.setattr(ports_mod, "_candidates", lambda: [ports[0], ports[1]])
        assert ports_mod.unused_ports(1) == [ports[1]]
        with pytest.raises(RuntimeError, match="fewer than 2"):
            ports_mod.unused_ports(2)
