"""Per-model configuration: ``REPO/NAME/config.json``, optional (Triton's ``config.pbtxt``, TF
Serving's ``model_version_policy`` and version labels). Every key is optional; a key left out takes
the server's flag (``recserve serve --max-batch-size ...``)::

    {
      "version_policy": {"latest": 2},        // or {"all": true}, or {"specific": [3, 5]}; default latest 1
      "version_labels": {"stable": 3, "canary": 4},
      "max_batch_size": 1024,                 // samples per model call and per request
      "max_delay_ms": 0.5,                    // longest wait for batch-mates
      "max_queue": 64,                        // requests waiting per version and RPC
      "replicas": 1,                          // engines (GPUs) holding a copy; default every engine
      "warmup_batch_sizes": [1, 256, 1024],   // run (and capture CUDA graphs) at these sizes before ready
      "oip_inputs": "packed"                  // what OIP ModelMetadata/ModelConfig advertise; default "all"
    }

- ``version_policy``: which versions on disk are served. ``latest N``: the N highest that load and
  verify (a version that fails is skipped and the next lower one tried, so N keep serving);
  ``all``: every version on disk that loads; ``specific``: these, where on disk and they load.
  A request that names no version gets the highest served one.
- ``version_labels``: names for versions; a request may name a label where it names a version
  (recserve.v1 ``model_version_label``, OIP ``model_version``). A labelled version is served
  whatever the policy says (a canary next to the latest, or pinning ``stable`` while ``latest``
  moves on). Labels are letters, digits, ``_`` and ``-``, starting with a letter.
- ``oip_inputs``: the Open Inference Protocol's tensor contract as ModelMetadata and ModelConfig
  advertise it: ``all`` (every form, the per-feature and packed inputs optional) or ``packed``
  (``dense``, ``lengths`` and ``ids``, none optional: for tools that refuse optional inputs, such as
  perf_analyzer with ``--shared-memory``). The server takes every form either way.
- The file is read at every poll, like the version directories: a change is applied without
  dropping a request (batching delay and queue in place; a new ``max_batch_size``, ``replicas`` or
  warm-up loads the versions again and swaps them in; a new policy loads and drains versions).
- A file that does not parse, an unknown key or a bad value refuses that model, with one log line
  naming the key (``recserve_model_load_failures_total{reason="InvalidConfig"}``); the other models
  are not affected. A model already serving keeps its last good configuration until it is fixed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from recserve.errors import UserError
from recserve.manifest import MAX_VERSION
from serving.config import BatchSettings, ServerConfig

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few lines
LABEL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}\Z")


class ModelConfigError(UserError):
    """``config.json`` of a model does not parse or holds a bad key or value."""


@dataclass(frozen=True)
class VersionPolicy:
    latest: int = 1  # with kind "latest"
    kind: str = "latest"  # latest | all | specific
    specific: Tuple[int, ...] = ()

    def describe(self) -> str:
        return {"latest": f"latest {self.latest}", "all": "all",
                "specific": f"specific {list(self.specific)}"}[self.kind]


@dataclass(frozen=True)
class ModelConfig:
    """The effective configuration of one model: its config.json over the server's flags."""

    version_policy: VersionPolicy = VersionPolicy()
    version_labels: Dict[str, int] = field(default_factory=dict)
    batch: BatchSettings = field(default_factory=BatchSettings)
    replicas: int = 0  # engines holding a copy (0: every engine of the server)
    warmup_batch_sizes: Tuple[int, ...] = ()
    oip_inputs: str = "all"  # all | packed: what OIP ModelMetadata and ModelConfig advertise

    def load_key(self) -> Tuple:
        """What a loaded version was built for: a change means loading it again."""
        return (self.batch.max_batch_size, self.batch.max_ids_per_request, self.warmup_batch_sizes)

    def served_by(self, engine_index: int) -> bool:
        return self.replicas == 0 or engine_index < self.replicas

    def __hash__(self) -> int:  # labels are a dict
        return hash((self.version_policy, tuple(sorted(self.version_labels.items())), self.load_key(),
                     self.batch.max_delay_ms, self.batch.max_queue, self.replicas, self.oip_inputs))


def defaults(server: ServerConfig) -> ModelConfig:
    return ModelConfig(batch=dataclasses.replace(server.batch))


def read_model_config(model_dir: Path, server: ServerConfig) -> ModelConfig:
    """The model's effective configuration (the server's flags without a config.json); raises
    ModelConfigError with one line naming the file and the key."""
    path = model_dir / CONFIG_FILE
    try:  # non-blocking open: a FIFO put there must not hang the model's refresh (and the server's start)
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ModelConfigError(f"{path}: not a regular file")
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ModelConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
        text = data.decode()
    except FileNotFoundError:
        return defaults(server)
    except (OSError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path}: cannot be read ({e})") from None
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise ModelConfigError(f"{path}: not JSON ({e})") from None
    except RecursionError:
        raise ModelConfigError(f"{path}: not JSON (nested too deeply)") from None
    return parse_model_config(raw, server, str(path))


def parse_model_config(raw, server: ServerConfig, where: str = CONFIG_FILE) -> ModelConfig:
    def bad(key: str, problem: str) -> ModelConfigError:
        return ModelConfigError(f"{where}: {key}: {problem}")

    if not isinstance(raw, dict):
        raise ModelConfigError(f"{where}: must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise bad(unknown[0], f"unknown key (known: {', '.join(sorted(KNOWN_KEYS))})")
    batch = server.batch
    max_batch_size = _int(raw, "max_batch_size", 1, 2**31 - 1, batch.max_batch_size, bad)
    max_queue = _int(raw, "max_queue", 1, 2**31 - 1, batch.max_queue, bad)
    delay = raw.get("max_delay_ms", batch.max_delay_ms)
    if not _is_number(delay) or not 0 <= delay <= 60_000:
        raise bad("max_delay_ms", f"must be a number of milliseconds from 0 to 60000, got {json.dumps(delay)}")
    replicas = _int(raw, "replicas", 1, 1 << 16, 0, bad)
    sizes = raw.get("warmup_batch_sizes", [])
    if not isinstance(sizes, list) or not all(_is_int(s) and 1 <= s <= max_batch_size for s in sizes):
        raise bad("warmup_batch_sizes", f"must be a list of batch sizes from 1 to max_batch_size "
                                        f"({max_batch_size}), got {json.dumps(sizes)}")
    oip_inputs = raw.get("oip_inputs", "all")
    if oip_inputs not in OIP_INPUTS:
        raise bad("oip_inputs", f"must be one of {', '.join(OIP_INPUTS)}, got {json.dumps(oip_inputs)}")
    return ModelConfig(
        version_policy=_policy(raw.get("version_policy", {"latest": 1}), bad),
        version_labels=_labels(raw.get("version_labels", {}), bad),
        batch=BatchSettings(max_batch_size=max_batch_size, max_delay_ms=float(delay), max_queue=max_queue,
                            max_ids_per_request=batch.max_ids_per_request),
        replicas=replicas, warmup_batch_sizes=tuple(sorted(set(sizes))), oip_inputs=oip_inputs)


KNOWN_KEYS = {"version_policy", "version_labels", "max_batch_size", "max_delay_ms", "max_queue", "replicas",
              "warmup_batch_sizes", "oip_inputs"}
OIP_INPUTS = ("all", "packed")


def _is_int(value) -> bool:
    return type(value) is int  # bool is an int to Python, not to a config file


def _is_number(value) -> bool:
    return type(value) in (int, float) and value == value


def _int(raw: dict, key: str, low: int, high: int, default: int, bad) -> int:
    value = raw.get(key, default)
    if key in raw and not (_is_int(value) and low <= value <= high):
        raise bad(key, f"must be an integer from {low} to {high}, got {json.dumps(value)}")
    return value


def _version(value) -> bool:
    return _is_int(value) and 1 <= value <= MAX_VERSION


def _policy(raw, bad) -> VersionPolicy:
    key = "version_policy"
    if not isinstance(raw, dict) or len(raw) != 1:
        raise bad(key, f'must be one of {{"latest": N}}, {{"all": true}}, {{"specific": [versions]}}, got {json.dumps(raw)}')
    (kind, value), = raw.items()
    if kind == "latest":
        if not (_is_int(value) and 1 <= value <= 1024):
            raise bad(f"{key}.latest", f"must be an integer from 1 to 1024, got {json.dumps(value)}")
        return VersionPolicy(latest=value)
    if kind == "all":
        if value is not True:
            raise bad(f"{key}.all", f"must be true, got {json.dumps(value)}")
        return VersionPolicy(kind="all")
    if kind == "specific":
        if not isinstance(value, list) or not value or not all(_version(v) for v in value):
            raise bad(f"{key}.specific", f"must be a non-empty list of version numbers, got {json.dumps(value)}")
        return VersionPolicy(kind="specific", specific=tuple(sorted(set(value))))
    raise bad(f"{key}.{kind}", "unknown policy (known: latest, all, specific)")


def _labels(raw, bad) -> Dict[str, int]:
    if not isinstance(raw, dict):
        raise bad("version_labels", f'must be an object of label -> version, e.g. {{"stable": 3}}, got {json.dumps(raw)}')
    for label, version in raw.items():
        if not LABEL_RE.match(label):
            raise bad(f"version_labels.{label}", "a label is letters, digits, _ and -, starting with a letter")
        if not _version(version):
            raise bad(f"version_labels.{label}", f"must be a version number, got {json.dumps(version)}")
    return dict(raw)


def wanted_versions(policy: VersionPolicy, on_disk: List[int]) -> List[int]:
    """The versions a policy asks for, highest first (``latest``: every version, tried in turn
    until N load)."""
    return [v for v in reversed(on_disk) if policy.kind != "specific" or v in policy.specific]


def describe(config: Optional[ModelConfig]) -> Dict:
    """The effective values, as GetModelInfo and OIP ModelConfig report them."""
    if config is None:
        return {}
    return {"version_policy": config.version_policy.describe(), "version_labels": dict(config.version_labels),
            "max_batch_size": config.batch.max_batch_size, "max_delay_ms": config.batch.max_delay_ms,
            "max_queue": config.batch.max_queue, "replicas": config.replicas,
            "warmup_batch_sizes": list(config.warmup_batch_sizes), "oip_inputs": config.oip_inputs}
