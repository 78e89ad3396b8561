"""Model factories: how a checkpoint's ``model_config.json`` becomes a float TorchRec model.

The export pipeline needs four things from a model family, and a user's own model class plugs in
by providing them (``"model": "my_package.my_module:factory"`` in ``model_config.json``):

- ``build(config, device) -> nn.Module``: the float model, whose ``state_dict()`` is ``weights.pt``.
- ``ebc_fqn``: where its ``EmbeddingBagCollection`` sits (this is what gets quantized and sharded).
- ``head(model, tables) -> nn.Module``: ``(dense f32[B,F], pooled f32[B, sum(dims)]) -> logits f32[B,1]``,
  the model's computation after the embedding lookup. The artifact runs ``head(dense, lookup(kjt))``,
  so ``forward`` and ``lookup`` share one copy of the tables.
- ``reference(model, dense, kjt) -> logits``: the float model's own forward, for verification.

and, optionally, ``name``: the manifest's ``model_family`` (default: the ``"model"`` string itself).

Built in: ``dlrm`` (``torchrec.models.dlrm.DLRM``) and ``dlrm_dcn`` (``DLRM_DCN``).
"""
# No `from __future__ import annotations`: torch.fx copies the head's annotations into generated
# code that TorchScript then compiles, and string annotations break that.
import importlib
from dataclasses import dataclass
from typing import Any, Dict, List, Protocol

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.models.dlrm import DLRM, DLRM_DCN

from recserve.errors import UserError


class ModelFactory(Protocol):
    name: str
    ebc_fqn: str

    def build(self, config: Dict[str, Any], device: torch.device) -> nn.Module: ...

    def head(self, model: nn.Module, tables: List[EmbeddingBagConfig]) -> nn.Module: ...

    def reference(self, model: nn.Module, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor: ...


# PoolingType's other member, NONE, is for unpooled collections; an EmbeddingBagCollection pools.
POOLINGS = ("SUM", "MEAN")
TABLE_KEYS = "each needs name, num_embeddings, embedding_dim, feature_names, and optionally pooling"


def table_configs(config: Dict[str, Any], device: torch.device) -> List[EmbeddingBagConfig]:
    tables = [_table_config(entry) for entry in config["tables"]]
    seen: Dict[str, str] = {}
    for t in tables:
        for f in t.feature_names:
            if f in seen:
                raise UserError(f"model_config.json: feature {f!r} is listed by table {seen[f]!r} and table "
                                f"{t.name!r}; list each feature once (to share a table, list its features in it)")
            seen[f] = t.name
    names = [t.name for t in tables]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise UserError(f"model_config.json: table names {duplicated} appear more than once; name each table once")
    return tables


def _table_config(entry: Any) -> EmbeddingBagConfig:
    if not isinstance(entry, dict):
        raise UserError(f"model_config.json: table entry {entry!r} is not an object; {TABLE_KEYS}")
    missing = [k for k in ("name", "num_embeddings", "embedding_dim", "feature_names") if k not in entry]
    if missing:
        raise UserError(f"model_config.json: table entry {entry.get('name', entry)!r} lacks {missing}; {TABLE_KEYS}")
    where = f"model_config.json: table {entry['name']!r}"
    if not str(entry["name"]) or "." in str(entry["name"]):
        raise UserError(f"{where}: a table name is a non-empty string without '.' (it names a module of the model)")
    for key in ("num_embeddings", "embedding_dim"):
        value = entry[key]
        if not _positive(value):
            raise UserError(f"{where}: {key} must be a positive integer, got {value!r}")
    features = entry["feature_names"]
    if not isinstance(features, list) or not features or not all(isinstance(f, str) and f for f in features):
        raise UserError(f"{where}: feature_names must be a non-empty list of feature names, got {features!r}")
    pooling = str(entry.get("pooling", "SUM")).upper()
    if pooling not in POOLINGS:
        raise UserError(f"{where}: pooling {entry['pooling']!r} is not supported; use one of {list(POOLINGS)}")
    return EmbeddingBagConfig(
        name=str(entry["name"]),
        num_embeddings=entry["num_embeddings"],
        embedding_dim=entry["embedding_dim"],
        feature_names=features,
        pooling=PoolingType[pooling],
    )


def _positive(value: Any) -> bool:
    """A positive JSON integer (not a bool, not a float)."""
    return type(value) is int and value > 0


def _positive_int(config: Dict[str, Any], key: str, default: Any = None) -> int:
    value = config[key] if default is None else config.get(key, default)
    if not _positive(value):
        raise UserError(f"model_config.json: {key} must be a positive integer, got {value!r}")
    return value


def _layer_sizes(config: Dict[str, Any], key: str) -> List[int]:
    sizes = config[key]
    if not isinstance(sizes, list) or not sizes or not all(_positive(n) for n in sizes):
        raise UserError(f"model_config.json: {key} must be a non-empty list of positive integers, got {sizes!r}")
    return sizes


def _over_arch_layer_sizes(config: Dict[str, Any]) -> List[int]:
    """The over arch's last layer is the logit: one per sample (the artifact's ``forward`` is f32[B])."""
    sizes = _layer_sizes(config, "over_arch_layer_sizes")
    if sizes[-1] != 1:
        raise UserError(f"model_config.json: over_arch_layer_sizes must end in 1 (one logit per sample, whose "
                        f"sigmoid is the click probability), got {sizes!r}")
    return sizes


class DLRMHead(nn.Module):
    """DLRM after the sparse arch: dense arch, interaction, over arch (as ``DLRM.forward`` does)."""

    def __init__(self, model: DLRM, num_features: int, dim: int) -> None:
        super().__init__()
        self.dense_arch = model.dense_arch
        self.inter_arch = model.inter_arch
        self.over_arch = model.over_arch
        self.num_features = num_features
        self.dim = dim

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense)
        sparse = pooled.reshape(-1, self.num_features, self.dim)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense, sparse_features=sparse))


@dataclass
class DLRMFactory:
    name: str = "dlrm"
    ebc_fqn: str = "sparse_arch.embedding_bag_collection"

    def build(self, config: Dict[str, Any], device: torch.device) -> nn.Module:
        ebc = EmbeddingBagCollection(tables=table_configs(config, device), device=device)
        try:
            kwargs = dict(
                embedding_bag_collection=ebc,
                dense_in_features=_positive_int(config, "dense_in_features"),
                dense_arch_layer_sizes=_layer_sizes(config, "dense_arch_layer_sizes"),
                over_arch_layer_sizes=_over_arch_layer_sizes(config),
                dense_device=device,
            )
            if self.name == "dlrm_dcn":
                return DLRM_DCN(
                    dcn_num_layers=_positive_int(config, "dcn_num_layers", 3),
                    dcn_low_rank_dim=_positive_int(config, "dcn_low_rank_dim", 512),
                    **kwargs,
                )
            return DLRM(**kwargs)
        except KeyError as e:
            raise UserError(f"model_config.json lacks {e}") from e
        except (AssertionError, ValueError) as e:
            raise UserError(f"model_config.json does not describe a valid {self.name}: {e}") from e

    def head(self, model: nn.Module, tables: List[EmbeddingBagConfig]) -> nn.Module:
        num_features = sum(len(t.feature_names) for t in tables)
        return DLRMHead(model, num_features, tables[0].embedding_dim)

    def reference(self, model: nn.Module, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return model(dense, kjt)


FACTORY_ATTRIBUTES = ("ebc_fqn", "build", "head", "reference")  # and optionally name

BUILTIN: Dict[str, ModelFactory] = {
    "dlrm": DLRMFactory("dlrm"),
    "dlrm_dcn": DLRMFactory("dlrm_dcn"),
}


def factory_for(config: Dict[str, Any]) -> ModelFactory:
    """The factory named by ``config["model"]``: a built-in name, or ``module:attribute``."""
    name = str(config.get("model", "dlrm"))
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise UserError(f"model_config.json: unknown model {name!r}; use one of {sorted(BUILTIN)} "
                        "or 'package.module:factory'")
    module_name, attr = name.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise UserError(f"model_config.json: cannot import model factory {name!r}: {e}") from e
    lacking = [a for a in FACTORY_ATTRIBUTES if not hasattr(factory, a)]
    if lacking:
        raise UserError(f"model_config.json: {name!r} is not a model factory: it lacks {lacking} "
                        "(see export/models.py)")
    return factory
