"""grpc.health.v1 probe used by the echospec containers' healthchecks.

The images carry no grpc_health_probe binary; this script asks the service's
own health endpoint with grpcio (already in the image) instead.

Usage:
    python healthcheck.py [HOST:PORT] [--service NAME] [--timeout SECONDS] [--http]

Arguments:
    HOST:PORT   target; default 127.0.0.1:$ECHOSPEC_PORT (the port the
                service in this container listens on)
    --service   health service name; default "" (the whole server)
    --timeout   deadline of the Check call in seconds (default 2.0)
    --http      probe the HTTP gateway's GET /health instead (200 when its coordinator is
                SERVING)

TLS: when ECHOSPEC_TLS_CERT is set (the container's own settings), the probe connects with TLS,
trusting ECHOSPEC_TLS_CA (else the certificate itself) and presenting ECHOSPEC_TLS_CERT /
ECHOSPEC_TLS_KEY as its client certificate (the internal ports demand one under mTLS). The
certificate must then name 127.0.0.1. Health needs no API key.

Exit status: 0 when the status is SERVING; 1 otherwise (NOT_SERVING while the
model loads and warms up, UNKNOWN, or the call failed), with one line on
stderr saying which.
"""
from __future__ import annotations

import argparse
import http.client
import os
import ssl
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 2.0) -> tuple[bool, str]:
    """Ask `target` for its grpc.health.v1 status.

    Returns:
        (serving, detail): serving is True only for SERVING; detail is the
        status name or the gRPC error code and message.
    """
    cert, key = os.environ.get("ECHOSPEC_TLS_CERT", ""), os.environ.get("ECHOSPEC_TLS_KEY", "")
    if cert:
        ca = os.environ.get("ECHOSPEC_TLS_CA", "") or cert
        read = lambda p: open(p, "rb").read()  # noqa: E731
        creds = grpc.ssl_channel_credentials(read(ca), read(key) if key else None, read(cert))
        channel = grpc.secure_channel(target, creds)
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, name


def check_http(target: str, timeout: float = 2.0) -> tuple[bool, str]:
    """GET /health of the gateway at `target` (HTTPS when ECHOSPEC_TLS_CERT is set)."""
    cert = os.environ.get("ECHOSPEC_TLS_CERT", "")
    ctx = None
    if cert:
        ctx = ssl.create_default_context(cafile=os.environ.get("ECHOSPEC_TLS_CA", "") or cert)
    url = f"{'https' if cert else 'http'}://{target}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as r:
            return r.status == 200, f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, str(e)
    except http.client.HTTPException as e:   # not HTTP at all (a gRPC port): BadStatusLine, ...
        return False, f"{url} does not answer HTTP ({type(e).__name__})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="grpc.health.v1 probe")
    ap.add_argument("target", nargs="?", default=None)
    ap.add_argument("--service", default="")
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--http", action="store_true", help="probe the HTTP gateway's /health")
    args = ap.parse_args(argv)
    target = args.target
    if target is None:
        port = os.environ.get("ECHOSPEC_PORT", "")
        if not port:
            print("healthcheck: no target given and ECHOSPEC_PORT is not set", file=sys.stderr)
            return 1
        target = f"127.0.0.1:{port}"
    ok, detail = (check_http(target, args.timeout) if args.http
                  else check(target, args.service, args.timeout))
    if not ok:
        print(f"healthcheck: {target} {detail}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
