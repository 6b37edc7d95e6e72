"""The coordinator's Prometheus export counts what the responses report."""
from __future__ import annotations

import re
import sys
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ggufgen import write_tiny_model  # noqa: E402

from echospec.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc
from echospec.stack import start_stack


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def test_metrics_match_the_reported_stats(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_model(model, arch="llama", n_vocab=320, seed=2)
    st = start_stack(str(model), n_ctx=256, n_threads=1, metrics_port=0)
    try:
        port = st._servers["coordinator"].metrics_port
        assert port > 0
        with grpc.insecure_channel(st.target) as ch:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(ch)
            results = [stub.Complete(cpb.CompleteRequest(text="a b a b a b a", max_tokens=24, k=4,
                                                         spec=common_pb2.SPEC_MODE_ON, prediction=pred),
                                     timeout=60).result
                       for pred in ("", " b a b a b a b a b a b")]
            results.append(stub.Complete(cpb.CompleteRequest(text="x y", max_tokens=5,
                                                             spec=common_pb2.SPEC_MODE_OFF), timeout=60).result)
        m = scrape(port)
        for field, name in (("tries", "tries"), ("hits", "hits"), ("kv_rolls", "kv_rolls"),
                            ("draft_tokens", "draft_tokens"), ("rounds", "rounds")):
            assert m[f"echospec_spec_{name}_total"] == sum(getattr(r.stats, field) for r in results), name
        assert m["echospec_generated_tokens_total"] == sum(r.completion_tokens for r in results)
        per: dict[tuple[str, str], int] = {}
        for r in results:
            for x in r.stats.sources:
                for name in ("draft_tokens", "hits", "tries"):
                    per[(x.source, name)] = per.get((x.source, name), 0) + getattr(x, name)
        assert per, "no draft source reported"
        for (source, name), v in per.items():
            assert m[f'echospec_spec_source_{name}_total{{source="{source}"}}'] == v, (source, name)
        assert sum(v for (_, name), v in per.items() if name == "hits") == sum(r.stats.hits for r in results)
        gens = sum(v for k, v in m.items() if k.startswith("echospec_generations_total{"))
        assert gens == 3
        assert any('spec="off"' in k for k in m if k.startswith("echospec_generations_total{"))
    finally:
        st.stop()


def _non_loopback_address() -> str:
    """An address of this machine that is not loopback ("" when it has none): the source address
    of a route out (a UDP connect sends nothing)."""
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))   # TEST-NET-1: never answers, only picks a route
            addr = s.getsockname()[0]
        except OSError:
            return ""
    return "" if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_metrics_listen_on_loopback_when_the_service_binds_every_interface():
    """/metrics answers without the API key, so it binds metrics_host (loopback by default)
    whatever `host` says: from another address of the machine it is refused while the gRPC
    port answers there."""
    import socket

    from echospec.services.common.config import DraftConfig
    from echospec.services.draft import server as dserver

    handle, _ = dserver.start(DraftConfig(host="0.0.0.0", port=0, metrics_port=0))
    try:
        assert handle.metrics_http.server_address[0] == "127.0.0.1"
        assert "echospec_rpc_in_flight" in urllib.request.urlopen(
            f"http://127.0.0.1:{handle.metrics_port}/metrics", timeout=10).read().decode()
        other = _non_loopback_address()
        if other:
            socket.create_connection((other, handle.port), timeout=5).close()
            try:
                socket.create_connection((other, handle.metrics_port), timeout=5).close()
                reached = True
            except OSError:
                reached = False
            assert not reached, f"/metrics answered on {other}"
    finally:
        handle.stop(0).wait()


def test_metrics_host_moves_metrics_elsewhere():
    from echospec.services.common.config import DraftConfig, load
    from echospec.services.draft import server as dserver

    cfg = load(DraftConfig, ["--port", "0", "--metrics-port", "0", "--metrics-host", "0.0.0.0"],
               environ={})
    assert cfg.host == "127.0.0.1"
    handle, _ = dserver.start(cfg)
    try:
        assert handle.metrics_http.server_address[0] == "0.0.0.0"
    finally:
        handle.stop(0).wait()


def test_serve_metrics_host_defaults_to_loopback_whatever_host_says():
    """`echospec serve --metrics-host` (the coordinator's setting, which echospec.stack hands to
    the verifier and the draft service) is loopback unless given, even with --host 0.0.0.0."""
    import argparse

    from echospec.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--host", "0.0.0.0"])
    assert serve.configs_of(args).coordinator.metrics_host == "127.0.0.1"
    args = parser.parse_args(["serve", "--metrics-host", "10.1.2.3"])
    assert serve.configs_of(args).coordinator.metrics_host == "10.1.2.3"
