"""Dynamic batching: concurrent requests for one model version and RPC become one model call.

One :class:`Batcher` per (model version, RPC, replica). Its settings (serving/config.py
``BatchSettings``): a batch closes when it holds ``max_batch_size`` samples or its first request has
waited ``max_delay_ms``; at most ``max_queue`` requests wait, beyond that ``submit`` raises Overloaded
at once. Every request gets exactly one result or one error:

- a request whose deadline passed before its batch ran gets DeadlineExpired and is not executed;
- a cancelled request (client gone) is dropped from the queue and frees its place;
- a failure of the model call fails only the requests of that batch (ExecutionFailed), unless it
  left the device unusable (a CUDA error poisons the process): then the batch gets DeviceLost
  (UNAVAILABLE) and ``on_fatal`` takes the server down for a restart.

The model call is pipelined in two steps (serving/engine/runner.py): ``launch`` puts a batch on the device
and queues its work without waiting for it; ``finish`` waits for that work and reads the outcome.
While batch k runs on the GPU, batch k+1 is merged and launched behind it: up to ``PIPELINE_DEPTH``
batches are in flight. Each step runs on its own thread (an executor) where it blocks, else inline
on the event loop, which saves a thread hop per step: on CUDA, launching only queues work (inline)
and finishing waits for the GPU (a thread); on the CPU, launching is the computation (a thread) and
finishing has nothing to wait for (inline). Where the runner can say whether a batch is done without
waiting (``ready``), the loop first polls it for up to ``SPIN_S`` (yielding to other work between
polls): most batches end within that, and are answered without a thread hop.

Requests are validated before they get here; one whose ids fail the device check gets its own
error from ``finish`` and never fails its batch-mates.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Set

from serving.config import BatchSettings
from serving.errors import DeadlineExpired, DeviceLost, ExecutionFailed, Overloaded

log = logging.getLogger("serving.engine.batcher")
PIPELINE_DEPTH = 2
SPIN_S = 0.002  # how long a finished-yet? poll may keep the event loop spinning before a thread waits


@dataclass
class Work:
    """One validated request waiting for its batch."""

    inputs: Any  # serving.engine.assemble.Request: the request's arrays and where its result goes
    batch_size: int
    deadline: Optional[float]  # time.monotonic() by which it must have started, or None
    ids: int = 0  # ids it puts into its batch's KJT (shared bags once per sample)
    future: asyncio.Future = field(default=None)  # type: ignore[assignment]
    enqueued: float = field(default_factory=time.monotonic)
    started: float = 0.0
    finished: float = 0.0  # when its batch's outputs were written


# launch(works) -> a handle, on the launch thread; finish(handle) -> one None (the result is in the
# request's output) or the request's own Exception per work, in order, on the finish thread.
Launch = Callable[[List[Work]], Any]
Finish = Callable[[Any], List[Optional[Exception]]]
OnBatch = Callable[[List[Work], List[Optional[Exception]], float], None]


class Batcher:
    def __init__(self, label: str, settings: BatchSettings, launch: Launch, finish: Finish,
                 launcher: Optional[Executor], finisher: Optional[Executor],
                 on_batch: OnBatch = lambda works, results, seconds: None,
                 is_fatal: Callable[[BaseException], bool] = lambda exc: False,
                 on_fatal: Callable[[], None] = lambda: None,
                 ready: Optional[Callable[[Any], bool]] = None) -> None:
        self.label = label
        self.settings = settings
        self.launch = launch
        self.finish = finish
        self._launcher = launcher
        self._finisher = finisher
        self._ready = ready
        self._on_batch = on_batch
        self._is_fatal = is_fatal
        self._on_fatal = on_fatal
        self._queue: Deque[Work] = deque()
        self._wakeup = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self._closed = False
        self._running = 0
        self._completing: Set[asyncio.Task] = set()

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def load(self) -> int:
        """Queued requests plus the batches being executed: what a new request would wait behind."""
        return len(self._queue) + self._running

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher {self.label}")

    async def submit(self, work: Work) -> Any:
        if self._closed:
            raise Overloaded(f"{self.label} is unloading; retry")
        if len(self._queue) >= self.settings.max_queue:
            raise Overloaded(f"{self.label}: queue full ({self.settings.max_queue} requests waiting); retry with backoff")
        work.future = asyncio.get_running_loop().create_future()
        self._queue.append(work)
        self._wakeup.set()
        try:
            return await asyncio.shield(work.future)
        except asyncio.CancelledError:
            if work.started:
                # Its batch is running and writes this request's output: the caller may reuse that
                # memory only once the batch is done.
                await asyncio.wait([work.future])
            else:  # still queued: free the place now
                work.future.cancel()
                try:
                    self._queue.remove(work)
                except ValueError:
                    pass
            raise

    async def close(self) -> None:
        """Finish what is queued, then stop."""
        self._closed = True
        self._wakeup.set()
        if self._task:
            await self._task
        while self._completing:
            await asyncio.gather(*self._completing)

    def fail_queued(self, error: Exception) -> None:
        """Answer every waiting request with ``error`` (the server is going down)."""
        self._closed = True
        while self._queue:
            work = self._queue.popleft()
            if not work.future.done():
                work.future.set_exception(error)
        self._wakeup.set()

    def _take_batch(self) -> List[Work]:
        batch, samples, ids, now = [], 0, 0, time.monotonic()
        while self._queue:
            work = self._queue[0]
            if work.future.done():  # cancelled while waiting
                self._queue.popleft()
                continue
            if batch and (samples + work.batch_size > self.settings.max_batch_size
                          or ids + work.ids > self.settings.max_ids_per_request):
                break
            self._queue.popleft()
            if work.deadline is not None and now > work.deadline:
                work.future.set_exception(DeadlineExpired("deadline passed while queued; not executed"))
                continue
            batch.append(work)
            samples += work.batch_size
            ids += work.ids
        return batch

    def _queued_samples(self) -> int:
        return sum(w.batch_size for w in self._queue)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(PIPELINE_DEPTH)
        while True:
            if not self._queue:
                if self._closed:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            close_at = self._queue[0].enqueued + self.settings.max_delay_ms / 1000.0
            while (not self._closed and self._queued_samples() < self.settings.max_batch_size
                   and time.monotonic() < close_at):
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout=max(0.0, close_at - time.monotonic()))
                except asyncio.TimeoutError:
                    break
            await slots.acquire()  # a place in the pipeline first: requests keep queueing (and batching) meanwhile
            batch = self._take_batch()
            if not batch:
                slots.release()
                continue
            started = time.monotonic()
            for work in batch:
                work.started = started
            self._running += 1
            try:
                handle = (self.launch(batch) if self._launcher is None
                          else await loop.run_in_executor(self._launcher, self.launch, batch))
            except Exception as exc:  # noqa: BLE001 - fails this batch only, unless the device is gone
                self._running -= 1
                slots.release()
                self._fail(batch, exc)
                continue
            task = loop.create_task(self._complete(batch, handle, started, slots))
            self._completing.add(task)
            task.add_done_callback(self._completing.discard)

    async def _complete(self, batch: List[Work], handle: Any, started: float, slots: asyncio.Semaphore) -> None:
        try:
            if self._ready is not None:  # a short batch: poll, and save two thread hops
                spin_until = time.monotonic() + SPIN_S
                while not self._ready(handle) and time.monotonic() < spin_until:
                    await asyncio.sleep(0)
            results = (self.finish(handle) if self._finisher is None or (self._ready and self._ready(handle))
                       else await asyncio.get_running_loop().run_in_executor(self._finisher, self.finish, handle))
        except Exception as exc:  # noqa: BLE001 - fails this batch only, unless the device is gone
            self._fail(batch, exc)
            return
        finally:
            self._running -= 1
            slots.release()
        finished = time.monotonic()
        self._on_batch(batch, results, finished - started)
        for work, error in zip(batch, results):
            work.finished = finished
            if work.future.done():
                continue
            if error is not None:  # this request's own error (e.g. an id check)
                work.future.set_exception(error)
            else:
                work.future.set_result(None)

    def _fail(self, batch: List[Work], exc: Exception) -> None:
        fatal = self._is_fatal(exc)
        log.log(logging.CRITICAL if fatal else logging.ERROR, "%s: model call failed for a batch of %d "
                "request(s)%s", self.label, len(batch), "; the device is unusable" if fatal else "", exc_info=exc)
        error = DeviceLost() if fatal \
            else ExecutionFailed("model execution failed")
        for work in batch:
            if not work.future.done():
                work.future.set_exception(error)
        if fatal:
            self._on_fatal()


class Router:
    """Replicas of one model version (one batcher per GPU): each request goes to the replica with
    the least work ahead of it (queued requests plus the batch running)."""

    def __init__(self, batchers: List[Batcher]) -> None:
        self.batchers = batchers

    @property
    def depth(self) -> int:
        return sum(b.depth for b in self.batchers)

    async def submit(self, work: Work) -> Any:
        return await min(self.batchers, key=lambda b: b.load).submit(work)

    def start(self) -> None:
        for b in self.batchers:
            b.start()

    async def close(self) -> None:
        for b in self.batchers:
            await b.close()

    def fail_queued(self, error: Exception) -> None:
        for b in self.batchers:
            b.fail_queued(error)
