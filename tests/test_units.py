"""Unit tests: one module alone (batcher, validation, assembly), no server."""
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from recserve import wire
from recserve.v1 import inference_pb2 as pb
from serving.engine.assemble import Assembler, Request
from serving.engine.batcher import Batcher, Router, Work
from serving.config import BatchSettings
from serving.errors import DeadlineExpired, ExecutionFailed, InvalidInput, Overloaded
from serving.frontend.protowire import parse_request
from serving.ipc import Schema
from serving.frontend.validate import decode_predict, decode_sparse, id_error

SCHEMA = Schema(feature_names=("a", "b", "c"), rows=(10, 20, 30), dims=(2, 3, 4), dense_features=2,
                max_batch_size=8, max_ids=100)


def sparse_msg(keys, lengths, values, ldt=np.int32, vdt=np.int64):
    """A LookupRequest's bytes, located (serving/frontend/protowire.py): what decode_sparse reads."""
    body = pb.LookupRequest(model_name="m", sparse=pb.SparseFeatures(
        keys=keys, lengths=wire.encode(np.array(lengths, ldt)), values=wire.encode(np.array(values, vdt)))
    ).SerializeToString()
    return body, parse_request(body, predict=False)


def decode(keys, lengths, values, **kw):
    return decode_sparse(*sparse_msg(keys, lengths, values, **kw), SCHEMA, None)


# -- validation --------------------------------------------------------------------------------

def test_decode_keeps_request_order_and_views_the_bytes():
    s = decode(["c", "a"], [1, 0, 2, 1], [29, 0, 9, 3])
    assert s.keys == ["c", "a"] and s.positions == (2, 0) and s.batch_size == 2
    assert s.totals.tolist() == [1, 3] and not s.in_model_order
    assert not s.values.flags.writeable  # a view of the message bytes, not a copy


@pytest.mark.parametrize("keys,lengths,values,message", [
    (["a"], [1, -1], [1], "negative length for feature 'a'"),
    (["a"], [1, 1], [1], "sum to 2 but sparse.values has 1"),
    (["a", "a"], [0, 0, 0, 0], [], "appears more than once"),
    (["z"], [0, 0], [], "unknown feature 'z'"),
    (["a", "b"], [0, 0, 0], [], "not a multiple of 2 keys"),
    (["a"], [0] * 9, [], "exceeds the server's max batch size 8"),
    (["a"], [101, 0], list(range(101)), "101 ids exceed the server's limit of 100"),
])
def test_decode_rejects_with_a_message_naming_the_problem(keys, lengths, values, message):
    with pytest.raises(InvalidInput) as exc:
        decode(keys, lengths, values)
    assert message in str(exc.value)


def decode_shared(keys, lengths, values, shared_keys, shared_lengths, shared_values, batch_size=None):
    body = pb.LookupRequest(model_name="m", sparse=pb.SparseFeatures(
        keys=keys, lengths=wire.encode(np.array(lengths, np.int32)), values=wire.encode(np.array(values, np.int64)),
        shared_keys=shared_keys, shared_lengths=wire.encode(np.array(shared_lengths, np.int32)),
        shared_values=wire.encode(np.array(shared_values, np.int64)))).SerializeToString()
    return decode_sparse(body, parse_request(body, predict=False), SCHEMA, batch_size)


def test_shared_bags_stay_one_bag_and_the_request_is_not_in_model_order():
    s = decode_shared(["a", "c"], [1, 0, 0, 2], [3, 28, 29], ["b"], [3], [1, 2, 19])
    assert s.shared_keys == ["b"] and s.shared_positions == (1,) and s.shared_lengths.tolist() == [3]
    assert s.all_keys == ["a", "c", "b"] and s.all_positions == (0, 2, 1) and not s.in_model_order
    only_shared = decode_shared([], [], [], ["c", "a"], [1, 2], [5, 1, 2])
    assert only_shared.batch_size == 1 and only_shared.keys == [] and only_shared.shared_lengths.tolist() == [1, 2]


@pytest.mark.parametrize("shared_keys,shared_lengths,shared_values,message", [
    (["a"], [1], [1], "feature 'a' appears more than once"),  # also per-sample
    (["z"], [0], [], "sparse.shared_keys: unknown feature 'z'"),
    (["b"], [1, 0], [1], "2 entries for 1 shared keys"),
    (["b"], [-1], [], "sparse.shared_lengths: negative length for feature 'b'"),
    (["b"], [2], [1], "sparse.shared_lengths: a bag of 2 ids, but sparse.shared_values has 1"),
    (["b", "c"], [1, 1], [1], "sparse.shared_lengths sum to 2 but sparse.shared_values has 1"),
    # 2 per-sample ids + 2 samples x 50 shared ids = 102 > 100: the expanded count is what is bounded
    (["b"], [50], list(range(50)), "102 ids exceed the server's limit of 100 per request (50 shared ids count once"),
])
def test_shared_bags_are_checked_like_per_sample_ones(shared_keys, shared_lengths, shared_values, message):
    with pytest.raises(InvalidInput) as exc:
        decode_shared(["a"], [1, 1], [1, 2], shared_keys, shared_lengths, shared_values)
    assert message in str(exc.value)


def test_id_error_names_the_shared_feature():
    s = decode_shared(["a"], [1, 0], [1], ["c"], [2], [3, 30])
    assert "sparse.shared_values: id 30 of feature 'c' is outside [0, 30)" in id_error(s, SCHEMA)


# -- assembly on the device ----------------------------------------------------------------------

def test_assembly_reorders_fills_and_merges_like_one_kjt():
    asm = Assembler(SCHEMA, torch.device("cpu"))
    r1 = decode(["b", "a"], [2, 0, 1, 1], [5, 6, 1, 2], vdt=np.int32)
    r2 = decode(["a", "b", "c"], [0, 1, 1], [19, 29])
    requests, bad = asm.prepare([request(r1), request(r2)])
    assert bad.tolist() == [False, False]
    values, lengths = asm.merge(requests)
    # Model order a, b, c; per feature, request 1's samples then request 2's.
    assert lengths.reshape(-1).tolist() == [1, 1, 0, 2, 0, 1, 0, 0, 1]
    assert values.tolist() == [1, 2, 5, 6, 19, 29] and values.dtype == torch.int64


def test_assembly_flags_only_the_request_with_a_bad_id():
    asm = Assembler(SCHEMA, torch.device("cpu"))
    good = decode(["a"], [1], [9])
    bad = decode(["a", "c"], [1, 1], [3, 30])
    requests, flags = asm.prepare([request(good), request(bad), request(good)])
    assert flags.tolist() == [False, True, False]
    # The kernel never sees the bad id: it is row 0 now; the good ids are as sent.
    assert requests[1].values.tolist() == [3, 0] and requests[0].values.tolist() == [9]
    assert "id 30 of feature 'c' is outside [0, 30)" in id_error(bad, SCHEMA)


def test_assembly_expands_shared_bags_per_request_like_their_per_sample_form():
    asm = Assembler(SCHEMA, torch.device("cpu"))
    # Two requests of 2 and 3 samples, each with its own shared bag of "b" (and one of "c" in the second).
    r1 = decode_shared(["a"], [1, 0], [4], ["b"], [2], [7, 8])
    r2 = decode_shared(["a"], [0, 1, 1], [5, 6], ["c", "b"], [1, 1], [29, 19])
    p1 = decode(["a", "b"], [1, 0, 2, 2], [4, 7, 8, 7, 8])
    p2 = decode(["a", "c", "b"], [0, 1, 1, 1, 1, 1, 1, 1, 1], [5, 6, 29, 29, 29, 19, 19, 19])
    shared_values, shared_lengths = asm.merge(asm.prepare([request(r1), request(r2)])[0])
    values, lengths = asm.merge(asm.prepare([request(p1), request(p2)])[0])
    assert torch.equal(shared_lengths, lengths) and torch.equal(shared_values, values)
    assert values.tolist() == [4, 5, 6, 7, 8, 7, 8, 19, 19, 19, 29, 29, 29]


def test_assembly_flags_negative_ids_per_sample_and_shared():
    asm = Assembler(SCHEMA, torch.device("cpu"))
    good = decode(["a"], [1], [9])
    negative = decode(["b", "a"], [1, 1], [5, -3])
    shared_negative = decode_shared(["a"], [1], [2], ["c"], [1], [-1])
    requests, flags = asm.prepare([request(good), request(negative), request(shared_negative)])
    assert flags.tolist() == [False, True, True]
    assert requests[1].values.tolist() == [5, 0] and requests[2].shared[0][1].tolist() == [0]
    assert id_error(negative, SCHEMA) == "sparse.values: id -3 of feature 'a' is outside [0, 10)"
    assert id_error(shared_negative, SCHEMA) == "sparse.shared_values: id -1 of feature 'c' is outside [0, 30)"


def test_assembly_flags_a_bad_shared_id_and_replaces_it():
    asm = Assembler(SCHEMA, torch.device("cpu"))
    good = decode_shared(["a"], [1], [9], ["c"], [1], [29])
    bad = decode_shared(["a"], [1], [9], ["c"], [2], [3, 30])
    requests, flags = asm.prepare([request(good), request(bad)])
    assert flags.tolist() == [False, True]
    assert requests[1].shared[0][1].tolist() == [3, 0]


def request(sparse):
    return Request(sparse, None, np.empty(sparse.batch_size, np.float32), pinned=False)


# -- batcher -------------------------------------------------------------------------------------

def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


class Box:
    """A request whose output the fake model writes (as the runner writes into the shared buffer)."""

    def __init__(self, value):
        self.value, self.out = value, None


def make_batcher(settings, fn):
    """``fn(values) -> outputs`` runs at launch and writes each request's output; finish reports none failed."""

    def launch(works):
        for w, out in zip(works, fn([w.inputs.value for w in works])):
            w.inputs.out = out
        return works

    return Batcher("test", settings, launch, lambda works: [None] * len(works), ThreadPoolExecutor(1),
                   ThreadPoolExecutor(1))


async def ask(batcher, value, batch_size=1, deadline=None, ids=0):
    box = Box(value)
    await batcher.submit(Work(inputs=box, batch_size=batch_size, deadline=deadline, ids=ids))
    return box.out


def test_batcher_merges_concurrent_requests_and_gives_each_its_rows():
    calls = []

    def echo(values):
        time.sleep(0.05)
        calls.append([2] * len(values))
        return values

    async def main():
        b = make_batcher(BatchSettings(max_batch_size=8, max_delay_ms=20, max_queue=16), echo)
        b.start()
        results = await asyncio.gather(*(ask(b, i, batch_size=2) for i in range(6)))
        await b.close()
        return results

    assert run(main()) == list(range(6))
    assert sum(len(c) for c in calls) == 6 and len(calls) < 6 and max(sum(c) for c in calls) <= 8


def test_batcher_closes_a_batch_at_its_id_budget():
    """Shared bags make a few samples carry many ids: a batch also stops at max_ids_per_request ids
    (the kernels' offsets are int32), and a request alone at the limit still runs."""
    calls = []

    def record(values):
        time.sleep(0.05)
        calls.append(len(values))
        return values

    async def main():
        b = make_batcher(BatchSettings(max_batch_size=64, max_delay_ms=30, max_queue=16, max_ids_per_request=100),
                         record)
        b.start()
        results = await asyncio.gather(*(ask(b, i, ids=60 if i else 100) for i in range(5)))
        await b.close()
        return results

    assert run(main()) == list(range(5))
    assert max(calls) == 1 and sum(calls) == 5  # 60 + 60 > 100: never two in one batch


def test_decode_accepts_a_predict_of_dense_features_alone():
    empty = pb.SparseFeatures(lengths=wire.encode(np.zeros(0, np.int32)), values=wire.encode(np.zeros(0, np.int64)))
    body = pb.PredictRequest(model_name="m", dense=wire.encode(np.zeros((3, 2), np.float32)),
                             sparse=empty).SerializeToString()
    request = parse_request(body, predict=True)
    dense, sparse = decode_predict(body, request, SCHEMA)
    assert sparse.batch_size == 3 and sparse.keys == [] and sparse.expanded_ids == 0
    with pytest.raises(InvalidInput, match="at least one key is required"):
        decode([], [], [])  # a Lookup needs a key


async def until(predicate, timeout=5.0):
    """Yield to the event loop until ``predicate()`` holds; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for a state"
        await asyncio.sleep(0.001)


def test_full_queue_is_refused_at_once_and_an_expired_request_never_runs():
    """A request whose deadline passes while it waits behind a running batch gets DeadlineExpired
    from the batch it would have joined, and the model never sees it."""
    release, started, ran = threading.Event(), threading.Event(), []

    def gated(values):
        ran.extend(values)
        started.set()
        assert release.wait(10)
        return values

    async def main():
        b = make_batcher(BatchSettings(max_batch_size=1, max_delay_ms=0, max_queue=1), gated)
        b.start()
        first = asyncio.ensure_future(ask(b, 1))
        await until(started.is_set)  # executing: its queue place is free again
        deadline = time.monotonic() + 0.05
        late = asyncio.ensure_future(ask(b, 2, deadline=deadline))
        await until(lambda: b.depth == 1)
        with pytest.raises(Overloaded, match=r"queue full \(1 requests waiting\)"):
            await ask(b, 3)
        await until(lambda: time.monotonic() > deadline)
        release.set()
        assert await first == 1
        with pytest.raises(DeadlineExpired, match="deadline passed while queued; not executed"):
            await late
        await b.close()

    run(main())
    assert ran == [1]


def test_each_request_of_a_batch_gets_its_own_result_or_its_own_error():
    """``finish`` answers per request (the device's id check): one request's error never reaches
    its batch-mates, and the batch observer sees exactly which ones failed."""
    batches, observed = [], []

    def launch(works):
        batches.append(len(works))
        for w in works:
            w.inputs.out = w.inputs.value * 10
        return works

    def finish(works):
        return [InvalidInput(f"request {w.inputs.value} has a bad id") if w.inputs.value % 2 else None for w in works]

    def on_batch(works, errors, seconds):
        observed.append([(w.inputs.value, type(e).__name__ if e else None) for w, e in zip(works, errors)])

    async def main():
        # One batch for sure: it closes only when all six samples are queued.
        b = Batcher("test", BatchSettings(max_batch_size=6, max_delay_ms=60_000, max_queue=8), launch, finish,
                    ThreadPoolExecutor(1), ThreadPoolExecutor(1), on_batch=on_batch)
        b.start()
        outcomes = await asyncio.gather(*(ask(b, v) for v in range(6)), return_exceptions=True)
        await b.close()
        return outcomes

    outcomes = run(main())
    assert batches == [6]
    assert [o if isinstance(o, int) else (type(o).__name__, str(o)) for o in outcomes] == [
        0, ("InvalidInput", "request 1 has a bad id"), 20, ("InvalidInput", "request 3 has a bad id"), 40,
        ("InvalidInput", "request 5 has a bad id")]
    assert observed == [[(0, None), (1, "InvalidInput"), (2, None), (3, "InvalidInput"), (4, None),
                         (5, "InvalidInput")]]


def test_a_failed_model_call_fails_only_its_batch():
    def flaky(values):
        if "boom" in values:
            raise RuntimeError("boom")
        return values

    async def main():
        b = make_batcher(BatchSettings(max_batch_size=1, max_delay_ms=0, max_queue=8), flaky)
        b.start()
        with pytest.raises(ExecutionFailed, match="model execution failed"):
            await ask(b, "boom")
        assert await ask(b, "ok") == "ok"
        await b.close()

    run(main())


def test_router_sends_a_request_to_the_replica_with_the_least_work():
    """One replica runs a batch that waits for the test, with another request queued behind it; a
    new request goes to the idle replica (sent to the busy one, it would wait: a fast failure here,
    not a hang)."""
    release, started = threading.Event(), threading.Event()

    def blocked(values):
        started.set()
        assert release.wait(10)
        return [("busy", v) for v in values]

    async def main():
        settings = BatchSettings(max_batch_size=1, max_delay_ms=0, max_queue=8)
        busy, idle = make_batcher(settings, blocked), make_batcher(settings, lambda vs: [("idle", v) for v in vs])
        router = Router([busy, idle])
        router.start()
        try:
            running = asyncio.ensure_future(ask(busy, 1))
            await until(started.is_set)
            queued = asyncio.ensure_future(ask(busy, 2))
            await until(lambda: busy.depth == 1)
            assert (busy.load, idle.load) == (2, 0)
            box = Box(3)
            await asyncio.wait_for(router.submit(Work(inputs=box, batch_size=1, deadline=None)), 5)
            assert box.out == ("idle", 3)
        finally:
            release.set()
        assert (await running, await queued) == (("busy", 1), ("busy", 2))
        await router.close()

    run(main())
