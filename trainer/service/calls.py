"""The futures the tinker SDK polls, and the order each training client's calls run in.

- Every training call answers its POST at once with a request id; the work runs later and the SDK polls
  `/api/v1/retrieve_future`, which waits up to `service.poll_hold_s` for the result (the SDK re-polls without a
  pause), then answers 408 (the SDK polls again).
- A client's calls run in the order of their seq_id (the SDK submits without waiting for results, and posts the
  chunks of one call concurrently); all calls run one at a time on one worker thread, since every client shares
  the base model. Sampling calls are coroutines that run concurrently on the event loop instead.
- A call that raises is a result in the SDK's error format, `{"error", "category"}`: "user" for a refused call
  (the SDK raises RequestFailedError), "server" for anything else; it still takes its place in the client's order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, Response

from trainer.service.wire import Result, UserError

log = logging.getLogger("trainer.service")

PROTOBUF = "application/x-protobuf"


@dataclass
class Ordered:
    """One training client's place in line: the next seq_id to run."""

    next_seq: int = 1
    cond: asyncio.Condition = field(default_factory=asyncio.Condition)


def error(message: str, category: str = "user") -> Result:
    return Result({"error": message, "category": category})


def failure(exc: Exception, what: str) -> Result:
    """A call that raised, in the SDK's error format (it raises RequestFailedError); the service goes on."""
    if isinstance(exc, UserError):
        return error(str(exc))
    log.exception(what)
    return error(f"{type(exc).__name__}: {exc}", "server")


class Calls:
    def __init__(self, poll_hold_s: float):
        self.poll_hold_s = poll_hold_s
        self.futures: dict[str, asyncio.Future[Result]] = {}
        self.order: dict[str, Ordered] = {}  # training client -> its line
        self.request_ids = itertools.count()
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train")

    def line(self, model_id: str) -> None:
        """A new training client: its calls run in seq_id order from now on."""
        self.order.setdefault(model_id, Ordered())

    def _new_future(self) -> tuple[str, asyncio.Future[Result]]:
        request_id = f"req-{next(self.request_ids)}"
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self.futures[request_id] = future
        return request_id, future

    def submit(
        self, work: Callable[[], Result], model_id: str | None = None, seq_id: int | None = None
    ) -> str:
        """Queue `work` (in the client's seq_id order when given) and return its request id."""
        request_id, future = self._new_future()
        asyncio.get_running_loop().create_task(self._run(future, work, model_id, seq_id))
        return request_id

    async def _run(
        self,
        future: asyncio.Future[Result],
        work: Callable[[], Result],
        model_id: str | None,
        seq_id: int | None,
    ) -> None:
        line = self.order.get(model_id) if model_id is not None else None
        turn = seq_id if seq_id is not None else 0
        if line is not None:
            async with line.cond:
                await line.cond.wait_for(lambda: line.next_seq >= turn)
        try:
            result = await asyncio.get_running_loop().run_in_executor(self.worker, _guarded, work)
        finally:
            if line is not None:
                async with line.cond:
                    line.next_seq = max(line.next_seq, turn + 1)
                    line.cond.notify_all()
        future.set_result(result)

    def submit_async(self, work: Callable[[], Awaitable[Result]]) -> str:
        """Queue a coroutine (sampling: I/O bound, concurrent with training) and return its request id."""
        request_id, future = self._new_future()

        async def run() -> None:
            try:
                result = await work()
            except Exception as exc:
                result = failure(exc, "a sampling call failed")
            future.set_result(result)

        asyncio.get_running_loop().create_task(run())
        return request_id

    async def retrieve(self, request_id: str) -> Response:
        future = self.futures.get(request_id)
        if future is None:
            return JSONResponse({"detail": f"no request {request_id!r} here"}, status_code=404)
        try:
            result = await asyncio.wait_for(asyncio.shield(future), self.poll_hold_s)
        except TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"}, 408)
        self.futures.pop(request_id, None)
        if result.proto:
            assert isinstance(result.body, bytes)
            return Response(result.body, media_type=PROTOBUF)
        return JSONResponse(result.body)


def _guarded(work: Callable[[], Result]) -> Result:
    try:
        return work()
    except Exception as exc:
        return failure(exc, "a training call failed")
