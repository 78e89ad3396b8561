"""The bench's table (stdout) and plot (throughput against p99 latency: bare, floor and served)."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

STYLE = {"bare": "o-", "floor": "^:", "served": "s--"}
NAME = {"floor": "floor (gRPC alone)", "served": "served"}


def _plural(clients: int) -> str:
    return f"{clients} client{'s' if clients > 1 else ''}"


def print_table(figures: Dict) -> None:
    rows = figures["rows"]
    bare = {r["batch_size"]: r for r in rows if r["mode"] == "bare"}
    floor = {(r["batch_size"], r["concurrency"], r.get("form")): r for r in rows if r["mode"] == "floor"}
    # Ranking requests (--shared-features) load the model differently from bare's random batches.
    comparable = not figures.get("shared_features")
    # A CPU artifact's manifest says "hbm" (the placement's default), but its rows are host memory.
    tables = "host memory" if figures["device"] == "cpu" else "/".join(figures.get("placements", ["hbm"]))
    print(f"\n{figures['model']} v{figures['version']} on {figures['device']} ({figures['gpu']}), "
          f"{figures['ids_per_bag']:g} ids per bag, ids {figures.get('id_distribution', 'uniform')}, "
          f"tables in {tables}, {figures['date']}")
    if "floor_processes" in figures:
        frontends = figures.get("server_frontends")
        print(f"front-end processes: {'the server default' if frontends is None else frontends}; "
              f"floor (gRPC alone, constant answers) processes: {figures['floor_processes']}")
    print(f"{'mode':7s} {'batch':>6s} {'clients':>7s} {'samples/s':>14s} {'p50 ms':>9s} {'p99 ms':>9s} {'calls':>7s} "
          f"{'client CPU':>10s} {'served/bare':>11s} {'p50 - (floor + bare)':>20s}")
    for r in rows:
        ratio, over = "", ""
        if r["mode"] == "served" and r["batch_size"] in bare and comparable:
            b = bare[r["batch_size"]]
            ratio = f"{r['samples_per_s'] / b['samples_per_s']:.2f}x"
            f = floor.get((r["batch_size"], r["concurrency"], r.get("form")))
            if f:
                over = f"{r['p50_ms'] - (f['p50_ms'] + b['p50_ms']):+.3f}"
        cpu = "" if r.get("client_cpu") is None else f"{r['client_cpu']:.2f}"
        mode = r["mode"] if r.get("form", "per-sample") == "per-sample" else f"{r['mode'][:1]}-shared"
        print(f"{mode:7s} {r['batch_size']:6d} {r['concurrency']:7d} {r['samples_per_s']:14,.0f} "
              f"{r['p50_ms']:9.3f} {r['p99_ms']:9.3f} {r['calls']:7d} {cpu:>10s} {ratio:>11s} {over:>20s}")
    if not comparable:
        _print_shared(figures)
    split = [r for r in rows if r.get("server_ms") is not None]
    if split:
        print("in the server, mean ms per request: front end receipt to response = engine queue + model call + the rest")
        for r in split:
            q, c = r.get("queue_ms") or 0.0, r.get("compute_ms") or 0.0
            cpu, calls = r.get("engine_cpu_ms_per_request"), r.get("device_launches_per_batch")
            print(f"  B={r['batch_size']:<6d} {r['concurrency']:3d} clients: {r['server_ms']:8.3f} = {q:7.3f} + {c:7.3f} "
                  f"+ {r['server_ms'] - q - c:7.3f}   (client p50 {r['p50_ms']:.3f})"
                  + ("" if cpu is None else f"  engine CPU {cpu:.3f} ms/request"
                     f" (polling {r.get('engine_poll_ms_per_request') or 0.0:.3f})")
                  + ("" if calls is None else f"  device calls {calls:.1f}/batch"))
    if any(r.get("client_cpu") is not None for r in rows):
        print("client CPU: CPU-seconds of all client processes per second; near the free cores, the clients "
              "bound the row")
    hits = [r for r in rows if r.get("cache_hit_ratio") is not None]
    if hits:
        print("UVM cache hit ratio (unique ids per batch): " + ", ".join(
            f"{r['mode']} B={r['batch_size']}: {100 * r['cache_hit_ratio']:.1f}%" for r in hits))
    if figures.get("launches"):
        print("what the engine asks of the device per batch (profiled launch + finish, CUDA graphs as served):")
        for count, kinds in figures["launches"]:
            print(f"  {count:3d} request(s) per batch: " + ", ".join(f"{v:.1f} {k}" for k, v in kinds.items()))
    if "bare_gpu_memory_bytes" in figures:
        print(f"bare GPU memory {figures['bare_gpu_memory_bytes'] / 2**30:.3f} GiB allocated (HBM tables, caches, dense "
              f"part, inputs; uvm rows are host memory) + CUDA graph pool {figures['bare_cuda_graph_pool_bytes'] / 2**30:.3f}"
              " GiB reserved")
    if "served_host_memory_bytes" in figures:
        print(f"served host memory (engine RSS, uvm tables included) {figures['served_host_memory_bytes'] / 2**30:.3f} GiB")
    if "served_gpu_memory_bytes" in figures:
        pool = figures.get("served_cuda_graph_pool_bytes")
        print(f"served GPU memory {figures['served_gpu_memory_bytes'] / 2**30:.3f} GiB = "
              f"{figures['served_gpu_memory_ratio']:.3f}x (table + dense bytes {figures['model_bytes'] / 2**30:.3f} GiB)"
              + ("" if pool is None else f", of which CUDA graph pools {pool / 2**30:.3f} GiB"))
    if "kernels" in figures:
        k = figures["kernels"]
        print(f"TBE lookups ({k['shape']}), copy bandwidth {k['copy_bytes_per_s'] / 1e12:.2f} TB/s:")
        for r in k["rows"]:
            print(f"  {r['weight_dtype']:14s} {r['lookups_per_s'] / 1e9:6.2f} G lookups/s  "
                  f"{100 * r['fraction_of_copy']:5.1f}% of copy bandwidth")


def _print_shared(figures: Dict) -> None:
    """Each served and floor row of the shared form beside the same requests sent per sample."""
    rows = figures["rows"]
    per_sample = {(r["mode"], r["batch_size"], r["concurrency"]): r for r in rows if r.get("form") == "per-sample"}
    print(f"ranking requests: features {figures['shared_features']} one bag per request "
          f"({figures['shared_ids_per_bag']:g} ids mean), the others {figures['ids_per_bag']:g} ids per sample; "
          f"server --shared-pooling {figures.get('shared_pooling', 'expand') or 'as the target runs it'}")
    print(f"{'mode':7s} {'batch':>6s} {'clients':>7s} {'KiB/req per-sample':>18s} {'KiB/req shared':>14s} "
          f"{'samples/s per-sample':>20s} {'samples/s shared':>16s} {'shared/per-sample':>17s}")
    for r in rows:
        p = per_sample.get((r["mode"], r["batch_size"], r["concurrency"]))
        if r.get("form") != "shared" or p is None:
            continue
        print(f"{r['mode']:7s} {r['batch_size']:6d} {r['concurrency']:7d} {p['request_bytes'] / 1024:18,.1f} "
              f"{r['request_bytes'] / 1024:14,.1f} {p['samples_per_s']:20,.0f} {r['samples_per_s']:16,.0f} "
              f"{r['samples_per_s'] / p['samples_per_s']:16.2f}x")


def plot(figures: Dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    def line(r):
        return r["mode"], r.get("form") or "per-sample", r["concurrency"]

    for mode, form, clients in sorted({line(r) for r in figures["rows"]}):
        rows = sorted((r for r in figures["rows"] if line(r) == (mode, form, clients)), key=lambda r: r["batch_size"])
        shared = ", shared bags" if form == "shared" else ""
        ax.plot([r["p99_ms"] for r in rows], [r["samples_per_s"] for r in rows], STYLE[mode],
                label="bare" if mode == "bare" else f"{NAME[mode]}{shared}, {_plural(clients)}")
        for r in rows:
            ax.annotate(f"B={r['batch_size']}", (r["p99_ms"], r["samples_per_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    ax.set_xscale("log")
    ax.set_xlabel("p99 latency per request (ms)")
    ax.set_ylabel("samples / s")
    ax.set_title(f"{figures['model']} on {figures['gpu']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
