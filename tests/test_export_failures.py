"""System tests of `recserve export` when things go wrong as a careless operator makes them: a full
disk, a killed export, a bad checkpoint, an exhausted version number. Each must end in one line and
exit code 2 (or, for a killed export, in its work directory being removed by the next export), and
leave the repository as it was."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, cli_error, run_cli

from recserve.errors import UserError
from recserve.manifest import MAX_VERSION

ERROR = "recserve export: error:"
# Every file this export writes may grow to 64 KiB, less than model.pt: the write fails with EFBIG
# (the errno differs from a full disk's ENOSPC; the path through the code is the same).
SMALL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
from recserve.cli import main
sys.exit(main(sys.argv[1:]))
"""
# An export that has made its work directory and is still running, until stdin closes.
RUNNING_EXPORT = """
import sys
from pathlib import Path
from export.write import staged
with staged(Path(sys.argv[1])) as work:
    print(work.name, flush=True)
    sys.stdin.readline()
"""


def export_in_subprocess(*args, script=None):
    head = ["-c", script] if script else ["-m", "recserve"]
    return subprocess.run([sys.executable, *head, "export", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT)


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(ERROR)]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_full_disk_exits_2_in_one_line_and_leaves_no_work_directory(checkpoint, repo):
    proc = export_in_subprocess("--checkpoint", checkpoint, "--repo", repo, "--name", "demo", script=SMALL_DISK)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert f"writing {repo / 'demo' / '2'} failed: [Errno 27] File too large" in line
    assert "free disk space" in line
    assert sorted(p.name for p in (repo / "demo").iterdir()) == ["1"]


def test_train_demo_on_a_full_disk_exits_2_in_one_line_and_leaves_no_half_checkpoint(tmp_path):
    """torch.save into a path failed with "RuntimeError: ... unexpected pos" and a traceback, leaving a
    truncated weights.pt that the next train-demo refused to overwrite without --force."""
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", SMALL_DISK, "train-demo", "--out", str(out), "--steps", "1"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("recserve train-demo: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0] == (f"recserve train-demo: error: writing the checkpoint into {out} failed: [Errno 27] File too "
                        "large; nothing was kept: free disk space (or fix permissions) there and run again")
    assert list(out.iterdir()) == []


def test_bench_checkpoint_on_a_full_disk_exits_2_in_one_line_and_leaves_no_half_checkpoint(tmp_path):
    """As train-demo's: torch.save's "unexpected pos" RuntimeError traceback, and a model_config.json
    beside a truncated weights.pt that the next bench-checkpoint refused to overwrite without --force."""
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", SMALL_DISK, "bench-checkpoint", "--out", str(out),
                           "--rows-per-table", "100"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("recserve bench-checkpoint: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"recserve bench-checkpoint: error: writing the checkpoint into {out} failed: ")
    assert lines[0].endswith("; nothing was kept: free disk space (or fix permissions) there and run again")
    assert list(out.iterdir()) == []


def test_work_directory_of_a_running_export_is_kept_and_of_a_killed_one_removed(checkpoint, repo):
    running = subprocess.Popen([sys.executable, "-c", RUNNING_EXPORT, str(repo / "demo" / "9")],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        work = running.stdout.readline().strip()
        assert work == f".9.incomplete-{running.pid}"
        (repo / "demo" / work / "model.pt").write_bytes(b"half")
        assert run_cli("export", "--checkpoint", checkpoint, "--repo", repo, "--name", "demo", "--no-progress") == 0
        assert sorted(p.name for p in (repo / "demo").iterdir()) == [work, "1", "2"]
    finally:
        running.kill()
        running.wait()
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", repo, "--name", "demo", "--no-progress") == 0
    assert sorted(p.name for p in (repo / "demo").iterdir()) == ["1", "2", "3"]


def _edit_table(**changes):
    return lambda config: config["tables"][0].update(changes)


BAD_CHECKPOINTS = {
    "zero_rows": (_edit_table(num_embeddings=0), "table 't_user': num_embeddings must be a positive integer, got 0"),
    "negative_rows": (_edit_table(num_embeddings=-3), "num_embeddings must be a positive integer, got -3"),
    "text_dim": (_edit_table(embedding_dim="16"), "embedding_dim must be a positive integer, got '16'"),
    "no_features": (_edit_table(feature_names=[]), "feature_names must be a non-empty list of feature names, got []"),
    "features_as_text": (_edit_table(feature_names="user_id"), "feature_names must be a non-empty list"),
    "duplicate_feature": (_edit_table(feature_names=["item_id"]),
                          "feature 'item_id' is listed by table 't_user' and table 't_item'; list each feature once"),
    "dotted_table_name": (_edit_table(name="t.user"), "model_config.json: table 't.user': a table name is a non-empty "
                                                      "string without '.' (it names a module of the model)"),
    "empty_table_name": (_edit_table(name=""), "model_config.json: table '': a table name is a non-empty string"),
    "duplicate_table": (_edit_table(name="t_item", feature_names=["user_id"]), "table names ['t_item'] appear more"),
    "max_pooling": (_edit_table(pooling="MAX"), "pooling 'MAX' is not supported; use one of ['SUM', 'MEAN']"),
    "missing_key": (lambda config: config["tables"][0].pop("embedding_dim"), "'t_user' lacks ['embedding_dim']"),
    "unknown_model": (lambda config: config.update(model="dlrm_v9"), "unknown model 'dlrm_v9'"),
    "not_a_factory": (lambda config: config.update(model="os:path"), "'os:path' is not a model factory"),
    "float64_weights": (None, "tensors are not float32 ('dense_arch.model._mlp.0._linear.weight' is float64)"),
    "layer_sizes_not_a_list": (lambda config: config.update(dense_arch_layer_sizes=5),
                               "model_config.json: dense_arch_layer_sizes must be a non-empty list of positive "
                               "integers, got 5"),
    "zero_layer_size": (lambda config: config.update(over_arch_layer_sizes=[32, 0, 1]),
                        "over_arch_layer_sizes must be a non-empty list of positive integers, got [32, 0, 1]"),
    "text_dense_features": (lambda config: config.update(dense_in_features="8"),
                            "model_config.json: needs \"dense_in_features\", the number of dense features, a "
                            "positive integer; got '8'"),
    "dcn_layers_null": (lambda config: config.update(model="dlrm_dcn", dcn_num_layers=None),
                        "model_config.json: dcn_num_layers must be a positive integer, got None"),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoint_exits_2_naming_the_problem(case, checkpoint, tmp_path, capsys):
    edit, message = BAD_CHECKPOINTS[case]
    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoint, bad)
    if edit is None:
        weights = torch.load(bad / "weights.pt")
        torch.save({k: v.double() if k.startswith("dense_arch") else v for k, v in weights.items()},
                   bad / "weights.pt")
    else:
        config = json.loads((bad / "model_config.json").read_text())
        edit(config)
        (bad / "model_config.json").write_text(json.dumps(config))
    repo = tmp_path / "repo"
    line = cli_error(capsys, "export", "--checkpoint", bad, "--repo", repo, "--name", "m", "--no-progress")
    assert message in line, line
    assert not repo.exists()


@pytest.mark.parametrize("stray,version,message", [
    (str(MAX_VERSION), None, f"demo/{MAX_VERSION} leaves no next version number"),
    (None, MAX_VERSION + 1, f"--version must be in [1, {MAX_VERSION}]"),
    (None, 0, f"--version must be in [1, {MAX_VERSION}]"),
])
def test_version_out_of_range_exits_2(stray, version, message, checkpoint, repo, capsys):
    if stray:
        (repo / "demo" / stray).mkdir()
    before = sorted(p.name for p in (repo / "demo").iterdir())
    args = [] if version is None else ["--version", version]
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", repo, "--name", "demo", "--no-progress",
                   *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in (repo / "demo").iterdir()) == before


@pytest.mark.parametrize("spec,message", [
    ({"sharding": ["row_wise"]}, "sharding ['row_wise'] is not one of ['table_wise', 'row_wise', 'column_wise']"),
    ({"dtype": ["int8"]}, "\"dtype\" must be a string, got ['int8']"),
    ({"placement": ["uvm"]}, "\"placement\" must be a string, got ['uvm']"),
    ({"rank": "0"}, "\"rank\" must be an integer, got '0'"),
    ({"sharding": "column_wise", "ranks": 5}, "\"ranks\" must be a list of integers, got 5"),
    ({"sharding": "column_wise", "ranks": [0, None]}, "\"ranks\" must be a list of integers, got [0, None]"),
])
def test_plan_value_of_the_wrong_type_exits_2_naming_table_and_key(spec, message, checkpoint, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tables": {"t_user": spec}}))
    repo = tmp_path / "repo"
    line = cli_error(capsys, "export", "--checkpoint", checkpoint, "--repo", repo, "--name", "m", "--no-progress",
                     "--plan", plan)
    assert line == f"{ERROR} plan file {plan}: table 't_user': {message}"
    assert not repo.exists()


def test_unreadable_json_path_exits_2_in_one_line(checkpoint, tmp_path, capsys):
    """A directory given as the plan file, and a version path that runs through a file."""
    repo = tmp_path / "repo"
    line = cli_error(capsys, "export", "--checkpoint", checkpoint, "--repo", repo, "--name", "m", "--no-progress",
                     "--plan", tmp_path)
    assert line == f"{ERROR} {tmp_path}: cannot read (Is a directory)"
    assert not repo.exists()
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    line = cli_error(capsys, "inspect", a_file / "1")
    assert line == f"recserve inspect: error: {a_file / '1' / 'manifest.json'}: cannot read (Not a directory)"


@pytest.mark.parametrize("command", [["train-demo", "--steps", "1"], ["bench-checkpoint", "--rows-per-table", "8"]])
def test_checkpoint_out_that_is_a_file_exits_2_and_leaves_it(command, tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    line = cli_error(capsys, *command, "--out", out)
    assert line == f"recserve {command[0]}: error: --out {out} exists and is not a directory; choose another --out"
    assert out.read_text() == "mine"


def test_placing_plan_on_cpu_must_fit_the_memory_budget_as_the_planner_does(checkpoint, tmp_path, capsys):
    """On the CPU every table is in host memory: 7300 INT8 rows of dim 16 at 20 bytes (with scale and
    bias), 0.14 MiB on rank 0, above 10 KiB; TorchRec's planner refuses that budget without a plan."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tables": {"t_user": {"rank": 0}}}))
    repo = tmp_path / "repo"
    args = ["export", "--checkpoint", checkpoint, "--repo", repo, "--name", "m", "--no-progress", "--device", "cpu"]
    line = cli_error(capsys, *args, "--plan", plan, "--device-memory-gb", "0.00001")
    assert line == (f"{ERROR} the plan puts 0.14 MiB of tables in the memory of rank 0, above --device-memory-gb "
                    "9.99961e-06: raise it, or spread the tables over more ranks (--world-size)")
    assert not repo.exists() or not any(repo.rglob("*"))
    assert run_cli(*args, "--plan", plan, "--device-memory-gb", "0.001") == 0  # 1 MiB: fits


def test_over_arch_of_several_logits_per_sample_exits_2_before_writing_an_artifact(checkpoint, tmp_path, capsys):
    """An over arch ending in 2 outputs (config and weights agreeing) would make forward return 2B
    values for B samples, which the server then refuses with an unrelated error; the export says so."""
    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoint, bad)
    config = json.loads((bad / "model_config.json").read_text())
    config["over_arch_layer_sizes"][-1] = 2
    (bad / "model_config.json").write_text(json.dumps(config))
    weights = torch.load(bad / "weights.pt")
    for key in ("over_arch.model.1.weight", "over_arch.model.1.bias"):  # DLRM's final linear layer: [1, ...]
        weights[key] = torch.cat([weights[key], weights[key]])
    torch.save(weights, bad / "weights.pt")
    repo = tmp_path / "repo"
    line = cli_error(capsys, "export", "--checkpoint", bad, "--repo", repo, "--name", "m", "--no-progress")
    assert line == (f"{ERROR} model_config.json: over_arch_layer_sizes must end in 1 (one logit per sample, whose "
                    "sigmoid is the click probability), got [32, 16, 2]")
    assert not repo.exists()


def test_torchrec_planner_exports_say_nothing_but_their_result(checkpoint, tmp_path, capsys):
    """torchrec 1.8 logs a WARNING that "the job will fail" for a Topology not built by its
    TopologyFactory: on every export it planned (--world-size N, --device-memory-gb) and before the
    one line of one it could not place."""
    repo = tmp_path / "repo"
    args = ["export", "--checkpoint", checkpoint, "--repo", repo, "--name", "m", "--no-progress"]
    capsys.readouterr()
    assert run_cli(*args, "--world-size", "2") == 0
    assert capsys.readouterr().err == ""
    assert run_cli(*args, "--device-memory-gb", "0.00001") == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{ERROR} TorchRec's planner found no placement on 1 device(s) "
                                                   "of 9.99961e-06 GB: raise --device-memory-gb or --world-size"), lines


@pytest.mark.parametrize("command,message", [
    (["train-demo", "--steps", "-2"], "--steps must be >= 1, got -2"),
    (["train-demo", "--seed", "-1"], "--seed must be from 0 to 2**64 - 1, got -1"),
])
def test_out_of_range_number_flag_exits_2_in_one_line_and_writes_nothing(command, message, tmp_path, capsys):
    """A negative seed was a numpy traceback after --out was made; negative steps 'trained' and wrote a
    checkpoint."""
    out = tmp_path / "out"
    line = cli_error(capsys, *command, "--out", out)
    assert line == f"recserve {command[0]}: error: {message}"
    assert not out.exists()


@pytest.mark.parametrize("key,value,message", [
    ("files", None, "manifest field files: None is not a map of strings"),
    ("versions", [], "manifest field versions: [] is not a map of strings"),
    ("table_bytes", "140000", "manifest field table_bytes: '140000' is not an integer"),
    ("verification.sharded_vs_float", 5, "manifest field verification.sharded_vs_float: 5 is not a map of figures"),
    ("sharding.tables.t_user.cache_load_factor", "0.2",
     "manifest field sharding.tables.t_user.cache_load_factor: '0.2' is not a number in (0, 1]"),
    ("sharding.tables.t_user.placement", "UVM", "manifest field sharding.tables.t_user.placement: 'UVM' is not one of "
                                                "['hbm', 'uvm', 'uvm_caching']"),
])
def test_inspect_of_a_hand_edited_manifest_names_the_field_in_one_line(key, value, message, artifact, tmp_path,
                                                                       capsys):
    """Fields the loader's checks left out: inspect (and the server's checksum step) died in a TypeError or
    AttributeError traceback on them."""
    version = tmp_path / "1"
    shutil.copytree(artifact, version)
    manifest = json.loads((version / "manifest.json").read_text())
    *parents, last = key.split(".")
    target = manifest
    for parent in parents:
        target = target[parent]
    target[last] = value
    (version / "manifest.json").write_text(json.dumps(manifest))
    assert cli_error(capsys, "inspect", version) == f"recserve inspect: error: {message}"


def test_inspect_of_a_manifest_nested_too_deeply_is_one_line(artifact, tmp_path, capsys):
    """json.loads recurses per level: "[[[[..." was a RecursionError traceback (the C++ loader's own
    parser stops at 512 levels)."""
    version = tmp_path / "1"
    shutil.copytree(artifact, version)
    (version / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    assert cli_error(capsys, "inspect", version) == (f"recserve inspect: error: {version / 'manifest.json'}: JSON "
                                                     "nested too deeply to read (recserve's files nest a few levels)")


def test_truncated_weights_exit_2_in_one_line(checkpoint, tmp_path, capsys):
    """A weights.pt cut short (a copy that stopped, a full disk while training) was torch's mmap
    'OSError: [Errno 22] Invalid argument' traceback, naming no file."""
    bad = tmp_path / "ckpt"
    shutil.copytree(checkpoint, bad)
    weights = bad / "weights.pt"
    weights.write_bytes(weights.read_bytes()[:60000])
    repo = tmp_path / "repo"
    line = cli_error(capsys, "export", "--checkpoint", bad, "--repo", repo, "--name", "m", "--no-progress")
    # torch's own words differ between versions (here "[Errno 22] Invalid argument"); the file is named
    assert line.startswith(f"recserve export: error: {weights}: not a readable torch.save file ("), line
    assert not repo.exists()


# An export that signals itself when it reaches a stage, as an operator's Ctrl-C (SIGINT) or a job
# scheduler's SIGTERM would. "rename": just after the artifact's version directory was renamed into place.
SIGNALLED_EXPORT = """
import os, signal, sys
import export.run
stage, signum = sys.argv[1], getattr(signal, sys.argv[2])
def signalling(call, before=True):
    def wrapper(*args, **kwargs):
        if before:
            os.kill(os.getpid(), signum)
        result = call(*args, **kwargs)
        if not before:
            os.kill(os.getpid(), signum)
        return result
    return wrapper
if stage == "rename":
    os.rename = signalling(os.rename, before=False)
else:
    name = {"load": "load_checkpoint", "verify": "gate", "save": "save_module", "golden": "save_tensors"}[stage]
    setattr(export.run, name, signalling(getattr(export.run, name)))
from recserve.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("stage, signame, code", [
    ("load", "SIGTERM", 143), ("verify", "SIGINT", 130), ("save", "SIGTERM", 143), ("save", "SIGINT", 130),
    ("golden", "SIGTERM", 143),
])
def test_signal_during_export_ends_in_one_line_and_leaves_the_repository_as_it_was(stage, signame, code, checkpoint,
                                                                                 repo):
    """SIGTERM killed the export where it stood, silently, leaving its work directory and the model's
    directory it had made; SIGINT's KeyboardInterrupt cleaned up but ended silently too."""
    proc = subprocess.run([sys.executable, "-c", SIGNALLED_EXPORT, stage, signame, "export", "--checkpoint",
                           str(checkpoint), "--repo", str(repo), "--name", "demo", "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1:] == [
        f"recserve export: interrupted by {signame}; {repo / 'demo' / '2'} was not written"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (repo / "demo").iterdir()) == ["1"]


def test_signal_after_the_rename_says_the_version_was_written(checkpoint, repo):
    proc = subprocess.run([sys.executable, "-c", SIGNALLED_EXPORT, "rename", "SIGINT", "export", "--checkpoint",
                           str(checkpoint), "--repo", str(repo), "--name", "demo", "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1:] == [
        f"recserve export: interrupted by SIGINT after {repo / 'demo' / '2'} was written (it is complete)"]
    assert sorted(p.name for p in (repo / "demo").iterdir()) == ["1", "2"]
    assert run_cli("inspect", repo / "demo" / "2") == 0


def test_bench_checkpoint_signalled_while_saving_leaves_no_half_checkpoint(tmp_path):
    """The half-written weights.pt and its model_config.json stayed: the next bench-checkpoint refused
    to overwrite them without --force, an export of them failed on the truncated file."""
    script = """
import os, signal, sys, torch
save = torch.save
def signalled(obj, f, *args, **kwargs):
    with open(f, "wb") as half:
        half.write(b"half")
    os.kill(os.getpid(), signal.SIGTERM)
    return save(obj, f, *args, **kwargs)
torch.save = signalled
from recserve.cli import main
sys.exit(main(sys.argv[1:]))
"""
    out = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", script, "bench-checkpoint", "--out", str(out), "--rows-per-table",
                           "100"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1:] == ["recserve bench-checkpoint: interrupted by SIGTERM; nothing was kept"]
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("rows, needs", [(10_000_000, "128.8"), (10**18, "12874603271484.4")])
def test_bench_checkpoint_larger_than_memory_is_refused_before_allocating(rows, needs, tmp_path, capsys, monkeypatch):
    """Rows that need more memory than the machine has were allocated table by table until the
    allocator failed with a traceback or the OOM killer ended the process; 10**18 rows overflowed
    torch's size arithmetic (a traceback)."""
    import bench.checkpoint

    monkeypatch.setattr(bench.checkpoint, "usable_memory", lambda: 8 * 2**30, raising=False)
    out = tmp_path / "ckpt"
    line = cli_error(capsys, "bench-checkpoint", "--out", out, "--rows-per-table", rows)
    prefix = (f"recserve bench-checkpoint: error: --rows-per-table {rows} needs {needs} GiB of memory to write the "
              "checkpoint; this machine gives 8.0 GiB: use at most --rows-per-table ")
    assert line.startswith(prefix), line
    most = int(line[len(prefix):])
    bench.checkpoint._check_memory("dlrm_dcn", most)  # the advice fits, a row more would not
    with pytest.raises(UserError, match=f"^--rows-per-table {most + 1} needs "):
        bench.checkpoint._check_memory("dlrm_dcn", most + 1)
    assert not out.exists()


def test_export_of_a_version_another_export_writes_meanwhile_says_what_to_do(checkpoint, repo):
    """Two exports of one version (or two of the next version, both left out) at once: the second to
    finish said "cannot move the export into REPO/demo/2: [Errno 39] Directory not empty: ..."."""
    script = """
import sys
from pathlib import Path
import export.run
save = export.run.save_module
def beaten(module, path):
    save(module, path)
    other = Path(sys.argv[1]) / "demo" / "2"
    other.mkdir()
    (other / "model.pt").write_bytes(b"the other export's")
export.run.save_module = beaten
from recserve.cli import main
sys.exit(main(sys.argv[2:]))
"""
    proc = subprocess.run([sys.executable, "-c", script, str(repo), "export", "--checkpoint", str(checkpoint),
                           "--repo", str(repo), "--name", "demo", "--no-progress"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc.stderr) == (
        f"{ERROR} {repo / 'demo' / '2'} was written by another export while this one ran; nothing of this one was "
        "kept: pass another --version or leave it out for the next one")
    assert sorted(p.name for p in (repo / "demo").iterdir()) == ["1", "2"]
    assert (repo / "demo" / "2" / "model.pt").read_bytes() == b"the other export's"


def test_staged_version_is_synced_to_disk_files_directory_and_rename(tmp_path, monkeypatch):
    """Only the files were fsynced: after a power cut the version directory could be missing entries,
    or the rename be lost after the export had said it wrote the version."""
    import os

    from export.write import staged

    synced = []
    fsync = os.fsync

    def recording(fd):
        synced.append(os.fstat(fd).st_ino)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    target = tmp_path / "repo" / "demo" / "1"
    with staged(target) as work:
        (work / "model.pt").write_bytes(b"model")
        (work / "manifest.json").write_text("{}")
    inode = {path: path.stat().st_ino for path in (target / "model.pt", target / "manifest.json", target,
                                                   target.parent)}
    assert sorted(synced) == sorted(inode.values()), (synced, inode)
    assert synced[-1] == inode[target.parent]
