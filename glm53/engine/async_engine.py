"""An `Engine` stepping in a thread of its own, for asyncio clients (the OpenAI-compatible server).

The engine is single-threaded: only the engine thread touches it. Clients hand it commands (add a
request, abort one, reset the prefix cache) through a queue; the thread applies them between steps,
steps while anything is unfinished, and hands each request's tokens to its client's asyncio queue
(`loop.call_soon_threadsafe`). A request added while others run joins the next step's batch
(continuous batching). A client whose connection goes away aborts its request, which frees its blocks at
the next step boundary.

    engine = AsyncEngine(Engine(model, deploy)).start()
    handle = await engine.add(prompt_ids, params, salt="user-1", text=TextStream(tok, ["\\n\\n"]))
    async for token, text, finished in handle: ...     # tokens as the engine samples them, and their text
    handle.ended                                       # how it ended: finish_reason, counts, error
    engine.abort_nowait(handle.req_id)                 # the client went away
    engine.shutdown()                                  # abort what runs, stop the thread

No request can stop the thread. A request is validated when it is added (`Engine.add_request`; the
error is raised in the client's task). An exception while a step schedules or executes fails the
requests it touched (`glm53.engine.engine.StepError`: each ends with finish_reason "error" and the
exception in `Ended.error`) and the thread steps on. While the last `MAX_CONSECUTIVE_STEP_FAILURES` steps
all failed the engine reports itself unhealthy (`healthy`: the server's /health answers 503) but keeps
serving, and one step that succeeds makes it healthy again: a step that keeps failing whatever it runs
(device memory lost, say) is worth a probe's attention, yet a restart would lose what still works. Only
an error the engine cannot repair (a failed step that left its state inconsistent) stops the thread:
then `error` is set, /health stays 503 and every request ends with "error".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable

from glm53.engine.engine import Engine, StepError
from glm53.engine.request import SamplingParams

# failed steps in a row from which the engine reports itself unhealthy (a step that keeps failing whatever
# it runs, e.g. device memory lost, rather than one bad batch) until a step succeeds
MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclasses.dataclass(frozen=True)
class Ended:
    """How a request ended (the last item of its stream). finish_reason: "length" | "stop" | "abort" |
    "error"; num_output_tokens: tokens it generated (after a stop, those up to the stop); num_cached_tokens:
    prompt tokens its admission found in a cache; text: what its TextStream still held (its flush), "" without
    one; error: why its step failed (finish_reason "error"), else None."""

    finish_reason: str
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    text: str = ""
    error: str | None = None


# put on a handle's queue by `RequestHandle.end_now`: the client's side ends the stream itself
_END_NOW = object()


class RequestHandle:
    """One request's stream: iterate for (token, text, finished), text being what its TextStream released
    with that token ("" without one). Iteration ends after the finishing token, or without one when the
    request was aborted or failed; `ended` is set by then (before the finishing token is yielded)."""

    def __init__(self, req_id: str, queue: asyncio.Queue):
        self.req_id = req_id
        self._queue = queue
        self.ended: Ended | None = None
        self.num_tokens = 0  # tokens taken from the queue so far

    def __aiter__(self) -> AsyncIterator[tuple[int, str, bool]]:
        return self._tokens()

    def end_now(self) -> None:
        """End this stream from the client's event loop, without the engine thread (which may be inside a
        long step, a compilation say): after the tokens already queued, iteration ends with Ended("abort")
        counting them. The caller aborts the request in the engine too (`AsyncEngine.abort_nowait`);
        whatever the engine sends later is not read. Call it on the handle's event loop."""
        self._queue.put_nowait(_END_NOW)

    async def _tokens(self):
        while self.ended is None:
            item = await self._queue.get()
            if item is _END_NOW:
                self.ended = Ended("abort", self.num_tokens)
                return
            if isinstance(item, Ended):
                self.ended = item
                return
            self.num_tokens += 1
            if item[2]:  # the finishing token: its Ended follows at once (the same engine-thread pass)
                nxt = await self._queue.get()
                self.ended = nxt if isinstance(nxt, Ended) else Ended("abort", self.num_tokens)
            yield item


class AsyncEngine:
    """`engine` driven by a background thread (see the module docstring). `idle_wait_s`: how long the
    thread sleeps when nothing is queued or running (a new command wakes it at once)."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._cmds: collections.deque = collections.deque()
        # "add" commands queued (written under _lock) and taken by the thread (written by it alone): one
        # writer each, so neither loses an update, and the thread takes commands without the lock
        self._adds_queued = self._adds_taken = 0
        # held while a command is queued and while the thread stops taking them, so no command is queued
        # after the thread drained the queue for the last time (its client would wait forever)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # req_id -> (client loop, client queue, its TextStream or None)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, object]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did
        self.consecutive_failures = 0  # failed steps since the last step that succeeded
        self.failed_steps = 0  # failed steps in all
        self.last_failure: BaseException | None = None  # the exception of the latest failed step

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    @property
    def healthy(self) -> bool:
        """Serving, and not MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row since the last that
        succeeded."""
        return self.error is None and not self._stop and self.consecutive_failures < MAX_CONSECUTIVE_STEP_FAILURES

    @property
    def num_waiting(self) -> int:
        """Requests queued by `add` and not scheduled to run yet (adds the thread has not taken, and every
        replica's waiting queue), as of now: read from another thread (the server's
        --max-waiting-requests) while the engine thread runs, since a deque's length is one atomic read
        and a long step has taken the requests it runs off the queue when it began. An add the thread
        took and has not put in a queue yet (microseconds) is not counted: never one counted twice."""
        queued = self._adds_queued - self._adds_taken
        return queued + sum(len(rep.scheduler.waiting) for rep in self.engine.replicas)

    @property
    def unhealthy_reason(self) -> str | None:
        """Why `healthy` is False (None while it is True)."""
        if self.error is not None:
            return f"the engine stopped: {self.error!r}"
        if self._stop:
            return "the engine is shutting down"
        if self.consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            return f"the last {self.consecutive_failures} steps failed; the last: {self.last_failure!r}"
        return None

    # ---------------------------------------------------------------------------------- client side
    def add(self, prompt_ids, params: SamplingParams, *, salt: str = "", kv_peer: str | None = None,
            kv_lease: int = 0, kv_remote=None, kv_produce: bool = False, text=None,
            prefill_after: str | None = None) -> Awaitable[RequestHandle]:
        """Queue a request (validated by `Engine.add_request` in the engine thread) -> an awaitable of its
        handle. It is queued (and counted in `num_waiting`) when this returns, before anything is awaited:
        a caller's count of the requests it let in can hand over to `num_waiting` with no moment counted
        twice. Call it on the event loop the handle is read on. text: a glm53.tokenizer.TextStream for its
        output (its stop strings end the request in the engine, and its text travels with the tokens); it
        is the engine thread's from now on. prefill_after: a sibling with the same prompt (n > 1;
        `Engine.add_request`). Raises RuntimeError once the engine stopped; the awaitable raises what
        add_request raises (ValueError for a bad request)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", prompt_ids, params, (salt, kv_peer, kv_lease, kv_remote, kv_produce, prefill_after), text,
                      loop, queue, fut))

        async def handle() -> RequestHandle:
            return RequestHandle(await asyncio.wrap_future(fut), queue)

        return handle()

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
        with contextlib.suppress(RuntimeError):
            self._submit(("abort", req_id, None))

    def shutdown(self, timeout_s: float = 30.0, flush_s: float | None = None) -> bool:
        """Abort every live request (their streams end), stop the thread, shut the engine down (tiers,
        event sockets) -> whether it did. The thread stops between steps only: if it is still inside one
        (a compilation, say) after `timeout_s`, this returns False leaving the engine to it (a daemon
        thread: the process may exit meanwhile; its tiers are not flushed then). flush_s: a bound on the
        engine's own shutdown (the tiers' pending stores, a hung mount's included), run in a daemon thread;
        False if it is still running then (what it had not stored is lost, never half-written: chunks
        appear by rename or whole PUT). Idempotent."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # it stopped meanwhile
                self._submit(("stop",))
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
        if flush_s is None:
            self.engine.shutdown()
            return True
        flush = threading.Thread(target=self.engine.shutdown, name="glm53-engine-shutdown", daemon=True)
        flush.start()
        flush.join(flush_s)
        return not flush.is_alive()

    def _submit(self, cmd) -> None:
        with self._lock:
            if self._stop or (self.error is not None):
                raise RuntimeError(f"the engine is stopped{f': {self.error!r}' if self.error else ''}")
            self._cmds.append(cmd)
            self._adds_queued += cmd[0] == "add"
        self._wake.set()

    def _pop(self):
        """The next command (the engine thread's)."""
        cmd = self._cmds.popleft()
        self._adds_taken += cmd[0] == "add"
        return cmd

    # ---------------------------------------------------------------------------------- engine side
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                while self._cmds:
                    cmd = self._pop()
                    if cmd[0] == "stop":
                        for rid in list(eng.requests):
                            eng.abort_request(rid)
                            self._end(rid)
                        self._close(RuntimeError("the engine is shutting down"))
                        return
                    try:
                        self._apply(cmd)
                    except BaseException as e:  # the engine failed applying it: its client learns why
                        fut = cmd[-1]
                        if isinstance(fut, concurrent.futures.Future) and not fut.done():
                            fut.set_exception(e)
                        raise
                if eng.has_unfinished():
                    try:
                        out = eng.step()
                    except StepError as e:
                        self._deliver(e.tokens)
                        self._step_failed(e)
                    else:
                        self._deliver(out)
                        self.consecutive_failures = 0
                    for rid in eng.last_finished:  # those that ended without a token (a failed KV load)
                        self._end(rid)
                else:
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - reported to every client instead of dying silently
            self.error = e
            traceback.print_exception(e)
            for rid in list(self._streams):
                self._end(rid, Ended("error", error=f"the engine stopped: {e!r}"))
            self._close(e)

    def _close(self, e: BaseException) -> None:
        """Take no more commands, and fail the futures of those still queued with `e`."""
        with self._lock:
            self._stop = True
        self._fail_pending(e)

    def _step_failed(self, e: StepError) -> None:
        self.failed_steps += 1
        self.consecutive_failures += 1
        self.last_failure = e.error
        print(f"glm53 engine: a step failed ({len(e.failed)} request(s) finished with 'error'):", flush=True)
        traceback.print_exception(e.error)
        for rid in e.failed:
            self._end(rid)

    def _deliver(self, out) -> None:
        """Hand a step's tokens (and their text) to their clients; end the requests that finished."""
        for rid, tok, fin in out:
            entry = self._streams.get(rid)
            if entry is None:
                continue
            loop, queue, text = entry
            loop.call_soon_threadsafe(queue.put_nowait, (tok, text.take() if text is not None else "", fin))
            if fin:
                self._end(rid)

    def _apply(self, cmd) -> None:
        eng = self.engine
        if cmd[0] == "add":
            _, prompt_ids, params, (salt, kv_peer, kv_lease, kv_remote, kv_produce, after), text, loop, queue, fut = cmd
            try:
                rid = eng.add_request(prompt_ids, params, salt=salt, kv_peer=kv_peer, kv_lease=kv_lease,
                                      kv_remote=kv_remote, kv_produce=kv_produce,
                                      stop_check=text.add if text is not None else None, prefill_after=after)
            except Exception as e:  # noqa: BLE001 - the client's bad request, raised in its own task
                fut.set_exception(e)
                return
            self._streams[rid] = (loop, queue, text)
            fut.set_result(rid)
        elif cmd[0] == "reset":
            eng.reset_prefix_cache()
            cmd[1].set_result(None)
        elif cmd[0] == "abort":
            _, rid, fut = cmd
            if rid in eng.requests:
                eng.abort_request(rid)
                self._end(rid)
            if fut is not None:
                fut.set_result(None)

    def _end(self, rid: str, ended: Ended | None = None) -> None:
        """Send rid's Ended (by default: from its finished record) and drop its stream."""
        entry = self._streams.pop(rid, None)
        if entry is None:
            return
        loop, queue, text = entry
        if ended is None:
            req = self.engine.finished[rid]
            # an aborted or failed request's held-back text is not its output (nor is a failing stream flushed)
            flush = text is not None and req.finish_reason not in ("abort", "error")
            ended = Ended(req.finish_reason or "length", len(req.output_ids), req.num_cached_tokens,
                          text.flush() if flush else "", req.error)
        loop.call_soon_threadsafe(queue.put_nowait, ended)

    def _fail_pending(self, e: BaseException) -> None:
        while self._cmds:
            cmd = self._pop()
            fut = cmd[-1] if len(cmd) > 1 else None
            if isinstance(fut, concurrent.futures.Future) and not fut.done():
                fut.set_exception(e)
