"""Mutation check of the request path: small deliberate bugs in the core behaviours, each with the
tests that must catch it. Run by hand when the request path changes (it is slow: a pytest run per
mutant), from the repository root:

    .venv/bin/python scripts/mutants.py              # every mutant
    .venv/bin/python scripts/mutants.py --list       # names, files and tests
    .venv/bin/python scripts/mutants.py draining-early router-busiest

The working tree (tracked files and untracked ones git does not ignore) is copied to a temporary
directory once; each mutant is one exact text replacement in that copy, its tests run there, and the
file is restored. The tree itself is never touched. Before any mutant, the union of their tests must
pass unmutated. Prints a table (mutant, tests, outcome, seconds); exits 1 if a mutant survives or
cannot be applied ("anchor not found: update the mutant": the code moved), 0 if all are killed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str  # the behaviour, in a few words
    file: str
    old: str  # exact text; every occurrence is replaced
    new: str
    tests: Tuple[str, ...]


E, P, R = "tests/test_engine_units.py::", "tests/test_properties.py::", "tests/test_repository.py::"
G = "tests/test_graphs.py::"
S, L, REL = "tests/test_serving.py::", "tests/test_lifecycle.py::", "tests/test_reliability.py::"

MUTANTS: List[Mutant] = [
    Mutant("id-negative-accepted", "id checks: a negative id reaches the kernel", "serving/frontend/validate.py",
           "if low < 0 or high >= rows[k]:", "if high >= rows[k]:",
           (E + "test_an_id_outside_its_table_is_refused_naming_the_feature",
            P + "test_assembly_equals_a_kjt_built_by_hand")),
    Mutant("id-off-by-one", "id checks: id == rows accepted", "serving/frontend/validate.py",
           "if low < 0 or high >= rows[k]:", "if low < 0 or high > rows[k]:",
           (E + "test_an_id_outside_its_table_is_refused_naming_the_feature",
            P + "test_assembly_equals_a_kjt_built_by_hand")),
    Mutant("negative-length-accepted", "validation: a length of -1 passes", "serving/frontend/validate.py",
           "if per_key.min() < 0:", "if per_key.min() < -1:",
           (P + "test_check_sparse_refuses_lengths_that_disagree_with_the_ids",)),
    Mutant("results-to-wrong-request", "batch isolation: every request of a batch gets the first one's rows",
           "serving/engine/assemble.py",
           "rows = result[first:first + it.batch_size]", "rows = result[0:it.batch_size]",
           (G + "test_batches_of_several_requests_give_each_sample_its_own_ctr",)),
    Mutant("gather-ignores-request-start", "batch isolation: a request's dense rows read from the batch's start",
           "serving/engine/assemble.py",
           "in_request = i - (row_end - b)[rr]", "in_request = i",
           (G + "test_batches_of_several_requests_give_each_sample_its_own_ctr",
            E + "test_gather_pads_with_empty_bags_and_zero_rows")),
    Mutant("stale-descriptor-rows", "batch isolation: a graph reads rows of an earlier, larger batch",
           "serving/engine/assemble.py",
           "table[:self._rows_used[k]] = 0", "table[:len(items)] = 0",
           (E + "test_a_fixed_shape_descriptor_holds_no_rows_of_earlier_batches",)),
    Mutant("draining-early", "draining: a replaced version is released with requests still on it",
           "serving/engine/repository.py",
           "            if self.in_flight == 0:\n                self.drained.set()", "            self.drained.set()",
           (R + "test_a_draining_version_answers_its_holders_and_is_released_after_the_last",)),
    Mutant("drain-never-signalled", "draining: the last request out never releases the version",
           "serving/engine/repository.py",
           "        if self.state == DRAINING and self.in_flight == 0 and self._grace_over:\n            self.drained.set()",
           "        pass",
           (R + "test_a_draining_version_answers_its_holders_and_is_released_after_the_last",)),
    Mutant("deadline-unchecked", "deadlines: an expired request still runs", "serving/engine/batcher.py",
           "return self.deadline is not None and now > self.deadline", "return False",
           (E + "test_batcher_refuses_beyond_its_queue_and_expires_late_requests",
            L + "test_a_request_whose_deadline_passes_behind_a_slow_batch_is_never_executed")),
    Mutant("queue-limit-off-by-one", "overload: one request more than max_queue waits", "serving/engine/batcher.py",
           "if len(self._queue) >= self.settings.max_queue:", "if len(self._queue) > self.settings.max_queue:",
           (E + "test_batcher_refuses_beyond_its_queue_and_expires_late_requests",
            L + "test_full_queue_is_unavailable_at_once")),
    Mutant("cancel-keeps-queue-place", "cancellation: a cancelled request keeps its queue place",
           "serving/engine/batcher.py",
           "                self._queue.remove(work)", "                pass",
           (REL + "test_cancelled_request_frees_its_queue_place",
            E + "test_a_queued_request_cancelled_is_answered_once_and_never_runs")),
    Mutant("cancelled-slot-leaks", "slot freeing: a request answered after its client left keeps its slot",
           "serving/frontend/link.py",
           "        if future.done():  # its caller went away: nobody reads the slot any more\n            self._free(offset)",
           "        if future.done():\n            pass",
           ("tests/test_slots.py::test_1000_requests_cancelled_at_random_moments_leave_the_buffer_empty",)),
    Mutant("router-busiest", "routing: requests go to the replica with the most work", "serving/engine/batcher.py",
           "min(room or self.batchers, key=lambda b: b.load)", "max(room or self.batchers, key=lambda b: b.load)",
           (E + "test_router_sends_a_request_to_the_replica_with_the_least_work",)),
    Mutant("shared-bag-not-expanded", "shared features: a shared bag's ids go in once, not once per sample",
           "serving/ipc.py",
           "ids.shape[0] * kjt.batch_size", "ids.shape[0]",
           (E + "test_gather_expands_shared_bags_per_request_like_their_per_sample_form",
            P + "test_assembly_equals_a_kjt_built_by_hand")),
    Mutant("oip-int-datatypes-swapped", "OIP datatypes: INT32 read as int64 and the reverse",
           "serving/frontend/oip/wire.py",
           'DTYPES = {"FP32": "float32", "INT32": "int32", "INT64": "int64"}',
           'DTYPES = {"FP32": "float32", "INT32": "int64", "INT64": "int32"}',
           (P + "test_oip_inputs_make_the_batch_recserve_v1_makes_of_the_same_tensors",)),
    Mutant("tf32-always-on", "precision: every model computes with TF32 allowed", "recserve/manifest.py",
           'allow = dense_dtype == "tf32"', "allow = True",
           (S + "test_each_model_call_runs_under_its_own_tf32_switch",)),
    Mutant("precision-switch-removed", "precision: model calls run under whatever switch the process has",
           "serving/engine/runner.py",
           "dense_math(self.manifest.dense_dtype)", "contextlib.nullcontext()",
           (S + "test_each_model_call_runs_under_its_own_tf32_switch",)),
    Mutant("batch-size-counts-requests", "metric counts: batch sizes count requests, not samples",
           "serving/engine/repository.py",
           "metrics.batch_done(rpc, name, sum(w.batch_size for w in works),",
           "metrics.batch_done(rpc, name, len(works),",
           (S + "test_batch_size_counts_only_samples_that_ran_and_were_answered",)),
    Mutant("rollback-to-lowest", "swap and rollback: the lowest version on disk is served",
           "serving/model_config.py",
           "return [v for v in reversed(on_disk) if", "return [v for v in on_disk if",
           (R + "test_deleting_the_served_version_rolls_back_and_drains_it",)),
    Mutant("any-bearer-token", "auth: any bearer token is accepted", "serving/frontend/security.py",
           "return matched\n", "return True\n",
           (REL + "test_bearer_token_required_on_every_rpc_but_health",
            REL + "test_the_token_check_compares_sha256_digests_with_every_token")),
    Mutant("gpu-count-unchecked", "placement: an artifact for 8 GPUs loads where fewer are visible",
           "serving/engine/loader.py",
           "if torch.cuda.device_count() < manifest.sharding.world_size:", "if False:",
           ("tests/test_scaleout.py::test_serving_refuses_an_artifact_needing_more_gpus_than_visible",)),
    Mutant("protowire-reads-past-the-end", "wire format: a field one byte longer than the message is read",
           "serving/frontend/protowire.py",
           "if size > end - pos:", "if size > end - pos + 1:",
           (P + "test_truncated_messages_fail_exactly_where_protobuf_fails",)),
]


def copy_tree(dst: Path) -> None:
    """The working tree as it is (committed or not), without what git ignores."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_symlink() or not src.is_file():  # .venv links and the like: not code under test
            continue
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / name)


def pytest(tree: Path, tests: Tuple[str, ...], timeout: float) -> Tuple[int, str]:
    """(pytest's exit code, or -1 on timeout; the tail of its output)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "CI": "1"}  # CI: derandomized property tests
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, f"no verdict within {timeout:.0f} s"
    return proc.returncode, (proc.stdout + proc.stderr)[-1500:]


def run_mutant(tree: Path, m: Mutant, timeout: float) -> Tuple[str, str]:
    """(outcome, what to do about it)."""
    path = tree / m.file
    original = path.read_text() if path.exists() else ""
    if m.old not in original:
        return "NO ANCHOR", f"anchor not found in {m.file}: update the mutant"
    path.write_text(original.replace(m.old, m.new))
    try:
        code, tail = pytest(tree, m.tests, timeout)
    finally:
        path.write_text(original)
    if code == 1:
        return "killed", ""
    if code == 0:
        return "SURVIVED", "its tests pass with the bug in: strengthen them"
    if code == -1:
        return "HANG", f"no verdict within {timeout:.0f} s: make the tests fail fast"
    return "ERROR", f"pytest exit {code}: " + (tail.strip().splitlines() or [""])[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutant's test run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; --list names them")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.breaks}\n  {m.file}\n  " + "\n  ".join(m.tests))
        return 0
    with tempfile.TemporaryDirectory(prefix="recserve-mutants-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        started = time.monotonic()
        code, tail = pytest(tree, tests, args.timeout * 2)
        if code != 0:
            print(f"the tests fail without any mutant (pytest exit {code}); fix them first:\n{tail}")
            return 2
        print(f"unmutated: {len(tests)} tests pass ({time.monotonic() - started:.0f} s)\n")
        rows = []
        for m in chosen:
            started = time.monotonic()
            outcome, advice = run_mutant(tree, m, args.timeout)
            rows.append((m.name, ", ".join(t.split("::")[-1] for t in m.tests), outcome, time.monotonic() - started))
            print(f"{m.name}: {outcome} ({rows[-1][3]:.0f} s){'; ' + advice if advice else ''}", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'mutant':<{width}}  {'outcome':<9}  {'seconds':>7}  tests")
    for name, tests_run, outcome, seconds in rows:
        print(f"{name:<{width}}  {outcome:<9}  {seconds:>7.0f}  {tests_run}")
    killed = sum(r[2] == "killed" for r in rows)
    print(f"\n{killed} of {len(rows)} killed")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
