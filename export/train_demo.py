"""``recserve train-demo``: a small DLRM trained on synthetic clicks, written as a checkpoint.

The data has a planted signal in both parts of the input: each id of each sparse feature carries a
hidden click propensity, and the dense features enter the click logit linearly. So the embeddings
matter: the same model with zeroed tables ranks the held-out clicks far worse (both AUCs printed).
Nothing is downloaded.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from torch import nn

from export.checkpoint import CONFIG_FILE, HOLDOUT_FILE, WEIGHTS_FILE, checkpoint_files, make_checkpoint_dir
from export.models import factory_for
from export.write import save_tensors

DEMO_CONFIG: Dict = {
    "model": "dlrm",
    "tables": [
        {"name": "t_user", "num_embeddings": 2000, "embedding_dim": 16, "feature_names": ["user_id"], "pooling": "SUM"},
        {"name": "t_item", "num_embeddings": 5000, "embedding_dim": 16, "feature_names": ["item_id"], "pooling": "SUM"},
        {"name": "t_topic", "num_embeddings": 300, "embedding_dim": 16, "feature_names": ["topics"], "pooling": "MEAN"},
    ],
    "dense_in_features": 8,
    "dense_arch_layer_sizes": [32, 16],
    "over_arch_layer_sizes": [32, 16, 1],
}


@dataclass
class ClickData:
    dense: torch.Tensor  # float32 [B, F]
    values: torch.Tensor  # int64, key-major in feature order
    lengths: torch.Tensor  # int32 [T*B]
    labels: torch.Tensor  # float32 [B]


class SyntheticClicks:
    """Click = Bernoulli(sigmoid(sum over features of mean id propensity + dense . w + b))."""

    def __init__(self, config: Dict, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.features: List[tuple] = [(f, t["num_embeddings"]) for t in config["tables"] for f in t["feature_names"]]
        self.propensity = [self.rng.normal(0.0, 1.5, rows) for _, rows in self.features]
        self.dense_w = self.rng.normal(0.0, 0.3, config["dense_in_features"])
        self.dense_in = config["dense_in_features"]

    def batch(self, n: int) -> ClickData:
        rng = self.rng
        lengths = rng.integers(0, 4, size=(len(self.features), n))
        lengths[0] = 1  # one user per sample
        values, logit = [], np.full(n, -0.5)
        for k, (_, rows) in enumerate(self.features):
            # A Zipf-like popularity so that frequent ids get trained.
            ids = np.minimum((rng.pareto(1.2, lengths[k].sum()) * rows / 20).astype(np.int64), rows - 1)
            values.append(ids)
            sums = np.add.reduceat(np.append(self.propensity[k][ids], 0.0), np.r_[0, np.cumsum(lengths[k])[:-1]])
            logit += np.where(lengths[k] > 0, sums / np.maximum(lengths[k], 1), 0.0)
        dense = rng.normal(0.0, 1.0, (n, self.dense_in))
        logit += dense @ self.dense_w
        labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return ClickData(
            dense=torch.from_numpy(dense.astype(np.float32)),
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(lengths.reshape(-1).astype(np.int32)),
            labels=torch.from_numpy(labels),
        )


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve by the rank-sum formula (ties get average ranks)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _predict(model: nn.Module, factory, data: ClickData, feature_names: List[str]) -> np.ndarray:
    from torchrec import KeyedJaggedTensor

    with torch.no_grad():
        kjt = KeyedJaggedTensor(keys=feature_names, values=data.values, lengths=data.lengths)
        return torch.sigmoid(factory.reference(model, data.dense, kjt)).reshape(-1).numpy()


def train_demo(out: Path, steps: int = 400, batch_size: int = 512, seed: int = 0, log=print) -> Dict[str, float]:
    from torchrec import KeyedJaggedTensor

    started = time.monotonic()
    torch.manual_seed(seed)
    out = make_checkpoint_dir(out)
    config = DEMO_CONFIG
    factory = factory_for(config)
    model = factory.build(config, torch.device("cpu"))
    feature_names = [f for t in config["tables"] for f in t["feature_names"]]
    data = SyntheticClicks(config, seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.BCEWithLogitsLoss()
    model.train()
    for step in range(steps):
        b = data.batch(batch_size)
        kjt = KeyedJaggedTensor(keys=feature_names, values=b.values, lengths=b.lengths)
        loss = loss_fn(factory.reference(model, b.dense, kjt).reshape(-1), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 100 == 0:
            log(f"step {step + 1}/{steps}  loss {loss.item():.4f}")
    model.eval()

    holdout = data.batch(8192)
    held_auc = auc(_predict(model, factory, holdout, feature_names), holdout.labels.numpy())
    zeroed = factory.build(config, torch.device("cpu"))
    zeroed.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in zeroed.get_submodule(factory.ebc_fqn).parameters():
            p.zero_()
    zeroed_auc = auc(_predict(zeroed.eval(), factory, holdout, feature_names), holdout.labels.numpy())

    # save_tensors: a failed write is an OSError (torch.save into a path: an opaque RuntimeError)
    with checkpoint_files(out):
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_tensors(model.state_dict(), out / WEIGHTS_FILE)
        save_tensors({"dense": holdout.dense, "values": holdout.values, "lengths": holdout.lengths,
                      "labels": holdout.labels, "feature_names": feature_names}, out / HOLDOUT_FILE)
    figures = {"holdout_auc": held_auc, "zeroed_tables_auc": zeroed_auc, "seconds": time.monotonic() - started}
    log(f"held-out AUC {held_auc:.4f} (same model with zeroed tables: {zeroed_auc:.4f}); "
        f"{steps} steps in {figures['seconds']:.1f}s; checkpoint in {out}")
    return figures
