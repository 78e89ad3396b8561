"""The module that becomes ``model.pt`` (contract: recserve/manifest.py).

``forward`` runs ``head(dense, lookup(values, lengths))``: both methods read the one sharded copy of
the tables. Only plain tensors cross the boundary; the KJT is built inside (TorchScript needs that).
"""

from typing import List

import torch
from torch import nn
from torchrec import KeyedJaggedTensor


class SparseLookup(nn.Module):
    """``values i64[N], lengths i32[T*B]`` (key-major, feature order) -> ``pooled [B, sum(dims)]``
    (in the dtype the tables were quantized to output: float32, or the head's 16-bit dtype).

    ``in_feature_order``: the sharded EBC returns its features in feature order (one device), so
    its output is the result as is; otherwise (shard order) the columns are put back in order."""

    def __init__(self, ebc: nn.Module, feature_names: List[str], in_feature_order: bool = False) -> None:
        super().__init__()
        self.ebc = ebc
        self.feature_names = feature_names
        self.in_feature_order = in_feature_order

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor(keys=self.feature_names, values=values, lengths=lengths)
        if self.in_feature_order:
            return self.ebc(kjt).values()
        pooled = self.ebc(kjt).to_dict()
        return torch.cat([pooled[name] for name in self.feature_names], dim=1)


class Servable(nn.Module):
    """``head_dtype``: the dtype the dense part computes in (its weights are stored in it); inputs
    are cast to it and the logits back to float32, so the contract stays float32 in and out."""

    def __init__(self, sparse: nn.Module, head: nn.Module, head_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.sparse = sparse
        self.head = head.to(head_dtype)
        self.head_dtype = head_dtype

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pooled = self.sparse(values, lengths)
        logits = self.head(dense.to(self.head_dtype), pooled.to(self.head_dtype))
        return torch.sigmoid(logits.float()).reshape(-1)

    @torch.jit.export
    def lookup(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.sparse(values, lengths).float()

    # ``forward`` in two steps, for a server that pools some bags once for many samples (shared
    # features): ``predict_pooled(dense, pooled(values, lengths))`` computes what ``forward`` does.
    @torch.jit.export
    def pooled(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.sparse(values, lengths)

    @torch.jit.export
    def predict_pooled(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        logits = self.head(dense.to(self.head_dtype), pooled.to(self.head_dtype))
        return torch.sigmoid(logits.float()).reshape(-1)
