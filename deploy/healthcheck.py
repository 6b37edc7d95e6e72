"""grpc.health.v1 probe used by the echospec containers' healthchecks.

The images carry no grpc_health_probe binary; this script asks the service's
own health endpoint with grpcio (already in the image) instead.

Usage:
    python healthcheck.py [HOST:PORT] [--service NAME] [--timeout SECONDS]

Arguments:
    HOST:PORT   target; default 127.0.0.1:$ECHOSPEC_PORT (the port the
                service in this container listens on)
    --service   health service name; default "" (the whole server)
    --timeout   deadline of the Check call in seconds (default 2.0)

Exit status: 0 when the status is SERVING; 1 otherwise (NOT_SERVING while the
model loads and warms up, UNKNOWN, or the call failed), with one line on
stderr saying which.
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(target: str, service: str = "", timeout: float = 2.0) -> tuple[bool, str]:
    """Ask `target` for its grpc.health.v1 status.

    Returns:
        (serving, detail): serving is True only for SERVING; detail is the
        status name or the gRPC error code and message.
    """
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="grpc.health.v1 probe")
    ap.add_argument("target", nargs="?", default=None)
    ap.add_argument("--service", default="")
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args(argv)
    target = args.target
    if target is None:
        port = os.environ.get("ECHOSPEC_PORT", "")
        if not port:
            print("healthcheck: no target given and ECHOSPEC_PORT is not set", file=sys.stderr)
            return 1
        target = f"127.0.0.1:{port}"
    ok, detail = check(target, args.service, args.timeout)
    if not ok:
        print(f"healthcheck: {target} {detail}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
