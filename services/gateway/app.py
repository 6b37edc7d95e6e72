"""The gateway's HTTP routes (FastAPI): OpenAI's /v1/chat/completions, /v1/completions and
/v1/models, plus /health. Requests are checked and shaped by openai_api.py; the coordinator is
called through upstream.py, one call per choice (choices.py: n choices of each prompt). A
request naming another model than the one served gets 404 model_not_found (OpenAI's), unless
config.allow_any_model; one without ``model`` is taken. Each HTTP request is recorded in the
gateway's own metrics when it has them (http_metrics.py).

    POST /v1/chat/completions, /v1/completions   JSON, or server-sent events when "stream": true
    GET  /v1/models                              the one model served
    GET  /v1/models/{id}                         that model's object (404 for any other id)
    GET  /health                                 the coordinator's grpc.health.v1 status (no key)

Errors have OpenAI's shape with matching HTTP codes (openai_api.error_from_status): a bad field 400,
a missing or wrong API key 401, overload (no free verifier session, the RPC cap) 429, the
coordinator unreachable 503, its deadline (request_timeout_s) 504. A stream answers with its HTTP
status once the coordinator's first message (or error) is in (every prompt's, with a list of
them: choices.ChoiceStreams.first), so a refused request gets its error
code, not a 200 with an error event; an error after that is sent as one ``data: {"error": ...}``
event and the stream ends. On shutdown (SIGINT/SIGTERM, GatewayServer.stop) requests in flight get
the grace period (config.grace_s) to finish; a stream still running then gets one error event naming
the shutdown and ends cleanly, an answer still awaited gets 503 (the same wording as the gRPC
services' UNAVAILABLE). A client that disconnects (before a stream's first message, mid-stream, or
while it waits for a whole answer) cancels the gRPC call at once, which ends the generation on the
verifier (its prefill too) and frees its session; one that disconnects while still sending its
request body is only logged (INFO): there is nothing to call and no one to answer.
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.exceptions import HTTPException as StarletteHTTPException

from echospec_client.limits import MAX_REQUEST_ID
from echospec.services.common import auth
from echospec.services.common.config import GatewayConfig
from echospec.services.text.clip import json_value
from echospec.services.gateway import choices
from echospec.services.gateway import openai_api as api
from echospec.services.gateway.http_metrics import HttpMetrics, MetricsMiddleware
from echospec.services.gateway.upstream import Upstream, UpstreamError

log = logging.getLogger("echospec.gateway")


def _json(obj: dict) -> str:
    # raw UTF-8, not \u escapes: what a client sees of each character is its own bytes
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _event(obj: dict) -> bytes:
    return f"data: {_json(obj)}\n\n".encode("utf-8")


def _error_response(err: api.ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _model_object(model: str) -> dict:
    """The one model served, as OpenAI's model object."""
    return {"id": model, "object": "model", "created": 0, "owned_by": "echospec"}


def model_not_found(asked: str, served: str) -> api.ApiError:
    """OpenAI's 404 for a model it does not have, naming the one served."""
    return api.ApiError(404, f"the model {json_value(asked)} is not served here (this server "
                             f"serves {json_value(served)}, as GET /v1/models lists)", "model",
                        type_="invalid_request_error", code="model_not_found")


def _request_id(request: Request) -> str:
    """The client's ``x-request-id`` header when gRPC metadata can carry it (up to MAX_REQUEST_ID
    printable ASCII characters: a UTF-8 header reaches here as Latin-1 text, printable but not ASCII),
    else a new id."""
    rid = request.headers.get("x-request-id", "")
    return rid if 0 < len(rid) <= MAX_REQUEST_ID and rid.isascii() and rid.isprintable() \
        else uuid.uuid4().hex[:16]


class Shutdown:
    """The gateway's shutdown signal. ``begin(reason)`` (any thread, a signal handler included)
    starts the grace period; ``over()`` returns when it has ended, for the requests still running.
    Created inside the app's event loop (the lifespan)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.reason = ""
        self._loop = asyncio.get_running_loop()
        self._started = asyncio.Event()

    def begin(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason or "stopped"
        self._loop.call_soon_threadsafe(self._started.set)

    async def over(self) -> None:
        await self._started.wait()
        await asyncio.sleep(self.grace_s)

    def error(self, what: str) -> api.ApiError:
        return api.error_from_status(
            "UNAVAILABLE", f"the gateway is shutting down ({self.reason}); this {what} was still "
                           f"running when its {self.grace_s:g} s grace period for requests in "
                           f"flight ended and was cancelled")


class ApiKeyMiddleware:
    """401 in OpenAI's shape for every HTTP request but GET /health without ``Authorization:
    Bearer <api_key>`` (no check when api_key is ""). Plain ASGI: it leaves ``receive`` alone, so a
    streaming response still sees the client's disconnect."""

    def __init__(self, app, api_key: str, tenants=None):
        self.app = app
        self.api_key = api_key
        self.tenants = tenants   # a tenants.Tenants: its keys are taken too (None: api_key alone)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not (self.api_key or self.tenants) \
                or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        header = Headers(scope=scope).get("authorization")
        if self.api_key and auth.authorized(header, self.api_key):
            return await self.app(scope, receive, send)
        if self.tenants is not None and self.tenants.tenant_of(header) is not None:
            return await self.app(scope, receive, send)
        why = "no API key" if header is None else "wrong API key"
        resp = _error_response(api.ApiError(401, f"{why}: send the header `Authorization: Bearer "
                                                 f"<key>`", None, "invalid_request_error",
                                            "invalid_api_key"))
        await resp(scope, receive, send)


def create_app(config: GatewayConfig, metrics: HttpMetrics | None = None) -> FastAPI:
    """The gateway's ASGI app; its lifespan opens and closes the channel to the coordinator.
    ``metrics``: where its HTTP requests are recorded (http_metrics.py; None: nowhere)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.upstream = Upstream(config)
        app.state.shutdown = Shutdown(config.grace_s)
        try:
            yield
        finally:
            await app.state.upstream.close()

    app = FastAPI(title="echospec gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(api.ApiError)
    async def _api_error(request: Request, exc: api.ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(api.ApiError(exc.status_code, str(exc.detail), None, kind))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        # a bug, not the client's fault: still OpenAI's shape (the traceback goes to the log)
        return _error_response(api.ApiError(500, f"internal error in the gateway: "
                                                 f"{type(exc).__name__}", None, "server_error"))

    tenants = None
    if config.api_keys_file:
        from echospec.services.common.tenants import Tenants
        tenants = Tenants.load(config.api_keys_file)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, tenants=tenants)
    if metrics is not None:   # added last: the outermost, so a 401 of the key check counts too
        app.add_middleware(MetricsMiddleware, metrics=metrics)

    def upstream(request: Request) -> Upstream:
        return request.app.state.upstream

    def too_large() -> api.ApiError:
        # the request as sent is refused, like the 400s the gateway and the coordinator give
        # (INVALID_ARGUMENT): the same code, not a retryable one
        return api.ApiError(413, f"request body larger than {config.max_body_bytes} bytes",
                            code="invalid_argument")

    async def body_of(request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
            raise too_large()
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            raise too_large()
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise api.bad(f"the request body is not valid JSON: {exc}") from None
        except ValueError:   # Python's limit on the digits of an int it converts
            raise api.bad(f"the request body holds an integer of more than "
                          f"{sys.get_int_max_str_digits()} digits") from None

    def _client_key(request: Request) -> str | None:
        """With tenants, the client's own ``authorization``, sent on to the coordinator, which
        scopes the namespace to its tenant (None: the gateway's api_key is sent)."""
        return request.headers.get("authorization") if config.api_keys_file else None

    async def generation(request: Request, chat: bool) -> Response:
        up = upstream(request)
        try:
            body = await body_of(request)
        except ClientDisconnect:
            log.info("client disconnected while sending its request body: nothing to answer")
            return Response(status_code=499)
        try:
            parsed = api.parse_request(body, chat, config.n_limit)
        except api.MaxTokensBelowOne as exc:
            limit = await up.max_tokens_limit(_client_key(request))
            raise exc if limit is None else exc.with_limit(limit) from None
        rid = _request_id(request)
        key = _client_key(request)
        shutdown = request.app.state.shutdown
        gone = _disconnected(request)
        try:
            model = await up.model_id(key)
            if parsed.model is not None and parsed.model != model and not config.allow_any_model:
                raise model_not_found(parsed.model, model)
            if not parsed.stream:
                try:
                    results = await _unless_disconnected(
                        choices.complete_all(up, parsed, rid, key, config.n_limit), gone,
                        shutdown)
                finally:
                    gone.cancel()
                if results is _GONE:   # nobody to answer
                    return Response(status_code=499)
                seeds = [parsed.choice_seed(i % parsed.n) for i in range(parsed.choices)]
                return JSONResponse(api.responses(chat, api.new_id(chat), model, results, seeds,
                                                  parsed.n, parsed.request.logprobs))
            stream = choices.ChoiceStreams(up, parsed, rid, key, config.n_limit)
            try:
                # errors before any output keep their HTTP code; a client that leaves during the
                # prefill cancels it now, not when the first token comes out
                first = await _unless_disconnected(stream.first(), gone, shutdown)
            except BaseException:
                stream.cancel()
                raise
            if first is _GONE:
                stream.cancel()
                return Response(status_code=499)
        except BaseException as exc:
            gone.cancel()
            if isinstance(exc, UpstreamError):
                raise api.error_from_status(exc.code, exc.message, chat, parsed.max_tokens_name,
                                            exc.prompt_index) from None
            raise
        return _EventStream(_sse(parsed, stream, first, api.new_id(chat), model, shutdown, gone),
                            media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation(request, chat=False)

    async def served_model(request: Request) -> str:
        try:
            return await upstream(request).model_id(_client_key(request))
        except UpstreamError as exc:
            raise api.error_from_status(exc.code, exc.message) from None

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_object(await served_model(request))]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        served = await served_model(request)
        if model_id != served:
            raise model_not_found(model_id, served)
        return JSONResponse(_model_object(served))

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        status = await upstream(request).health()
        return JSONResponse({"status": status}, status_code=200 if status == "SERVING" else 503)

    return app


_GONE = object()   # _unless_disconnected: the client disconnected first


def _disconnected(request: Request) -> asyncio.Future:
    """A task that ends when the client disconnects. Started once the body has been read, so the
    only message left to receive is ``http.disconnect``; the caller cancels it when done."""
    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return asyncio.ensure_future(watch())


async def _unless_disconnected(call, gone: asyncio.Future, shutdown: Shutdown):
    """Await ``call`` (a coordinator call, or a stream's first message), or cancel it when the
    client disconnects first (``gone``, from _disconnected, ends): a unary call is cancelled with
    it, a stream's caller cancels its call. Returns its result, or _GONE when the client went away
    (logged). Raises the shutdown's 503 when the gateway's grace period ends first."""
    task = asyncio.ensure_future(call)
    stop = asyncio.ensure_future(shutdown.over())
    try:
        done, _ = await asyncio.wait({task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
    if gone in done:
        log.info("client disconnected: generation cancelled")
        return _GONE
    if task in done:
        return task.result()
    raise shutdown.error("request")


class _EventStream(StreamingResponse):
    """A StreamingResponse without Starlette's own disconnect listener (ASGI spec < 2.4), which
    would cancel the body generator from outside: _sse watches the disconnect itself, so it can
    say so and end the gRPC call the same way whatever the server's spec version."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.stream_response(send)
        except OSError:   # the connection is gone (servers of spec 2.4 raise it from send)
            pass
        finally:
            await self.body_iterator.aclose()


async def _sse(parsed: api.Parsed, stream: choices.ChoiceStreams, first, rid: str,
               model: str, shutdown: Shutdown, gone: asyncio.Future) -> AsyncIterator[bytes]:
    """The SSE body of a streamed generation. Each coordinator message's text delta (never a split
    UTF-8 character) becomes one chunk of its choice (``index``); a choice's result, its closing
    chunk; after every choice's, the usage chunk when asked for, and ``data: [DONE]``. The gRPC
    calls are cancelled when this generator ends for any reason; the client's disconnect
    (``gone``, from _disconnected, ends) ends them at once, even while the next message is awaited.
    When the gateway's shutdown grace period ends first, one error event naming the shutdown ends
    the stream."""
    chat = parsed.chat
    created = int(time.time())
    stop = asyncio.ensure_future(shutdown.over())
    nxt = None
    try:
        if chat:
            for index in range(parsed.choices):
                yield _event(api.chunk(chat, rid, created, model, "", role=True, index=index))
        results: list = [None] * parsed.choices
        want_lps = parsed.request.logprobs
        offsets = [api.TextOffsets() for _ in range(parsed.choices)] if want_lps and not chat else []
        item = first
        while item is not None:
            index, msg = item
            if msg.text or (want_lps and msg.logprobs):
                lps = None
                if want_lps:
                    lps = api.chat_logprobs(msg.logprobs) if chat else \
                        api.completion_logprobs(msg.logprobs, offsets[index])
                yield _event(api.chunk(chat, rid, created, model, msg.text, index=index,
                                       logprobs=lps))
            if msg.HasField("result"):
                results[index] = msg.result
                if chat:
                    for c in api.tool_call_chunks(rid, created, model, msg.result, index):
                        yield _event(c)
                yield _event(api.chunk(chat, rid, created, model, None, result=msg.result,
                                       seed=parsed.choice_seed(index % parsed.n), index=index))
            nxt = asyncio.ensure_future(anext(stream, None))
            await asyncio.wait({nxt, stop, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                log.info("client disconnected: generation cancelled")
                return
            if not nxt.done():
                nxt.cancel()
                log.info("stream %s cancelled: %s", rid, shutdown.error("stream").message)
                yield _event(shutdown.error("stream").body())
                return
            item = nxt.result()
        if any(r is None for r in results):
            raise UpstreamError("INTERNAL", "the coordinator's stream ended without a result")
        if parsed.include_usage:
            yield _event(api.usage_chunk(chat, rid, created, model, results, parsed.n))
        yield b"data: [DONE]\n\n"
    except UpstreamError as exc:
        log.info("stream %s ended by the coordinator: %s", rid, exc)
        yield _event(api.error_from_status(exc.code, exc.message).body())
    finally:
        stop.cancel()
        gone.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
        stream.cancel()
