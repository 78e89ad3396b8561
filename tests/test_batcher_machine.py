"""The batcher (serving/engine/batcher.py) as a state machine: seeded random submit, cancel, pump,
device-done and device-failure events on a fake device and a fake clock. After every event: each
request answered at most once, and never both run and refused; the queue within max_queue (full:
only while none of its requests is past its deadline), the
pipeline within its depth; each batch within the limits (samples, ids, requests) and in arrival
order; nothing launched past its deadline or after its cancel; a batch that has all it can take is
due at once. At the end, with the device done, every request has exactly one answer."""
from concurrent.futures import Executor, Future
from types import SimpleNamespace

import numpy as np
import pytest

from serving.config import BatchSettings
from serving.engine.assemble import MAX_REQUESTS
from serving.engine import batcher as batcher_module
from serving.engine.batcher import EXPIRE_SCAN_INTERVAL_S, PIPELINE_DEPTH, Batcher, Work
from serving.errors import Cancelled, DeadlineExpired, ExecutionFailed, Overloaded, QueueFull


class Device:
    """Launch only queues a batch (as on CUDA); the test says when each is done or failed."""

    def __init__(self):
        self.batches, self.done, self.failed = [], set(), set()

    def launch(self, works):
        self.batches.append(list(works))
        return len(self.batches) - 1

    def ready(self, handle):
        return handle in self.done or handle in self.failed

    def finish(self, handle):
        if handle in self.failed:
            raise RuntimeError("the model call failed")
        assert handle in self.done, "finish before the device is done: the engine would block"


class Worker(Executor):
    """The CPU's replica thread, run by the test: a launch (the whole model call) ends when it says."""

    def __init__(self):
        self.pending = []

    def submit(self, fn, *args):
        future = Future()
        self.pending.append((future, fn, args))
        return future

    def run_oldest(self, fail):
        future, fn, args = self.pending.pop(0)
        try:
            result = fn(*args)
            if fail:
                raise RuntimeError("the model call failed")
            future.set_result(result)
        except Exception as e:  # noqa: BLE001 - as a thread pool hands it over
            future.set_exception(e)


class Machine:
    def __init__(self, rng, settings, cpu=False):
        self.rng, self.settings = rng, settings
        self.device = Device()
        self.worker = Worker() if cpu else None
        if cpu:  # the launch is the computation: done when it returns
            self.device.ready = self.device.finish = lambda handle: True
        self.b = Batcher("machine", settings, self.device.launch, self.device.ready, self.device.finish,
                         self.worker, wake=self._woken)
        self.now, self.wakes = 1000.0, 0
        self.works, self.answers, self.launched_at = [], {}, {}
        self.cancelled = set()

    def _woken(self):
        self.wakes += 1

    def answer(self, work, error):
        assert id(work) not in self.answers, ("answered twice", work.inputs)
        self.answers[id(work)] = error

    def submit(self):
        s = self.settings
        batch_size = int(self.rng.integers(1, min(s.max_batch_size, 8) + 1))
        ids = int(self.rng.integers(0, s.max_ids_per_request + 1))
        deadline = None if self.rng.random() < 0.6 else self.now + float(self.rng.uniform(0, 0.02))
        work = Work(inputs=len(self.works), batch_size=batch_size, deadline=deadline, ids=ids, answer=self.answer)
        work.enqueued = self.now
        live = sum(1 for w in self.b._queue if w.deadline is None or self.now <= w.deadline)
        looked = self.now - self.b._expired_at < EXPIRE_SCAN_INTERVAL_S  # a full queue was looked through just now
        try:
            self.b.submit(work)
        except QueueFull:
            # a full queue first gives up the places of requests past their deadline (looked for once a ms)
            assert live >= s.max_queue or looked
            return
        assert live < s.max_queue
        self.works.append(work)

    def cancel(self):
        if self.works:
            work = self.works[int(self.rng.integers(0, len(self.works)))]
            if not work.started:
                self.cancelled.add(id(work))
            self.b.cancel(work)

    def pump(self):
        self.b.pump(self.now)

    def step(self):
        event = self.rng.choice(["submit"] * 5 + ["cancel", "pump", "pump", "done", "fail", "tick"])
        if event == "submit":
            self.submit()
        elif event == "cancel":
            self.cancel()
        elif event == "pump":
            self.pump()
        elif event in ("done", "fail") and self.worker is not None:
            if self.worker.pending:
                wakes = self.wakes
                self.worker.run_oldest(fail=event == "fail")
                assert self.wakes == wakes + 1  # the engine's loop, maybe asleep, hears of it
        elif event in ("done", "fail"):
            running = [h for h in range(len(self.device.batches)) if not self.device.ready(h)]
            if running:
                (self.device.done if event == "done" else self.device.failed).add(running[0])
        else:
            self.now += float(self.rng.uniform(0, 0.01))
        self.check()

    def check(self):
        s, b = self.settings, self.b
        for batch in self.device.batches:  # run: handed to the model (on the CPU, when the worker takes it)
            for work in batch:
                self.launched_at.setdefault(id(work), self.now)
        assert b.depth <= s.max_queue
        assert len(b._in_flight) <= (1 if self.worker is not None else PIPELINE_DEPTH)
        queued = list(b._queue)
        if queued and len(b._in_flight) < b._depth:
            full = (sum(w.batch_size for w in queued) >= s.max_batch_size or len(queued) >= MAX_REQUESTS
                    or sum(w.ids for w in queued) >= s.max_ids_per_request)
            if full:  # the batch has all it can take: waiting out max_delay_ms would only add latency
                assert b.due_in(self.now) == 0.0, (len(queued), sum(w.ids for w in queued))
        order = [w.inputs for batch in self.device.batches for w in batch]
        assert order == sorted(order), "batches out of arrival order"
        for batch in self.device.batches:
            assert len(batch) <= MAX_REQUESTS
            if len(batch) > 1:
                assert sum(w.batch_size for w in batch) <= s.max_batch_size
                assert sum(w.ids for w in batch) <= s.max_ids_per_request
        for work in self.works:
            error = self.answers.get(id(work))
            if id(work) in self.launched_at:
                assert work.deadline is None or self.launched_at[id(work)] <= work.deadline, "ran past its deadline"
                assert not isinstance(error, (Cancelled, DeadlineExpired)), "ran and refused"
            else:
                assert error is None or isinstance(error, (Cancelled, DeadlineExpired, Overloaded)), error

    def finish(self):
        """The device does everything; the engine pumps until nothing is left."""
        for _ in range(10 * len(self.works) + 10):
            self.device.done.update(range(len(self.device.batches)))
            while self.worker is not None and self.worker.pending:
                self.worker.run_oldest(fail=False)
                self.check()  # launched now, not a second later
            self.now += 1.0
            self.pump()
            self.check()
            if not self.b.busy:
                break
        assert not self.b.busy
        unanswered = [w.inputs for w in self.works if id(w) not in self.answers]
        assert not unanswered, unanswered
        for work in self.works:
            error = self.answers[id(work)]
            if id(work) in self.launched_at:
                assert error is None or isinstance(error, ExecutionFailed)
            elif id(work) in self.cancelled:
                assert isinstance(error, (Cancelled, DeadlineExpired))


SETTINGS = [BatchSettings(max_batch_size=8, max_delay_ms=0, max_queue=16, max_ids_per_request=50),
            BatchSettings(max_batch_size=8, max_delay_ms=5, max_queue=16, max_ids_per_request=50),
            BatchSettings(max_batch_size=4096, max_delay_ms=5, max_queue=400, max_ids_per_request=1 << 20),
            BatchSettings(max_batch_size=64, max_delay_ms=5, max_queue=64, max_ids_per_request=100)]


@pytest.mark.parametrize("cpu", [False, True], ids=["cuda-like", "cpu"])
@pytest.mark.parametrize("seed", range(40))
def test_the_batcher_answers_every_request_once_within_its_limits(seed, cpu, monkeypatch):
    rng = np.random.default_rng(seed)
    machine = Machine(rng, SETTINGS[seed % len(SETTINGS)], cpu)
    # The batcher's own clock reads (a launch's start; on the CPU, the worker's deadline check) are
    # the machine's: the real one is not comparable to the fake deadlines.
    monkeypatch.setattr(batcher_module, "time", SimpleNamespace(monotonic=lambda: machine.now))
    for _ in range(600):
        machine.step()
    machine.finish()
