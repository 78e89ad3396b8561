"""Requests -> one model batch, on the model's device.

Each request's arrays go to the device once, as they came (no host-side concatenation or dtype
conversion), as asynchronous DMA transfers: straight from the front end's shared buffer, which the
engine page-locked (serving/ipc.py), or, for arrays elsewhere (the golden check), through a reused
page-locked staging buffer. There, per request: ids are checked against their tables' row counts
(one vectorised compare), int32 ids are widened, and keys are put in model order; then the requests
are merged into one KJT (per feature, request by request).

The id check never waits for the device: a request's out-of-range ids are replaced by row 0 before
the lookup (FBGEMM's inference kernels do no bounds checks: the kernel must never see them), and
its flag travels back with the results; ``finish`` then answers that request with its own error
and its batch-mates with their rows.
"""
import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch

from serving.ipc import Schema
from serving.frontend.validate import SparseBatch, lookup_columns

# The request arrays are read-only views of the message bytes; torch only reads them (one copy to
# the device, or, on CPU, inputs to ops that write new tensors).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


TORCH_DTYPES = {np.dtype(d): t for d, t in ((np.int32, torch.int32), (np.int64, torch.int64),
                                             (np.float32, torch.float32))}


class PinnedStaging:
    """Host arrays -> device tensors through one reused page-locked buffer (CUDA), or as they are
    (CPU, where the model reads host memory). Use one ``batch()`` per model call: it waits until
    the previous batch's copies have left the buffer before overwriting it."""

    ALIGN = 256

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

    def put(self, array: np.ndarray, pinned: bool = False) -> torch.Tensor:
        """``array`` on the device; ``pinned``: it is in page-locked memory already, copy it from there."""
        if not self._pinned:
            return torch.from_numpy(array)
        if pinned:
            return torch.from_numpy(array).to(self.device, non_blocking=True)
        nbytes = array.nbytes
        if self._buffer is None or self._offset + nbytes > self._buffer.numel():
            return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)  # larger than announced
        host = self._buffer[self._offset:self._offset + nbytes]
        np.copyto(host.numpy().view(array.dtype).reshape(array.shape), array, casting="no")
        self._offset += -(-nbytes // self.ALIGN) * self.ALIGN
        return host.view(TORCH_DTYPES[array.dtype]).reshape(array.shape).to(self.device, non_blocking=True)


def staged_bytes(arrays: List[np.ndarray]) -> int:
    """What ``put`` takes of the buffer for these arrays (each starts aligned)."""
    return sum(-(-a.nbytes // PinnedStaging.ALIGN) * PinnedStaging.ALIGN for a in arrays)


CACHED_KEY_SETS = 1024


@dataclass
class Request:
    """One validated request as the engine holds it: arrays in the front end's shared buffer."""

    sparse: SparseBatch
    dense: Optional[np.ndarray]  # float32 [B, F] (Predict) or None (Lookup)
    out: np.ndarray  # where its result goes: float32 [B] (Predict) or [B, columns] (Lookup)
    pinned: bool  # its arrays are in page-locked memory: the device reads and writes them by DMA
    # Every id and every key's id count, per-sample keys then shared ones, each one array (one copy
    # and one range check on the device): the front end writes them so (sparse's arrays are views).
    ids: Optional[np.ndarray] = None
    id_totals: Optional[np.ndarray] = None  # int64 [K + S]

    def __post_init__(self) -> None:
        s = self.sparse
        if self.ids is None:
            self.ids = np.concatenate((s.values, s.shared_values)) if s.shared_keys else s.values
            self.id_totals = np.concatenate((s.totals, s.shared_lengths)) if s.shared_keys else s.totals


@dataclass
class DeviceRequest:
    lengths: torch.Tensor  # int32 [T, B], model feature order (zeros for features left out)
    positions: Tuple[int, ...]  # each key's model feature, in request key order
    totals: List[int]  # ids per key
    values: torch.Tensor  # int64 ids as sent (request key order)
    in_model_order: bool  # every model feature, in model order: values and lengths are the KJT as is
    dense: Optional[torch.Tensor] = None  # float32 [B, F] (Predict)
    # Shared features: (model feature, int64 ids of its one bag); their rows of ``lengths`` are 0.
    shared: Tuple[Tuple[int, torch.Tensor], ...] = ()
    shared_positions: Tuple[int, ...] = ()
    shared_lengths: Optional[torch.Tensor] = None  # int32 [S]


class Assembler:
    def __init__(self, schema: Schema, device: torch.device) -> None:
        self.schema = schema
        self.device = device
        self.staging = PinnedStaging(device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Small device tensors per key set (a list index would be copied on every call). Clients choose
        # the key sets: the most recent CACHED_KEY_SETS are kept, so no client can grow them for ever.
        self._index = functools.lru_cache(CACHED_KEY_SETS)(self._device_index)
        self._rows_of = functools.lru_cache(CACHED_KEY_SETS)(self._device_rows)
        self._pooled_columns = functools.lru_cache(CACHED_KEY_SETS)(self._device_columns)

    def _device_index(self, positions: Tuple[int, ...]) -> torch.Tensor:
        """``positions`` as an int64 index on the device."""
        return torch.tensor(positions, dtype=torch.int64, device=self.device)

    def _device_rows(self, positions: Tuple[int, ...]) -> torch.Tensor:
        """The row count of each feature at ``positions`` (the bound of its ids), on the device."""
        return torch.tensor([self.schema.rows[t] for t in positions], dtype=torch.int64, device=self.device)

    def _device_columns(self, positions: Tuple[int, ...]) -> torch.Tensor:
        """The columns of the pooled output of the features at ``positions``, on the device."""
        keys = [self.schema.feature_names[t] for t in positions]
        return torch.from_numpy(lookup_columns(self.schema, keys)).to(self.device)

    @staticmethod
    def _arrays(request: Request) -> Tuple[Optional[np.ndarray], ...]:
        """What of a request travels to the device: ids, lengths, id totals, dense (None for Lookup)."""
        return request.ids, request.sparse.lengths, request.id_totals, request.dense

    def _upload(self, request: Request) -> List[Optional[torch.Tensor]]:
        """:meth:`_arrays` of a request, on the device."""
        return [None if a is None else self.staging.put(a, request.pinned) for a in self._arrays(request)]

    def _check(self, sparse: SparseBatch, ids: torch.Tensor, lengths: torch.Tensor, id_totals: torch.Tensor,
               dense: Optional[torch.Tensor]) -> Tuple[DeviceRequest, torch.Tensor]:
        """The request in model layout, its out-of-range ids replaced by 0, and a 0-d bool tensor:
        did it hold an id outside its table. A shared bag stays one bag here (expanded or pooled once
        in :meth:`merge` / :meth:`merge_pooling_once`); its feature's lengths are 0 here."""
        ids = ids.long()
        if ids.numel():
            bounds = torch.repeat_interleave(self._rows_of(sparse.all_positions), id_totals, output_size=ids.numel())
            outside = (ids < 0) | (ids >= bounds)
            bad = outside.any()
            ids = ids.masked_fill(outside, 0)
        else:
            bad = torch.zeros((), dtype=torch.bool, device=self.device)
        lengths = lengths.int()
        values, shared, shared_lengths = ids, (), None
        if sparse.shared_keys:
            n = sparse.values.shape[0]
            values = ids[:n]
            shared = tuple(zip(sparse.shared_positions, torch.split(ids[n:], sparse.shared_lengths.tolist())))
            shared_lengths = id_totals[len(sparse.keys):].int()
        if not sparse.in_model_order:
            full = torch.zeros((len(self.schema.feature_names), sparse.batch_size), dtype=torch.int32,
                               device=self.device)
            if sparse.positions:
                full.index_copy_(0, self._index(sparse.positions), lengths)
            lengths = full
        return DeviceRequest(lengths, sparse.positions, sparse.totals.tolist(), values, sparse.in_model_order,
                             dense, shared, sparse.shared_positions, shared_lengths), bad

    def prepare(self, requests: List[Request]) -> Tuple[List[DeviceRequest], torch.Tensor]:
        """Every request on the device, and a bool tensor [R]: which ones hold an id outside its
        table (their ids were replaced; their results must not be used). Nothing waits for the device.

        On CUDA the copies run on a stream of their own, so that a batch's inputs travel while the
        previous batch computes; the model's stream waits for them."""
        staged = [a for r in requests if not r.pinned for a in self._arrays(r) if a is not None]
        copying = contextlib.nullcontext() if self.copy_stream is None else torch.cuda.stream(self.copy_stream)
        with copying, self.staging.batch(staged_bytes(staged)):
            uploaded = [self._upload(r) for r in requests]
        if self.copy_stream is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.copy_stream)
            for group in uploaded:
                for t in group:
                    if t is not None:
                        t.record_stream(compute)  # its memory is not handed out again before compute used it
        moved = [self._check(r.sparse, *group) for r, group in zip(requests, uploaded)]
        return [m for m, _ in moved], torch.stack([bad for _, bad in moved])

    def merge(self, requests: List[DeviceRequest]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(values int64 [N], lengths int32 [T, sum(B)]) of one KJT holding every request in order, each
        shared bag repeated for each sample of its request (on the device)."""
        if len(requests) == 1 and requests[0].in_model_order:
            return requests[0].values, requests[0].lengths
        lengths = torch.cat([self._expanded_lengths(r) for r in requests], dim=1)
        shared = [[(t, bag.repeat(r.lengths.shape[1])) for t, bag in r.shared] for r in requests]
        return self._values(requests, shared), lengths

    def merge_pooling_once(self, requests: List[DeviceRequest]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`merge`, but each request's shared bags appear once, in one extra sample after all
        the requests' samples (their own samples have those bags empty): the lookup pools them once and
        :meth:`broadcast_shared` copies them to the samples. (values, lengths int32 [T, sum(B) + E])."""
        with_shared = [r for r in requests if r.shared]
        extra = []
        for r in with_shared:
            column = torch.zeros((len(self.schema.feature_names), 1), dtype=torch.int32, device=self.device)
            extra.append(column.index_copy_(0, self._index(r.shared_positions), r.shared_lengths.unsqueeze(1)))
        lengths = torch.cat([r.lengths for r in requests] + extra, dim=1)
        shared = [[] for _ in requests] + [list(r.shared) for r in with_shared]
        return self._values(requests + with_shared, shared, per_sample=len(requests)), lengths

    def broadcast_shared(self, pooled: torch.Tensor, requests: List[DeviceRequest]) -> torch.Tensor:
        """pooled [sum(B) + E, D] of :meth:`merge_pooling_once` -> [sum(B), D]: each request's samples
        get its shared features' pooled rows."""
        samples = sum(r.lengths.shape[1] for r in requests)
        out = pooled[:samples]
        start, extra_row = 0, samples
        for r in requests:
            b = r.lengths.shape[1]
            if r.shared:
                columns = self._pooled_columns(r.shared_positions)
                out[start:start + b].index_copy_(1, columns, pooled[extra_row].index_select(0, columns).expand(b, -1))
                extra_row += 1
            start += b
        return out

    def _expanded_lengths(self, r: DeviceRequest) -> torch.Tensor:
        if not r.shared:
            return r.lengths
        b = r.lengths.shape[1]
        return r.lengths.index_copy(0, self._index(r.shared_positions), r.shared_lengths.unsqueeze(1).expand(-1, b))

    def _values(self, requests: List[DeviceRequest], shared: List[List[Tuple[int, torch.Tensor]]],
                per_sample: Optional[int] = None) -> torch.Tensor:
        """Every feature's ids, feature by feature (model order), request by request: the per-sample
        ids of ``requests[:per_sample]`` and the bags in ``shared``."""
        per_feature = []  # per request: the ids of each model feature (views), None where not sent
        for i, r in enumerate(requests):
            mine: List[Optional[torch.Tensor]] = [None] * len(self.schema.feature_names)
            if per_sample is None or i < per_sample:
                for t, piece in zip(r.positions, torch.split(r.values, r.totals)):
                    mine[t] = piece
            for t, ids in shared[i]:
                mine[t] = ids
            per_feature.append(mine)
        pieces = []
        for t in range(len(self.schema.feature_names)):
            for mine in per_feature:
                piece = mine[t]
                if piece is not None and piece.numel():
                    pieces.append(piece)
        device = requests[0].lengths.device
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)
