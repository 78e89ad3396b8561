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
SLOTS = "tests/test_slots.py::"

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
           (SLOTS + "test_a_cancelled_call_frees_its_slot_once_whether_its_answer_came_before_or_after_the_cancel",
            SLOTS + "test_1000_requests_cancelled_at_random_moments_leave_the_buffer_empty")),
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

    # -- request semantics (batcher, engine, front end link): deadlines, cancels, limits, drains --------------
    Mutant("delay-from-newest", "batching delay: counted from the newest request, restarted by every arrival",
           "serving/engine/batcher.py",
           "self._queue[0].enqueued + self.settings.max_delay_ms",
           "self._queue[-1].enqueued + self.settings.max_delay_ms",
           (E + "test_the_batching_delay_runs_from_the_first_request_queued_not_the_last",)),
    Mutant("delay-ignored", "batching delay: a lone request never waits for company", "serving/engine/batcher.py",
           "self.settings.max_delay_ms <= 0 or", "self.settings.max_delay_ms >= 0 or",
           (E + "test_a_full_batch_launches_without_waiting_out_its_delay",)),
    Mutant("batch-over-max-requests", "batch limits: a batch takes one request more than MAX_REQUESTS",
           "serving/engine/batcher.py",
           "while self._queue and len(batch) < MAX_REQUESTS:", "while self._queue and len(batch) <= MAX_REQUESTS:",
           (E + "test_a_batch_closes_at_max_requests_requests",)),
    Mutant("batch-split-at-exact-fit", "batch limits: requests that fill max_batch_size exactly are split",
           "serving/engine/batcher.py",
           "samples + work.batch_size > self.settings.max_batch_size",
           "samples + work.batch_size >= self.settings.max_batch_size",
           (E + "test_batcher_merges_queued_requests_up_to_its_limits_and_answers_each_once",)),
    Mutant("batch-over-max-samples", "batch limits: a batch takes more than max_batch_size samples",
           "serving/engine/batcher.py",
           "samples + work.batch_size > self.settings.max_batch_size", "samples > self.settings.max_batch_size",
           (E + "test_batcher_merges_queued_requests_up_to_its_limits_and_answers_each_once",
            "tests/test_batcher_machine.py")),
    Mutant("late-runs-anyway", "deadlines: a request past its deadline is answered DEADLINE_EXCEEDED and still run",
           "serving/engine/batcher.py",
           "                self._answer_late(work)\n                continue\n",
           "                self._answer_late(work)\n",
           (E + "test_batcher_refuses_beyond_its_queue_and_expires_late_requests", "tests/test_batcher_machine.py")),
    Mutant("expired-keep-queue-place", "deadlines: requests expired from a full queue keep their places",
           "serving/engine/batcher.py",
           "                self._answer_late(work)\n            else:\n                live.append(work)",
           "                self._answer_late(work)\n            live.append(work)",
           (E + "test_a_full_queue_frees_the_places_of_requests_whose_deadline_passed_before_refusing_one",)),
    Mutant("cpu-expired-answered-ok", "deadlines: a CPU request left out of its batch as late is answered OK",
           "serving/engine/batcher.py",
           "        for work in flight.expired:\n            self._answer_late(work)\n", "",
           (E + "test_a_request_whose_deadline_passes_behind_the_other_rpcs_batch_on_its_worker_is_not_run",)),
    Mutant("failure-fails-queue", "error routing: a failed batch's error also answers the requests queued behind it",
           "serving/engine/batcher.py",
           "        for work in batch:\n            self._answer(work, error)",
           "        for work in batch + list(self._queue):\n            self._answer(work, error)",
           (E + "test_batcher_failure_fails_only_its_batch",)),
    Mutant("device-lost-as-internal", "error routing: a device failure is INTERNAL, not UNAVAILABLE",
           "serving/engine/batcher.py",
           "error = DeviceLost() if fatal else", "error = ExecutionFailed() if fatal else",
           (REL + "test_device_error_goes_not_serving_and_exits_nonzero",)),
    Mutant("pipeline-over-depth", "pipeline: more batches launched than PIPELINE_DEPTH",
           "serving/engine/batcher.py",
           "if not self._queue or len(self._in_flight) >= self._depth:", "if not self._queue:",
           ("tests/test_batcher_machine.py",)),
    Mutant("queue-full-is-503", "queue limits: a full queue is Overloaded (HTTP 503), not QueueFull (429)",
           "serving/engine/batcher.py",
           "raise QueueFull(f\"{self.label}: queue full", "raise Overloaded(f\"{self.label}: queue full",
           (E + "test_router_skips_a_replica_whose_queue_is_full_while_another_has_room",)),
    Mutant("engine-ignores-cancel", "cancellation: the engine drops a front end's cancel", "serving/engine/core.py",
           "                work.owner.cancel(work)\n            return", "                pass\n            return",
           (REL + "test_cancelled_request_frees_its_queue_place",)),
    Mutant("refused-keeps-version", "draining: a request its batcher refuses keeps holding its version",
           "serving/engine/core.py",
           "                link.works.pop(s.rid, None)\n                mv.release()\n",
           "                link.works.pop(s.rid, None)\n",
           (E + "test_a_request_the_engine_takes_holds_its_version_until_answered_or_refused",)),
    Mutant("shutdown-no-grace", "shutdown: the engine refuses what is queued at once, not after the grace period",
           "serving/engine/core.py",
           "while any(link.works for link in self.links) and time.monotonic() < deadline and not self.exit_code:",
           "while False:",
           (E + "test_at_shutdown_a_request_queued_within_the_grace_period_runs_and_is_answered",)),
    Mutant("gone-front-end-not-cancelled", "cancellation: a front end that went keeps its queued requests to run",
           "serving/engine/core.py",
           "                if work.owner is not None:\n                    work.owner.cancel(work)",
           "                if work.owner is not None:\n                    pass",
           (E + "test_a_front_end_that_goes_has_its_queued_requests_cancelled_not_run",)),
    Mutant("drain-ignores-grace", "draining: a retired version is released within its grace when its last holder ends",
           "serving/engine/repository.py",
           "if self.state == DRAINING and self.in_flight == 0 and self._grace_over:",
           "if self.state == DRAINING and self.in_flight == 0:",
           (R + "test_a_retired_version_is_released_only_once_its_grace_is_over_and_its_last_holder_done",)),
    Mutant("cancel-race-slot-leaks", "slot freeing: a request answered just before its cancel keeps its slot",
           "serving/frontend/link.py",
           "self._free(offset)  # answered just before the cancel: nobody else frees it", "pass",
           (SLOTS + "test_a_cancelled_call_frees_its_slot_once_whether_its_answer_came_before_or_after_the_cancel",)),
    Mutant("cancel-never-sent", "cancellation: the front end never tells the engine its client went",
           "serving/frontend/link.py",
           "            elif rid in self._pending:", "            elif False:",
           (SLOTS + "test_a_cancelled_call_frees_its_slot_once_whether_its_answer_came_before_or_after_the_cancel",
            REL + "test_cancelled_request_frees_its_queue_place")),
    Mutant("whole-buffer-too-large", "buffer limits: a request that needs exactly the whole buffer is refused",
           "serving/frontend/link.py",
           "if ipc.aligned(nbytes) > self.arena.size:", "if ipc.aligned(nbytes) >= self.arena.size:",
           ("tests/test_frontend_limits.py::"
            "test_a_request_needing_exactly_the_whole_buffer_runs_and_one_byte_more_is_resource_exhausted",
            "tests/test_frontend_limits.py::test_a_bad_id_is_invalid_argument_even_while_the_buffer_is_full")),
    Mutant("buffer-full-not-retryable", "buffer limits: a full buffer is RESOURCE_EXHAUSTED, not UNAVAILABLE",
           "serving/frontend/link.py",
           "raise QueueFull(\"the server's request buffers are full",
           "raise TooLarge(\"the server's request buffers are full",
           ("tests/test_lifecycle.py::test_a_full_front_end_buffer_answers_unavailable_and_frees_itself",)),
    Mutant("oip-timeout-latest", "deadlines: the OIP timeout parameter and the gRPC deadline: the later one wins",
           "serving/frontend/oip/protocol.py",
           "until if transport_deadline is None else min(until, transport_deadline)",
           "until if transport_deadline is None else max(until, transport_deadline)",
           ("tests/test_units.py::"
            "test_an_oip_timeout_parameter_and_a_grpc_deadline_give_the_request_the_earlier_of_them",)),
    Mutant("transport-deadline-dropped", "deadlines: a gRPC client's deadline never reaches the engine",
           "serving/frontend/servicer.py",
           "return None if remaining is None else time.monotonic() + remaining", "return None",
           (L + "test_a_client_timeout_is_the_engines_deadline_and_an_expired_request_never_runs",)),
    Mutant("draining-stops-accepting", "shutdown: a front end going down still accepts new requests",
           "serving/frontend/main.py",
           "        self.engine.accepting = False\n", "",
           (REL + "test_sigterm_answers_the_request_in_its_model_call_and_refuses_new_ones",)),
    Mutant("closed-batcher-admits", "shutdown: a batcher failed at shutdown still queues new requests",
           "serving/engine/batcher.py",
           "        if self.closed:\n            raise Overloaded", "        if False:\n            raise Overloaded",
           (E + "test_a_batcher_failed_at_shutdown_refuses_what_comes_after",)),
    Mutant("descriptor-result-unchecked", "bad requests: a result written past the front end's buffer is accepted",
           "serving/engine/core.py",
           "s.result_at + 4 * s.batch_size * width > link.arena.size", "s.result_at > link.arena.size",
           (E + "test_a_malformed_request_descriptor_is_refused_alone_and_never_queued",)),
    Mutant("descriptor-lookup-width", "bad requests: a Lookup's result is bounds-checked as one column",
           "serving/engine/core.py",
           "width = 1 if s.kind == ipc.PREDICT else mv.schema.pooled_width", "width = 1",
           (E + "test_a_malformed_request_descriptor_is_refused_alone_and_never_queued",)),
    Mutant("descriptor-batch-size-unchecked", "bad requests: a batch size above the model's reaches a batch",
           "serving/engine/core.py",
           "not 0 < s.batch_size <= mv.schema.max_batch_size", "not 0 < s.batch_size",
           (E + "test_a_malformed_request_descriptor_is_refused_alone_and_never_queued",)),
    Mutant("engine-gone-leaks-slots", "slot freeing: an engine gone leaves its requests' slots taken",
           "serving/frontend/link.py",
           "        for future, offset in self._pending.values():\n            self._free(offset)\n",
           "        for future, offset in self._pending.values():\n",
           (E + "test_an_unreadable_engine_message_takes_the_engine_gone_path",)),
    Mutant("engine-gone-callers-hang", "one answer: requests in flight when the engine goes are never answered",
           "serving/frontend/link.py",
           "            if not future.done():\n"
           "                future.set_exception(DeviceLost(\"the server's engine stopped; "
           "this server is restarting\"))\n"
           "        self._pending.clear()",
           "            pass\n        self._pending.clear()",
           (E + "test_an_unreadable_engine_message_takes_the_engine_gone_path",)),
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
