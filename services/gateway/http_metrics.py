"""The gateway's own Prometheus metrics: its HTTP requests, recorded by an ASGI middleware.

    echospec_http_requests_total{route,code}         finished HTTP requests by route and status
    echospec_http_request_duration_seconds{route}    from the request's arrival to its response's
                                                     last byte (a stream: the whole stream)
    echospec_http_requests_in_flight{route}          HTTP requests being answered now

``route`` is the route's template (``/v1/completions``, ``/v1/models/{model_id}``, ...) or
``other`` for a path the gateway has no route for, so a client cannot grow the label set. A 401
of the API key check counts too; a connection refused or timed out before its request reached the
app (conn.py's 503 and 408) does not. The names do not meet the services' (``echospec_rpc_*``,
the coordinator's request metrics: services/common/metrics.py): this is another registry, served
on the gateway's own metrics port.
"""
from __future__ import annotations

import time

from echospec.services.common.metrics import BUCKETS_S

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")


def route_of(path: str) -> str:
    """The route label of a request path."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model_id}"
    return "other"


class HttpMetrics:
    """The gateway's metrics, in a registry of their own (``registry``)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry()
        self.requests = Counter("echospec_http_requests_total",
                                "Finished HTTP requests by route and status code",
                                ["route", "code"], registry=r)
        self.duration = Histogram("echospec_http_request_duration_seconds",
                                  "HTTP request wall time to the response's last byte, seconds",
                                  ["route"], buckets=BUCKETS_S, registry=r)
        self.in_flight = Gauge("echospec_http_requests_in_flight",
                               "HTTP requests being answered", ["route"], registry=r)


class MetricsMiddleware:
    """Plain ASGI (like app.ApiKeyMiddleware: ``receive`` is left alone, so a stream still sees
    its client's disconnect): records each HTTP request in ``metrics``. The status is the one the
    response started with; a request that ended without starting one counts as 500."""

    def __init__(self, app, metrics: HttpMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        m = self.metrics
        route = route_of(scope["path"])
        status = [500]
        t0 = time.perf_counter()

        async def send_and_see(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        m.in_flight.labels(route=route).inc()
        try:
            await self.app(scope, receive, send_and_see)
        finally:
            m.in_flight.labels(route=route).dec()
            m.duration.labels(route=route).observe(time.perf_counter() - t0)
            m.requests.labels(route=route, code=str(status[0])).inc()
