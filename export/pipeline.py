"""The export pipeline's steps: quantize -> shard -> restore weights -> trace -> script.

Each step is a small function over modules; export/run.py calls them in order and checks each
result on a sample batch (export/verify.py) before the next one runs.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torchrec.fx
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torchrec.distributed.global_settings import set_propogate_device
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan
from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS
from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from torchrec.inference.modules import (
    DEFAULT_FUSED_PARAMS,
    assign_weights_to_tbe,
    get_table_to_weights_from_tbe,
    quantize_inference_model,
    shard_quant_model,
)
from torchrec.tensor_types import UInt4Tensor

from export import rewrite
from export.models import ModelFactory
from export.plan import PLACEMENT_KERNELS, WEIGHT_DTYPES, ExportPlan
from export.servable import Servable, SparseLookup
from export.verify import Batch
from recserve import tables
from recserve.errors import UserError

QuantWeights = Dict[str, Tuple[torch.Tensor, torch.Tensor]]
# Where FBGEMM's inference TBE keeps table rows (device, host and unified memory).
TBE_WEIGHT_BUFFERS = ("weights_dev", "weights_host", "weights_uvm")


def quantize(model: nn.Module, plan: ExportPlan, dense_dtype: str = "fp32") -> nn.Module:
    """Swap the model's EBC for TorchRec's quantized one (in place), each table in its plan dtype.
    The lookup kernel writes the pooled embeddings in the dtype the dense part computes in, so that
    a 16-bit head reads them without a float32 round trip (half the bytes written, no cast)."""
    per_table = {name: WEIGHT_DTYPES[tp.dtype] for name, tp in plan.tables.items()}
    return quantize_inference_model(model, per_table_weight_dtype=per_table, output_dtype=DENSE_DTYPES[dense_dtype])


def quantized_weights(quant_model: nn.Module) -> QuantWeights:
    """The quantized tables, taken before sharding (sharding re-initialises them to zeros)."""
    return get_table_to_weights_from_tbe(quant_model)


def shard(
    quant_model: nn.Module,
    module_plan: EmbeddingModuleShardingPlan,
    factory: ModelFactory,
    plan: ExportPlan,
    device: str,
) -> nn.Module:
    """Shard the quantized EBC with TorchRec following the plan (in place)."""
    # Without this TorchRec puts CPU-sharded tables on CUDA.
    set_propogate_device(device == "cpu")
    cached = any(ps.compute_kernel == PLACEMENT_KERNELS["uvm_caching"] for ps in module_plan.values())
    sharded, _ = shard_quant_model(
        quant_model,
        world_size=plan.world_size,
        compute_device=device,
        sharding_device=device,
        sharding_plan=ShardingPlan({factory.ebc_fqn: module_plan}),
        sharders=[_sharder(split_scale_bias(plan), cached)],
    )
    return sharded


def split_scale_bias(plan: ExportPlan) -> bool:
    """TorchRec's sharded state_dict (needed for row- and column-wise) splits INT8/INT4 rows into
    weight, scale and bias; it fails on FP16 tables, which have no scale. A plan with FP16 tables
    therefore uses the unsplit sharder, and export/plan.py allows only table-wise placement there."""
    return not any(tp.dtype == "fp16" for tp in plan.tables.values())


def _sharder(split: bool, cache_stats: bool) -> QuantEmbeddingBagCollectionSharder:
    """TorchRec's default inference sharder; for UVM-cached tables FBGEMM also counts the cache's
    lookups and misses per TBE (``uvm_cache_stats``, counted inside its cache kernels: the server's
    hit and miss metrics read them)."""
    fused = {**DEFAULT_FUSED_PARAMS, FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: split}
    if cache_stats:
        fused["gather_uvm_cache_stats"] = True
    return QuantEmbeddingBagCollectionSharder(fused_params=fused)


def restore_weights(sharded_ebc: nn.Module, weights: QuantWeights, plan: ExportPlan) -> None:
    """Copy the quantized tables into the sharded TBEs (sharding left them zero): through TorchRec's
    sharded state_dict loader, which slices rows (row-wise) and columns (column-wise) per shard, or,
    for table-wise plans with FP16 tables, table by table into the TBEs."""
    _restore(sharded_ebc, weights, plan)
    # A UVM cache filled before the restore would hold the zero rows: start every cache empty.
    for tbe in sharded_ebc.modules():
        if isinstance(tbe, IntNBitTableBatchedEmbeddingBagsCodegen) and tbe.lxu_cache_weights.numel():
            tbe.reset_cache_states()


def _restore(sharded_ebc: nn.Module, weights: QuantWeights, plan: ExportPlan) -> None:
    if not split_scale_bias(plan):
        assign_weights_to_tbe(sharded_ebc, weights)
        return
    source: Dict[str, torch.Tensor] = {}
    for table, (weight, scale_bias) in weights.items():
        # INT4 rows are packed two per byte; the wrapper slices them in 4-bit units.
        if plan.tables[table].dtype == "int4":
            weight = UInt4Tensor(weight)
        source[f"embedding_bags.{table}.weight"] = weight
        if scale_bias is not None:
            # FBGEMM keeps per-row (scale, bias) as two fp16 numbers after the row's data.
            scale_bias = scale_bias.contiguous().view(torch.float16)
            source[f"embedding_bags.{table}.weight_qscale"] = scale_bias[:, 0:1]
            source[f"embedding_bags.{table}.weight_qbias"] = scale_bias[:, 1:2]
    result = sharded_ebc.load_state_dict(source, strict=False)
    not_loaded = [k for k in result.missing_keys if not k.startswith("tbes.")]
    if result.unexpected_keys or not_loaded:
        raise UserError(f"restoring weights into the sharded tables failed: unexpected {result.unexpected_keys}, "
                        f"missing {not_loaded}")


# --dense-dtype: the storage and compute dtype of the dense part ("tf32": float32 weights, TF32
# matmuls, switched on by whoever loads the artifact: recserve.manifest.set_dense_math).
DENSE_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_servable(
    sharded_model: nn.Module,
    head: nn.Module,
    factory: ModelFactory,
    feature_names: List[str],
    sample: Batch,
    dense_dtype: str = "fp32",
) -> Servable:
    """The eager artifact module, both parts traced by torchrec.fx: the sparse part because the
    sharded EBC is not scriptable, the head because some TorchRec layers are not either (DCN's
    LowRankCrossNet indexes a ParameterList in a loop; tracing unrolls it)."""
    ebc = sharded_model.get_submodule(factory.ebc_fqn)
    with torch.no_grad():
        # TorchRec builds the sharded module's input distribution on the first call; tracing before
        # that fails. The call also tells in which order the sharded EBC returns its features.
        keys = ebc(sample.kjt()).keys()
    sparse = torchrec.fx.symbolic_trace(SparseLookup(ebc, feature_names, in_feature_order=keys == feature_names),
                                        leaf_modules=_LEAF_TBE if _has_cache(ebc) else None)
    rewrite.drop_whole_kjt_splits(sparse, len(feature_names))
    traced_head = torchrec.fx.symbolic_trace(head)
    with torch.no_grad():
        head_sample = (sample.dense, sparse(sample.values, sample.lengths).float())
        rewrite.fold_bias_into_linear(traced_head, *head_sample)
        rewrite.use_addcmul(traced_head, *head_sample)
    return Servable(sparse, traced_head, DENSE_DTYPES[dense_dtype])


# Tracing runs through FBGEMM's TBE and freezes what it reads on the host; a UVM cache decides per
# call on host state (its LRU timestep, the prefetch queue), so a cached TBE stays a module, scripted
# whole, as torchrec/inference/dlrm_predict.py does.
_LEAF_TBE = [IntNBitTableBatchedEmbeddingBagsCodegen.__name__]


def _has_cache(ebc: nn.Module) -> bool:
    return any(isinstance(m, IntNBitTableBatchedEmbeddingBagsCodegen) and m.lxu_cache_weights.numel()
               for m in ebc.modules())


def script(servable: Servable) -> torch.jit.ScriptModule:
    return torch.jit.script(servable)


def storage_bytes(tensors: List[torch.Tensor]) -> int:
    """Bytes held by the distinct storages behind ``tensors`` (a shared storage counts once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[(str(s.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def artifact_bytes(module: nn.Module) -> Dict[str, int]:
    """Memory an artifact module holds: FBGEMM table buffers, dense parameters, and all distinct
    storages together (equal to the sum of the first two when nothing is held twice)."""
    buffers = dict(module.named_buffers())
    if isinstance(module, torch.jit.ScriptModule):
        # FBGEMM keeps its rows in plain tensor attributes, which a scripted TBE (UVM-cached tables,
        # scripted whole) does not list among its buffers.
        buffers = {n: t for n, t in tables.attributes(module) if isinstance(t, torch.Tensor)}
    params = [p for _, p in module.named_parameters()]
    rows = [b for n, b in buffers.items() if n.rsplit(".", 1)[-1] in TBE_WEIGHT_BUFFERS]
    return {
        "table_bytes": storage_bytes(rows),
        "dense_bytes": storage_bytes(params),
        "total_bytes": storage_bytes(list(buffers.values()) + params),
    }
