"""Ports for servers a test starts itself, outside the kernel's ephemeral range.

A port found free by binding port 0 comes from the ephemeral range, from which the kernel also
takes the local port of every outgoing connection and of every service that binds port 0. Between
the test finding it and its server binding it, any of those may take it, and the server then
fails with "address in use". A port below the range (or above it) is never handed out that way,
so only another program that asks for that very port can take it."""
from __future__ import annotations

import random
import socket

_LOWEST = 10000     # below this live many well-known services' ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports it picks for port 0 and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999   # Linux's default


def _candidates() -> list[int]:
    lo, hi = ephemeral_range()
    ports = list(range(_LOWEST, lo)) if lo - _LOWEST >= 1000 else list(range(hi + 1, 65536))
    random.shuffle(ports)
    return ports


def _bindable(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False


def unused_ports(n: int = 1, ips: tuple[str, ...] = ("127.0.0.1",)) -> list[int]:
    """n distinct ports outside the ephemeral range that can be bound on every address of ips
    now (nothing listens there)."""
    out: list[int] = []
    for p in _candidates():
        if all(_bindable(ip, p) for ip in ips):
            out.append(p)
            if len(out) == n:
                return out
    raise RuntimeError(f"fewer than {n} unused ports outside the ephemeral range")


def unused_port(ip: str = "127.0.0.1") -> int:
    return unused_ports(1, (ip,))[0]
