"""The artifact contract shared by export (which writes it) and serving / the C++ loader (which read it).

An artifact is a directory ``REPO/NAME/VERSION/`` holding:

- ``model.pt``: TorchScript. ``forward(dense f32[B,F], values i64[N], lengths i32[T*B]) -> f32[B]``
  (click probabilities) and ``lookup(values, lengths) -> f32[B, sum(dims)]`` (pooled embeddings in
  manifest feature order). ``lengths`` is key-major in manifest feature order (the KJT layout).
  Both methods read the same single copy of the tables. Optional (artifacts exported since shared
  features): ``pooled(values, lengths)`` (the lookup in the dense part's dtype) and
  ``predict_pooled(dense, pooled) -> f32[B]``, ``forward`` in two steps; the server pools a shared bag
  once per request with them where they exist.
- ``golden.pt``: ``torch.save`` of a dict of sample inputs (``dense``, ``values``, ``lengths``, with
  empty bags and the largest valid ids) and the artifact's outputs on them (``ctr``, ``pooled``) plus
  the float model's (``float_ctr``, ``float_pooled``).
- ``manifest.json``: :class:`Manifest`, below. It names the sha256 of every other file.

A version directory appears by an atomic rename, after verification: a reader never sees half of one.
Names starting with ``.`` inside a model directory are work in progress and are never loaded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Optional

from recserve.errors import UserError

FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.pt"
GOLDEN_FILE = "golden.pt"
# A model name is one path component of safe characters: it never reaches the filesystem otherwise.
MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")  # \Z: "$" would take a final newline
MODEL_NAME_RULE = "a model name is 1 to 128 ASCII letters, digits, '_', '.' and '-', starting with a letter or digit"
# Version numbers travel as protobuf int64 (model_version) and as JSON integers: 1 .. 2**63 - 1.
MAX_VERSION = 2**63 - 1
VERSION_NAME_RE = re.compile(r"^[1-9][0-9]{0,18}\Z")  # ASCII digits only (str.isdigit() accepts superscripts)
# What the wire (recserve.v1.ModelInfo: int32 dim and dense_features, int64 rows; every request
# dimension < 2**31) and the kernels (int32 offsets) accept of a manifest's numbers.
MAX_INT32 = 2**31 - 1
WEIGHT_DTYPES = ("int8", "int4", "fp16")
DENSE_DTYPES = ("fp32", "tf32", "bf16", "fp16")
POOLINGS = ("SUM", "MEAN")
PLACEMENTS = ("hbm", "uvm", "uvm_caching")
DEVICES = ("cpu", "cuda")
MAX_WORLD_SIZE = 4096


def parse_version_name(name: str) -> "int | None":
    """The version number a directory name stands for, or None if it is not a version directory."""
    if not VERSION_NAME_RE.match(name):
        return None
    version = int(name)
    return version if version <= MAX_VERSION else None


class ArtifactError(UserError):
    """An artifact that is missing, incomplete, or does not verify."""


@dataclass
class Feature:
    """One sparse feature, in model order. Valid ids are ``[0, rows)``."""

    name: str
    table: str
    rows: int
    dim: int
    pooling: str  # "SUM" | "MEAN"
    weight_dtype: str  # "int8" | "int4" | "fp16"


@dataclass
class Shard:
    """One piece of a table: ``sizes`` = [rows, cols] starting at ``offsets`` = [row, col]."""

    rank: int
    offsets: List[int]
    sizes: List[int]
    placement: str  # torchrec placement, e.g. "rank:0/cuda:0"


@dataclass
class TableSharding:
    type: str  # "table_wise" | "row_wise" | "column_wise"
    ranks: List[int]
    shards: List[Shard]
    # Where the rows live (CUDA): "hbm" (GPU memory), "uvm" (host memory read over PCIe) or
    # "uvm_caching" (host memory behind an HBM cache of cache_load_factor x rows, FBGEMM's LRU cache).
    placement: str = "hbm"
    cache_load_factor: Optional[float] = None
    # Bytes of this table held in GPU memory (rows or cache) and in host memory, over all its shards
    # (rows padded as FBGEMM stores them; on a CPU export everything is host memory).
    hbm_bytes: int = 0
    host_bytes: int = 0


@dataclass
class Sharding:
    world_size: int
    device: str  # "cpu" | "cuda": where the tables live (cuda: rank r on cuda:r)
    tables: Dict[str, TableSharding]


@dataclass
class Verification:
    """Figures of the export's gates, each on the same sample batch (see export/verify.py)."""

    batch_size: int
    thresholds: Dict[str, float]
    quantized_vs_float: Dict[str, float]
    sharded_vs_float: Dict[str, float]
    reloaded_vs_sharded: Dict[str, float]


@dataclass
class Manifest:
    format_version: int
    name: str
    version: int
    model_family: str  # the factory that built the float model, e.g. "dlrm"
    model_config: Dict[str, Any]  # model_config.json of the checkpoint, verbatim
    features: List[Feature]
    dense_features: int
    sharding: Sharding
    dense_device: str  # where forward() expects `dense`, e.g. "cpu" or "cuda:0"
    dense_dtype: str  # the dense part's precision: fp32 | tf32 (loaders enable TF32 matmuls) | bf16 | fp16
    sparse_device: str  # where forward()/lookup() expect `values` and `lengths`
    versions: Dict[str, str]  # torch / torchrec / fbgemm_gpu / python
    fbgemm_libraries: List[str]  # shared objects a C++ loader must dlopen, in order (fbgemm_gpu dir)
    files: Dict[str, str]  # file name -> sha256 of every other file in the directory
    verification: Verification
    table_bytes: int  # bytes of the quantized tables (one copy)
    dense_bytes: int  # bytes of the dense parameters
    export_seconds: float
    created_at: str

    @property
    def feature_names(self) -> List[str]:
        return [f.name for f in self.features]

    @property
    def pooled_dim(self) -> int:
        return sum(f.dim for f in self.features)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=False) + "\n"

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "Manifest":
        if d.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"manifest format_version {d.get('format_version')!r} is not {FORMAT_VERSION}"
            )
        try:
            sharding = d["sharding"]
            return Manifest(
                **{
                    **d,
                    "features": [Feature(**f) for f in d["features"]],
                    "sharding": Sharding(
                        world_size=sharding["world_size"],
                        device=sharding["device"],
                        tables={
                            t: TableSharding(**{**ts, "shards": [Shard(**s) for s in ts["shards"]]})
                            for t, ts in sharding["tables"].items()
                        },
                    ),
                    "verification": Verification(**d["verification"]),
                }
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ArtifactError(f"manifest does not match format {FORMAT_VERSION}: {e}") from e


def _field(name: str, problem: str) -> ArtifactError:
    return ArtifactError(f"manifest field {name}: {problem}")


def _int_in(value: Any, low: int, high: int, name: str) -> None:
    if type(value) is not int:  # noqa: E721 - bool is an int subclass, and no count is true or false
        raise _field(name, f"{value!r:.64} is not an integer")
    if not low <= value <= high:
        raise _field(name, f"{value} is outside [{low}, {high}]")


def _one_of(value: Any, allowed: tuple, name: str) -> None:
    if value not in allowed:
        raise _field(name, f"{value!r:.64} is not one of {list(allowed)}")


def check_fields(m: Manifest) -> None:
    """Every field a server reads within what the wire and the kernels accept; ArtifactError naming
    the first field that is not (serving/engine/loader.py then checks the numbers against model.pt
    and golden.pt)."""
    if not isinstance(m.name, str) or not MODEL_NAME_RE.match(m.name):
        raise _field("name", f"{m.name!r:.64} is not a model name ({MODEL_NAME_RE.pattern})")
    _int_in(m.version, 1, MAX_VERSION, "version")
    if not isinstance(m.features, list) or not m.features:
        raise _field("features", "the model needs at least one sparse feature")
    tables = m.sharding.tables if isinstance(m.sharding.tables, dict) else {}
    seen = set()
    for i, f in enumerate(m.features):
        if not isinstance(f.name, str) or not f.name:
            raise _field(f"features[{i}].name", f"{f.name!r:.64} is not a feature name")
        if f.name in seen:
            raise _field(f"features[{i}].name", f"{f.name!r:.64} appears more than once")
        seen.add(f.name)
        if f.table not in tables:
            raise _field(f"features[{i}].table", f"{f.table!r:.64} is not in sharding.tables")
        _int_in(f.rows, 1, MAX_VERSION, f"features[{i}].rows")
        _int_in(f.dim, 1, MAX_INT32, f"features[{i}].dim")
        _one_of(f.pooling, POOLINGS, f"features[{i}].pooling")
        _one_of(f.weight_dtype, WEIGHT_DTYPES, f"features[{i}].weight_dtype")
    if sum(f.dim for f in m.features) > MAX_INT32:
        raise _field("features", f"the dims add up to {sum(f.dim for f in m.features)}, more than {MAX_INT32}")
    _int_in(m.dense_features, 1, MAX_INT32, "dense_features")
    _one_of(m.dense_dtype, DENSE_DTYPES, "dense_dtype")
    _int_in(m.sharding.world_size, 1, MAX_WORLD_SIZE, "sharding.world_size")
    _one_of(m.sharding.device, DEVICES, "sharding.device")
    # What verify_files and `recserve inspect` read: a hand-edited manifest was a TypeError there.
    _str_map(m.files, "files")
    for name in m.files:  # each is read as version_dir / name: "../x" or "/etc/x" would be read elsewhere
        if name in ("", ".", "..") or "/" in name or "\0" in name:
            raise _field("files", f"{name!r:.64} is not a file name of the version's directory")
    _str_map(m.versions, "versions")
    _int_in(m.table_bytes, 0, MAX_VERSION, "table_bytes")
    _int_in(m.dense_bytes, 0, MAX_VERSION, "dense_bytes")
    for t, ts in tables.items():
        _one_of(ts.placement, PLACEMENTS, f"sharding.tables.{t}.placement")
        factor = ts.cache_load_factor
        if factor is not None and not (type(factor) in (int, float) and 0 < factor <= 1):
            raise _field(f"sharding.tables.{t}.cache_load_factor", f"{factor!r:.64} is not a number in (0, 1]")
        _int_in(ts.hbm_bytes, 0, MAX_VERSION, f"sharding.tables.{t}.hbm_bytes")
        _int_in(ts.host_bytes, 0, MAX_VERSION, f"sharding.tables.{t}.host_bytes")
    for gate in ("quantized_vs_float", "sharded_vs_float", "reloaded_vs_sharded"):
        figures = getattr(m.verification, gate)
        if not isinstance(figures, dict) or not all(type(v) in (int, float) for v in figures.values()):
            raise _field(f"verification.{gate}", f"{figures!r:.64} is not a map of figures")


def _str_map(value: Any, name: str) -> None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _field(name, f"{value!r:.64} is not a map of strings")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def read_json_object(path: Path, error: type, missing: str) -> dict:
    """The JSON object in ``path``; ``error(message)`` where it is missing (``missing``), cannot be read
    (a directory, a path through a file, no permission), not JSON or not an object."""
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise error(missing) from e
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from e
    except RecursionError:  # "[[[[...": nested deeper than the parser's recursion
        raise error(f"{path}: JSON nested too deeply to read (recserve's files nest a few levels)") from None
    if not isinstance(d, dict):
        raise error(f"{path}: not a JSON object")
    return d


def read_manifest(version_dir: Path) -> Manifest:
    path = Path(version_dir) / MANIFEST_FILE
    manifest = Manifest.from_dict(read_json_object(path, ArtifactError, f"{path}: no manifest"))
    check_fields(manifest)
    return manifest


def verify_files(version_dir: Path, manifest: Manifest) -> None:
    """Raise ArtifactError unless every file the manifest names exists with its sha256."""
    version_dir = Path(version_dir)
    for required in (MODEL_FILE, GOLDEN_FILE):
        if required not in manifest.files:
            raise ArtifactError(f"{version_dir}: manifest lists no checksum for {required}")
    for name, digest in manifest.files.items():
        path = version_dir / name
        if not path.is_file():
            raise ArtifactError(f"{path}: missing")
        actual = sha256_file(path)
        if actual != digest:
            raise ArtifactError(f"{path}: sha256 {actual[:12]}... does not match the manifest's {digest[:12]}...")


def load_verified(version_dir: Path) -> Manifest:
    manifest = read_manifest(version_dir)
    verify_files(version_dir, manifest)
    return manifest


class VersionListing(NamedTuple):
    versions: List[int]  # ascending
    not_versions: List[str]  # directories not named by a version number: "v2", "²", "0", "9223372036854775808"


def scan_versions(model_dir: Path) -> VersionListing:
    """The version directories of a model, and the other directories, which are never loaded.
    In-progress directories (dot names) and plain files are neither. Raises OSError if
    ``model_dir`` cannot be read (FileNotFoundError if it is gone)."""
    versions, not_versions = [], []
    for p in Path(model_dir).iterdir():
        if p.name.startswith(".") or not p.is_dir():
            continue
        version = parse_version_name(p.name)
        if version is None:
            not_versions.append(p.name)
        else:
            versions.append(version)
    return VersionListing(sorted(versions), sorted(not_versions))


def list_versions(model_dir: Path) -> List[int]:
    """Complete versions of a model, ascending ([] if it has no directory)."""
    model_dir = Path(model_dir)
    return scan_versions(model_dir).versions if model_dir.is_dir() else []


class ModelListing(NamedTuple):
    models: List[str]
    not_models: List[str]  # directories not named as a model ("my model"), never served; dot names are neither


def scan_models(repo: Path) -> ModelListing:
    """The model directories of a repository, and the other directories, which are never served."""
    repo = Path(repo)
    if not repo.is_dir():
        return ModelListing([], [])
    models, not_models = [], []
    for p in repo.iterdir():
        if p.name.startswith(".") or not p.is_dir():
            continue
        (models if MODEL_NAME_RE.match(p.name) else not_models).append(p.name)
    return ModelListing(sorted(models), sorted(not_models))


def list_models(repo: Path) -> List[str]:
    return scan_models(repo).models


_DENSE_MATH = threading.RLock()


@contextlib.contextmanager
def dense_math(dense_dtype: str) -> Iterator[None]:
    """One model's matmul precision around its own calls (TF32 tensor cores for "tf32", full float32
    otherwise): the switches are process-wide, and a server holds models of several precisions.
    A CUDA graph keeps the kernels chosen at capture, so captures must run inside it too. One thread
    at a time: a model's launches in one thread and another model's load (its golden check) in
    another would otherwise see each other's setting (an fp32 model computed in TF32, seen on an
    H200 as a golden check off by 2e-4). Launches are asynchronous, so the lock is held briefly."""
    import torch

    with _DENSE_MATH:
        before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        allow = dense_dtype == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allow
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def disable_texpr_fuser() -> None:
    """TorchScript's TensorExpr fuser off, for every model alike (process-wide; the C++ loader does
    the same). Its generated elementwise kernels ran at about a third of ATen's speed on an H200
    (DCN's cross layers: 3.3 ms vs 1.1 ms at B=65536, bf16; docs/benchmarks.md), and the export
    already merges what matters (export/rewrite.py)."""
    import torch

    torch._C._jit_set_texpr_fuser_enabled(False)


def set_dense_math(dense_dtype: str) -> None:
    """Both of the above for a process that runs one model (the export)."""
    import torch

    disable_texpr_fuser()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = dense_dtype == "tf32"
