"""Unit tests: one module alone (batcher, validation, assembly), no server."""
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from recserve import wire
from recserve.v1 import inference_pb2 as pb
from serving.assemble import Assembler
from serving.batcher import Batcher, Router, Work
from serving.config import BatchSettings
from serving.errors import DeadlineExpired, ExecutionFailed, InvalidInput, Overloaded
from serving.validate import Schema, decode_sparse

SCHEMA = Schema(feature_names=("a", "b", "c"), rows=(10, 20, 30), dims=(2, 3, 4), dense_features=2,
                max_batch_size=8, max_ids=100)


def sparse_msg(keys, lengths, values, ldt=np.int32, vdt=np.int64):
    return pb.SparseFeatures(keys=keys, lengths=wire.encode(np.array(lengths, ldt)),
                             values=wire.encode(np.array(values, vdt)))


# -- validation --------------------------------------------------------------------------------

def test_decode_keeps_request_order_and_views_the_bytes():
    msg = sparse_msg(["c", "a"], [1, 0, 2, 1], [29, 0, 9, 3])
    s = decode_sparse(msg, SCHEMA, None)
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
        decode_sparse(sparse_msg(keys, lengths, values), SCHEMA, None)
    assert message in str(exc.value)


# -- assembly on the device ----------------------------------------------------------------------

def test_assembly_reorders_fills_and_merges_like_one_kjt():
    asm = Assembler(SCHEMA, torch.device("cpu"))
    r1 = decode_sparse(sparse_msg(["b", "a"], [2, 0, 1, 1], [5, 6, 1, 2], vdt=np.int32), SCHEMA, None)
    r2 = decode_sparse(sparse_msg(["a", "b", "c"], [0, 1, 1], [19, 29]), SCHEMA, None)
    requests, errors = asm.prepare([r1, r2])
    assert errors == [None, None]
    values, lengths = asm.merge(requests)
    # Model order a, b, c; per feature, request 1's samples then request 2's.
    assert lengths.reshape(-1).tolist() == [1, 1, 0, 2, 0, 1, 0, 0, 1]
    assert values.tolist() == [1, 2, 5, 6, 19, 29] and values.dtype == torch.int64


def test_assembly_flags_only_the_request_with_a_bad_id():
    asm = Assembler(SCHEMA, torch.device("cpu"))
    good = decode_sparse(sparse_msg(["a"], [1], [9]), SCHEMA, None)
    bad = decode_sparse(sparse_msg(["a", "c"], [1, 1], [3, 30]), SCHEMA, None)
    requests, errors = asm.prepare([good, bad, good])
    assert errors[0] is None and errors[2] is None and requests[1] is None
    assert "id 30 of feature 'c' is outside [0, 30)" in errors[1]


# -- batcher -------------------------------------------------------------------------------------

def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def make_batcher(settings, fn):
    return Batcher("test", settings, fn, ThreadPoolExecutor(1))


def test_batcher_merges_concurrent_requests_and_gives_each_its_rows():
    calls = []

    def echo(works):
        time.sleep(0.05)
        calls.append([w.batch_size for w in works])
        return [w.inputs for w in works]

    async def main():
        b = make_batcher(BatchSettings(max_batch_size=8, max_delay_ms=20, max_queue=16), echo)
        b.start()
        results = await asyncio.gather(*(b.submit(Work(inputs=i, batch_size=2, deadline=None)) for i in range(6)))
        await b.close()
        return results

    assert run(main()) == list(range(6))
    assert sum(len(c) for c in calls) == 6 and len(calls) < 6 and max(sum(c) for c in calls) <= 8


def test_batcher_limits_fail_cleanly():
    def slow(works):
        time.sleep(0.3)
        return [w.inputs for w in works]

    async def main():
        b = make_batcher(BatchSettings(max_batch_size=1, max_delay_ms=0, max_queue=1), slow)
        b.start()
        first = asyncio.ensure_future(b.submit(Work(inputs=1, batch_size=1, deadline=None)))
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(b.submit(Work(inputs=2, batch_size=1, deadline=time.monotonic() + 0.1)))
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):
            await b.submit(Work(inputs=3, batch_size=1, deadline=None))
        assert await first == 1
        with pytest.raises(DeadlineExpired):
            await late
        await b.close()

    run(main())


def test_batcher_failure_fails_only_its_batch_and_router_prefers_the_idle_replica():
    def flaky(works):
        if any(w.inputs == "boom" for w in works):
            raise RuntimeError("boom")
        return [w.inputs for w in works]

    async def main():
        settings = BatchSettings(max_batch_size=1, max_delay_ms=0, max_queue=8)
        b = make_batcher(settings, flaky)
        b.start()
        with pytest.raises(ExecutionFailed):
            await b.submit(Work(inputs="boom", batch_size=1, deadline=None))
        assert await b.submit(Work(inputs="ok", batch_size=1, deadline=None)) == "ok"
        busy, idle = make_batcher(settings, flaky), make_batcher(settings, flaky)
        busy._running = 1
        router = Router([busy, idle])
        idle.start()
        assert await router.submit(Work(inputs="x", batch_size=1, deadline=None)) == "x"
        assert busy.depth == 0  # it went to the idle replica
        await b.close()
        await idle.close()

    run(main())
