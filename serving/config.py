"""Server settings: one typed object, filled from the command line (serving/cli.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from recserve.errors import UserError
from serving.machine import usable_cores


@dataclass
class BatchSettings:
    """Dynamic batching, per model version and RPC.

    - ``max_batch_size``: most samples merged into one model call; also the largest request accepted.
    - ``max_delay_ms``: longest the first request of a batch waits for company. 0 (default): a batch
      takes what queued while the previous model call ran - under load that batches by itself, and
      a lone request pays no delay.
    - ``max_queue``: most requests waiting per model; beyond it requests get UNAVAILABLE at once.
    - ``max_ids_per_request``: most sparse ids one request may carry (INVALID_ARGUMENT above), shared
      bags counted once per sample; also the most ids a batch merges into one model call (below 2**31:
      the lookup kernels take int32 offsets).
    """

    max_batch_size: int = 4096
    max_delay_ms: float = 0.0
    max_queue: int = 256
    max_ids_per_request: int = 1 << 23  # 8,388,608 ids: 64 MiB of int64, the default message limit


@dataclass
class ServerConfig:
    repo: Path
    device: str = "auto"  # auto | cuda | cpu
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9400  # 0: no metrics endpoint
    http_port: Optional[int] = None  # the Open Inference Protocol over HTTP/REST on this port (0: any free); None: off
    shared_memory: str = "off"  # "system": Triton's system shared memory extension (serving/frontend/oip/shm.py)
    batch: BatchSettings = None  # type: ignore[assignment]
    poll_interval_s: float = 5.0  # 0: load once, never poll
    # poll: serve every model in the repository, polled; explicit: only those loaded by request
    # (OIP RepositoryModelLoad, `recserve models load`) or named in load_models, never polled.
    model_control: str = "poll"
    load_models: Tuple[str, ...] = ()
    grace_period_s: float = 10.0  # SIGTERM: how long in-flight requests may take to finish
    max_message_bytes: int = 64 * 1024 * 1024
    # HTTP/REST: the most JSON parsed from one body, in the front end's event loop (serving/frontend/oip/rest.py)
    max_json_bytes: int = 4 * 1024 * 1024
    replicas: int = 0  # engines: one per GPU on this many GPUs (0: every visible GPU); on the CPU, this many (0: 1)
    engine_index: int = 0  # set by the supervisor for each engine it starts (0: the one that may span GPUs)
    engines: int = 1  # how many engines the supervisor starts (set by it)
    cuda_graphs: bool = True  # replay Predict's model call from CUDA graphs where shapes allow (serving/engine/graphs.py)
    shared_pooling: str = "expand"  # shared bags: "expand" per sample (bitwise as sent per sample) or pool "once"
    frontends: int = 0  # gRPC front-end processes sharing the port (0: by core count, serving/supervisor.py)
    frontend_buffer_bytes: int = 256 << 20  # each front end's shared buffer: requests in flight and their results
    max_connections: int = 1000  # open gRPC client connections, split over the front ends (beyond a share: refused)
    idle_timeout_s: float = 300.0  # a connection with no call for this long is closed (0: never)
    tls_cert: Optional[Path] = None  # PEM server certificate chain; with tls_key: TLS
    tls_key: Optional[Path] = None
    tls_client_ca: Optional[Path] = None  # PEM CA bundle: clients must present a certificate it signed (mTLS)
    auth_token_file: Optional[Path] = None  # bearer tokens, one per line: every RPC but health needs one
    allow_symlinks: bool = False  # serve version directories that resolve outside the repository
    load_timeout_s: float = 120.0  # a version whose files are not read, loaded and checked by then is refused
    load_threads: int = 4  # versions loading at once (Triton's --model-load-thread-count); the others wait their turn
    log_format: str = "text"  # text | json (one object per line), every process (recserve/logs.py)
    otlp_endpoint: Optional[str] = None  # OpenTelemetry spans per request to this OTLP/gRPC collector; None: off
    trace_sample_ratio: float = 1.0  # share of traces started here that are kept (a caller's sampled flag wins)
    access_log_ratio: float = 0.0  # share of requests logged one line each (0: off; denied ones are logged anyway, rate-limited)

    def __post_init__(self) -> None:
        if self.batch is None:
            self.batch = BatchSettings()


# The stop waits for the server's processes in poll(2), whose timeout is an int of milliseconds (24.8
# days); a day is asyncio's own longest wait.
MAX_GRACE_PERIOD_S = 86400


def parse_replicas(text: str) -> int:
    """``--replicas`` (serve, and bench that passes it on): "auto" (0: one engine per GPU) or a number >= 1."""
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise UserError(f"--replicas must be auto or a number >= 1, got {text!r}")
    return 0 if text == "auto" else int(text)


def default_frontends() -> int:
    """Half the usable cores, at most 8: the engine and the clients on the same host need cores too."""
    return max(1, min(8, usable_cores() // 2))
