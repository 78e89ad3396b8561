"""Requests -> one model batch on the device, with a fixed number of device operations per batch.

The front ends wrote each request in the batch layout (serving/ipc.py ``RequestLayout``: every
model feature in model order, ids checked and narrowed, int32 lengths [T, C], float32 dense). Here:

1. each request's block travels to the device as it lies in the shared buffer: one copy per request
   (asynchronous DMA from the page-locked buffer, on a copy stream of its own, into one of two
   halves of a device staging buffer, so that batch k+1 travels while batch k computes);
2. one small descriptor table [R, 4] (where each block starts, B, extra sample, ids stored) travels
   with it;
3. :func:`gather` turns staging + descriptor into the model's KJT (values int64 [N], lengths int32
   [T, C]) and dense float32 [B, F] with a fixed set of tensor operations whatever the number of
   requests: segment ends by cumsum, each output element's segment by searchsorted, one indexed
   read per output. A shared bag is a segment whose source repeats (its period is the bag), so
   expanding it costs nothing more; pooled once, it sits in an extra sample and
   :func:`broadcast_pooled` adds its pooled row to its request's samples.

Why plain torch ops and not a fused Triton or CUDA kernel: the same code then runs on the CPU
(where CI checks it bit for bit) and inside a CUDA graph (serving/engine/graphs.py captures the
gather with the model call, so a batch costs one graph launch however many kernels the gather has);
FBGEMM's permute ops reorder whole KJTs, not the per-request segments of a merge.

The device never checks ids: the front end did, against the model's row counts (FBGEMM's inference
kernels read any id they are given).
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch

from serving import ipc
from serving.engine import cudart
from serving.ipc import ModelKJT, Schema

MAX_REQUESTS = 256  # per batch: the descriptor table's rows (the batcher closes a batch there)
DESCRIPTOR_COLUMNS = 4  # start (int32 words into staging), B, extra, stored ids
STAGING_ALIGN = 256


@dataclass
class Item:
    """One request of a batch, as the engine holds it: its block and its result in shared memory."""

    memory: torch.Tensor  # uint8, the front end's whole buffer (page-locked on CUDA) or a host buffer
    slot: int
    block_bytes: int
    result_at: int
    batch_size: int
    extra: int
    stored: int
    ids: int  # in the model's KJT (what the batch's id budget counts)


@dataclass
class Staged:
    """A batch staged on the device: what :func:`gather` reads and the sizes of what it writes."""

    descriptor: torch.Tensor  # int64 [R or MAX_REQUESTS, 4] on the device
    requests: int
    columns: int  # C: samples + extra samples
    ids: int  # N
    rows: int  # B: samples
    row_starts: List[int]  # each request's first sample
    half: int  # the staging half its blocks are in (free again once its results are copied out)
    repeats: bool = True  # some shared bag is expanded to its samples
    once: bool = False  # some shared bag is pooled once, in an extra sample


def gather(words: torch.Tensor, descriptor: torch.Tensor, features: int, dense_features: int, wide_ids: bool,
           columns: int, ids: int, rows: int, repeats: bool = True
           ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(values int64 [ids], lengths int32 [T, columns], dense float32 [rows, F] or None, extra_rows
    int64 [rows], extra_weight float32 [rows]) of the requests the descriptor names, in order.
    ``columns``/``ids``/``rows`` may exceed the batch's (CUDA graph buckets): the rest is padding,
    empty bags and zero rows. ``extra_rows[i]``: the column of sample i's extra sample (its request's
    shared bags pooled once), weighted 1 where there is one, else 0. ``repeats``: some shared bag is
    expanded (else a cheaper read: no segment repeats). Never reads outside ``words``."""
    device, t = words.device, features
    last_word = words.numel() - 1
    start, b, extra, stored_total = descriptor.unbind(1)
    c = b + extra
    active = (c > 0).long().unsqueeze(1)  # padding rows of the descriptor point at no block
    header = words[(start.unsqueeze(1) + torch.arange(2 * t, device=device)).clamp(0, last_word)].long() * active
    out_totals, stored = header[:, :t], header[:, t:]
    # values: segments in (feature, request) order, each read from its request's block, repeating with
    # period ``stored`` (a shared bag expanded to its samples) or not (period = length)
    id_words = 2 if wide_ids else 1
    source = words.view(torch.int64) if wide_ids else words
    first = (start + 2 * t) // id_words
    seg_first = (first.unsqueeze(1) + torch.cumsum(stored, 1) - stored).t().reshape(-1)
    seg_len = out_totals.t().reshape(-1)
    seg_end = torch.cumsum(seg_len, 0)
    p = torch.arange(ids, device=device)
    seg = torch.searchsorted(seg_end, p, right=True).clamp(max=seg_end.numel() - 1)
    if repeats:
        period = stored.t().reshape(-1).clamp(min=1)
        src = seg_first[seg] + torch.remainder(p - (seg_end - seg_len)[seg], period[seg])
    else:  # each output id is its segment's source shifted: one read per id
        src = (seg_first - seg_end + seg_len)[seg] + p
    values = torch.where(p < seg_end[-1], source[src.clamp(0, source.numel() - 1)], 0).long()
    # lengths [T, columns]: column j of request r reads row t of r's lengths
    col_end = torch.cumsum(c, 0)
    col_start = col_end - c
    j = torch.arange(columns, device=device)
    r = torch.searchsorted(col_end, j, right=True).clamp(max=c.numel() - 1)
    lengths_at = start + 2 * t + stored_total * id_words
    src = (lengths_at[r] + (j - col_start[r])).unsqueeze(0) + torch.arange(t, device=device).unsqueeze(1) * c[r]
    lengths = torch.where(j < col_end[-1], words[src.clamp(0, last_word)], 0)
    # samples: dense rows, and where each sample's extra column is
    row_end = torch.cumsum(b, 0)
    i = torch.arange(rows, device=device)
    rr = torch.searchsorted(row_end, i, right=True).clamp(max=b.numel() - 1)
    in_request = i - (row_end - b)[rr]
    valid = i < row_end[-1]
    extra_rows = (col_start[rr] + b[rr]).clamp(max=max(columns - 1, 0))
    extra_weight = (extra[rr] * valid).float()
    dense = None
    if dense_features:
        dense_at = lengths_at + t * c
        src = (dense_at[rr] + in_request * dense_features).unsqueeze(1) + torch.arange(dense_features, device=device)
        dense = torch.where(valid.unsqueeze(1), words[src.clamp(0, last_word)], 0).view(torch.float32)
    return values, lengths, dense, extra_rows, extra_weight


def sample_rows(rows: int, descriptor: torch.Tensor, columns: int) -> torch.Tensor:
    """int64 [rows]: the column of each sample (samples skip the extra columns)."""
    b, extra = descriptor[:, 1], descriptor[:, 2]
    row_end = torch.cumsum(b, 0)
    i = torch.arange(rows, device=descriptor.device)
    rr = torch.searchsorted(row_end, i, right=True).clamp(max=b.numel() - 1)
    col_start = torch.cumsum(b + extra, 0) - (b + extra)
    return (col_start[rr] + i - (row_end - b)[rr]).clamp(max=max(columns - 1, 0))


def broadcast_pooled(pooled: torch.Tensor, descriptor: torch.Tensor, rows: int, extra_rows: torch.Tensor,
                     extra_weight: torch.Tensor) -> torch.Tensor:
    """pooled [columns, D] of a batch whose shared bags sit in extra samples -> [rows, D]: each sample's
    row plus its extra sample's (a shared feature is empty in the sample and the only feature of the
    extra sample, so the sum is the expanded form's row, bit for bit: x + 0 is exact). A sample without
    an extra sample takes its own row alone: the row its index points at is another request's (or
    padding), and an inf there times 0 would be NaN in this request's answer."""
    own = pooled.index_select(0, sample_rows(rows, descriptor, pooled.shape[0]))
    return torch.where(extra_weight.unsqueeze(1) > 0, own + pooled.index_select(0, extra_rows), own)


class Assembler:
    """Stages batches on one device: the staging buffer (two halves on CUDA), the descriptor, the
    result copies. On CPU the staging is host memory and the copies are memcpy."""

    def __init__(self, schema: Schema, device: torch.device) -> None:
        self.schema = schema
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        # Batches run on the device's default stream (nothing in the engine sets another): resolved
        # once: looking up the current stream per call was about a twelfth of a launch's host time.
        self.compute_stream = torch.cuda.default_stream(device) if self.cuda else None
        # CUDA: copies, ordering and events through the runtime directly (serving/engine/cudart.py),
        # else through torch's calls.
        self.runtime = cudart.runtime() if self.cuda else None
        self.half_words = 0
        self.words: Optional[torch.Tensor] = None  # int32 [2 * half_words]
        self._staging_bytes: Optional[torch.Tensor] = None
        self._staging_at = 0  # its device address
        self.generation = 0  # bumped when the staging buffer is replaced (graphs read its address)
        self._half = 0
        self.descriptor = torch.zeros((MAX_REQUESTS, DESCRIPTOR_COLUMNS), dtype=torch.int64, device=device)
        self._host_descriptors = [torch.zeros((MAX_REQUESTS, DESCRIPTOR_COLUMNS), dtype=torch.int64,
                                              pin_memory=self.cuda) for _ in range(4)]
        self._host_tables = [h.numpy() for h in self._host_descriptors]  # their numpy views, made once
        self._next_host = 0
        self._rows_used = [MAX_REQUESTS] * 4  # rows each host descriptor holds (zeroed before its next use)
        # CUDA events, made once and recorded again for each batch: the last batch that read each
        # staging half; the last that read each host descriptor; the copies in before the compute.
        self._half_free: List[Optional[torch.cuda.Event]] = [_event(self.compute_stream) for _ in range(2)] \
            if self.cuda else [None, None]
        self._host_used: List[Optional[torch.cuda.Event]] = [_event(self.compute_stream) for _ in range(4)] \
            if self.cuda else [None] * 4
        self._copied = _event(self.copy_stream) if self.cuda else None

    @property
    def wide_ids(self) -> bool:
        return self.schema.id_dtype.itemsize == 8

    def reserve(self, words: int) -> None:
        """Make each half hold at least ``words`` int32 words (growing replaces the buffer: the device
        must be idle, and graphs that read the old one are dropped by their owner, see generation)."""
        if words <= self.half_words:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        half = max(words, 2 * self.half_words, 1 << 20)
        half = -(-half // (STAGING_ALIGN // 4)) * (STAGING_ALIGN // 4)
        # The old buffer goes first (the peak is the new one alone); until the new one is made there is
        # none: a failed allocation fails this batch, and the next one makes it again.
        self.words = self._staging_bytes = None
        self.half_words = self._staging_at = 0
        self.generation += 1
        self.words = torch.zeros(2 * half, dtype=torch.int32, device=self.device)
        self._staging_bytes = self.words.view(torch.uint8)  # what the copies write into
        self._staging_at = self.words.data_ptr()
        self.half_words = half

    def stage(self, items: List[Item], exact: bool) -> Staged:
        """Copy the requests' blocks to the device and fill the descriptor; nothing waits for the
        device. ``exact``: the descriptor has exactly R rows (eager calls); else MAX_REQUESTS rows,
        the rest zero (a captured graph reads a fixed shape)."""
        assert 0 < len(items) <= MAX_REQUESTS
        sizes = [-(-it.block_bytes // STAGING_ALIGN) * (STAGING_ALIGN // 4) for it in items]
        self.reserve(sum(sizes))
        half = self._half
        self._half ^= 1
        k = self._host_descriptor()
        table = self._host_tables[k]
        table[:self._rows_used[k]] = 0  # what this buffer held last
        self._rows_used[k] = len(items)
        starts = list(itertools.accumulate(sizes, initial=half * self.half_words))
        for row, (it, at) in enumerate(zip(items, starts)):
            table[row] = (at, it.batch_size, it.extra, it.stored)
        if self.runtime is not None:
            self._copy_in(items, starts, half, k)
        else:
            self._copy_in_torch(items, starts, half, k)
        row_starts, rows, extra, stored, ids = [], 0, 0, 0, 0
        for it in items:
            row_starts.append(rows)
            rows += it.batch_size
            extra += it.extra
            stored += it.stored
            ids += it.ids
        return Staged(self.descriptor[:len(items)] if exact else self.descriptor, len(items), rows + extra, ids,
                      rows, row_starts, half, repeats=ids != stored and not extra, once=extra > 0)

    def _copy_in(self, items: List[Item], starts: List[int], half: int, k: int) -> None:
        """CUDA, through the runtime: the blocks on the copy stream once the batch before last has
        read this half, then the descriptor on the compute stream once the blocks are in."""
        rt, copy, compute = self.runtime, self.copy_stream.cuda_stream, self.compute_stream.cuda_stream
        rt.wait(copy, self._half_free[half].cuda_event)
        for it, at in zip(items, starts):
            rt.copy(self._staging_at + 4 * at, it.memory.data_ptr() + it.slot, it.block_bytes, cudart.HOST_TO_DEVICE,
                    copy)
        rt.record(self._copied.cuda_event, copy)
        rt.wait(compute, self._copied.cuda_event)
        host = self._host_descriptors[k]
        rt.copy(self.descriptor.data_ptr(), host.data_ptr(), host.nbytes, cudart.HOST_TO_DEVICE, compute)
        rt.record(self._host_used[k].cuda_event, compute)

    def _copy_in_torch(self, items: List[Item], starts: List[int], half: int, k: int) -> None:
        """The same through torch's calls (the CPU: plain copies)."""
        copying = torch.cuda.stream(self.copy_stream) if self.cuda else contextlib.nullcontext()
        with copying:
            if self.cuda:
                self.copy_stream.wait_event(self._half_free[half])
            staging = self._staging_bytes
            for it, at in zip(items, starts):
                staging[4 * at:4 * at + it.block_bytes].copy_(it.memory[it.slot:it.slot + it.block_bytes],
                                                              non_blocking=True)
        host = self._host_descriptors[k]
        if self.cuda:
            self.compute_stream.wait_stream(self.copy_stream)
            self.descriptor.copy_(host, non_blocking=True)
            self._host_used[k].record(self.compute_stream)
        else:
            self.descriptor.copy_(host)

    def _host_descriptor(self) -> int:
        """A page-locked descriptor the device has finished reading (a pool of four, round robin)."""
        k = self._next_host
        self._next_host = (k + 1) % len(self._host_descriptors)
        if self.runtime is not None:
            self.runtime.synchronize(self._host_used[k].cuda_event)
        elif self.cuda:
            self._host_used[k].synchronize()
        return k

    def write_results(self, items: List[Item], result: torch.Tensor, staged: Staged) -> None:
        """Each request's rows of ``result`` ([rows] or [rows, D]) into its result slot (by DMA into
        the page-locked buffer on CUDA), then mark the staging half free when the device gets there."""
        if self.runtime is not None and result.dtype == torch.float32 and result.is_contiguous():
            rt, compute = self.runtime, self.compute_stream.cuda_stream
            row_bytes = 4 * (result.numel() // result.shape[0])
            at = result.data_ptr()
            for it, first in zip(items, staged.row_starts):
                rt.copy(it.memory.data_ptr() + it.result_at, at + first * row_bytes, it.batch_size * row_bytes,
                        cudart.DEVICE_TO_HOST, compute)
            rt.record(self._half_free[staged.half].cuda_event, compute)
            return
        for it, first in zip(items, staged.row_starts):
            rows = result[first:first + it.batch_size]
            out = it.memory[it.result_at:it.result_at + 4 * rows.numel()].view(torch.float32).view(rows.shape)
            out.copy_(rows, non_blocking=self.cuda)
        if self.cuda:
            self._half_free[staged.half].record(self.compute_stream)


def _event(stream: "torch.cuda.Stream") -> "torch.cuda.Event":
    event = torch.cuda.Event()
    event.record(stream)
    return event


def host_item(kjt: ModelKJT, schema: Schema, pool_shared_once: bool, lookup: bool) -> Item:
    """One request laid out as a front end lays it out, in a host buffer of its own (the golden
    check, benchmarks, tests); its result is read back with :func:`host_result`."""
    layout, out_totals, stored = ipc.layout_of(kjt, schema, pool_shared_once, lookup)
    memory = torch.zeros(layout.slot_bytes, dtype=torch.uint8)
    ipc.write_request(memory.numpy(), kjt, layout, out_totals, stored, schema.id_dtype)
    return Item(memory, 0, layout.block_bytes, layout.result_at, layout.batch_size, layout.extra, layout.stored,
                int(out_totals.sum()))


def host_result(item: Item, width: int) -> np.ndarray:
    """A copy of a host item's result: float32 [B] (width 1, Predict) or [B, width] (Lookup)."""
    shape = (item.batch_size,) if width == 1 else (item.batch_size, width)
    count = item.batch_size * width
    return item.memory.numpy()[item.result_at:item.result_at + 4 * count].view(np.float32).reshape(shape).copy()
