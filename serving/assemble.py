"""Requests -> one model batch, on the model's device.

Each request's arrays go to the device once, as they came (no host-side merging or dtype
conversion), as asynchronous DMA transfers into one device buffer per batch: straight from the
front end's shared buffer, which the engine page-locked (serving/ipc.py), or, for arrays elsewhere
(the golden check), through a reused page-locked staging buffer. On CUDA the copies run on a stream
of their own, so that a batch's inputs travel while the previous batch computes.

On the device the requests become one KJT in model feature order through two gathers, whose index
tables the host computes from the requests' key order and bag counts (a few hundred integers): a
batch costs the same kernels whatever its number of requests. int32 ids are widened there.

The id check never waits for the device: ids outside their table are replaced by row 0 before the
lookup (FBGEMM's inference kernels do no bounds checks: the kernel must never see them), and each
request's flag travels back with the results; ``finish`` then answers that request with its own
error and its batch-mates with their rows.
"""
import contextlib
import warnings
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from serving.validate import Schema, SparseBatch

# The request arrays are read-only views of the message bytes; torch only reads them (one copy to
# the device, or, on CPU, into the batch's buffer).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

ALIGN = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class PinnedStaging:
    """Host arrays -> device tensors through one reused page-locked buffer (CUDA), or as they are
    (CPU, where the model reads host memory). Use one ``batch()`` per model call: it waits until
    the previous batch's copies have left the buffer before overwriting it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._buffer: Optional[torch.Tensor] = None
        self._offset = 0
        self._copied: Optional[torch.cuda.Event] = None

    @contextlib.contextmanager
    def batch(self, nbytes: int) -> Iterator["PinnedStaging"]:
        if self._pinned:
            if self._copied is not None:
                self._copied.synchronize()
            if self._buffer is None or self._buffer.numel() < nbytes:
                # Page-locking is slow: grow geometrically so that it happens a few times, not per batch.
                size = max(nbytes, 2 * self._buffer.numel() if self._buffer is not None else 1 << 20)
                self._buffer = None
                self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._offset = 0
        try:
            yield self
        finally:
            if self._pinned:
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.device))

    def put_into(self, dst: torch.Tensor, array: np.ndarray, pinned: bool = False) -> None:
        """Copy ``array``'s bytes into ``dst`` (uint8, on the device); ``pinned``: the array is in
        page-locked memory already, and the device reads it from there."""
        source = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        if self._pinned and not pinned:
            nbytes = array.nbytes
            if self._buffer is None or self._offset + nbytes > self._buffer.numel():
                dst.copy_(source)  # larger than announced: a synchronous copy
                return
            host = self._buffer[self._offset:self._offset + nbytes]
            host.copy_(source)
            self._offset += aligned(nbytes)
            source = host
        dst.copy_(source, non_blocking=self._pinned)


def staged_bytes(arrays: List[np.ndarray]) -> int:
    """What ``put_into`` takes of the staging buffer for these arrays (each starts aligned)."""
    return sum(aligned(a.nbytes) for a in arrays)


@dataclass
class Request:
    """One validated request as the engine holds it: arrays in the front end's shared buffer."""

    sparse: SparseBatch
    dense: Optional[np.ndarray]  # float32 [B, F] (Predict) or None (Lookup)
    out: np.ndarray  # where its result goes: float32 [B] (Predict) or [B, columns] (Lookup)
    pinned: bool  # its arrays are in page-locked memory: the device reads and writes them by DMA


@dataclass
class Batch:
    """The requests of one model call as one KJT on the device."""

    values: torch.Tensor  # int64 [N], model feature order, request by request within a feature
    lengths: torch.Tensor  # int32 [T, sum(B)]
    dense: Optional[torch.Tensor]  # float32 [sum(B), F] (Predict)
    bad: torch.Tensor  # bool [R]: the request held an id outside its table (its ids were replaced by 0)


@dataclass
class _Tables:
    """The host's part of a batch: index tables for the device's gathers (int64, one array)."""

    data: np.ndarray  # value table [7, S] then length table [3, T*R], flattened
    segments: int  # S: (feature, request) pairs with ids
    ids: int  # N
    id_widths: Tuple[int, ...]  # itemsizes of the requests' ids (4, 8 or both)


class Assembler:
    def __init__(self, schema: Schema, device: torch.device) -> None:
        self.schema = schema
        self.device = device
        self.rows = np.asarray(schema.rows, dtype=np.int64)
        self.staging = PinnedStaging(device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._arange = torch.arange(1 << 16, device=device)

    def _iota(self, n: int) -> torch.Tensor:
        if self._arange.numel() < n:
            self._arange = torch.arange(max(n, 2 * self._arange.numel()), device=self.device)
        return self._arange[:n]

    def assemble(self, requests: List[Request]) -> Batch:
        """One KJT of every request, in order, and the id-check flags; nothing waits for the device."""
        uploads, offsets, end = [], [], 0
        for r in requests:
            mine = []
            for array in (r.sparse.values, r.sparse.lengths.astype(np.int32, copy=False), r.dense):
                mine.append(end)
                if array is not None:
                    uploads.append((end, array, r.pinned))
                    end += aligned(array.nbytes)
            offsets.append(mine)
        tables = self._tables(requests, offsets)
        uploads.append((end, tables.data, False))
        copying = contextlib.nullcontext() if self.copy_stream is None else torch.cuda.stream(self.copy_stream)
        with copying, self.staging.batch(staged_bytes([a for _, a, pinned in uploads if not pinned])):
            buf = torch.empty(end + aligned(tables.data.nbytes), dtype=torch.uint8, device=self.device)
            for start, array, pinned in uploads:
                self.staging.put_into(buf[start:start + array.nbytes], array, pinned)
        if self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            buf.record_stream(compute)  # its memory is not handed out again before the model used it
        return self._on_device(requests, offsets, tables, buf, end // 8)

    def _tables(self, requests: List[Request], offsets: List[List[int]]) -> _Tables:
        t_count = len(self.schema.feature_names)
        seg_t, seg_r, seg_src, seg_n, seg_64 = [], [], [], [], []
        len_src = np.zeros((t_count, len(requests)), dtype=np.int64)
        len_present = np.zeros((t_count, len(requests)), dtype=np.int64)
        sizes = np.array([r.sparse.batch_size for r in requests], dtype=np.int64)
        for i, (r, (values_at, lengths_at, _)) in enumerate(zip(requests, offsets)):
            sp, width = r.sparse, r.sparse.values.itemsize
            positions = np.asarray(sp.positions, dtype=np.int64)
            totals = np.asarray(sp.totals, dtype=np.int64)
            seg_t.append(positions)
            seg_r.append(np.full(len(positions), i, dtype=np.int64))
            seg_src.append(values_at // width + np.concatenate(([0], np.cumsum(totals)[:-1])))
            seg_n.append(totals)
            seg_64.append(np.full(len(positions), width == 8, dtype=np.int64))
            # Lengths: feature t of request i is row k of its [K, B] lengths, or absent (zeros).
            len_src[positions, i] = lengths_at // 4 + np.arange(len(positions)) * sp.batch_size
            len_present[positions, i] = 1
        t, r, src, n, wide = (np.concatenate(x) for x in (seg_t, seg_r, seg_src, seg_n, seg_64))
        order = np.lexsort((r, t))  # feature-major, then request: the KJT's order
        t, r, src, n, wide = t[order], r[order], src[order], n[order], wide[order]
        target = np.cumsum(n) - n
        value_table = np.stack([src - target, self.rows[t], wide, n, target, r, target + n])
        # Length blocks in KJT order: feature t, request i -> columns [b0_i, b0_i + B_i) of row t.
        columns = np.cumsum(sizes) - sizes
        target = (np.arange(t_count)[:, None] * sizes.sum() + columns[None, :]).reshape(-1)
        length_table = np.stack([len_src.reshape(-1) - target, len_present.reshape(-1),
                                 target + np.tile(sizes, t_count)])
        widths = tuple(sorted({req.sparse.values.itemsize for req in requests}))
        return _Tables(np.concatenate([value_table.reshape(-1), length_table.reshape(-1)]), len(t),
                       int(n.sum()), widths)

    def _on_device(self, requests: List[Request], offsets: List[List[int]], tables: _Tables, buf: torch.Tensor,
                   table_at: int) -> Batch:
        t_count, r_count = len(self.schema.feature_names), len(requests)
        buf32, buf64 = buf.view(torch.int32), buf.view(torch.int64)
        s, n = tables.segments, tables.ids
        value_table = buf64[table_at:table_at + 7 * s].view(7, s)
        length_table = buf64[table_at + 7 * s:table_at + 7 * s + 3 * t_count * r_count].view(3, -1)
        # Ids: per id, its segment (a binary search over the segments' ends; repeat_interleave's
        # kernel fills a segment per warp, slow for a few long ones), then where it is in the
        # buffer, its table's rows and its width.
        iota = self._iota(n)
        per_id = value_table[:3, torch.searchsorted(value_table[6], iota, right=True)]
        index = per_id[0] + iota
        if tables.id_widths == (8,):
            values = buf64[index]
        elif tables.id_widths == (4,):
            values = buf32[index].long()
        else:  # int32 and int64 requests in one batch
            wide = per_id[2].bool()
            values = torch.where(wide, buf64[index.masked_fill(~wide, 0)], buf32[index.masked_fill(wide, 0)].long())
        outside = (values < 0) | (values >= per_id[1])
        values = values.masked_fill(outside, 0)
        # Out-of-range ids per (feature, request) segment from a running count, then per request: a
        # scatter per id would put a million atomic adds on a few addresses.
        running = torch.cat([torch.zeros(1, dtype=torch.int64, device=self.device), outside.long().cumsum(0)])
        start, count = value_table[4], value_table[3]
        per_segment = running[start + count] - running[start]
        bad = torch.zeros(r_count, dtype=torch.int64, device=self.device).index_add_(0, value_table[5], per_segment) > 0
        # Lengths: gathered per (feature, request) block; absent features are zeros.
        batch = sum(r.sparse.batch_size for r in requests)
        iota = self._iota(t_count * batch)
        per_length = length_table[:2, torch.searchsorted(length_table[2], iota, right=True)]
        lengths = buf32[per_length[0] + iota]
        if not all(r.sparse.in_model_order for r in requests):
            lengths = lengths * per_length[1].int()  # absent: the index read something else, zero it
        dense = None
        if requests[0].dense is not None:
            views = [buf.view(torch.float32)[o[2] // 4:o[2] // 4 + r.dense.size].view(r.dense.shape)
                     for r, o in zip(requests, offsets)]
            dense = views[0] if len(views) == 1 else torch.cat(views)
        return Batch(values, lengths.view(t_count, batch), dense, bad)
