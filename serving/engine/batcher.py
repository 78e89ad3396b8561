"""Dynamic batching: concurrent requests for one model version and RPC become one model call.

One :class:`Batcher` per (model version, RPC, replica). Its settings (serving/config.py
``BatchSettings``): a batch closes when it holds ``max_batch_size`` samples (or ``max_ids_per_request``
ids, or MAX_REQUESTS requests) or its first request has waited ``max_delay_ms``; at most
``max_queue`` requests wait, beyond that ``submit`` raises Overloaded at once (once the requests
whose deadline passed have left the queue, answered). Every request gets
exactly one answer (``answer(work, error)``, error None when its result is written):

- a request whose deadline passed before its batch ran gets DeadlineExpired and is not executed;
- a cancelled request (client gone) still queued is answered Cancelled at once and frees its place;
  one already in a batch is answered with the batch;
- a failure of the model call fails only the requests of that batch (ExecutionFailed), unless it
  left the device unusable (a CUDA error poisons the process): then the batch gets DeviceLost
  (UNAVAILABLE) and ``on_fatal`` takes the server down for a restart.

Nothing here waits or wakes anything unless asked: the engine's loop (serving/engine/core.py) calls
``pump``, which answers the batches the device has finished and launches the ones that are due, up
to ``PIPELINE_DEPTH`` in flight, so batch k+1 is staged while batch k computes; with the pipeline
full and nothing to launch, it calls ``wait_oldest`` (see ``saturated``). On CUDA launching
only queues work (inline); on the CPU launching is the computation, which runs on the replica's
worker thread (``executor``), one batch at a time, while the loop goes on.
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Tuple

from serving.config import BatchSettings
from serving.engine.assemble import MAX_REQUESTS
from serving.errors import Cancelled, DeadlineExpired, DeviceLost, ExecutionFailed, Overloaded, QueueFull, ServingError

log = logging.getLogger("serving.batcher")
PIPELINE_DEPTH = 2
# Block in a full pipeline's oldest batch only where batches take the device this long: a blocking
# wait wakes about 0.13 ms late (H200 machines), and the next launch must be queued before the batch
# the device has meanwhile ends; short batches (B=256: 0.33 ms) lost 5-9% of their rate.
BLOCK_MIN_BATCH_S = 0.0005
# A full queue is looked through for requests past their deadline at most this often: under overload
# every refused request would otherwise scan max_queue requests on the engine's thread.
EXPIRE_SCAN_INTERVAL_S = 0.001


@dataclass(eq=False)
class Work:
    """One validated request waiting for its batch."""

    inputs: Any  # serving.engine.assemble.Item: the request's block and where its result goes
    batch_size: int
    deadline: Optional[float]  # time.monotonic() by which it must have started, or None
    ids: int = 0  # ids it puts into its batch's KJT (shared bags once per sample)
    answer: Callable[["Work", Optional[ServingError]], None] = lambda work, error: None
    tag: Any = None  # the caller's (the engine: which front end, which request)
    owner: Optional["Batcher"] = None  # the batcher it was submitted to
    enqueued: float = field(default_factory=time.monotonic)
    started: float = 0.0
    finished: float = 0.0  # when its batch's outputs were written
    answered: bool = False

    def late(self, now: float) -> bool:
        """Its deadline has passed: it must not run."""
        return self.deadline is not None and now > self.deadline


# launch(works) -> a handle (on CUDA inline; on CPU on the executor); ready(handle) -> done without
# waiting?; finish(handle) waits for it.
Launch = Callable[[List[Work]], Any]
OnBatch = Callable[[List[Work], float, Any], None]  # (works, seconds, the launch's handle)


@dataclass
class _InFlight:
    works: List[Work]
    handle: Any  # the launch's handle, or a Future of it (CPU)
    started: float
    expired: List[Work] = field(default_factory=list)  # left out when the worker took it (CPU)


class Batcher:
    def __init__(self, label: str, settings: BatchSettings, launch: Launch, ready: Callable[[Any], bool],
                 finish: Callable[[Any], None], executor: Optional[Executor] = None,
                 on_batch: OnBatch = lambda works, seconds, handle: None,
                 is_fatal: Callable[[BaseException], bool] = lambda exc: False,
                 on_fatal: Callable[[], None] = lambda: None,
                 wake: Callable[[], None] = lambda: None) -> None:
        """``executor``: where launches run (the CPU, where launching is the computation); ``wake``
        is called from its thread when one ends (the engine's loop may be asleep)."""
        self.label = label
        self.settings = settings
        self.launch = launch
        self.ready = ready
        self.finish = finish
        self.executor = executor
        self.on_batch = on_batch
        self.is_fatal = is_fatal
        self.on_fatal = on_fatal
        self.wake = wake
        self._queue: Deque[Work] = deque()
        self._in_flight: Deque[_InFlight] = deque()
        # On CUDA batch k+1 is staged while batch k computes; on the CPU the launch is the computation
        # and the replica's one thread runs one at a time: what waits meanwhile stays queued, to merge.
        self._depth = PIPELINE_DEPTH if executor is None else 1
        # A batch's time on the device (from its launch, or from the end of the batch before it if
        # it waited behind that one, to its answer), a moving average of the last batches.
        self._device_seconds = 0.0
        self._last_finished = 0.0
        self.closed = False
        self._expired_at = -math.inf  # when a full queue was last looked through (_expire)

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def load(self) -> int:
        """Queued requests plus the batches being executed: what a new request would wait behind."""
        return len(self._queue) + len(self._in_flight)

    @property
    def busy(self) -> bool:
        return bool(self._queue or self._in_flight)

    @property
    def polling(self) -> bool:
        """Work is on the device and only polling says when it ends (no thread will wake the loop)."""
        return bool(self._in_flight) and self.executor is None

    @property
    def on_thread(self) -> bool:
        """A batch runs on the worker thread (the CPU), which wakes the loop when it ends."""
        return bool(self._in_flight) and self.executor is not None

    @property
    def full(self) -> bool:
        """Batches are in flight on the device up to the pipeline's depth: nothing launches until
        the oldest ends."""
        return self.executor is None and len(self._in_flight) >= self._depth

    @property
    def oldest_launch(self) -> float:
        return self._in_flight[0].started if self._in_flight else math.inf

    @property
    def batch_seconds(self) -> float:
        """A batch's time on the device, a moving average of the last batches (0 before the first)."""
        return self._device_seconds

    def wait_oldest(self) -> None:
        """Block until the device has done the oldest batch in flight (a blocking wait in the CUDA
        runtime: no CPU meanwhile); ``pump`` then answers it. A failure is left for ``pump``."""
        if self._in_flight and self.executor is None:
            try:
                self.finish(self._in_flight[0].handle)
            except Exception:  # noqa: BLE001 - pump's finish raises it again, for that batch
                pass

    def submit(self, work: Work) -> None:
        if self.closed:
            raise Overloaded(f"{self.label} is unloading; retry")
        self.make_room(work.enqueued)
        if len(self._queue) >= self.settings.max_queue:
            raise QueueFull(f"{self.label}: queue full ({self.settings.max_queue} requests waiting); retry with backoff")
        work.owner = self
        self._queue.append(work)

    def make_room(self, now: float) -> None:
        """A full queue answers its requests past their deadline (looked through at most every
        EXPIRE_SCAN_INTERVAL_S)."""
        if len(self._queue) >= self.settings.max_queue and now - self._expired_at >= EXPIRE_SCAN_INTERVAL_S:
            self._expire(now)

    def cancel(self, work: Work) -> None:
        """The client went away: a queued request is dropped and answered now; one already in a
        batch is answered with its batch (its result may be being written)."""
        if not work.started:
            try:
                self._queue.remove(work)
            except ValueError:
                return
            self._answer(work, Cancelled("the client went away"))

    def due_in(self, now: float) -> Optional[float]:
        """Seconds until the queued batch is due (0: now), None if nothing is queued or room is lacking."""
        if not self._queue or len(self._in_flight) >= self._depth:
            return None
        if self.closed or self.settings.max_delay_ms <= 0 or self._batch_full():
            return 0.0
        return max(0.0, self._queue[0].enqueued + self.settings.max_delay_ms / 1000.0 - now)

    def pump(self, now: float) -> bool:
        """Answer finished batches, launch due ones; True if anything happened."""
        progressed = False
        while self._in_flight and self._done(self._in_flight[0]):
            self._complete(self._in_flight.popleft())
            progressed = True
        while self.due_in(now) == 0.0:
            batch = self._take_batch(now)
            progressed = True
            if batch:
                self._launch(batch)
        return progressed

    def fail_queued(self, error: ServingError) -> None:
        """Answer every waiting request with ``error`` (the server is going down)."""
        self.closed = True
        while self._queue:
            self._answer(self._queue.popleft(), error)

    # -- internals -------------------------------------------------------------------------------
    def _batch_full(self) -> bool:
        """What is queued fills a batch by samples, ids or requests: waiting would add nothing to it."""
        s = self.settings
        return (len(self._queue) >= MAX_REQUESTS or sum(w.batch_size for w in self._queue) >= s.max_batch_size
                or sum(w.ids for w in self._queue) >= s.max_ids_per_request)

    def _take_batch(self, now: float) -> List[Work]:
        batch: List[Work] = []
        samples = ids = 0
        while self._queue and len(batch) < MAX_REQUESTS:
            work = self._queue[0]
            if batch and (samples + work.batch_size > self.settings.max_batch_size
                          or ids + work.ids > self.settings.max_ids_per_request):
                break
            self._queue.popleft()
            if work.late(now):
                self._answer_late(work)
                continue
            batch.append(work)
            samples += work.batch_size
            ids += work.ids
        return batch

    def _expire(self, now: float) -> None:
        """Answer the queued requests whose deadline has passed: a deadline of the OIP ``timeout``
        parameter alone brings no cancel when it passes (a gRPC one does). Only when the queue is full:
        until then ``_take_batch`` answers them, without a scan of the queue."""
        self._expired_at = now
        live: Deque[Work] = deque()
        for work in self._queue:
            if work.late(now):
                self._answer_late(work)
            else:
                live.append(work)
        self._queue = live

    def _launch(self, batch: List[Work]) -> None:
        started = time.monotonic()
        for work in batch:
            work.started = started
        if self.executor is not None:
            flight = _InFlight(batch, None, started)
            flight.handle = self.executor.submit(self._launch_in_time, flight)
            flight.handle.add_done_callback(lambda _: self.wake())
            self._in_flight.append(flight)
            return
        try:
            handle = self.launch(batch)
        except Exception as exc:  # noqa: BLE001 - fails this batch only, unless the device is gone
            self._fail(batch, exc)
            return
        self._in_flight.append(_InFlight(batch, handle, started))

    def _launch_in_time(self, flight: _InFlight) -> Any:
        """On the worker thread, which the replica's other RPC shares: a batch may have waited there
        behind one of the other's. Its requests whose deadline passed meanwhile are left out, not run
        (``_complete`` answers them)."""
        now = time.monotonic()
        flight.expired = [w for w in flight.works if w.late(now)]
        live = [w for w in flight.works if not w.late(now)]
        return self.launch(live) if live else None

    def _done(self, flight: _InFlight) -> bool:
        if isinstance(flight.handle, Future):
            return flight.handle.done()
        try:
            return self.ready(flight.handle)
        except Exception:  # noqa: BLE001 - finish raises it, for this batch
            return True

    def _complete(self, flight: _InFlight) -> None:
        for work in flight.expired:
            self._answer_late(work)
        works = [w for w in flight.works if not w.answered]
        if not works:
            return
        try:
            handle = flight.handle.result() if isinstance(flight.handle, Future) else flight.handle
            self.finish(handle)
        except Exception as exc:  # noqa: BLE001 - fails this batch only, unless the device is gone
            self._fail(works, exc)
            return
        finished = time.monotonic()
        device = finished - max(flight.started, self._last_finished)
        self._device_seconds = device if not self._device_seconds else 0.75 * self._device_seconds + 0.25 * device
        self._last_finished = finished
        self.on_batch(works, finished - flight.started, handle)
        for work in works:
            work.finished = finished
            self._answer(work, None)

    def _fail(self, batch: List[Work], exc: Exception) -> None:
        fatal = self.is_fatal(exc)
        log.log(logging.CRITICAL if fatal else logging.ERROR, "%s: model call failed for a batch of %d "
                "request(s)%s", self.label, len(batch), "; the device is unusable" if fatal else "", exc_info=exc)
        error = DeviceLost() if fatal else ExecutionFailed("model execution failed")
        for work in batch:
            self._answer(work, error)
        if fatal:
            self.on_fatal()

    def _answer_late(self, work: Work) -> None:
        self._answer(work, DeadlineExpired("deadline passed while queued; not executed"))

    @staticmethod
    def _answer(work: Work, error: Optional[ServingError]) -> None:
        if not work.answered:
            work.answered = True
            work.answer(work, error)


class Router:
    """Replicas of one model version (one batcher per GPU): each request goes to the replica with
    the least work ahead of it (queued requests plus the batches running) among those whose queue
    has room; QueueFull only when every replica's queue is full."""

    def __init__(self, batchers: List[Batcher]) -> None:
        self.batchers = batchers

    @property
    def depth(self) -> int:
        return sum(b.depth for b in self.batchers)

    def submit(self, work: Work) -> None:
        room = [b for b in self.batchers if b.depth < b.settings.max_queue]
        if not room:  # every queue full: each frees the places of its requests past their deadline
            for b in self.batchers:
                b.make_room(work.enqueued)
            room = [b for b in self.batchers if b.depth < b.settings.max_queue]
        min(room or self.batchers, key=lambda b: b.load).submit(work)

    def fail_queued(self, error: ServingError) -> None:
        for b in self.batchers:
            b.fail_queued(error)


def saturated(batchers: List[Batcher]) -> Optional[Batcher]:
    """When no batcher can launch (call with none due) and one whose batches take the device more
    than BLOCK_MIN_BATCH_S has its pipeline full: of those, the one whose oldest batch was launched
    first, else None. Blocking on that batch costs its own requests nothing (what is queued behind
    it cannot start before it ends, and the device has the next batch meanwhile); another batcher's
    batch that ends meanwhile, or a request arriving for a batcher with room, waits for it to end
    (at most one batch's time)."""
    full = [b for b in batchers if b.full and b.batch_seconds > BLOCK_MIN_BATCH_S]
    return min(full, key=lambda b: b.oldest_launch) if full else None


def stats(batchers: List[Batcher], now: float) -> Tuple[bool, Optional[float]]:
    """(any polling the device, seconds until the next batch is due or None)."""
    polling = False
    due: Optional[float] = None
    for b in batchers:
        polling = polling or b.polling
        d = b.due_in(now)
        if d is not None:
            due = d if due is None else min(due, d)
    return polling, due
