"""The engine's request path, unit by unit: ids checked in the front end, requests laid out in the
shared buffer (serving/ipc.py), staged and gathered into one KJT (serving/engine/assemble.py) - each
against a KJT built by hand - and the batcher (serving/engine/batcher.py) with a fake model."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from recserve import wire
from recserve.v1 import inference_pb2 as pb
from serving import ipc
from serving.config import BatchSettings
from serving.engine.assemble import MAX_REQUESTS, Assembler, broadcast_pooled, gather, host_item, host_result
from serving.engine import batcher as batcher_module
from serving.engine.batcher import Batcher, Router, Work, saturated
from serving.engine.core import page_lock, page_unlock
from serving.errors import Cancelled, DeadlineExpired, ExecutionFailed, InvalidInput, Overloaded, QueueFull
from serving.frontend.protowire import parse_request
from serving.frontend.validate import IdSegments, decode_sparse, model_kjt, write_checked

SCHEMA = ipc.Schema(feature_names=("a", "b", "c"), rows=(10, 20, 30), dims=(2, 3, 4), dense_features=2,
                    max_batch_size=8, max_ids=100)


def front_end_checked(sparse, schema):
    """What a front end does with a request it has read: written into a slot (as a Lookup: every id,
    no dense) and its ids checked on that copy (serving/frontend/link.py); the checked request."""
    kjt = model_kjt(sparse, None, schema)
    layout, out_totals, stored = ipc.layout_of(kjt, schema, False, lookup=True)
    write_checked(np.zeros(layout.slot_bytes, np.uint8), sparse, kjt, layout, out_totals, stored, schema)
    return sparse


def decode(keys, lengths, values, shared=None, vdt=np.int64):
    """A LookupRequest as the front end reads it; ``shared``: (keys, lengths, values)."""
    sparse = pb.SparseFeatures(keys=keys, lengths=wire.encode(np.array(lengths, np.int32)),
                               values=wire.encode(np.array(values, vdt)))
    if shared:
        sparse.shared_keys.extend(shared[0])
        sparse.shared_lengths.CopyFrom(wire.encode(np.array(shared[1], np.int32)))
        sparse.shared_values.CopyFrom(wire.encode(np.array(shared[2], np.int64)))
    body = pb.LookupRequest(model_name="m", sparse=sparse).SerializeToString()
    return front_end_checked(decode_sparse(body, parse_request(body, predict=False), SCHEMA, None), SCHEMA)


# -- ids are checked in the front end ------------------------------------------------------------

@pytest.mark.parametrize("keys,lengths,values,shared,message", [
    (["a", "c"], [1, 1], [3, 30], None, "sparse.values: id 30 of feature 'c' is outside [0, 30)"),
    (["c", "a"], [1, 1], [29, -1], None, "sparse.values: id -1 of feature 'a' is outside [0, 10)"),
    (["a"], [2], [9, 10], None, "id 10 of feature 'a' is outside [0, 10)"),  # the last id of a slice
    (["a"], [1], [9], (["c"], [2], [3, 30]), "sparse.shared_values: id 30 of feature 'c' is outside [0, 30)"),
    (["a"], [1], [9], (["b"], [1], [-5]), "sparse.shared_values: id -5 of feature 'b' is outside [0, 20)"),
])
def test_an_id_outside_its_table_is_refused_naming_the_feature(keys, lengths, values, shared, message):
    with pytest.raises(InvalidInput) as exc:
        decode(keys, lengths, values, shared)
    assert message in str(exc.value)


def test_ids_are_checked_on_the_written_copy_unless_narrowing_them_could_wrap():
    """int32 ids (the tables' dtype here) are checked where the front end wrote them (aligned, one
    piece); int64 ids before they are narrowed, where 2**32 + 3 would become 3."""
    def lookup(values, vdt):
        sparse = pb.SparseFeatures(keys=["a"], lengths=wire.encode(np.array([len(values)], np.int32)),
                                   values=wire.encode(np.array(values, vdt)))
        body = pb.LookupRequest(model_name="m", sparse=sparse).SerializeToString()
        return decode_sparse(body, parse_request(body, predict=False), SCHEMA, None)

    assert SCHEMA.id_dtype == np.int32
    read = lookup([3, 10], np.int32)
    assert not read.ids_checked
    with pytest.raises(InvalidInput, match=r"id 10 of feature 'a' is outside \[0, 10\)"):
        front_end_checked(read, SCHEMA)
    with pytest.raises(InvalidInput, match=r"id 4294967299 of feature 'a' is outside \[0, 10\)"):
        lookup([2**32 + 3], np.int64)
    good = lookup([0, 9], np.int32)
    assert front_end_checked(good, SCHEMA).ids_checked


def test_ids_at_both_ends_of_every_table_are_accepted():
    s = decode(["c", "b", "a"], [2, 2, 2], [0, 29, 0, 19, 0, 9], vdt=np.int32)
    assert s.totals.tolist() == [2, 2, 2]


@pytest.mark.parametrize("vdt", [np.int32, np.int64])
@pytest.mark.parametrize("lookup", [False, True])
@pytest.mark.parametrize("chunk_bytes", [8, 16, ipc.COPY_CHUNK_BYTES])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_a_request_in_model_order_is_written_whole_exactly_as_feature_by_feature(vdt, lookup, chunk_bytes,
                                                                                   per_tensor, monkeypatch):
    """A request that already is the model's KJT is copied as three whole arrays; the bytes must be
    those of the per-feature layout (int64 ids narrowed to the tables' int32 alike), and the largest
    id found by the copy, piece by piece (8 bytes: two ids a piece), the largest written. Ids sent
    as a tensor per feature (OIP) are copied together up to a piece (16 bytes: the first two
    features' ids), a feature with more alone (the third)."""
    monkeypatch.setattr(ipc, "COPY_CHUNK_BYTES", chunk_bytes)
    sparse = decode(["a", "b", "c"], [2, 0, 1, 1, 3, 0], [9, 0, 19, 7, 8, 29, 5], vdt=vdt)
    if per_tensor:
        sparse.values = IdSegments(np.split(sparse.values, [2, 4]))
    dense = None if lookup else np.array([[0.5, -1.0], [2.0, 3.5]], np.float32)
    whole = model_kjt(sparse, dense, SCHEMA)
    assert whole.whole is not None
    per_feature = ipc.ModelKJT(2, *whole.per_feature(), dense)
    written = []
    for kjt in (whole, per_feature):
        layout, out_totals, stored = ipc.layout_of(kjt, SCHEMA, False, lookup)
        slot = np.full(layout.slot_bytes, 0xAB, np.uint8)
        ids, high = ipc.write_request(slot, kjt, layout, out_totals, stored, SCHEMA.id_dtype)
        written.append((layout, out_totals.tolist(), stored.tolist(), ids.tolist(), high,
                        slot[:layout.block_bytes].tobytes()))
    assert written[0] == written[1]
    assert written[0][3] == [9, 0, 19, 7, 8, 29, 5] and written[0][2] == [2, 2, 3] and written[0][4] == 29


@pytest.mark.parametrize("once", [False, True])
@pytest.mark.parametrize("chunk_bytes", [8, 16, ipc.COPY_CHUNK_BYTES])
def test_a_request_with_a_shared_bag_and_a_feature_not_sent_is_written_in_model_order(once, chunk_bytes,
                                                                                       monkeypatch):
    """Feature a one bag shared by both samples (int64 ids, narrowed to the tables' int32), b not
    sent, c per sample: the ids go in model order whatever the pieces (8 bytes: two ids a piece), the
    largest written is found, and the shared bag's length fills every column (expanded) or the extra
    one (pooled once)."""
    monkeypatch.setattr(ipc, "COPY_CHUNK_BYTES", chunk_bytes)
    kjt = ipc.ModelKJT(2, [np.array([3, 4, 5], np.int64), None, np.array([29, 7, 8], np.int64)],
                       [3, None, np.array([1, 2], np.int32)], np.array([[0.5, -1.0], [2.0, 3.5]], np.float32))
    layout, out_totals, stored = ipc.layout_of(kjt, SCHEMA, once, lookup=False)
    slot = np.full(layout.slot_bytes, 0xAB, np.uint8)
    ids, high = ipc.write_request(slot, kjt, layout, out_totals, stored, SCHEMA.id_dtype)
    assert ids.tolist() == [3, 4, 5, 29, 7, 8] and high == 29
    assert out_totals.tolist() == [3 if once else 6, 0, 3] and stored.tolist() == [3, 0, 3]
    values = slot[layout.values_at:layout.lengths_at].view(SCHEMA.id_dtype)
    assert values[:6].tolist() == [3, 4, 5, 29, 7, 8]
    lengths = slot[layout.lengths_at:layout.dense_at].view(np.int32).reshape(3, layout.columns).tolist()
    assert lengths == ([[0, 0, 3], [0, 0, 0], [1, 2, 0]] if once else [[3, 3], [0, 0], [1, 2]])
    dense = slot[layout.dense_at:layout.block_bytes].view(np.float32).reshape(2, 2)
    np.testing.assert_array_equal(dense, kjt.dense)


def test_ids_below_their_own_tables_pass_where_they_exceed_the_smallest_one():
    """Tables of 10, 20 and 30 rows: ids up to 29 are not all below the smallest table, so each
    feature's largest is compared with its own table's rows (a feature not sent in between)."""
    assert decode(["a", "c"], [1, 2], [9, 0, 29], vdt=np.int32).totals.tolist() == [1, 2]
    with pytest.raises(InvalidInput, match="id 20 of feature 'b' is outside"):
        decode(["c", "b"], [1, 1], [29, 20], vdt=np.int32)


# -- requests laid out, staged and gathered -------------------------------------------------------

def staged_batch(requests, once=False, dense=None, pad=None, schema=SCHEMA):
    """Each request laid out as a front end writes it, staged and gathered on the CPU."""
    asm = Assembler(schema, torch.device("cpu"))
    items = []
    for i, sparse in enumerate(requests):
        d = None if dense is None else dense[i]
        items.append(host_item(model_kjt(sparse, d, schema), schema, once, lookup=d is None))
    staged = asm.stage(items, exact=pad is None)
    columns, ids, rows = pad or (staged.columns, staged.ids, staged.rows)
    out = gather(asm.words, staged.descriptor, len(schema.feature_names), 0 if dense is None else schema.dense_features,
                 asm.wide_ids, columns, ids, rows, staged.repeats)
    return staged, out


def test_gather_reorders_fills_and_merges_like_one_kjt():
    r1 = decode(["b", "a"], [2, 0, 1, 1], [5, 6, 1, 2], vdt=np.int32)
    r2 = decode(["a", "b", "c"], [1, 1, 1], [9, 19, 29])
    staged, (values, lengths, dense, _, _) = staged_batch([r1, r2])
    # Model order a, b, c; per feature, request 1's samples then request 2's.
    assert lengths.tolist() == [[1, 1, 1], [2, 0, 1], [0, 0, 1]]
    assert values.tolist() == [1, 2, 9, 5, 6, 19, 29] and values.dtype == torch.int64
    assert dense is None and staged.rows == staged.columns == 3 and staged.row_starts == [0, 2]


def test_gather_pads_with_empty_bags_and_zero_rows():
    r1 = decode(["a", "b", "c"], [1, 2, 1], [7, 3, 4, 5])
    dense = [np.array([[1.5, -2.0]], np.float32)]
    _, (values, lengths, d, _, _) = staged_batch([r1], dense=dense, pad=(4, 8, 4))
    assert lengths.tolist() == [[1, 0, 0, 0], [2, 0, 0, 0], [1, 0, 0, 0]]
    assert values.tolist()[:4] == [7, 3, 4, 5]
    assert d.tolist() == [[1.5, -2.0], [0, 0], [0, 0], [0, 0]] and d.dtype == torch.float32


def test_gather_expands_shared_bags_per_request_like_their_per_sample_form():
    # Two requests of 2 and 3 samples, each with its own shared bag of "b" (and one of "c" in the second).
    r1 = decode(["a"], [1, 0], [4], (["b"], [2], [7, 8]))
    r2 = decode(["a"], [0, 1, 1], [5, 6], (["c", "b"], [1, 1], [29, 19]))
    p1 = decode(["a", "b"], [1, 0, 2, 2], [4, 7, 8, 7, 8])
    p2 = decode(["a", "c", "b"], [0, 1, 1, 1, 1, 1, 1, 1, 1], [5, 6, 29, 29, 29, 19, 19, 19])
    _, (shared_values, shared_lengths, *_) = staged_batch([r1, r2])
    _, (values, lengths, *_) = staged_batch([p1, p2])
    assert torch.equal(shared_lengths, lengths) and torch.equal(shared_values, values)
    assert values.tolist() == [4, 5, 6, 7, 8, 7, 8, 19, 19, 19, 29, 29, 29]
    assert staged_batch([r1, r2])[0].repeats and not staged_batch([p1, p2])[0].repeats


def test_shared_bags_pooled_once_sit_in_one_extra_sample_and_broadcast_exactly():
    r1 = decode(["a"], [1, 0], [4], (["b"], [2], [7, 8]))
    r2 = decode(["a"], [1], [6])  # no shared bag: no extra sample
    staged, (values, lengths, _, extra_rows, weight) = staged_batch([r1, r2], once=True)
    # Columns: r1's 2 samples, r1's extra sample (only b's bag), r2's sample.
    assert lengths.tolist() == [[1, 0, 0, 1], [0, 0, 2, 0], [0, 0, 0, 0]]
    assert values.tolist() == [4, 6, 7, 8] and staged.rows == 3 and staged.columns == 4
    # A pooled table where each column's row says which sample it is: samples get their extra row added.
    pooled = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 50.0], [3.0, 0.0]])
    out = broadcast_pooled(pooled, staged.descriptor, 3, extra_rows, weight)
    assert out.tolist() == [[1.0, 50.0], [2.0, 50.0], [3.0, 0.0]]
    # The request without a shared bag first: its sample's extra index points at the next request's
    # first column. An inf pooled there (a bag past fp16's range) is that request's alone, not NaN here.
    staged, (_, lengths, _, extra_rows, weight) = staged_batch([r2, r1], once=True)
    assert lengths.tolist() == [[1, 1, 0, 0], [0, 0, 0, 2], [0, 0, 0, 0]]
    pooled = torch.tensor([[3.0, 0.0], [float("inf"), 0.0], [2.0, 0.0], [0.0, 50.0]], dtype=torch.float16)
    out = broadcast_pooled(pooled, staged.descriptor, 3, extra_rows, weight)
    assert out.tolist() == [[3.0, 0.0], [float("inf"), 50.0], [2.0, 50.0]]


def test_wide_ids_travel_as_int64():
    wide = ipc.Schema(feature_names=("a",), rows=(1 << 40,), dims=(2,), dense_features=1, max_batch_size=8,
                      max_ids=100)
    assert wide.id_dtype == np.int64 and SCHEMA.id_dtype == np.int32
    kjt = ipc.ModelKJT(2, [np.array([(1 << 39) + 5, 3], np.int64)], [np.array([1, 1], np.int32)])
    asm = Assembler(wide, torch.device("cpu"))
    staged = asm.stage([host_item(kjt, wide, False, lookup=True)], exact=True)
    values, lengths, *_ = gather(asm.words, staged.descriptor, 1, 0, True, 2, 2, 2)
    assert values.tolist() == [(1 << 39) + 5, 3] and lengths.tolist() == [[1, 1]]


# -- the channel: rings and the shared buffer ----------------------------------------------------

def test_a_full_ring_refuses_a_record_instead_of_overwriting_one_unread():
    channel = ipc.Channel(4)
    try:
        ring = channel.submissions
        record = lambda rid: (ipc.PREDICT, 0, 0, rid, 1, float("nan"), 1, 0, 1, 1, 0, 64, 256)
        assert [ring.put(record(rid)) for rid in range(5)] == [True, True, True, True, False]
        assert [r[3] for r in ring.take()] == [0, 1, 2, 3] and len(ring) == 0
        assert [ring.put(record(rid)) for rid in (4, 5, 6)] == [True, True, True]  # wrapping around
        assert [r[3] for r in ring.take()] == [4, 5, 6]
    finally:
        channel.close()


def test_freed_slots_merge_with_their_free_neighbours_and_an_exact_fit_is_taken():
    """First fit over 4 slots of ipc.ALIGN bytes: two freed neighbours make room for a request of
    both (in either order of freeing), and the whole buffer, freed, holds one request of its size."""
    arena = ipc.Arena(4 * ipc.ALIGN)
    try:
        assert [arena.alloc(ipc.ALIGN) for _ in range(4)] + [arena.alloc(1)] == [0, 256, 512, 768, None]
        arena.free(256)
        arena.free(512)  # merges with the slot before it
        assert arena.alloc(2 * ipc.ALIGN) == 256 and arena.alloc(1) is None
        arena.free(256)
        arena.free(0)  # merges with the one after it
        assert arena.alloc(3 * ipc.ALIGN) == 0 and arena.used_bytes == 4 * ipc.ALIGN
        arena.free(0)
        arena.free(768)
        assert arena.used_bytes == 0 and arena.alloc(4 * ipc.ALIGN) == 0
    finally:
        arena.close()


# -- batcher ------------------------------------------------------------------------------------

class Fake:
    """A model whose launch records the batch (values of its works) and may fail or take time."""

    def __init__(self, fail=None, seconds=0.0):
        self.calls, self.fail, self.seconds = [], fail, seconds

    def launch(self, works):
        time.sleep(self.seconds)
        values = [w.inputs for w in works]
        if self.fail in values:
            raise RuntimeError("boom")
        self.calls.append(values)
        return values


def batcher(settings, model, executor=True):
    return Batcher("test", settings, model.launch, lambda handle: True, lambda handle: None,
                   ThreadPoolExecutor(1) if executor else None)


def submit(b, value, answers, batch_size=1, deadline=None, ids=0):
    work = Work(inputs=value, batch_size=batch_size, deadline=deadline, ids=ids,
                answer=lambda w, error: answers.append((w.inputs, error)))
    b.submit(work)
    return work


def pump_until(b, answers, count, timeout=5.0):
    end = time.monotonic() + timeout
    while len(answers) < count:
        assert time.monotonic() < end, f"{len(answers)} of {count} answers"
        b.pump(time.monotonic())
        time.sleep(0.001)


def test_batcher_merges_queued_requests_up_to_its_limits_and_answers_each_once():
    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=4, max_queue=16), model)
    for i in range(6):
        submit(b, i, answers, batch_size=2)
    pump_until(b, answers, 6)
    assert sorted(answers) == [(i, None) for i in range(6)]
    assert sorted(v for call in model.calls for v in call) == list(range(6))
    assert model.calls == [[0, 1], [2, 3], [4, 5]]  # 2 samples each, 4 per batch: full batches, none larger


def test_a_full_batch_launches_without_waiting_out_its_delay():
    """max_delay_ms is how long a batch waits for company: one holding max_batch_size samples has
    all it can take and is due at once."""
    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=4, max_queue=16, max_delay_ms=10_000), model)
    submit(b, 0, answers, batch_size=2)
    now = time.monotonic()
    assert 9.9 < b.due_in(now) <= 10.0
    submit(b, 1, answers, batch_size=2)
    assert b.due_in(now) == 0.0
    pump_until(b, answers, 2)
    assert model.calls == [[0, 1]]


def test_a_batch_full_by_ids_or_requests_launches_without_waiting_out_its_delay():
    """A batch also closes at max_ids_per_request ids and at MAX_REQUESTS requests (the module's
    contract): one that has all it can take by either is due at once, as one full by samples."""
    b = batcher(BatchSettings(max_batch_size=4096, max_queue=512, max_delay_ms=10_000, max_ids_per_request=100),
                Fake())
    now = time.monotonic()
    submit(b, 0, [], ids=60)
    assert b.due_in(now) > 9.9
    submit(b, 1, [], ids=60)  # 120 ids: the first batch can take no more than request 0
    assert b.due_in(now) == 0.0
    b = batcher(BatchSettings(max_batch_size=4096, max_queue=512, max_delay_ms=10_000), Fake())
    for i in range(MAX_REQUESTS):
        submit(b, i, [])
    assert b.due_in(now) == 0.0


def test_the_batching_delay_runs_from_the_first_request_queued_not_the_last():
    """max_delay_ms is how long the first request of a batch waits for company: one arriving later
    joins that batch and does not start the wait again (under a steady trickle a batch would never
    be due until it filled)."""
    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=8, max_queue=16, max_delay_ms=100), model, executor=False)
    t0 = time.monotonic()
    for i, at in enumerate((t0, t0 + 0.06)):
        work = Work(inputs=i, batch_size=1, deadline=None, answer=lambda w, error: answers.append((w.inputs, error)))
        work.enqueued = at
        b.submit(work)
    assert b.due_in(t0 + 0.07) == pytest.approx(0.03)
    assert not b.pump(t0 + 0.099) and model.calls == []
    assert b.pump(t0 + 0.1) and model.calls == [[0, 1]]
    b.pump(t0 + 0.1)
    assert answers == [(0, None), (1, None)]


def test_a_batch_closes_at_max_requests_requests():
    """MAX_REQUESTS is the most requests one batch takes (the rows of its descriptor table), however
    small they are: one more waits for the next batch."""
    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=4096, max_queue=1024), model, executor=False)
    for i in range(MAX_REQUESTS + 1):
        submit(b, i, answers)
    pump_until(b, answers, MAX_REQUESTS + 1)
    assert [len(call) for call in model.calls] == [MAX_REQUESTS, 1]
    assert sorted(answers) == [(i, None) for i in range(MAX_REQUESTS + 1)]


def test_batcher_closes_a_batch_at_its_id_budget():
    """Shared bags make a few samples carry many ids: a batch also stops at max_ids_per_request ids
    (the kernels' offsets are int32), and a request alone at the limit still runs."""
    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=64, max_queue=16, max_ids_per_request=100), model)
    for i in range(5):
        submit(b, i, answers, ids=60 if i else 100)
    pump_until(b, answers, 5)
    assert [len(c) for c in model.calls] == [1] * 5
    model.calls.clear()
    for i in range(3):
        submit(b, i, answers, ids=50)
    pump_until(b, answers, 8)
    assert model.calls == [[0, 1], [2]]  # two of 50 fill the budget of 100 exactly: one batch


def test_batcher_refuses_beyond_its_queue_and_expires_late_requests():
    model, answers = Fake(seconds=0.05), []
    b = batcher(BatchSettings(max_batch_size=1, max_queue=2), model)
    submit(b, "first", answers)
    b.pump(time.monotonic())  # "first" runs
    submit(b, "late", answers, deadline=time.monotonic() + 0.01)
    submit(b, "second", answers)
    with pytest.raises(Overloaded, match="queue full"):
        submit(b, "third", answers)
    time.sleep(0.03)  # "late" passes its deadline while "first" runs
    pump_until(b, answers, 3)
    outcome = {v: type(e) for v, e in answers}
    assert outcome == {"first": type(None), "late": DeadlineExpired, "second": type(None)}
    assert [c for c in model.calls] == [["first"], ["second"]]  # "late" never ran


def test_a_full_queue_frees_the_places_of_requests_whose_deadline_passed_before_refusing_one():
    """A deadline given only by the OIP ``timeout`` parameter brings no cancel when it passes: a new
    request that finds the queue full of such requests takes a place of one (answered 504 now), not
    UNAVAILABLE while the batch ahead runs."""
    model, answers = Fake(seconds=0.2), []
    b = batcher(BatchSettings(max_batch_size=1, max_queue=2), model)
    submit(b, "first", answers)
    b.pump(time.monotonic())  # "first" runs
    for value in ("late1", "late2"):
        submit(b, value, answers, deadline=time.monotonic() + 0.01)
    time.sleep(0.03)
    submit(b, "new", answers)
    assert [(v, type(e)) for v, e in answers] == [("late1", DeadlineExpired), ("late2", DeadlineExpired)]
    assert b.depth == 1
    pump_until(b, answers, 4)
    assert model.calls == [["first"], ["new"]]


def test_batcher_failure_fails_only_its_batch():
    model, answers = Fake(fail="boom"), []
    b = batcher(BatchSettings(max_batch_size=1, max_queue=8), model)
    for v in ("ok1", "boom", "ok2"):
        submit(b, v, answers)
    pump_until(b, answers, 3)
    assert {v: type(e) for v, e in answers} == {"ok1": type(None), "boom": ExecutionFailed, "ok2": type(None)}


def test_a_queued_request_cancelled_is_answered_once_and_never_runs():
    model, answers = Fake(seconds=0.05), []
    b = batcher(BatchSettings(max_batch_size=1, max_queue=8), model)
    running = submit(b, "running", answers)
    b.pump(time.monotonic())
    queued = submit(b, "queued", answers)
    b.cancel(queued)
    b.cancel(queued)  # twice: still one answer
    b.cancel(running)  # in a batch: answered with its batch
    pump_until(b, answers, 2)
    b.pump(time.monotonic())
    assert answers == [("queued", answers[0][1]), ("running", None)] and type(answers[0][1]) is Cancelled
    assert model.calls == [["running"]]


def test_a_full_pipeline_is_waited_on_without_polling_and_its_batches_answered_in_order(monkeypatch):
    """CUDA-like batcher (launch only queues work): with PIPELINE_DEPTH batches on the device, more
    queued and batches that take the device a while (the last batches' times), nothing can launch:
    the engine blocks in the oldest batch's wait (the runtime's blocking wait), and pump then answers
    it and launches the next; never while there is room to launch, nor for short batches."""
    device = {}  # batch's first value -> threading.Event set when "the device" has done it
    launched = []

    def launch(works):
        launched.append(works[0].inputs)
        return device.setdefault(works[0].inputs, threading.Event())

    answers = []
    b = Batcher("test", BatchSettings(max_batch_size=1, max_queue=8), launch, lambda done: done.is_set(),
                lambda done: done.wait(5))
    submit(b, 0, answers)
    b.pump(time.monotonic())
    assert not b.full and saturated([b]) is None  # room: a new request launches at once
    threading.Timer(0.06, device[0].set).start()
    pump_until(b, answers, 1)  # batches take about 60 ms
    for i in range(1, 4):
        submit(b, i, answers)
    b.pump(time.monotonic())
    assert launched == [0, 1, 2] and b.full  # batch 3 waits for room
    assert saturated([b]) is b
    threading.Timer(0.05, device[1].set).start()
    began = time.monotonic()
    b.wait_oldest()
    assert time.monotonic() - began >= 0.04 and device[1].is_set() and not device[2].is_set()
    b.pump(time.monotonic())
    assert answers == [(0, None), (1, None)] and launched == [0, 1, 2, 3]
    # Batches shorter than the threshold (a blocking wait would wake too late): polled, full or not.
    monkeypatch.setattr(batcher_module, "BLOCK_MIN_BATCH_S", 1.0)
    assert b.full and saturated([b]) is None
    for done in device.values():
        done.set()


def test_router_sends_a_request_to_the_replica_with_the_least_work():
    settings = BatchSettings(max_batch_size=1, max_queue=8)
    busy, idle = batcher(settings, Fake(), executor=False), batcher(settings, Fake(), executor=False)
    answers = []
    submit(busy, "x", answers)
    router = Router([busy, idle])
    for v in ("a", "b", "c"):
        router.submit(Work(inputs=v, batch_size=1, deadline=None))
    assert (busy.depth, idle.depth) == (2, 2)  # 1 + 1 and 2: ties go to the first
    router.submit(Work(inputs="d", batch_size=1, deadline=None))
    assert (busy.depth, idle.depth) == (3, 2)



def test_router_skips_a_replica_whose_queue_is_full_while_another_has_room():
    """The replica with the least work can be one whose queue is full (its batches all queued, none
    running) while another runs two batches with a request queued: the request goes to the one with
    room; QueueFull only when every queue is full."""
    settings = BatchSettings(max_batch_size=1, max_queue=2)
    running = Batcher("running", settings, Fake().launch, lambda handle: False, lambda handle: None, None)
    queued = batcher(settings, Fake(), executor=False)
    answers = []
    for v in ("a", "b"):
        submit(running, v, answers)
    running.pump(time.monotonic())
    submit(running, "c", answers)
    for v in ("d", "e"):
        submit(queued, v, answers)
    assert (running.load, running.depth, queued.load, queued.depth) == (3, 1, 2, 2)
    router = Router([running, queued])
    router.submit(Work(inputs="f", batch_size=1, deadline=None))
    assert (running.depth, queued.depth) == (2, 2)
    with pytest.raises(QueueFull, match="queue full"):
        router.submit(Work(inputs="g", batch_size=1, deadline=None))
    assert answers == []


def test_router_with_every_queue_full_frees_the_places_of_late_requests_on_any_replica():
    """Every replica's queue full: only the one with the least work looked for requests past their
    deadline, so a request got QueueFull (UNAVAILABLE) while another replica's queue held only late
    requests whose places it could have taken (answered DEADLINE_EXCEEDED now)."""
    settings = BatchSettings(max_batch_size=1, max_queue=2)
    running = Batcher("running", settings, Fake().launch, lambda handle: False, lambda handle: None, None)
    queued = batcher(settings, Fake(), executor=False)
    answers = []
    submit(running, "a", answers)
    running.pump(time.monotonic())
    for v in ("late1", "late2"):
        submit(running, v, answers, deadline=time.monotonic() - 1)
    for v in ("b", "c"):
        submit(queued, v, answers)
    assert (running.load, running.depth, queued.load, queued.depth) == (3, 2, 2, 2)
    Router([running, queued]).submit(Work(inputs="new", batch_size=1, deadline=None))
    assert [(v, type(e)) for v, e in answers] == [("late1", DeadlineExpired), ("late2", DeadlineExpired)]
    assert [w.inputs for w in running._queue] == ["new"] and queued.depth == 2

@pytest.mark.gpu
def test_a_refused_page_lock_leaves_its_error_on_the_pinning_thread_only():
    """The engine page-locks front ends' buffers on a thread of its own (serving/engine/core.py
    page_lock): a refused cudaHostRegister leaves its error in that thread's CUDA state, where no
    batch is launched. On the launching thread the same refusal fails the next kernel."""
    arena = ipc.Arena(1 << 20)
    arena.touch()
    index = torch.tensor([7, 0], device="cuda")
    values = torch.arange(8, device="cuda")
    assert page_lock(arena)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="engine-pinning") as pinning:
            with pytest.raises(OSError, match="712"):  # registered already: refused there
                pinning.submit(page_lock, arena).result()
        assert values.index_select(0, index).tolist() == [7, 0]  # this thread's kernels run
        with pytest.raises(OSError, match="712"):  # refused on this thread ...
            page_lock(arena)
        with pytest.raises(Exception, match="already"):  # ... and its next kernel fails with that error
            values.index_select(0, index)
        assert values.index_select(0, index).tolist() == [7, 0]  # (read once, the error is gone)
    finally:
        page_unlock(arena)
        arena.close()


@pytest.mark.gpu
def test_a_buffer_unmapped_while_page_locked_is_refused_at_its_address_and_not_copied_from():
    """Why the engine unlocks a front end's buffer before it unmaps it (core.py ``_release``), and
    refuses a buffer CUDA finds locked already (error 712) instead of copying from it as pageable
    memory: the lock outlives the mapping, and a copy from a new mapping at its address reads the
    old pages (what the device read of a request in the seventh H200 run, docs/benchmarks.md)."""
    import ctypes
    import mmap
    import os
    from types import SimpleNamespace

    from serving.engine import cudart
    from serving.engine.core import _address

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size = 1 << 20
    first = ipc.Arena(size)
    first.bytes[:] = 1
    address = _address(first)
    assert page_lock(first)
    first.close()  # unmapped, still locked
    fd = os.memfd_create("second")
    mapped = None
    try:  # the lock is released whatever fails: left behind, it would poison this address for later tests
        os.ftruncate(fd, size)
        mapped = libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10, fd, 0)  # MAP_FIXED
        assert mapped == address
        second = SimpleNamespace(map=(ctypes.c_uint8 * size).from_address(address), size=size)
        np.frombuffer(second.map, np.uint8)[:] = 2
        device = torch.zeros(size, dtype=torch.uint8, device="cuda")
        cudart.runtime().copy(device.data_ptr(), address, size, cudart.HOST_TO_DEVICE,
                              torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        seen = device.unique().tolist()
        with ThreadPoolExecutor(1, thread_name_prefix="engine-pinning") as pinning:
            refused = pinning.submit(page_lock, second).exception()
        assert seen == [1], f"the device read {seen} from the new mapping"
        assert isinstance(refused, OSError) and "712" in str(refused)
    finally:
        with ThreadPoolExecutor(1) as other:  # its error, if any, stays on that thread
            other.submit(torch.cuda.cudart().cudaHostUnregister, address).result()
        if mapped == address:
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.munmap(address, size)
        os.close(fd)


def test_a_fixed_shape_descriptor_holds_no_rows_of_earlier_batches():
    """Graphs read all MAX_REQUESTS rows: a row left from a larger earlier batch would be read as a
    request (its ids past the batch's, an out-of-bounds lookup on a GPU)."""
    asm = Assembler(SCHEMA, torch.device("cpu"))

    def item(b):
        return host_item(model_kjt(decode(["a"], [1] * b, [3] * b), None, SCHEMA), SCHEMA, False, lookup=True)

    for count in (5, 3, 1, 1, 1, 1, 2, 1):  # more stagings than host descriptors, shrinking batches
        staged = asm.stage([item(2) for _ in range(count)], exact=False)
        table = staged.descriptor
        assert table.shape[0] > count and bool((table[count:] == 0).all()) and bool((table[:count, 1] == 2).all())


def test_an_unreadable_engine_message_takes_the_engine_gone_path():
    """#22 item 2: a control message the front end cannot read (here: one announced larger than any
    message may be) used to kill the front end's reader silently, leaving health SERVING and every
    request hanging. Now the link goes the way of an engine gone: requests in flight fail with
    UNAVAILABLE, their slots are freed, and the front end is told to exit non-zero."""
    import asyncio
    import struct

    from serving.errors import DeviceLost
    from serving.frontend.link import EngineLink

    lost = []

    async def scenario():
        link = EngineLink("/nonexistent", 1 << 20, 0, on_state=lambda: None, on_lost=lost.append)
        link.ready = True
        offset = link.arena.alloc(4096)
        waiting = asyncio.get_running_loop().create_future()
        link._pending[7] = (waiting, offset)
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack("<I", ipc.MAX_MESSAGE + 1))
        await link._read(reader)
        with pytest.raises(DeviceLost):
            await asyncio.wait_for(waiting, 5)  # answered, not left waiting
        return link

    link = asyncio.run(scenario())
    assert lost == [1] and not link.ready and not link.accepting
    assert link.arena.used_bytes == 0 and link.in_flight == 0


def test_a_request_checked_against_a_replaced_version_runs_only_where_its_layout_still_holds(tmp_path):
    """The engine swapped versions between a front end's check and the engine's take: an unpinned
    request runs on the new version if it takes the same layout, else UNAVAILABLE "changed its
    inputs ... retry"; a request pinned to the old version gets NOT_FOUND. A version reloaded under
    its own number with other inputs is such a swap too (the request's model_id names the layout):
    the request runs on the old copy while that copy drains (in its grace or held), else UNAVAILABLE."""
    import asyncio
    from types import SimpleNamespace

    from serving.config import ServerConfig
    from serving.engine.core import Engine
    from serving.errors import ModelNotFound

    engine = Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
    engine.repo.ready = True
    # Layout 0: what version 2 was published with; layout 1: another (another schema, or shared bags
    # pooled once), e.g. version 1's, or version 2's before it was reloaded with other inputs.
    engine._names = {0: "m", 1: "m"}
    engine.repo.served = {"m": {2: SimpleNamespace(version=2, layout_id=0, state="READY")}}

    def submission(version, pinned=False, layout=0):
        return ipc.Submission(ipc.PREDICT, ipc.PINNED if pinned else 0, layout, 1, version, None, 1, 0, 1, 1, 0, 64,
                              256)

    assert engine._version_for(submission(2)) is engine.repo.models["m"]
    assert engine._version_for(submission(2, pinned=True)) is engine.repo.models["m"]
    assert engine._version_for(submission(1)) is engine.repo.models["m"]
    with pytest.raises(ModelNotFound, match=r"version 1 is not loaded; serving versions \[2\]"):
        engine._version_for(submission(1, pinned=True))
    for version, pinned in ((1, False), (2, False), (2, True)):
        with pytest.raises(Overloaded, match="model 'm' changed its inputs while the request was in flight; retry"):
            engine._version_for(submission(version, pinned, layout=1))
    old = SimpleNamespace(name="m", version=2, layout_id=1, state="DRAINING", drained=asyncio.Event())
    engine.repo._draining = [old]  # version 2 before its reload, draining
    assert engine._version_for(submission(2, layout=1)) is old
    assert engine._version_for(submission(2, pinned=True, layout=1)) is old
    old.drained.set()  # released: nothing runs on it any more
    with pytest.raises(Overloaded, match="changed its inputs"):
        engine._version_for(submission(2, layout=1))
    # Version 1 (same inputs as 2) replaced by 2 and draining: a request laid out for 1 finishes on 1,
    # not on 2. An OIP request for both outputs makes two model calls: split over the swap, one ran on
    # 1 and the other on 2, and the client got UNAVAILABLE "changed version during the request".
    one = SimpleNamespace(name="m", version=1, layout_id=0, state="DRAINING", drained=asyncio.Event())
    engine.repo._draining = [one]
    assert engine._version_for(submission(1)) is one
    assert engine._version_for(submission(1, pinned=True)) is one
    one.drained.set()
    assert engine._version_for(submission(1)) is engine.repo.models["m"]


@pytest.mark.gpu
def test_a_batch_staged_through_the_cuda_runtime_equals_one_staged_through_torch():
    """Copies in, descriptor and copies out through libcudart directly (serving/engine/cudart.py) give
    the staging buffer, descriptor and results that torch's own copy calls give."""
    requests = [decode(["b", "a"], [2, 0, 1, 1], [5, 6, 1, 2], vdt=np.int32), decode(["a", "b", "c"], [1, 1, 1], [9, 19, 29])]
    dense = [np.array([[1.5, -2.0], [0.5, 3.0]], np.float32), np.array([[-1.0, 4.0]], np.float32)]
    direct, through_torch = Assembler(SCHEMA, torch.device("cuda")), Assembler(SCHEMA, torch.device("cuda"))
    assert direct.runtime is not None  # the runtime torch loaded was found
    through_torch.runtime = None
    seen = []
    for asm in (direct, through_torch):
        predict = [host_item(model_kjt(s, d, SCHEMA), SCHEMA, False, lookup=False) for s, d in zip(requests, dense)]
        lookup = [host_item(model_kjt(s, None, SCHEMA), SCHEMA, False, lookup=True) for s in requests]
        for it in predict + lookup:
            it.memory = it.memory.pin_memory()
        for _ in range(3):  # both staging halves; a host descriptor used again
            staged = asm.stage(predict, exact=False)
            asm.write_results(predict, torch.arange(4, dtype=torch.float32, device="cuda") + 0.25, staged)
        staged_lookup = asm.stage(lookup, exact=True)
        pooled = torch.arange(3 * 9, dtype=torch.float32, device="cuda").view(3, 9)
        asm.write_results(lookup, pooled, staged_lookup)
        torch.cuda.synchronize()
        seen.append((asm.words.cpu(), asm.descriptor.cpu(), [host_result(it, 1).tolist() for it in predict],
                     [host_result(it, 9).tolist() for it in lookup]))
    (words, descriptor, ctr, rows), (torch_words, torch_descriptor, torch_ctr, torch_rows) = seen
    assert torch.equal(words, torch_words) and torch.equal(descriptor, torch_descriptor)
    assert descriptor[:2, 1].tolist() == [2, 1]  # the lookup batch's rows: B of each request
    assert ctr == torch_ctr == [[0.25, 1.25], [2.25]]
    assert rows == torch_rows == [pooled[:2].tolist(), pooled[2:3].tolist()]


def test_a_failed_cuda_runtime_call_raises_a_cuda_error_and_clears_the_threads_last_error():
    """serving/engine/cudart.py against a stand-in libcudart: a failing call raises the error the
    runner treats as a CUDA failure (its FATAL_DEVICE_ERRORS decide), and clears the thread's last
    error, which torch's next kernel launch check would otherwise raise for another batch."""
    from serving.engine import cudart
    from serving.engine.runner import FATAL_DEVICE_ERRORS

    calls = []

    class Lib:
        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                if name == "cudaGetErrorString":
                    return b"invalid argument"
                return 1 if name == "cudaMemcpyAsync" else 0
            setattr(self, name, call)
            return call

    runtime = cudart.Runtime(Lib())
    runtime.record(1, 0)  # succeeds: nothing raised, nothing cleared
    assert calls == ["cudaEventRecord"]
    with pytest.raises(RuntimeError) as exc:
        runtime.copy(16, 32, 8, cudart.HOST_TO_DEVICE, 0)
    assert str(exc.value) == "CUDA error: invalid argument (1) in cudaMemcpyAsync"
    assert any(marker in str(exc.value) for marker in FATAL_DEVICE_ERRORS)
    assert calls[1:] == ["cudaMemcpyAsync", "cudaGetLastError", "cudaGetErrorString"]


@pytest.mark.parametrize("error, probe, fatal", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), None, True),
    (RuntimeError("shape '[8, 32]' is invalid for input of size 384"), None, False),
    (RuntimeError("shape '[8, 32]' is invalid for input of size 384"), RuntimeError("CUDA error: unspecified launch "
                                                                                     "failure"), True),
    (RuntimeError("CUDA error: out of memory"), None, False),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), None, False),
    (RuntimeError("CUDA error: out of memory"), RuntimeError("CUDA error: an illegal memory access was encountered"),
     True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
     torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), False),
    # A launch or a call this device refuses (CUDA's non-sticky errors): the call did nothing, the
    # context works. As device loss, one request shape or one artifact's warm-up restarted the server,
    # again at each start (the load's DeviceFailed).
    (RuntimeError("CUDA error: invalid configuration argument\nCompile with `TORCH_USE_CUDA_DSA` to enable "
                  "device-side assertions."), None, False),
    (RuntimeError("CUDA error: too many resources requested for launch"), None, False),
    (RuntimeError("CUDA error: no kernel image is available for execution on the device"), None, False),
    (RuntimeError("CUDA error: invalid device function"), None, False),
    (RuntimeError("CUDA error: invalid argument"), None, False),
    (RuntimeError("CUDA error: invalid argument"), RuntimeError("CUDA error: an illegal memory access was "
                                                                "encountered"), True),
])
def test_only_a_device_that_no_longer_works_is_lost_never_one_out_of_memory(monkeypatch, error, probe, fatal):
    """runner.device_unusable decides whether a failed batch or load takes the server down (exit 3).
    An allocation refused ("CUDA error: out of memory" from a CUDA call, cuBLAS's handle; or the
    caching allocator's OutOfMemoryError when the probe could not get its one float either) left the
    context usable, but was device loss: a batch or a new version too large for the memory left
    restarted the server, instead of failing alone."""
    from serving.engine.runner import device_unusable

    probed = []

    class Probe:
        def add_(self, value):
            return self

        def item(self):
            if probe is not None:
                raise probe
            return 2.0

    def ones(*size, device=None, **kwargs):
        probed.append(str(device))
        return Probe()

    monkeypatch.setattr(torch, "ones", ones)
    assert device_unusable(error, torch.device("cuda:1")) is fatal
    assert probed == ([] if "illegal memory access" in str(error) else ["cuda:1"])


def _engine_serving_a_stand_in(tmp_path, submit, arena_bytes: int, ring: int):
    """An Engine (not started) whose model "m" v2 is a stand-in counting what it holds (``in_flight``)
    and handing each submission to ``submit(mv, rpc, work)``, and one front end's link to it:
    (engine, version, link, arena, channel); the caller closes the arena and channel."""
    from types import SimpleNamespace

    from serving.config import ServerConfig
    from serving.engine.core import Engine, FrontEndLink
    from serving.statistics import VersionStatistics

    class Version(SimpleNamespace):
        def acquire(self):
            self.in_flight += 1

        def release(self):
            self.in_flight -= 1

        def submit(self, rpc, work):
            submit(self, rpc, work)

    engine = Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
    engine.repo.ready, engine._names = True, {0: "m"}
    mv = Version(name="m", version=2, layout_id=0, state="READY", schema=SCHEMA, in_flight=0,
                 statistics=VersionStatistics())
    engine.repo.served = {"m": {2: mv}}
    arena, channel = ipc.Arena(arena_bytes), ipc.Channel(ring)
    link = FrontEndLink(0, arena, channel, torch.from_numpy(arena.bytes), False, None)
    return engine, mv, link, arena, channel


def test_a_request_the_engine_takes_holds_its_version_until_answered_or_refused(tmp_path):
    """The engine counts a request on its version (a draining copy is released when that count is 0)
    from its take to its answer, and not at all if its batcher refuses it (queue full): each ends with
    one completion record, its code the error's, and holds nothing after."""
    import math
    from serving.errors import ANSWER_ERRORS, DeviceLost

    def submit(mv, rpc, work):
        if mv.refuse:
            raise QueueFull("queue full")
        mv.queued.append(work)

    engine, mv, link, arena, channel = _engine_serving_a_stand_in(tmp_path, submit, 1 << 16, 16)
    mv.refuse, mv.queued = False, []

    def take(rid):
        engine._take(link, ipc.Submission(ipc.PREDICT, 0, 0, rid, 2, None, 1, 0, 1, 1, 0, 64, 256))
        return [(r, version, code, message.rstrip(b"\0")) for r, version, code, *_, message
                in channel.completions.take()]

    try:
        assert take(7) == [] and (mv.in_flight, list(link.works)) == (1, [7])
        work = mv.queued.pop()
        work.answer(work, None)  # its batch ended
        assert (mv.in_flight, link.works) == (0, {})
        assert [(r, v, c) for r, v, c, _ in take(8)] == [(7, 2, 0)] and mv.in_flight == 1  # 8 is queued now
        work = mv.queued.pop()
        work.answer(work, Overloaded("unloading"))
        mv.refuse = True
        assert take(9) == [(8, 2, 1 + ANSWER_ERRORS.index(Overloaded), b"unloading"),
                           (9, 2, 1 + ANSWER_ERRORS.index(QueueFull), b"queue full")]
        assert (mv.in_flight, link.works) == (0, {})
        engine.exit_code = 3  # the device failed: nothing more runs on it
        mv.refuse = False
        assert take(10) == [(10, 2, 1 + ANSWER_ERRORS.index(DeviceLost), DeviceLost.MESSAGE.encode())]
        assert (mv.in_flight, link.works, mv.queued) == (0, {}, [])
    finally:
        arena.close()
        channel.close()


def test_a_malformed_request_descriptor_is_refused_alone_and_never_queued(tmp_path):
    """The engine trusts a front end to lay requests out, not to stay inside its buffer: a descriptor
    whose block or result would reach past the buffer (a Lookup's result is B rows of the pooled
    width, a Predict's one CTR each), whose batch size is 0 or above the model's, or whose kind is not
    an RPC is answered INTERNAL "internal error" on its own, holds nothing and never reaches a batch;
    the well-formed requests of the same round are queued as usual."""
    from serving.errors import ANSWER_ERRORS

    queued = []
    size = 1 << 16
    engine, mv, link, arena, channel = _engine_serving_a_stand_in(
        tmp_path, lambda mv, rpc, work: queued.append((rpc, work.tag[1])), size, 64)
    width = SCHEMA.pooled_width
    descriptors = {  # rid: (kind, batch_size, extra, slot, block_bytes, result_at), and whether it is well formed
        1: ((ipc.PREDICT, 1, 0, 0, 64, size - 4), True),  # its one CTR ends at the buffer's end
        2: ((ipc.PREDICT, 1, 0, 0, 64, size - 3), False),  # ... one byte past it
        3: ((ipc.LOOKUP, 2, 0, 0, 64, size - 8 * width), True),
        4: ((ipc.LOOKUP, 2, 0, 0, 64, size - 8 * width + 4), False),  # fits as a Predict's, not as pooled rows
        5: ((ipc.PREDICT, 0, 0, 0, 64, 256), False),
        6: ((ipc.PREDICT, SCHEMA.max_batch_size, 0, 0, 64, 256), True),
        7: ((ipc.PREDICT, SCHEMA.max_batch_size + 1, 0, 0, 64, 256), False),
        8: ((ipc.PREDICT, 1, 1, 0, 64, 256), True),
        9: ((ipc.PREDICT, 1, 2, 0, 64, 256), False),
        10: ((ipc.PREDICT, 1, 0, 0, 256, 256), True),
        11: ((ipc.PREDICT, 1, 0, 0, 257, 256), False),  # its block runs into its result
        12: ((7, 1, 0, 0, 64, 256), False),
    }
    try:
        for rid, ((kind, batch_size, extra, slot, block_bytes, result_at), _) in descriptors.items():
            engine._take(link, ipc.Submission(kind, 0, 0, rid, 2, None, batch_size, extra, 1, 1, slot, block_bytes,
                                              result_at))
        answered = [(rid, version, code, message.rstrip(b"\0")) for rid, version, code, *_, message
                    in channel.completions.take()]
        bad = 1 + ANSWER_ERRORS.index(ExecutionFailed)
        assert answered == [(rid, 2, bad, b"internal error") for rid, (_, good) in descriptors.items() if not good]
        assert queued == [("Lookup" if kind == ipc.LOOKUP else "Predict", rid)
                          for rid, ((kind, *_), good) in descriptors.items() if good]
        assert mv.in_flight == len(queued) and sorted(link.works) == [rid for _, rid in queued]
    finally:
        arena.close()
        channel.close()


def test_at_shutdown_a_request_still_queued_after_the_grace_period_is_refused_not_run(tmp_path):
    """Engine.shutdown: once the grace period is over, what still waits for a batch is answered
    UNAVAILABLE "server is shutting down" (the client retries elsewhere); it never runs after it."""
    import asyncio
    from types import SimpleNamespace

    from serving.config import ServerConfig
    from serving.engine.core import Engine

    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=4, max_queue=16, max_delay_ms=60_000), model)

    async def close(release=True):
        b.closed = True
        while b.busy:
            await asyncio.sleep(0.005)

    async def scenario():
        engine = Engine(ServerConfig(repo=tmp_path, grace_period_s=0.05), str(tmp_path / "engine.sock"))
        mv = SimpleNamespace(name="m", version=1, state="READY", routers={"Predict": Router([b])}, batchers=[b],
                             close=close)
        engine.repo.served = {"m": {1: mv}}
        engine._pump_task = engine._spawn(engine._pump())
        submit(b, 0, answers)  # waits for company: a batch of 1 of 4, due in a minute
        await asyncio.sleep(0.05)
        await engine.shutdown()

    asyncio.run(scenario())
    assert [(value, type(error).__name__, str(error)) for value, error in answers] == \
        [(0, "Overloaded", "server is shutting down; retry on another replica")]
    assert model.calls == []


def _front_end(works):
    """A connected front end's side in the engine (its buffer and rings real, its socket not)."""
    from types import SimpleNamespace

    from serving.engine.core import FrontEndLink

    arena, channel = ipc.Arena(1 << 16), ipc.Channel(16)
    return FrontEndLink(0, arena, channel, torch.from_numpy(arena.bytes), False,
                        SimpleNamespace(close=lambda: None), works)


def _held(link, rid, value, answers):
    """A request of ``link`` as the engine holds it: answered, it leaves the front end's works."""
    def answer(work, error):
        answers.append((work.inputs, error))
        link.works.pop(rid)

    link.works[rid] = work = Work(inputs=value, batch_size=1, deadline=None, answer=answer)
    return work


def test_at_shutdown_a_request_queued_within_the_grace_period_runs_and_is_answered(tmp_path):
    """Engine.shutdown: what a front end still has in flight is given the grace period to finish; a
    request waiting out its batching delay runs and is answered in full, not refused at once, and
    the engine stops as soon as it is answered, not at the end of the grace period."""
    import asyncio
    from types import SimpleNamespace

    from serving.config import ServerConfig
    from serving.engine.core import Engine

    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=4, max_queue=16, max_delay_ms=200), model, executor=False)

    async def close(release=True):
        b.closed = True

    async def scenario():
        engine = Engine(ServerConfig(repo=tmp_path, grace_period_s=3600), str(tmp_path / "engine.sock"))
        mv = SimpleNamespace(name="m", version=1, state="READY", routers={"Predict": Router([b])}, batchers=[b],
                             close=close)
        engine.repo.served = {"m": {1: mv}}
        link = _front_end({})
        engine.links = [link]
        engine._pump_task = engine._spawn(engine._pump())
        b.submit(_held(link, 1, 0, answers))  # waits 0.2 s for company
        await asyncio.wait_for(engine.shutdown(), 60)  # not the hour's grace
        return engine.links, link.closed

    links, closed = asyncio.run(scenario())
    assert answers == [(0, None)] and model.calls == [[0]]
    assert (links, closed) == ([], True)


def test_a_front_end_that_goes_has_its_queued_requests_cancelled_not_run(tmp_path):
    """Its connection ends (it stopped, or died): nobody reads its answers any more. Its requests
    still waiting for a batch are dropped (answered CANCELLED, their queue places free), never run,
    and its buffer is released once none is left, not after their batching delay."""
    import asyncio

    from serving.config import ServerConfig
    from serving.engine.core import Engine

    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=4, max_queue=16, max_delay_ms=60_000), model, executor=False)

    async def scenario():
        engine = Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
        link = _front_end({})
        engine.links = [link]
        for rid in (1, 2):
            b.submit(_held(link, rid, rid, answers))
        gone = asyncio.StreamReader()
        gone.feed_eof()
        await asyncio.wait_for(engine._serve(link, gone), 5)
        return engine.links, link.closed

    assert asyncio.run(scenario()) == ([], True)
    assert [(value, type(error)) for value, error in answers] == [(1, Cancelled), (2, Cancelled)]
    assert model.calls == [] and b.depth == 0


def test_a_batcher_failed_at_shutdown_refuses_what_comes_after():
    """fail_queued (the engine stops, or its device failed) answers what waits and closes the batcher:
    a request that reaches it afterwards is refused UNAVAILABLE at once, never queued to run past
    the grace period."""
    model, answers = Fake(), []
    b = batcher(BatchSettings(max_batch_size=4, max_queue=16, max_delay_ms=60_000), model, executor=False)
    submit(b, "queued", answers)
    b.fail_queued(Overloaded("server is shutting down; retry on another replica"))
    with pytest.raises(Overloaded, match="^test is unloading; retry$") as refused:
        submit(b, "late", answers)
    assert type(refused.value) is Overloaded and b.depth == 0
    assert [(value, str(error)) for value, error in answers] == \
        [("queued", "server is shutting down; retry on another replica")]
    b.pump(time.monotonic())
    assert model.calls == []


def _gpu_engine(tmp_path, monkeypatch, engine_index, engines, pool_bytes):
    """An engine on CUDA with one model version whose runner's graphs hold ``pool_bytes`` on its cuda:0."""
    from types import SimpleNamespace

    from serving.config import ServerConfig
    from serving.engine.core import Engine

    engine = Engine(ServerConfig(repo=tmp_path, engine_index=engine_index, engines=engines),
                    str(tmp_path / "engine.sock"))
    engine.repo.device = "cuda"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 7 << 30)
    runner = SimpleNamespace(device="cuda:0", forward=SimpleNamespace(pool_bytes=lambda: pool_bytes),
                             cache_stats=SimpleNamespace(read=dict))
    depth = SimpleNamespace(depth=0)
    engine.repo.served = {"m": {1: SimpleNamespace(name="m", version=1, runners=[runner],
                                                   routers={"Predict": depth, "Lookup": depth})}}
    return engine


def test_a_second_gpu_engines_memory_gauges_name_its_own_gpu(tmp_path, monkeypatch):
    """Engine i > 0 sees only GPU i, as its cuda:0 (serving/supervisor.py): its GPU memory and CUDA
    graph pool gauges said device="cuda:0", where engine 0 reports GPU 0 (the series are merged by
    livemax: GPU 1's figures were lost in GPU 0's, and GPU 1's series showed engine 0's share only)."""
    engine = _gpu_engine(tmp_path, monkeypatch, engine_index=1, engines=2, pool_bytes=5 << 20)
    engine._gauges()
    value = engine.metrics.registry.get_sample_value
    assert value("recserve_gpu_memory_bytes", {"device": "cuda:1"}) == 7 << 30
    assert value("recserve_cuda_graph_pool_bytes", {"device": "cuda:1"}) == 5 << 20
    assert value("recserve_gpu_memory_bytes", {"device": "cuda:0"}) is None
    assert value("recserve_cuda_graph_pool_bytes", {"device": "cuda:0"}) is None


def test_the_graph_pool_gauge_goes_back_to_zero_once_the_last_model_on_its_gpu_is_released(tmp_path, monkeypatch):
    """A released version's graphs and their pool go with it (ModelVersion.close): the gauge kept the
    last figure of a GPU that no longer held any model's graphs."""
    engine = _gpu_engine(tmp_path, monkeypatch, engine_index=0, engines=1, pool_bytes=5 << 20)
    engine._gauges()
    value = engine.metrics.registry.get_sample_value
    assert value("recserve_cuda_graph_pool_bytes", {"device": "cuda:0"}) == 5 << 20
    engine.repo.served = {}  # unloaded
    engine._gauges()
    assert value("recserve_cuda_graph_pool_bytes", {"device": "cuda:0"}) == 0


async def _turned_away(engine, arena, channel):
    """A front end's hello with its buffer and rings: True if the engine closes the connection."""
    import asyncio
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(engine.socket_path)
    ipc.send_fds(sock, ipc.Hello(0, arena.size, channel.capacity), [arena.fd, *channel.fds])
    sock.setblocking(False)
    try:
        return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), 10) == b""
    finally:
        sock.close()


def _stop_engine_and_front_end(engine, arena, channel):
    for task in list(engine._tasks):
        task.cancel()
    engine._listener.close()
    engine._pinning.shutdown()
    arena.close()
    channel.close()


@pytest.mark.parametrize("locked", [False, True])
def test_a_front_end_whose_buffer_cannot_be_page_locked_leaves_no_mapping_or_descriptor_behind(tmp_path, monkeypatch,
                                                                                               locked):
    """CUDA: a front end's buffer refused by cudaHostRegister (error 712, core.py page_lock) is turned
    away; the engine kept its mappings of that buffer and rings and their four file descriptors, for
    the life of the process (a front end restarted by its operator leaked one more set each time).
    One locked before the connection failed is unlocked before it is unmapped."""
    import asyncio
    import gc
    import os

    from serving.config import ServerConfig
    from serving.engine import core

    def refused(arena):
        raise OSError("its buffer overlaps memory page-locked earlier and never unlocked (cudaHostRegister error 712)")

    async def no_connection(sock):
        raise OSError("connection reset")

    unlocked = []
    if locked:
        monkeypatch.setattr(core, "page_lock", lambda arena: True)
        monkeypatch.setattr(core, "page_unlock", lambda arena: unlocked.append(arena.map.closed))
        monkeypatch.setattr(core.asyncio, "open_connection", no_connection)
    else:
        monkeypatch.setattr(core, "page_lock", refused)

    def arena_mappings():
        with open("/proc/self/maps") as maps:
            return sum("recserve-arena" in line for line in maps)

    async def scenario():
        engine = core.Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
        engine.repo.device = "cuda"
        await engine.start()
        arena, channel = ipc.Arena(1 << 20), ipc.Channel(16)
        gc.collect()  # an earlier test's buffers released now, not while this one counts
        fds, mappings = len(os.listdir("/proc/self/fd")), arena_mappings()
        assert await _turned_away(engine, arena, channel)
        left = len(os.listdir("/proc/self/fd")) - fds, arena_mappings() - mappings, len(engine.links)
        _stop_engine_and_front_end(engine, arena, channel)
        return left

    left = asyncio.run(scenario())
    assert unlocked == ([False] if locked else [])  # while still mapped
    assert left == (0, 0, 0)


@pytest.mark.parametrize("fatal", [True, False])
def test_a_device_failure_page_locking_a_front_ends_buffer_takes_the_engine_down_as_a_batchs_would(tmp_path,
                                                                                                  monkeypatch, fatal):
    """page_lock's first CUDA call may start the CUDA runtime; a CUDA error there (a RuntimeError) killed
    the engine's accept loop, and the engine exited 1, its front ends told nothing. Now one that left the
    device unusable (as a batch's is classified) takes the fatal path, exit 3 and ipc.Fatal; any other
    turns that front end away and the engine goes on."""
    import asyncio

    from serving.config import ServerConfig
    from serving.engine import core

    def failing(arena):
        raise RuntimeError("CUDA error: unspecified launch failure" if fatal else "cudart: no such symbol")

    monkeypatch.setattr(core, "page_lock", failing)
    classified = []
    unusable = core.device_unusable
    monkeypatch.setattr(core, "device_unusable",
                        lambda exc, device: classified.append(str(device)) or unusable(exc, torch.device("cpu")))

    async def scenario():
        engine = core.Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
        engine.repo.device = "cuda"
        await engine.start()
        arena, channel = ipc.Arena(1 << 20), ipc.Channel(16)
        turned_away = await _turned_away(engine, arena, channel)
        await asyncio.sleep(0.01)
        accepting = any(not task.done() and task.get_coro().__name__ == "_accept" for task in engine._tasks)
        outcome = turned_away, accepting, engine.exit_code, engine._stop.is_set(), engine.links
        _stop_engine_and_front_end(engine, arena, channel)
        return outcome

    assert asyncio.run(scenario()) == (True, True, 3 if fatal else 0, fatal, [])
    assert classified == ["cuda"]


def test_a_staging_buffer_that_cannot_grow_fails_its_batch_only(monkeypatch):
    """A batch larger than the staging buffer grows it (Assembler.reserve): the old buffer was dropped
    before the new one was allocated, and a failed allocation (out of memory) left none, with the old
    size still recorded. Every later batch then failed ('NoneType' object is not subscriptable) until
    a restart; on CUDA, where the copies go to the staging buffer's address, they were written into
    the freed buffer and read there by the captured graphs, whoever the allocator gave it to."""
    from serving.engine.assemble import Item

    asm = Assembler(SCHEMA, torch.device("cpu"))
    small = host_item(model_kjt(decode(["a", "c"], [1, 2], [9, 0, 29]), None, SCHEMA), SCHEMA, False, lookup=True)
    asm.stage([small], exact=True)
    generation = asm.generation
    zeros = torch.zeros

    def out_of_memory(*size, **kwargs):
        if kwargs.get("dtype") == torch.int32 and size and size[0] > 2 << 20:  # grown past the first 2 x 4 MiB
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return zeros(*size, **kwargs)

    monkeypatch.setattr(torch, "zeros", out_of_memory)
    large = Item(small.memory, 0, 8 << 20, small.result_at, 1, 0, 3, 3)  # more than a half holds
    with pytest.raises(torch.OutOfMemoryError):
        asm.stage([large], exact=True)
    staged = asm.stage([small], exact=True)  # the next batch, of the old size
    values, lengths, _, _, _ = gather(asm.words, staged.descriptor, 3, 0, asm.wide_ids, staged.columns, staged.ids,
                                      staged.rows, staged.repeats)
    assert values.tolist() == [9, 0, 29] and lengths.tolist() == [[1], [0], [2]]
    assert asm.generation > generation  # graphs that read the old buffer are captured again


def test_a_request_whose_deadline_passes_behind_the_other_rpcs_batch_on_its_worker_is_not_run():
    """On the CPU a replica's Predict and Lookup batchers share one worker thread: a Lookup batch
    launched while a Predict batch holds the thread waits for it. A request whose deadline passes in
    that wait is answered DeadlineExpired and left out of its batch; its batch-mates still run."""
    model, answers = Fake(seconds=0.1), []
    worker = ThreadPoolExecutor(1)
    predict = Batcher("predict", BatchSettings(max_batch_size=4, max_queue=8), model.launch, lambda h: True,
                      lambda h: None, worker)
    lookup = Batcher("lookup", BatchSettings(max_batch_size=4, max_queue=8), model.launch, lambda h: True,
                     lambda h: None, worker)
    submit(predict, "predict", answers)
    predict.pump(time.monotonic())  # holds the worker for 0.1 s
    submit(lookup, "late", answers, deadline=time.monotonic() + 0.03)
    submit(lookup, "patient", answers)
    lookup.pump(time.monotonic())  # due, in time: handed to the worker, behind the Predict batch
    end = time.monotonic() + 5
    while len(answers) < 3 and time.monotonic() < end:
        predict.pump(time.monotonic())
        lookup.pump(time.monotonic())
        time.sleep(0.001)
    assert sorted((v, type(e).__name__) for v, e in answers) == \
        [("late", "DeadlineExpired"), ("patient", "NoneType"), ("predict", "NoneType")]
    assert model.calls == [["predict"], ["patient"]]  # "late" never ran
    assert not lookup.busy


@pytest.mark.parametrize("bad", ["arena", "rings", "hello"])
def test_a_front_end_whose_connection_fails_part_way_leaves_no_descriptor_open_and_the_engine_up(tmp_path, bad):
    """_accept: a hello whose buffer or rings cannot be mapped (sizes larger than the descriptors
    passed), or that is not a hello at all, is refused with its connection: the four descriptors
    passed (and what was mapped of them) are closed, not leaked for the engine's life, and the engine
    goes on accepting front ends."""
    import asyncio
    import os
    import socket
    import struct

    from serving.config import ServerConfig
    from serving.engine.core import Engine

    async def scenario():
        engine = Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
        await engine.start()
        arena, channel = ipc.Arena(1 << 16), ipc.Channel(16)
        before = len(os.listdir("/proc/self/fd"))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await asyncio.get_running_loop().sock_connect(sock, engine.socket_path)
        if bad == "hello":
            socket.send_fds(sock, [struct.pack("<I", 4) + b"junk"], [arena.fd, *channel.fds])
        else:
            ipc.send_fds(sock, ipc.Hello(0, arena.size * (2 if bad == "arena" else 1),
                                         channel.capacity * (2 if bad == "rings" else 1)), [arena.fd, *channel.fds])
        sock.setblocking(False)
        closed = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 1), 5)
        sock.close()
        await asyncio.sleep(0.01)
        leaked = len(os.listdir("/proc/self/fd")) - before
        accepting = any(not task.done() and task.get_coro().__name__ == "_accept" for task in engine._tasks)
        for task in list(engine._tasks):
            task.cancel()
        engine._listener.close()
        arena.close()
        channel.close()
        return closed, leaked, engine.links, accepting, engine.exit_code

    assert asyncio.run(scenario()) == (b"", 0, [], True, 0)


def test_a_repository_read_that_hangs_holds_up_neither_the_model_state_nor_the_gauges(tmp_path, monkeypatch):
    """The engine's publication loop reads the repository's model directories (for the index) in a
    thread; while that read hangs (a dead network mount), a change of the model state is still
    published to the front ends and the gauges still move, and no second read piles up behind it."""
    import asyncio
    import threading

    from serving.config import ServerConfig
    from serving.engine import core, repository
    from serving.engine.core import Engine

    mount_back, reads, scan = threading.Event(), [], repository.scan_models

    def hung(repo):
        reads.append(repo)
        mount_back.wait(10)
        return scan(repo)

    monkeypatch.setattr(repository, "scan_models", hung)
    monkeypatch.setattr(core, "_resident_bytes", lambda: 1234)

    async def scenario():
        engine = Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
        loop = engine._spawn(engine._publish_loop())
        await asyncio.sleep(3 * core.STATE_INTERVAL_S)
        engine.repo.ready = engine.repo.loaded = True  # e.g. a model loaded by request
        await asyncio.sleep(3 * core.STATE_INTERVAL_S)
        published = engine._published is not None and engine._published[:2] == (True, True)
        memory = engine.metrics.host_memory._value.get()
        mount_back.set()
        loop.cancel()
        engine.repo._disk.shutdown(wait=True)
        return published, memory, len(reads)

    assert asyncio.run(scenario()) == (True, 1234, 1)


def test_a_request_laid_out_before_its_model_was_unloaded_runs_on_the_draining_copy(tmp_path):
    """unload_model (or a config.json that moves the model to another engine) retires every version:
    a request a front end laid out before it heard of that runs on the draining copy, as after a swap
    ("requests in flight finish"); once that copy is released, NOT_FOUND."""
    import asyncio
    from types import SimpleNamespace

    from serving.config import ServerConfig
    from serving.engine.core import Engine
    from serving.errors import ModelNotFound

    engine = Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
    engine.repo.ready, engine._names = True, {0: "m"}
    old = SimpleNamespace(name="m", version=2, layout_id=0, state="DRAINING", drained=asyncio.Event())
    engine.repo.served, engine.repo._draining = {}, [old]
    for flags in (0, ipc.PINNED):
        s = ipc.Submission(ipc.PREDICT, flags, 0, 1, 2, None, 1, 0, 1, 1, 0, 64, 256)
        assert engine._version_for(s) is old
    old.drained.set()
    with pytest.raises(ModelNotFound, match=r"model 'm' is not loaded; loaded: \[\]"):
        engine._version_for(s)


def test_on_cuda_the_loop_does_not_poll_while_a_cpu_batch_runs_on_its_thread(tmp_path, monkeypatch):
    """After its last work the loop polls its rings for IDLE_POLL_S on a CUDA server, but not while a
    batch of a model that runs on the CPU (exported for cpu, served next to the GPU's models) is on its
    worker thread: polling would take a core from that batch, as on a CPU server. What it polled is
    counted in recserve_engine_poll_seconds_total: nothing while the batch runs (its end wakes the loop)."""
    import asyncio
    from types import SimpleNamespace

    from serving.config import ServerConfig
    from serving.engine import core

    monkeypatch.setattr(core, "IDLE_POLL_S", 3600.0)  # whatever the batch's time, it ends inside the window
    release, launched, calls = threading.Event(), threading.Event(), []

    def launch(works):
        launched.set()
        release.wait(60)  # the batch runs until the test has read the counter
        calls.append([w.inputs for w in works])
        return calls[-1]

    answers = []

    async def scenario():
        engine = core.Engine(ServerConfig(repo=tmp_path), str(tmp_path / "engine.sock"))
        engine.repo.device = "cuda"  # a CUDA server; this model was exported for cpu: its batches run on a thread
        engine._loop = asyncio.get_running_loop()
        b = Batcher("cpu-model", BatchSettings(max_batch_size=1, max_queue=4, max_delay_ms=0), launch,
                    lambda handle: True, lambda handle: None, ThreadPoolExecutor(1), wake=engine._wake_threadsafe)
        engine.repo.served = {"m": {1: SimpleNamespace(name="m", version=1, state="READY", batchers=[b])}}
        link = _front_end({})
        engine.links = [link]
        engine._pump_task = engine._spawn(engine._pump())
        b.submit(_held(link, 1, 7, answers))
        engine._wake.set()
        while not launched.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # the loop's rounds after the launch: polling, or asleep
        polled = engine.metrics.registry.get_sample_value("recserve_engine_poll_seconds_total")
        release.set()
        while not answers:
            await asyncio.sleep(0.001)
        engine._pump_task.cancel()
        return polled

    polled = asyncio.run(scenario())
    assert answers == [(7, None)] and calls == [[7]]
    assert polled == 0.0
