"""Requests -> one model batch, on the model's device.

Each request's arrays go to the device once, straight from the message bytes (no host-side
concatenation or dtype conversion). There, per request: ids are checked against their tables' row
counts (one vectorised compare, one sync for the whole batch), int32 ids are widened, and keys are
put in model order; then the requests are merged into one KJT (per feature, request by request).
A request with a bad id is answered with its own error and left out of the merge.
"""
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from serving.validate import Schema, SparseBatch, id_error

# The request arrays are read-only views of the message bytes; torch only reads them (one copy to
# the device, or, on CPU, inputs to ops that write new tensors).
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


@dataclass
class DeviceRequest:
    lengths: torch.Tensor  # int32 [T, B], model feature order (zeros for features left out)
    per_feature: List[Optional[torch.Tensor]]  # int64 ids of each model feature, or None
    values: torch.Tensor  # int64 ids as sent (request key order)
    in_model_order: bool  # every model feature, in model order: values and lengths are the KJT as is


class Assembler:
    def __init__(self, schema: Schema, device: torch.device) -> None:
        self.schema = schema
        self.device = device
        self._rows: Dict[Tuple[int, ...], torch.Tensor] = {}

    def _rows_of(self, positions: Tuple[int, ...]) -> torch.Tensor:
        if positions not in self._rows:
            self._rows[positions] = torch.tensor([self.schema.rows[t] for t in positions], dtype=torch.int64,
                                                 device=self.device)
        return self._rows[positions]

    def to_device(self, sparse: SparseBatch) -> Tuple[DeviceRequest, torch.Tensor]:
        """The request on the device, and a 0-d bool tensor: does it hold an id outside its table."""
        t_count = len(self.schema.feature_names)
        values = torch.from_numpy(sparse.values).to(self.device).long()
        lengths = torch.from_numpy(sparse.lengths).to(self.device).int()
        if values.numel():
            bounds = torch.repeat_interleave(self._rows_of(sparse.positions),
                                             torch.from_numpy(sparse.totals).to(self.device),
                                             output_size=values.numel())
            bad = ((values < 0) | (values >= bounds)).any()
        else:
            bad = torch.zeros((), dtype=torch.bool, device=self.device)
        per_feature: List[Optional[torch.Tensor]] = [None] * t_count
        for t, piece in zip(sparse.positions, torch.split(values, sparse.totals.tolist())):
            per_feature[t] = piece  # views, no copy
        if not sparse.in_model_order:
            full = torch.zeros((t_count, sparse.batch_size), dtype=torch.int32, device=self.device)
            if sparse.positions:
                full[list(sparse.positions)] = lengths
            lengths = full
        return DeviceRequest(lengths, per_feature, values, sparse.in_model_order), bad

    def prepare(self, batch: List[SparseBatch]) -> Tuple[List[Optional[DeviceRequest]], List[Optional[str]]]:
        """Each request on the device, or the error that keeps it out of the model call."""
        moved = [self.to_device(s) for s in batch]
        flags = torch.stack([bad for _, bad in moved]).tolist()
        errors = [id_error(s, self.schema) if flag else None for s, flag in zip(batch, flags)]
        return [None if e else r for (r, _), e in zip(moved, errors)], errors

    def merge(self, requests: List[DeviceRequest]) -> Tuple[torch.Tensor, torch.Tensor]:
        """(values int64 [N], lengths int32 [T * sum(B)]) of one KJT holding every request in order."""
        if len(requests) == 1 and requests[0].in_model_order:
            return requests[0].values, requests[0].lengths.reshape(-1)
        lengths = torch.cat([r.lengths for r in requests], dim=1).reshape(-1)
        pieces = []
        for t in range(len(self.schema.feature_names)):
            for r in requests:
                piece = r.per_feature[t]
                if piece is not None and piece.numel():
                    pieces.append(piece)
        values = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=lengths.device)
        return values, lengths


def split_rows(output: np.ndarray, sizes: List[int]) -> List[np.ndarray]:
    return np.split(output, np.cumsum(sizes)[:-1])
