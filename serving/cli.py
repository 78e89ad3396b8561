"""Serving-side subcommands: ``serve`` (the server) and ``predict`` (a client for it)."""
from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

from recserve.errors import UserError
from recserve.ids import SPEC_HELP


def register(sub: argparse._SubParsersAction) -> None:
    from recserve.client import ClientSecurity
    from serving.config import BatchSettings, ServerConfig

    d, b = ServerConfig(repo=Path(".")), BatchSettings()
    from recserve.cli import HelpWithDefaults as defaults
    p = sub.add_parser("serve", help="serve every model of a repository over gRPC", formatter_class=defaults)
    p.add_argument("--repo", type=Path, required=True, help="model repository (REPO/NAME/VERSION/)")
    p.add_argument("--device", default=d.device, choices=["auto", "cuda", "cpu"], help="auto (cuda if present), cuda or cpu")
    p.add_argument("--host", default=d.host, help="address to bind, the gRPC, HTTP and metrics ports (0.0.0.0: every interface, as in a container)")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (0: any free port, printed)")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus port (0: off)")
    p.add_argument("--http-port", type=int, default=d.http_port,
                   help="also serve the Open Inference Protocol over HTTP/REST (KServe v2, Triton's binary tensors) "
                        "on this port, from every front end (0: any free port, printed; default: off)")
    p.add_argument("--shared-memory", choices=["off", "system"], default=d.shared_memory,
                   help="system: Triton's system shared memory extension for clients on this host (inputs read from "
                        "and outputs written to POSIX shared memory regions they register; perf_analyzer "
                        "--shared-memory system). Any client that may call the server can then make it read and "
                        "write /dev/shm objects of the server's user: turn it on where only trusted local clients "
                        "reach it (default: off)")
    p.add_argument("--max-batch-size", type=int, default=b.max_batch_size,
                   help="most samples per model call and per request")
    p.add_argument("--max-delay-ms", type=float, default=b.max_delay_ms, help="longest wait for batch-mates")
    p.add_argument("--max-queue", type=int, default=b.max_queue, help="most requests waiting per model and RPC")
    p.add_argument("--poll-interval", type=float, default=d.poll_interval_s,
                   help="seconds between repository scans for new versions and config.json changes (0: never)")
    p.add_argument("--model-control", choices=["poll", "explicit"], default=d.model_control,
                   help="poll: serve every model of --repo, polled; explicit: only the models loaded by request "
                        "(OIP RepositoryModelLoad, `recserve models load`) or by --load-model, never polled")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="with --model-control explicit: load this model at start (repeat for several)")
    p.add_argument("--access-log", type=float, nargs="?", const=1.0, default=d.access_log_ratio, metavar="RATIO",
                   help="log one line per request (time, peer, method, model, version, batch size, code, server "
                        "time; JSON under --log-format json) for this share of requests (no RATIO: every one); "
                        "denied requests are logged anyway, at most one line a second per front end")
    p.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open gRPC client connections the server accepts, split evenly over its front ends (the "
                        "kernel spreads connections over them by hash: one may be refused at once while another "
                        "front end has room)")
    p.add_argument("--idle-timeout", type=float, default=d.idle_timeout_s,
                   help="seconds after which a connection with no call is closed (0: never)")
    p.add_argument("--load-timeout", type=float, default=d.load_timeout_s,
                   help="seconds a version may take to read, load and verify before it is refused")
    p.add_argument("--load-threads", type=int, default=d.load_threads,
                   help="model versions loading at once; the others wait their turn (each has --load-timeout "
                        "from its turn)")
    p.add_argument("--allow-symlinks", action="store_true",
                   help="serve version directories that are symlinks leading outside --repo (default: refused)")
    p.add_argument("--grace-period", type=float, default=d.grace_period_s,
                   help="seconds in-flight requests get after SIGTERM (at most a day)")
    p.add_argument("--max-message-mb", type=float, default=d.max_message_bytes / 2**20,
                   help="largest request accepted (RESOURCE_EXHAUSTED above)")
    p.add_argument("--max-json-mb", type=float, default=d.max_json_bytes / 2**20,
                   help="HTTP/REST: most JSON in one request body (413 above; at most --max-message-mb): it is "
                        "parsed in a front end's event loop, which answers nothing else meanwhile (about 50 MB/s); "
                        "binary tensor data and gRPC are not parsed")
    p.add_argument("--max-ids-per-request", type=int, default=b.max_ids_per_request,
                   help="most sparse ids in one request (INVALID_ARGUMENT above; shared bags count once per "
                        "sample) and in one model call")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", type=Path, default=None,
                   help="PEM CA bundle: require client certificates signed by it (mutual TLS)")
    p.add_argument("--auth-token-file", type=Path, default=None,
                   help="file of bearer tokens, one per line: every RPC but health, reflection and the Open "
                        "Inference Protocol's probes needs 'authorization: Bearer T'")
    p.add_argument("--otlp-endpoint", default=None,
                   help="send OpenTelemetry spans per request (decode, queue, model, encode) to this OTLP/gRPC "
                        "collector, e.g. http://otel-collector:4317; W3C traceparent from the request metadata "
                        "is followed (needs: pip install 'recserve[tracing]')")
    p.add_argument("--trace-sample-ratio", type=float, default=d.trace_sample_ratio,
                   help="share of new traces kept (a caller's traceparent sampled flag wins)")
    p.add_argument("--replicas", default="auto",
                   help="engine processes: one per GPU (auto: every visible GPU) or N of them, at most the GPUs "
                        "visible (on the CPU: N engines, at most the cores, auto: 1); each holds a copy of the models "
                        "that fit a GPU, and a request goes to the engine with the fewest in flight whose share of the "
                        "front end's buffer has room for it")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every model call eagerly (default: Predict and Lookup replay CUDA graphs per "
                        "batch-size bucket)")
    p.add_argument("--shared-pooling", choices=["expand", "once"], default=d.shared_pooling,
                   help="requests with shared features: expand each shared bag to every sample on the GPU (the "
                        "model sees the per-sample form, results bitwise equal to it) or pool it once per request "
                        "and copy the pooled row (less GPU work; replayed from CUDA graphs as expand is; CTRs may "
                        "differ from the per-sample form's in the last bits of the dense part's dtype)")
    p.add_argument("--frontends", type=int, default=d.frontends,
                   help="gRPC front-end processes sharing the port, each feeding every engine (--replicas) "
                        "(0: half the cores, at most 8)")
    p.add_argument("--frontend-buffer-mb", type=float, default=d.frontend_buffer_bytes / 2**20,
                   help="shared memory per front end for requests in flight and their results (split evenly "
                        "between the engines: a request needs room in one engine's share)")
    p.set_defaults(handler=_serve)

    p = sub.add_parser("predict", help="send a Predict request and print the CTRs", formatter_class=defaults)
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of recserve serve")
    p.add_argument("--model", required=True, help="model name")
    p.add_argument("--version", default="0", help="model version (0: the default, the highest served) or a version "
                                                  "label of the model (its config.json's version_labels)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--input", type=Path,
                       help='JSON: {"dense": [[...], ...], "sparse": {"feature": [[ids of sample 0], ...]}, '
                            '"shared": {"feature": [ids of every sample]}} ("shared" optional)')
    group.add_argument("--random", type=int, metavar="N", help="N random samples shaped from the model's schema")
    p.add_argument("--shared-features", default="", metavar="N|NAMES",
                   help="with --random: these features (the model's first N, or comma-separated names) are sent "
                        "once for the whole request, as shared bags")
    p.add_argument("--id-distribution", default="uniform", help="ids of --random: " + SPEC_HELP)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds the call may take")
    ClientSecurity.add_arguments(p)
    p.set_defaults(handler=_predict)
    _register_models(sub, defaults, ClientSecurity)


def _register_models(sub: argparse._SubParsersAction, defaults, client_security) -> None:
    p = sub.add_parser("models", help="list, load and unload the models of a running server (OIP repository "
                                      "extension; load/unload need serve --model-control explicit)",
                       formatter_class=defaults)
    p.add_argument("action", choices=["list", "load", "unload"], help="list: every model in the repository and "
                   "its loaded versions (and those refused: why); load: load (or load again) a model; unload: "
                   "stop serving it")
    p.add_argument("model", nargs="?", default="", help="the model to load or unload")
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of recserve serve")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds the call may take (a load verifies the model)")
    client_security.add_arguments(p)
    p.set_defaults(handler=_models)


def _models(args: argparse.Namespace) -> int:
    import grpc

    from recserve.client import ClientSecurity, check_timeout
    from recserve.oip import grpc_predict_v2_pb2 as oip
    from recserve.oip.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    check_timeout(args.timeout, "--timeout")
    if (args.action == "list") == bool(args.model):
        raise UserError("name the model to load or unload (and none to list)" if args.action != "list"
                        else "models list takes no model name")
    security = ClientSecurity.from_args(args)
    with security.channel(args.target) as channel:
        stub = GRPCInferenceServiceStub(channel)
        call = dict(timeout=args.timeout, metadata=security.metadata())
        try:
            if args.action == "list":
                for m in stub.RepositoryIndex(oip.RepositoryIndexRequest(), **call).models:
                    print("\t".join([m.name, m.version or "-", m.state, m.reason]))
            elif args.action == "load":
                stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name=args.model), **call)
                print(f"loaded {args.model}")
            else:
                stub.RepositoryModelUnload(oip.RepositoryModelUnloadRequest(model_name=args.model), **call)
                print(f"unloaded {args.model}")
        except grpc.RpcError as e:
            raise _refused(e, args) from None
    return 0


def _refused(e, args: argparse.Namespace) -> UserError:
    """The one line of a call the server or gRPC refused (predict, models). A connection that failed
    says where to look: gRPC's own words ('Socket closed') say nothing of a server that speaks TLS."""
    import grpc

    line = f"{e.code().name}: {e.details()}"
    if e.code() == grpc.StatusCode.UNAVAILABLE and (e.details() or "").startswith("failed to connect"):
        tls = "" if args.tls_ca else ", and without --tls-cert (with it, pass --tls-ca)"
        line += f"; is recserve serve running at {args.target}{tls}?"
    return UserError(line)


def _serve(args: argparse.Namespace) -> int:
    from recserve.manifest import MODEL_NAME_RE, MODEL_NAME_RULE, list_models
    from serving.config import MAX_GRACE_PERIOD_S, BatchSettings, ServerConfig, default_frontends, parse_replicas
    from serving.frontend.main import check_settings
    from serving.machine import usable_cores, usable_memory
    from serving.supervisor import serve, visible_gpus

    if not args.repo.is_dir():
        raise UserError(f"--repo {args.repo} is not a directory")
    _check_repo_layout(args.repo)
    for flag, value, least in (("--max-batch-size", args.max_batch_size, 1), ("--max-queue", args.max_queue, 1),
                               ("--max-delay-ms", args.max_delay_ms, 0), ("--frontends", args.frontends, 0),
                               ("--poll-interval", args.poll_interval, 0),
                               ("--frontend-buffer-mb", args.frontend_buffer_mb, 16)):
        if not value >= least:  # NaN too
            raise UserError(f"{flag} must be >= {least}, got {value:g}")
        if value == float("inf"):
            raise UserError(f"{flag} must be a finite number, got inf")
    if not 1 <= args.load_threads <= 1024:
        raise UserError(f"--load-threads must be from 1 to 1024, got {args.load_threads}")
    if not 0 <= args.grace_period <= MAX_GRACE_PERIOD_S:
        raise UserError(f"--grace-period must be from 0 to {MAX_GRACE_PERIOD_S} seconds, got {args.grace_period:g}")
    for flag, value in (("--max-message-mb", args.max_message_mb), ("--max-json-mb", args.max_json_mb),
                        ("--load-timeout", args.load_timeout)):
        if not 0 < value < float("inf"):  # gRPC takes a negative message limit as none
            raise UserError(f"{flag} must be > 0, got {value:g}")
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if not 0 <= port <= 65535:
            raise UserError(f"{flag} must be a TCP port, 0 to 65535, got {port}")
    try:  # before anything binds: gRPC and check_free would blame the port ("Unknown error -2")
        socket.getaddrinfo(args.host, None)
    except socket.gaierror as e:
        raise UserError(f"--host {args.host} does not resolve ({e.strerror}); give an address or name of this "
                        "machine (127.0.0.1, or 0.0.0.0 for every interface)") from None
    frontends = args.frontends or default_frontends()
    memory = usable_memory()  # a container's limit, not the host's
    if args.frontend_buffer_mb * 2**20 * frontends > memory:  # each buffer is faulted in whole at start
        raise UserError(f"--frontend-buffer-mb {args.frontend_buffer_mb:g} x {frontends} front ends is more than the "
                        f"memory this server may use ({memory / 2**30:.1f} GiB: the machine's, or its container's "
                        "limit); every front end's buffer is resident: give a smaller --frontend-buffer-mb or fewer "
                        "--frontends")
    if not 1 <= args.max_ids_per_request < 2**31:
        raise UserError("--max-ids-per-request must be between 1 and 2**31 - 1 (the lookup kernels' offsets are int32)")
    if args.max_connections < 1 or not args.idle_timeout >= 0:  # NaN too
        raise UserError("--max-connections must be >= 1 and --idle-timeout >= 0")
    if args.max_connections < frontends:  # each front end's share is at least one: the shares would add up to more
        raise UserError(f"--max-connections {args.max_connections} is fewer than the {frontends} front ends, which take "
                        f"at least one connection each: give at least {frontends}, or fewer --frontends")
    # gRPC takes these as C ints (bytes, milliseconds, connections): a larger value is a traceback there.
    for flag, value, most in (("--max-message-mb", args.max_message_mb, 2047), ("--idle-timeout", args.idle_timeout,
                              (2**31 - 1) // 1000), ("--max-connections", args.max_connections, 2**31 - 1)):
        if value > most:
            raise UserError(f"{flag} must be at most {most} (gRPC's limit), got {value:g}")
    if args.http_port is not None and not 0 <= args.http_port < 65536:
        raise UserError(f"--http-port must be a port number (0 to 65535), got {args.http_port}")
    if not 0.0 <= args.trace_sample_ratio <= 1.0:
        raise UserError("--trace-sample-ratio must be between 0 and 1")
    if not 0.0 <= args.access_log <= 1.0:
        raise UserError(f"--access-log must be a ratio between 0 and 1, got {args.access_log:g}")
    if args.load_model and args.model_control != "explicit":
        raise UserError("--load-model needs --model-control explicit (under poll every model of --repo is served)")
    models = list_models(args.repo)
    for name in args.load_model:  # explicit never polls: a name not there now would never load
        if not MODEL_NAME_RE.match(name):
            raise UserError(f"--load-model {name!r}: not a model name: {MODEL_NAME_RULE}")
        if name not in models:
            raise UserError(f"--load-model {name}: no such model in --repo {args.repo} (its models: "
                            f"{', '.join(models) or 'none'})")
    replicas = parse_replicas(args.replicas)
    gpus = visible_gpus(args.device)
    if gpus and replicas > len(gpus):  # one engine per GPU
        raise UserError(f"--replicas {replicas}: {len(gpus)} GPU(s) visible; one engine runs per GPU: give at most "
                        f"{len(gpus)}, or auto")
    if not gpus and args.device != "cuda" and replicas > usable_cores():  # each engine loads every model
        raise UserError(f"--replicas {replicas}: more CPU engines than the {usable_cores()} cores this server may use; "
                        "each loads its own copy of every model: give at most that many")
    config = ServerConfig(
        replicas=replicas,
        repo=args.repo, device=args.device, host=args.host, port=args.port, metrics_port=args.metrics_port,
        http_port=args.http_port, shared_memory=args.shared_memory,
        batch=BatchSettings(max_batch_size=args.max_batch_size, max_delay_ms=args.max_delay_ms,
                            max_queue=args.max_queue, max_ids_per_request=args.max_ids_per_request),
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
        auth_token_file=args.auth_token_file,
        poll_interval_s=args.poll_interval, grace_period_s=args.grace_period, load_timeout_s=args.load_timeout,
        load_threads=args.load_threads,
        allow_symlinks=args.allow_symlinks,
        max_message_bytes=int(args.max_message_mb * 2**20),
        max_json_bytes=int(min(args.max_json_mb, args.max_message_mb) * 2**20), cuda_graphs=not args.no_cuda_graphs,
        shared_pooling=args.shared_pooling, frontends=args.frontends,
        frontend_buffer_bytes=int(args.frontend_buffer_mb * 2**20),
        max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
        log_format=args.log_format, otlp_endpoint=args.otlp_endpoint, trace_sample_ratio=args.trace_sample_ratio,
        model_control=args.model_control, load_models=tuple(args.load_model), access_log_ratio=args.access_log,
    )
    check_settings(config)
    return serve(config, log_level=args.log_level)


def _check_repo_layout(repo: Path) -> None:
    """--repo given a version's or a model's directory, not the repository: every model of it would
    be refused or have no versions, and the server would start serving nothing."""
    from recserve.manifest import MANIFEST_FILE, list_models, list_versions, parse_version_name

    layout = "the layout is REPO/NAME/VERSION/manifest.json"
    if (repo / MANIFEST_FILE).is_file():
        raise UserError(f"--repo {repo} is a model version (it holds {MANIFEST_FILE}): pass the repository that "
                        f"holds its model, {repo.resolve().parent.parent} ({layout})")
    try:
        versions = sorted((p.name for p in repo.iterdir() if parse_version_name(p.name) is not None
                           and (p / MANIFEST_FILE).is_file()), key=parse_version_name)
        served = any(list_versions(repo / name) for name in list_models(repo))
    except OSError as e:
        raise UserError(f"--repo {repo}: cannot read ({e.strerror})") from None
    if versions and not served:
        raise UserError(f"--repo {repo} is a model (its versions: {', '.join(versions)}), not a repository: pass the "
                        f"repository that holds it, {repo.resolve().parent} ({layout})")


def _version_choice(text: str):
    """predict --version: (version, label); "0" is the default version."""
    from recserve.manifest import MAX_VERSION, parse_version_name

    if text == "0":
        return 0, ""
    version = parse_version_name(text)
    if version is not None:
        return version, ""
    if text[:1].isascii() and text[:1].isalpha():
        return 0, text  # a label: the server says if the model has it
    raise UserError(f"--version must be 0 (the default), a version number (1 to {MAX_VERSION}) or a version label, "
                    f"got {text!r}")


def _predict(args: argparse.Namespace) -> int:
    import grpc

    from recserve.client import (
        Client,
        ClientSecurity,
        check_timeout,
        random_request,
        ranking_request,
        request_from_json,
        shared_feature_names,
    )
    from recserve.ids import IdDistribution

    if args.random is not None and args.random < 1:
        raise UserError(f"--random must be >= 1 (samples to send), got {args.random}")
    check_timeout(args.timeout, "--timeout")
    if args.input is not None and (args.shared_features or args.id_distribution != "uniform"):
        raise UserError("--shared-features and --id-distribution shape --random requests; with --input the file "
                        'says which features are shared ("shared") and what the ids are')
    version, label = _version_choice(args.version)  # checked before any connection
    ids = IdDistribution.parse(args.id_distribution)
    with Client(args.target, timeout=args.timeout, security=ClientSecurity.from_args(args)) as client:
        try:
            shared = None
            if args.random is not None:
                info = client.model_info(args.model, version, label).models[0]  # that version's schema
                if args.random > info.max_batch_size:  # refused by the server anyway: never build it
                    raise UserError(f"--random {args.random}: the server's max batch size for model {info.name!r} "
                                    f"is {info.max_batch_size} samples per request; ask for at most that many")
                if args.shared_features:
                    try:
                        names = shared_feature_names(args.shared_features, info)
                    except ValueError as e:
                        raise UserError(str(e)) from None
                    dense, sparse, shared = ranking_request(info, args.random, names, ids=ids)
                else:
                    dense, sparse = random_request(info, args.random, ids=ids)
            else:
                try:
                    dense, sparse, shared = request_from_json(json.loads(args.input.read_text()))
                except OSError as e:
                    raise UserError(f"--input {args.input}: cannot read ({e.strerror})") from None
                except ValueError as e:
                    raise UserError(f"--input {args.input}: not valid JSON ({e})") from None
                except UserError as e:
                    raise UserError(f"--input {args.input}: {e}") from None
            ctr = client.predict(args.model, dense, sparse, version=version, shared=shared, label=label)
        except grpc.RpcError as e:
            raise _refused(e, args) from None
    for i, p in enumerate(ctr):
        print(f"{i}\t{p:.6f}")
    return 0
