"""The coordinator calls behind one HTTP request's choices: ``n`` per prompt, one prompt or a list
of them (openai_api.Parsed: choice ``index = prompt_i * n + j``).

Order of the calls: a prompt's choices one after another, different prompts at once. A finished
generation leaves its session, whose KV holds the prompt, in the verifier's prefix cache, so each
choice after the first starts from the previous one's session (``cached_prompt_tokens`` in its
stats: the prompt but its last token) instead of prefilling the prompt again. Measured against
the alternatives (SmolLM2-135M on a 2-core host, a 219-token prompt, n = 4, 16 and 96 tokens
each): running the choices all at once, or choice 0 and then the rest at once, reused the prompt
for at most one choice (a session is kept only once its generation has finished) and was as fast
or slower: the prompt's prefills then compete with the decoding for the same cores. A greedy
request's choices are all the same text (greedy decoding is deterministic, with or without
speculation): it is generated once and given as each of the prompt's n choices. At most ``limit``
generations of one request run at once (the gateway's n_limit): the rest wait for a slot, so a
long list of prompts does not take every verifier session.

No HTTP here: errors come out as upstream.UpstreamError, the first one of any choice; with a
list of prompts its ``prompt_index`` says whose call failed.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib

from echospec_client.limits import MAX_REQUEST_ID
from echospec.v1 import coordinator_pb2
from echospec.services.gateway import openai_api as api
from echospec.services.gateway.upstream import Upstream, UpstreamError


# messages of one choice's stream read from the coordinator but not yet by the HTTP client: a
# slow client's output waits in gRPC's flow control, not in this process's memory
BUFFERED = 64


def choice_request_id(rid: str, index: int, count: int) -> str:
    """The x-request-id of choice ``index`` of ``count``: ``rid`` itself for a single choice,
    else ``rid.<index>`` (``rid`` shortened to keep it within MAX_REQUEST_ID)."""
    if count == 1:
        return rid
    tail = f".{index}"
    return rid[:MAX_REQUEST_ID - len(tail)] + tail


async def complete_all(up: Upstream, parsed: api.Parsed, rid: str, authorization: str | None,
                       limit: int) -> list[coordinator_pb2.GenerationResult]:
    """Every choice's result, in index order (Complete calls, in the module docstring's order).

    Raises:
        UpstreamError: the first failed call; the others are cancelled.
    """
    n, count = parsed.n, parsed.choices
    slots = asyncio.Semaphore(limit)
    results: list[coordinator_pb2.GenerationResult | None] = [None] * count

    async def one(index: int) -> None:
        async with slots:
            req = api.complete_request(parsed.choice_request(index))
            with _naming_the_prompt(parsed, index):
                results[index] = await up.complete(req, choice_request_id(rid, index, count),
                                                   authorization)

    async def prompt(i: int) -> None:
        await one(i * n)
        for j in range(1, n):   # each from the previous one's session in the prefix cache
            if parsed.greedy:
                results[i * n + j] = results[i * n]
            else:
                await one(i * n + j)

    try:
        async with asyncio.TaskGroup() as tg:
            for i in range(len(parsed.requests)):
                tg.create_task(prompt(i))
    except BaseExceptionGroup as group:
        raise _first(group) from None
    return results   # type: ignore[return-value]


@contextlib.contextmanager
def _naming_the_prompt(parsed: api.Parsed, index: int):
    """An UpstreamError of choice ``index``'s call, with its prompt's index in a list of them."""
    try:
        yield
    except UpstreamError as exc:
        if len(parsed.requests) > 1:
            exc.prompt_index = index // parsed.n
        raise


def _first(group: BaseExceptionGroup) -> BaseException:
    """The error to report of a TaskGroup's: an UpstreamError when there is one."""
    flat = []
    stack = [group]
    while stack:
        g = stack.pop()
        for e in g.exceptions:
            (stack.append(e) if isinstance(e, BaseExceptionGroup) else flat.append(e))
    return next((e for e in flat if isinstance(e, UpstreamError)), flat[0])


class ChoiceStreams:
    """Every choice's Generate stream merged into one: iterate for ``(index, GenerateResponse)``
    in arrival order (each choice's own messages in their order); a greedy prompt's one stream
    is given once per choice index. The first failure of any choice is raised by the next
    ``__anext__`` (UpstreamError); ``cancel()`` ends every call. ``first()`` is the first item
    once the first choice of every prompt that starts at once has its first message, so a prompt
    of a list refused by the coordinator (too long, ...) is an error before any output, not one
    mid-stream. Each call's stream is read at most BUFFERED messages ahead of the reader. Create
    it inside the event loop that iterates it."""

    _END = object()

    def __init__(self, up: Upstream, parsed: api.Parsed, rid: str, authorization: str | None,
                 limit: int):
        self._up, self._parsed, self._rid, self._auth = up, parsed, rid, authorization
        self._slots = asyncio.Semaphore(limit)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._running = 0
        self._failed = False
        self._error: BaseException | None = None
        self._errored = asyncio.Event()
        self._opened = [asyncio.Event() for _ in parsed.requests]   # a prompt's first message
        self._limit = limit
        self._copies: collections.deque = collections.deque()
        for i in range(len(parsed.requests)):
            self._spawn(self._prompt(i))

    def _spawn(self, coro) -> None:
        self._running += 1
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._running -= 1
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            if self._error is None:
                self._error = exc
                self._errored.set()
            self._queue.put_nowait(exc)
        elif self._running == 0:
            self._queue.put_nowait(self._END)

    async def _pump(self, index: int, copies: int) -> None:
        """Choice ``index``'s stream into the queue, also as the next ``copies - 1`` indexes."""
        p = self._parsed
        async with self._slots:
            stream = self._up.generate(p.choice_request(index),
                                       choice_request_id(self._rid, index, p.choices), self._auth)
            room = asyncio.Semaphore(BUFFERED)   # released as the reader takes each message
            try:
                with _naming_the_prompt(p, index):
                    async for msg in stream:
                        await room.acquire()
                        self._queue.put_nowait((index, copies, msg, room))
                        self._opened[index // p.n].set()
            finally:
                stream.cancel()

    async def _prompt(self, i: int) -> None:
        n = self._parsed.n
        if self._parsed.greedy:
            await self._pump(i * n, n)
            return
        for j in range(n):   # each from the previous one's session in the prefix cache
            await self._pump(i * n + j, 1)

    async def first(self) -> tuple[int, coordinator_pb2.GenerateResponse]:
        """The first item, once every prompt that starts at once (the first ``limit``: the others
        wait for a slot) has its first message, or the first error."""
        async def all_opened() -> None:
            for e in self._opened[:self._limit]:
                await e.wait()

        opened = asyncio.ensure_future(all_opened())
        errored = asyncio.ensure_future(self._errored.wait())
        try:
            await asyncio.wait({opened, errored}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            opened.cancel()
            errored.cancel()
        if self._error is not None:
            self._failed = True
            self.cancel()
            raise self._error
        return await self.__anext__()

    def __aiter__(self) -> "ChoiceStreams":
        return self

    async def __anext__(self) -> tuple[int, coordinator_pb2.GenerateResponse]:
        if self._failed:
            raise StopAsyncIteration
        if self._copies:   # a greedy prompt's message, once more for its next choice
            return self._copies.popleft()
        item = await self._queue.get()
        if item is self._END:
            self._queue.put_nowait(item)
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._failed = True
            self.cancel()
            raise item
        index, copies, msg, room = item
        room.release()
        self._copies.extend((index + k, msg) for k in range(1, copies))
        return index, msg

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
