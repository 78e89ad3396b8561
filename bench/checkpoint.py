"""A DLRM-v2-shaped checkpoint with random weights, for benchmarks: 26 sparse features (one table
each, dim 128), 13 dense features, DLRM_DCN (3 cross layers of rank 512) or plain DLRM, the MLPerf
DLRM-v2 MLP sizes. Rows are scaled by ``rows_per_table`` so the float source fits in host memory
(the tables stay far larger than the GPU's L2)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict

import torch
from tqdm import tqdm

from export.checkpoint import CONFIG_FILE, WEIGHTS_FILE, checkpoint_files, make_checkpoint_dir
from export.models import factory_for
from recserve.errors import UserError
from serving.machine import usable_memory

NUM_SPARSE, DIM, NUM_DENSE = 26, 128, 13


def dlrm_v2_config(rows_per_table: int, model: str = "dlrm_dcn") -> Dict:
    return {
        "model": model,
        "tables": [{"name": f"t{i}", "num_embeddings": rows_per_table, "embedding_dim": DIM,
                    "feature_names": [f"f{i}"], "pooling": "SUM"} for i in range(NUM_SPARSE)],
        "dense_in_features": NUM_DENSE,
        "dense_arch_layer_sizes": [512, 256, DIM],
        "over_arch_layer_sizes": [1024, 1024, 512, 256, 1],
        "dcn_num_layers": 3,
        "dcn_low_rank_dim": 512,
    }


def _check_memory(model: str, rows_per_table: int) -> None:
    """The weights are all held in memory until torch.save has written them, and each table once more
    while it is drawn (randn, then scaled): more than this machine (its cgroup limit included) can hold
    is refused before any is allocated (the allocation failed with a traceback, or the kernel's OOM
    killer ended the process; rows past 2**56 overflowed torch's size arithmetic)."""
    one_row = factory_for(dlrm_v2_config(1, model)).build(dlrm_v2_config(1, model), torch.device("meta"))
    dense = sum(t.numel() for t in one_row.state_dict().values()) * 4 - NUM_SPARSE * DIM * 4
    row = (NUM_SPARSE + 1) * DIM * 4
    needed, usable = dense + rows_per_table * row, usable_memory()
    if needed > usable:
        raise UserError(f"--rows-per-table {rows_per_table} needs {needed / 2**30:.1f} GiB of memory to write the "
                        f"checkpoint; this machine gives {usable / 2**30:.1f} GiB: use at most --rows-per-table "
                        f"{max(0, (usable - dense) // row)}")


def write_bench_checkpoint(out: Path, rows_per_table: int, model: str = "dlrm_dcn", seed: int = 0) -> Path:
    config = dlrm_v2_config(rows_per_table, model)
    factory = factory_for(config)  # checks the config before --out is made
    _check_memory(model, rows_per_table)
    shapes = {k: v.shape for k, v in factory.build(config, torch.device("meta")).state_dict().items()}
    out = make_checkpoint_dir(out)
    g = torch.Generator().manual_seed(seed)
    state: Dict[str, torch.Tensor] = {}
    # disable=None: a bar only on a terminal (a log file or a pipe gets no carriage returns).
    for name, shape in tqdm(shapes.items(), desc="random weights", unit="tensor", file=sys.stderr, disable=None):
        fan_in = shape[-1] if len(shape) > 1 else shape[0]
        std = 0.05 if "embedding_bags" in name else (1.0 / fan_in) ** 0.5
        state[name] = torch.randn(shape, generator=g) * std
    with checkpoint_files(out):  # into the path, not through memory (save_tensors): gigabytes of tables
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        torch.save(state, out / WEIGHTS_FILE)
    return out
