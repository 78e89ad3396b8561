"""The export's inputs as far as they can be checked without torch: the checkpoint directory and its
``model_config.json``, the plan file's keys (export/plan.py documents the plan and checks its values
against the model), the dense precision for the device, the version directory to write (model name,
version number). ``recserve export`` runs these before it imports torch, so that a wrong argument is
one line within a second, not after torch's seconds of start-up."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from recserve.errors import UserError
from recserve.manifest import DENSE_DTYPES, MAX_VERSION, MODEL_NAME_RE, list_versions, read_json_object

CONFIG_FILE = "model_config.json"
WEIGHTS_FILE = "weights.pt"


def check_overwrite(out: Path, force: bool) -> None:
    """A checkpoint command (train-demo, bench-checkpoint) writes into an ``--out`` holding a
    checkpoint only with ``--force``."""
    written = [n for n in (CONFIG_FILE, WEIGHTS_FILE) if (out / n).exists()]
    if written and not force:
        raise UserError(f"--out {out} already holds a checkpoint ({', '.join(written)}); "
                        "pass --force to overwrite it or choose another --out")


PLAN_KEYS = frozenset({"world_size", "tables"})
# The keys a table's entry may have, by its sharding: "rank" places a table-wise table, "ranks" the
# shards of a column-wise one; a key that does not apply is refused rather than ignored.
TABLE_KEYS = {
    "table_wise": frozenset({"sharding", "rank", "dtype", "placement", "cache_load_factor"}),
    "row_wise": frozenset({"sharding", "dtype", "placement", "cache_load_factor"}),
    "column_wise": frozenset({"sharding", "ranks", "dtype", "placement", "cache_load_factor"}),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What a table's keys must hold, before export/plan.py checks their values against the model (and
# cache_load_factor's, a number in (0, 1]).
TABLE_VALUE_TYPES = {
    "rank": (_is_int, "an integer"),
    "ranks": (lambda v: isinstance(v, list) and all(_is_int(r) for r in v), "a list of integers"),
    "dtype": (lambda v: isinstance(v, str), "a string"),
    "placement": (lambda v: isinstance(v, str), "a string"),
}


def read_checkpoint_config(path: Path) -> Dict[str, Any]:
    """The checkpoint's model_config.json, after checking that both files are there."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint {path} is not a directory (expected {CONFIG_FILE} and {WEIGHTS_FILE} in it)")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise UserError(f"checkpoint {path}: {name} is missing")
    config_path = path / CONFIG_FILE
    config = read_json_object(config_path, UserError, f"checkpoint {path}: {CONFIG_FILE} is missing")
    if not isinstance(config.get("tables"), list) or not config["tables"]:
        raise UserError(f"{config_path}: needs a non-empty \"tables\" list")
    dense = config.get("dense_in_features")
    if not _is_int(dense) or dense < 1:  # every model's: the artifact's dense input is f32[B, dense_in_features]
        raise UserError(f"{config_path}: needs \"dense_in_features\", the number of dense features, a positive "
                        f"integer; got {dense!r}")
    return config


def _refuse_unknown(where: str, keys, known) -> None:
    unknown = sorted(set(keys) - set(known))
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; the keys are {sorted(known)}")


def read_plan_file(path: Optional[Path]) -> dict:
    """The plan file's JSON, every key known (a misspelt key would otherwise place a table elsewhere
    than the plan says, silently)."""
    if path is None:
        return {}
    raw = read_json_object(path, UserError, f"plan file {path} does not exist")
    _refuse_unknown(f"plan file {path}", raw, PLAN_KEYS)
    world_size = raw.get("world_size")
    if world_size is not None and (isinstance(world_size, bool) or not isinstance(world_size, int)):
        raise UserError(f"plan file {path}: \"world_size\" must be an integer, got {world_size!r}")
    tables = raw.get("tables") or {}
    if not isinstance(tables, dict):
        raise UserError(f"plan file {path}: \"tables\" must be an object mapping table name to its placement")
    for name, spec in tables.items():
        if not isinstance(spec, dict):
            raise UserError(f"plan file {path}: table {name!r}: expected an object")
        sharding = spec.get("sharding", "table_wise")
        if not isinstance(sharding, str) or sharding not in TABLE_KEYS:
            raise UserError(f"plan file {path}: table {name!r}: sharding {sharding!r} is not one of {list(TABLE_KEYS)}")
        _refuse_unknown(f"plan file {path}: table {name!r} ({sharding})", spec, TABLE_KEYS[sharding])
        for key, (valid, wanted) in TABLE_VALUE_TYPES.items():
            if key in spec and not valid(spec[key]):
                raise UserError(f"plan file {path}: table {name!r}: \"{key}\" must be {wanted}, got {spec[key]!r}")
    return raw


def resolve_dense_dtype(dense_dtype: str, device: str) -> str:
    """``--dense-dtype`` for ``--device``: auto is bf16 on cuda (tensor cores), fp32 on cpu."""
    if dense_dtype == "auto":
        return "bf16" if device == "cuda" else "fp32"
    if dense_dtype not in DENSE_DTYPES:
        raise UserError(f"--dense-dtype must be one of {sorted(DENSE_DTYPES)}, got {dense_dtype!r}")
    if device == "cpu" and dense_dtype in ("tf32", "fp16"):
        raise UserError(f"--dense-dtype {dense_dtype} needs --device cuda (CPUs have no TF32, and FP16 "
                        "matmuls there are slower than fp32); use fp32 or bf16 on cpu")
    return dense_dtype


def version_dir(repo: Path, name: str, version: Optional[int]) -> Path:
    """Where the new version goes: ``version`` or one above the newest present."""
    if not MODEL_NAME_RE.match(name):
        raise UserError(f"model name {name!r} must be 1-128 characters of letters, digits, '_', '-', '.', "
                        "starting with a letter or digit")
    model_dir = Path(repo) / name
    if version is None:
        newest = (list_versions(model_dir) or [0])[-1]
        if newest >= MAX_VERSION:
            raise UserError(f"{model_dir / str(newest)} leaves no next version number (versions travel as "
                            f"protobuf int64, at most {MAX_VERSION}); remove it if it is stray, or pass --version")
        version = newest + 1
    elif not 1 <= version <= MAX_VERSION:
        raise UserError(f"--version must be in [1, {MAX_VERSION}] (versions travel as protobuf int64), got {version}")
    target = model_dir / str(version)
    if target.exists():
        raise UserError(f"{target} already exists; pass another --version or leave it out for the next one")
    return target
