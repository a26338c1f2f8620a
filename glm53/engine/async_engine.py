"""An `Engine` stepping in a thread of its own, for asyncio clients (the OpenAI-compatible server).

The engine is single-threaded: only the engine thread touches it. Clients hand it commands (add a
request, abort one) through a queue; the thread applies them between steps, steps while anything is
unfinished, and hands each request's tokens to its client's asyncio queue (`loop.call_soon_threadsafe`).
A request added while others run joins the next step's batch (continuous batching). A client whose
connection goes away aborts its request (`abort`), which frees its blocks at the next step boundary.

    engine = AsyncEngine(Engine(model, deploy)).start()
    handle = await engine.add(prompt_ids, params, salt="user-1")     # ValueError: bad request
    async for tok, finished in handle: ...                           # tokens as the engine samples them
    await engine.abort(handle.req_id)                                # the client went away
    engine.shutdown()                                                # abort what runs, stop the thread
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import AsyncIterator

from glm53.engine.engine import Engine
from glm53.engine.request import RequestOutput, SamplingParams


class RequestHandle:
    """One request's token stream: iterate for (token, finished); it ends after the finishing token, or
    early (without one) when the engine aborted the request."""

    def __init__(self, req_id: str, queue: asyncio.Queue):
        self.req_id = req_id
        self._queue = queue
        self.aborted = False

    def __aiter__(self) -> AsyncIterator[tuple[int, bool]]:
        return self._tokens()

    async def _tokens(self):
        while True:
            item = await self._queue.get()
            if item is None:
                self.aborted = True
                return
            yield item
            if item[1]:
                return


class AsyncEngine:
    """`engine` driven by a background thread (see the module docstring). `idle_wait_s`: how long the
    thread sleeps when nothing is queued or running (a new command wakes it at once)."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    # ---------------------------------------------------------------------------------- client side
    async def add(self, prompt_ids, params: SamplingParams, *, salt: str = "", kv_peer: str | None = None,
                  kv_lease: int = 0) -> RequestHandle:
        """Queue a request (validated by `Engine.add_request` in the engine thread) -> its handle, whose
        iteration gives its tokens. Raises what add_request raises (ValueError for a bad request)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", prompt_ids, params, (salt, kv_peer, kv_lease), loop, queue, fut))
        return RequestHandle(await asyncio.wrap_future(fut), queue)

    async def abort(self, req_id: str) -> None:
        """End `req_id` if it is still running (a no-op once it finished); returns once applied."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("abort", req_id, fut))
        await asyncio.wrap_future(fut)

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (Engine.reset_prefix_cache), between steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("reset", fut))
        await asyncio.wrap_future(fut)

    def abort_nowait(self, req_id: str) -> None:
        """Queue an abort of `req_id` without waiting for it (from a cancelled task's cleanup); a no-op
        once the engine stopped or the request finished."""
        if not self._stop and self.error is None:
            self._cmds.append(("abort", req_id, None))
            self._wake.set()

    def output(self, req_id: str) -> RequestOutput:
        """A finished request's record (read after its stream ended)."""
        return self.engine.output(req_id)

    def finished_request(self, req_id: str):
        return self.engine.finished[req_id]

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort every live request (their streams end), stop the thread, shut the engine down (tiers,
        event sockets). Idempotent."""
        if self._thread.is_alive():
            self._submit(("stop",))
            self._thread.join(timeout_s)
        self.engine.shutdown()

    def _submit(self, cmd) -> None:
        if self._stop or (self.error is not None):
            raise RuntimeError(f"the engine is stopped{f': {self.error!r}' if self.error else ''}")
        self._cmds.append(cmd)
        self._wake.set()

    # ---------------------------------------------------------------------------------- engine side
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                while self._cmds:
                    cmd = self._cmds.popleft()
                    if cmd[0] == "stop":
                        self._stop = True
                        for rid in list(eng.requests):
                            eng.abort_request(rid)
                            self._end(rid, None)
                        self._fail_pending(RuntimeError("the engine is shutting down"))
                        return
                    self._apply(cmd)
                if eng.has_unfinished():
                    for rid, tok, fin in eng.step():
                        self._send(rid, (tok, fin))
                        if fin:
                            self._end(rid)
                else:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - reported to every client instead of dying silently
            self.error = e
            self._stop = True
            with self._lock:
                streams = list(self._streams.items())
                self._streams.clear()
            for _, (loop, queue) in streams:
                loop.call_soon_threadsafe(queue.put_nowait, None)
            self._fail_pending(e)

    def _apply(self, cmd) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, prompt_ids, params, (salt, kv_peer, kv_lease), loop, queue, fut = cmd
            try:
                rid = eng.add_request(prompt_ids, params, salt=salt, kv_peer=kv_peer, kv_lease=kv_lease)
            except Exception as e:  # noqa: BLE001 - the client's bad request, raised in its own task
                fut.set_exception(e)
                return
            with self._lock:
                self._streams[rid] = (loop, queue)
            fut.set_result(rid)
        elif cmd[0] == "reset":
            eng.reset_prefix_cache()
            cmd[1].set_result(None)
        elif cmd[0] == "abort":
            _, rid, fut = cmd
            if rid in eng.requests:
                eng.abort_request(rid)
                self._end(rid, None)
            if fut is not None:
                fut.set_result(None)

    def _send(self, rid: str, item) -> None:
        with self._lock:
            entry = self._streams.get(rid)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _end(self, rid: str, final=()) -> None:
        """Drop rid's stream; final None tells its client it was aborted."""
        with self._lock:
            entry = self._streams.pop(rid, None)
        if entry is not None and final is None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, None)

    def _fail_pending(self, e: BaseException) -> None:
        while self._cmds:
            cmd = self._cmds.popleft()
            fut = cmd[-1] if len(cmd) > 1 else None
            if isinstance(fut, concurrent.futures.Future) and not fut.done():
                fut.set_exception(e)
