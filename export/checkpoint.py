"""The checkpoint format that users' training jobs write, and its loader.

A directory with:
- ``model_config.json``: ``{"tables": [{"name", "num_embeddings", "embedding_dim", "feature_names",
  "pooling"}, ...], "dense_in_features", "dense_arch_layer_sizes", "over_arch_layer_sizes"}`` (the
  argument names of ``torchrec.EmbeddingBagConfig`` and ``torchrec.models.dlrm.DLRM``), optionally
  ``"model"`` (default ``"dlrm"``; see export/models.py) and that model's extra arguments.
- ``weights.pt``: ``torch.save(model.state_dict())`` of that model itself (no wrapper prefix), in
  float32.
"""
from __future__ import annotations

import pickle
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator

import torch
from torch import nn
from torchrec import EmbeddingBagCollection

from export.inputs import CONFIG_FILE, WEIGHTS_FILE, read_checkpoint_config

HOLDOUT_FILE = "holdout.pt"  # train-demo's held-out samples, beside the checkpoint (recserve.demo reads them)
from export.models import ModelFactory, factory_for
from recserve.errors import Interrupted, UserError


def make_checkpoint_dir(out: Path) -> Path:
    """The directory a checkpoint is written to (``--out``), made with its parents."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory; choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot make the directory ({e.strerror}); choose another --out") from e
    return out


@contextmanager
def checkpoint_files(out: Path) -> Iterator[None]:
    """Around writing a checkpoint's files into ``out``: a failed write (a full disk: an OSError, or
    torch.save's RuntimeError when it writes into a path) removes them all, so that no half checkpoint
    is left for the next run to refuse to overwrite, and is a UserError; so does an interruption."""
    try:
        yield
    except Interrupted as e:
        _remove_files(out)
        e.outcome = "; nothing was kept"
        raise
    except (OSError, RuntimeError) as e:
        _remove_files(out)
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"writing the checkpoint into {out} failed: {cause}; nothing was kept: free disk space (or "
                        "fix permissions) there and run again") from e


def _remove_files(out: Path) -> None:
    for name in (CONFIG_FILE, WEIGHTS_FILE, HOLDOUT_FILE):
        (out / name).unlink(missing_ok=True)


@dataclass
class Checkpoint:
    path: Path
    config: Dict[str, Any]
    factory: ModelFactory
    state_dict: Dict[str, torch.Tensor]  # memory-mapped: several models can share it for free

    def build_float_model(self) -> nn.Module:
        """A fresh float model holding the checkpoint's weights (views of the mmap, no copy)."""
        model = self.factory.build(self.config, torch.device("meta"))
        try:
            ebc = model.get_submodule(self.factory.ebc_fqn)
        except AttributeError:
            ebc = None
        if not isinstance(ebc, EmbeddingBagCollection):  # a user's factory: the export quantizes and shards it
            raise UserError(f"{CONFIG_FILE}: the model factory's ebc_fqn {self.factory.ebc_fqn!r} is "
                            f"{'a ' + type(ebc).__name__ if ebc is not None else 'no submodule'} of the model, not "
                            "its EmbeddingBagCollection")
        try:
            model.load_state_dict(self.state_dict, strict=True, assign=True)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise UserError(
                f"{self.path / WEIGHTS_FILE} does not match {CONFIG_FILE}: "
                f"{' '.join(line.strip() for line in first[:3])[:400]}"
            ) from e
        return model.eval()


def load_checkpoint(path: Path) -> Checkpoint:
    path = Path(path)
    config = read_checkpoint_config(path)
    weights_path = path / WEIGHTS_FILE
    factory = factory_for(config)
    try:
        state_dict = torch.load(weights_path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        raise UserError(f"{weights_path}: not a readable torch.save file ({str(e).splitlines()[0][:200]})") from e
    if not isinstance(state_dict, dict):
        raise UserError(f"{weights_path}: expected a state_dict (dict of tensors), got {type(state_dict).__name__}")
    not_float32 = [k for k, v in state_dict.items()
                   if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float32]
    if not_float32:
        first = state_dict[not_float32[0]]
        raise UserError(f"{weights_path}: {len(not_float32)} tensors are not float32 ({not_float32[0]!r} is "
                        f"{str(first.dtype).replace('torch.', '')}); the export reads float32 weights: "
                        "save model.float().state_dict()")
    return Checkpoint(path=path, config=config, factory=factory, state_dict=state_dict)
