"""Per model version statistics in Triton's terms (the Open Inference Protocol's statistics extension:
``ModelStatistics`` over gRPC, ``GET /v2/models/{name}/stats`` over HTTP).

They are kept in the engine because every request that runs passes it, whichever front end and
protocol it came through: a front end asks each engine (serving/ipc.py ``StatisticsQuery``) and adds
their answers up (:func:`merge`), so the figures are the server's whatever front end answers. Each
engine keeps them per loaded version (serving/engine/repository.py ``ModelVersion.statistics``); a
version unloaded takes its figures with it; one loaded again under its number (a new ``model.pt``
or build) keeps them. Both sides import this module; it imports nothing.

What each field holds (all durations CLOCK_MONOTONIC nanoseconds, counts of requests unless said):

- ``success``: requests answered with a result; time from admission in the engine to the result written.
- ``fail``: requests that reached the engine and failed there (queue full, deadline passed, model call
  failed, cancelled), admission to answer. Requests refused by a front end's checks (a bad input,
  an unknown model) never reach a model and are counted in ``recserve_requests_total{code}`` only.
- ``queue``: admission to the start of the request's batch.
- ``compute_infer``: the model call of the request's batch (the copies in and out included: on CUDA
  they are one graph with it); ``compute_input`` and ``compute_output`` count the same requests with
  0 ns, since the front end writes a request in the batch's layout before it is queued.
- ``inference_count``: samples answered; ``execution_count``: model calls (batches);
  ``batch_stats``: per batch size executed (samples of the batch), model calls and their time.
- ``last_inference``: wall-clock milliseconds since the epoch of the last answered request.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

Duration = Tuple[int, int]  # (count, ns)


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


@dataclass
class VersionStatistics:
    success: List[int] = field(default_factory=lambda: [0, 0])
    fail: List[int] = field(default_factory=lambda: [0, 0])
    queue: List[int] = field(default_factory=lambda: [0, 0])
    compute_infer: List[int] = field(default_factory=lambda: [0, 0])
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: Dict[int, List[int]] = field(default_factory=dict)  # batch size -> [model calls, ns]

    def answered(self, samples: int, enqueued: float, started: float, finished: float) -> None:
        self.success[0] += 1
        self.success[1] += _ns(finished - enqueued)
        self.queue[0] += 1
        self.queue[1] += _ns(started - enqueued)
        self.compute_infer[0] += 1
        self.compute_infer[1] += _ns(finished - started)
        self.inference_count += samples
        self.last_inference_ms = int(time.time() * 1000)

    def failed(self, enqueued: float) -> None:
        self.fail[0] += 1
        self.fail[1] += _ns(time.monotonic() - enqueued)

    def batch(self, samples: int, seconds: float) -> None:
        self.execution_count += 1
        entry = self.batches.setdefault(samples, [0, 0])
        entry[0] += 1
        entry[1] += _ns(seconds)

    def merged(self, other: "VersionStatistics") -> "VersionStatistics":
        """The sum of two engines' figures for one version."""
        batches = {size: list(entry) for size, entry in self.batches.items()}
        for size, (count, ns) in other.batches.items():
            entry = batches.setdefault(size, [0, 0])
            entry[0] += count
            entry[1] += ns

        def add(a: List[int], b: List[int]) -> List[int]:
            return [a[0] + b[0], a[1] + b[1]]

        return VersionStatistics(add(self.success, other.success), add(self.fail, other.fail),
                                 add(self.queue, other.queue), add(self.compute_infer, other.compute_infer),
                                 self.inference_count + other.inference_count,
                                 self.execution_count + other.execution_count,
                                 max(self.last_inference_ms, other.last_inference_ms), batches)


def merge(answers: List[Dict[Tuple[str, int], VersionStatistics]]) -> Dict[Tuple[str, int], VersionStatistics]:
    """Every engine's statistics, added up per (model, version)."""
    total: Dict[Tuple[str, int], VersionStatistics] = {}
    for answer in answers:
        for key, stats in answer.items():
            total[key] = total[key].merged(stats) if key in total else stats
    return total
