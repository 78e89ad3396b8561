"""C++ loader parity: cpp_loader/build/recserve-cpp-loader vs Python torch.jit.load on the same
artifact, and vs the float reference; and its error exits."""
import json
import shutil
import subprocess

import pytest
import torch
from conftest import ROOT, run_cli
from reference import errors, reference_outputs

import fbgemm_gpu  # noqa: F401
from export.verify import sample_batch
from recserve.manifest import read_manifest

LOADER = ROOT / "cpp_loader" / "build" / "recserve-cpp-loader"


@pytest.fixture(scope="module")
def loader():
    assert LOADER.exists(), f"{LOADER} is missing: run `make cpp-loader` (make test builds it)"
    return LOADER


def run_loader(loader, artifact, inputs: dict, tmp_path, *extra):
    inputs_path, outputs_path = tmp_path / "inputs.pt", tmp_path / "outputs.pt"
    torch.save(inputs, inputs_path)
    proc = subprocess.run([str(loader), str(artifact), str(inputs_path), str(outputs_path), *extra],
                          capture_output=True, text=True, timeout=300)
    return proc, outputs_path


@pytest.fixture(scope="module")
def cuda_artifact(tmp_path_factory, checkpoint):
    repo = tmp_path_factory.mktemp("cuda_repo")
    assert run_cli("export", "--checkpoint", checkpoint, "--repo", repo, "--name", "g", "--device", "cuda",
                   "--no-progress") == 0
    return repo / "g" / "1"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("batch_size", [1, 7, 256])
def test_cpp_matches_python_and_float(device, batch_size, loader, request, checkpoint, tmp_path):
    artifact = request.getfixturevalue("artifact" if device == "cpu" else "cuda_artifact")
    m = read_manifest(artifact)
    b = sample_batch([(f.name, f.rows) for f in m.features], m.dense_features, batch_size, seed=batch_size)
    proc, out_path = run_loader(loader, artifact, {"dense": b.dense, "values": b.values, "lengths": b.lengths},
                                tmp_path, "--device", device)
    assert proc.returncode == 0, proc.stderr
    out = torch.load(out_path)  # weights_only=True, the default
    model = torch.jit.load(str(artifact / "model.pt"), map_location=m.dense_device)
    with torch.no_grad():
        dev = m.dense_device
        ctr = model(b.dense.to(dev), b.values.to(dev), b.lengths.to(dev)).cpu()
        pooled = model.lookup(b.values.to(dev), b.lengths.to(dev)).cpu()
    if device == "cpu":
        assert torch.equal(out["ctr"], ctr) and torch.equal(out["pooled"], pooled)  # bitwise
    else:
        assert (out["ctr"] - ctr).abs().max() <= 1e-6 and (out["pooled"] - pooled).abs().max() <= 1e-6
    ref_ctr, ref_pooled = reference_outputs(checkpoint, b.dense, b.values, b.lengths)
    ctr_err, pooled_err = errors(out["ctr"], out["pooled"], ref_ctr, ref_pooled)
    assert ctr_err <= 1e-2
    if batch_size > 1:
        assert pooled_err <= 1e-2 and out["pooled"].abs().sum() > 0
    else:
        assert out["pooled"].abs().max() == 0  # one sample, all bags empty


def _inputs(artifact, **override):
    m = read_manifest(artifact)
    b = sample_batch([(f.name, f.rows) for f in m.features], m.dense_features, 4, seed=0)
    inputs = {"dense": b.dense, "values": b.values, "lengths": b.lengths}
    inputs.update(override)
    return {k: v for k, v in inputs.items() if v is not None}


@pytest.mark.parametrize("case,message", [
    ("missing manifest", "manifest.json: cannot open"),
    ("bad checksum", "does not match the manifest"),
    ("library not found", "cannot load fbgemm library"),
    ("missing input", "lacks \"dense\""),
    ("wrong dtype", "\"values\" has dtype Int"),
    ("missing inputs file", "inputs.pt: cannot open"),
    ("inputs not of torch.save", "inputs.pt: not a file of torch.save ("),
    ("missing model", "model.pt: cannot open (missing?)"),
    ("manifest lacks a key", "manifest.json lacks \"files\""),
    # It was the model's TorchScript traceback, as an internal failure: "the model failed in the TorchScript
    # interpreter: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x7 and 8x32)"
    ("wrong dense width", "INPUTS.pt: \"dense\" has 7 features per sample, the model 8 (manifest.json dense_features)"),
    # The kernels run without bounds checks: the inputs must fit together and the tables first.
    ("short values", "INPUTS.pt: \"lengths\" sum to 27 ids, \"values\" has 3"),
    ("negative lengths", "INPUTS.pt: \"lengths\" has a negative length"),
    ("lengths of another batch", "INPUTS.pt: \"lengths\" has 12 entries, expected 3 features x 2 samples (key-major)"),
    ("id past its table", "INPUTS.pt: feature \"user_id\" has id 2000, outside its table's 2000 rows"),
])
def test_cpp_loader_user_errors_exit_2_with_one_line(case, message, loader, artifact, tmp_path):
    """Each was exit code 1, as an internal failure is: a script could not tell its own mistake from
    the loader's."""
    target, extra, inputs = artifact, [], _inputs(artifact)
    if case in ("missing manifest", "bad checksum", "missing model", "manifest lacks a key"):
        target = tmp_path / "copy"
        shutil.copytree(artifact, target)
        if case == "missing manifest":
            (target / "manifest.json").unlink()
        elif case == "missing model":
            (target / "model.pt").unlink()
        elif case == "manifest lacks a key":
            manifest = json.loads((target / "manifest.json").read_text())
            del manifest["files"]
            (target / "manifest.json").write_text(json.dumps(manifest))
        else:
            data = bytearray((target / "model.pt").read_bytes())
            data[100] ^= 1
            (target / "model.pt").write_bytes(bytes(data))
    elif case == "library not found":
        extra = ["--fbgemm-dir", str(tmp_path / "nowhere")]
    elif case == "missing input":
        inputs = _inputs(artifact, dense=None)
    elif case == "wrong dtype":
        inputs = _inputs(artifact, values=_inputs(artifact)["values"].int())
    elif case == "wrong dense width":
        inputs = _inputs(artifact, dense=_inputs(artifact)["dense"][:, :7].contiguous())
    elif case == "short values":
        inputs = _inputs(artifact, values=_inputs(artifact)["values"][:3].clone())
    elif case == "negative lengths":
        inputs = _inputs(artifact, lengths=-_inputs(artifact)["lengths"])
    elif case == "lengths of another batch":
        inputs = _inputs(artifact, dense=_inputs(artifact)["dense"][:2].clone())
    elif case == "id past its table":
        values = _inputs(artifact)["values"].clone()
        values[0] = 2000
        inputs = _inputs(artifact, values=values)
    proc, _ = run_loader(loader, target, inputs, tmp_path, *extra)
    if case == "missing inputs file":
        proc = subprocess.run([str(loader), str(artifact), str(tmp_path / "inputs.pt.nope"), str(tmp_path / "o.pt")],
                              capture_output=True, text=True)
        message = "inputs.pt.nope: cannot open"
    elif case == "inputs not of torch.save":
        (tmp_path / "inputs.pt").write_text("dense, values, lengths\n")
        proc = subprocess.run([str(loader), str(artifact), str(tmp_path / "inputs.pt"), str(tmp_path / "o.pt")],
                              capture_output=True, text=True)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recserve-cpp-loader: error:") and message in lines[0], proc.stderr


def test_cpp_loader_usage_exit_2(loader):
    proc = subprocess.run([str(loader), "only-one-arg"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_cpp_loader_reads_strided_inputs_by_their_values(loader, artifact, tmp_path):
    """torch.save keeps a view's strides (values = ids[:, 0]): the kernels read the buffer as if dense,
    so the loader hands them contiguous copies. A strided "values" whose gaps hold other (valid) ids
    pooled those instead."""
    inputs = _inputs(artifact)
    proc, out_path = run_loader(loader, artifact, inputs, tmp_path)
    assert proc.returncode == 0, proc.stderr
    dense_ref = torch.load(out_path)
    strided = {}
    for name, t in inputs.items():  # every input a view of every other element of a larger buffer
        buffer = torch.zeros((2 * t.shape[0], *t.shape[1:]), dtype=t.dtype)
        buffer[::2] = t
        strided[name] = buffer[::2]
        assert not strided[name].is_contiguous() and torch.equal(strided[name], t)
    proc, out_path = run_loader(loader, artifact, strided, tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = torch.load(out_path)
    assert torch.equal(out["ctr"], dense_ref["ctr"]) and torch.equal(out["pooled"], dense_ref["pooled"])


@pytest.mark.parametrize("case,extra,message", [
    # each level was a stack frame of the parser: it died of SIGSEGV (exit -11), no message
    ("deep nesting", "[" * 200_000 + "]" * 200_000, "manifest.json is not valid JSON (nested deeper than 512 levels"),
    # std::stoul's own error: "recserve-cpp-loader: error: stoul"; and " +1a" was taken for a code point
    ("escape not hex", '"\\uZZZZ"', "manifest.json is not valid JSON (bad \\u escape at byte"),
    ("escape with sign", '"\\u +1a"', "manifest.json is not valid JSON (bad \\u escape at byte"),
])
def test_cpp_loader_hostile_manifest_is_one_line_exit_2(case, extra, message, loader, artifact, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(artifact, target)
    text = (target / "manifest.json").read_text().rstrip()
    (target / "manifest.json").write_text(text[:-1] + f', "extra": {extra}}}')
    proc, _ = run_loader(loader, target, _inputs(artifact), tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("recserve-cpp-loader: error:") and message in lines[0], proc.stderr


@pytest.mark.parametrize("option", ["--device", "--fbgemm-dir"])
def test_cpp_loader_option_without_value_exit_2(option, loader, tmp_path):
    """It said "unknown option --device" of an option it knows."""
    proc = subprocess.run([str(loader), "a", "b", "c", option], capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (2, f"recserve-cpp-loader: error: option {option} needs a value\n")


def test_cpp_loader_refuses_a_manifest_with_more_rows_than_the_table(loader, artifact, tmp_path):
    """The manifest is not covered by the checksums and the lookup kernels run without bounds checks:
    with user_id's rows edited from 2000 to 2001, id 2000 passed the loader's check and the kernel read
    past the table's end (exit 0, outputs from whatever lay there)."""
    target = tmp_path / "copy"
    shutil.copytree(artifact, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["features"][0]["rows"] = 2001
    (target / "manifest.json").write_text(json.dumps(manifest))
    values = _inputs(artifact)["values"].clone()
    values[0] = 2000
    proc, out_path = run_loader(loader, target, _inputs(artifact, values=values), tmp_path)
    assert (proc.returncode, proc.stderr) == (2, (
        "recserve-cpp-loader: error: manifest.json: features[0].rows is 2001, but the table of feature \"user_id\" "
        "in the artifact has 2000 rows (golden.pt's largest id + 1)\n")) and not out_path.exists()


def test_cpp_loader_internal_failure_exits_1_with_one_line(loader, artifact, tmp_path):
    """A model.pt that matches the manifest's checksum and that libtorch cannot load is no input the
    user got wrong (the export wrote it; another libtorch reads it): exit 1, not a user error's 2."""
    import hashlib

    target = tmp_path / "copy"
    shutil.copytree(artifact, target)
    (target / "model.pt").write_bytes(b"not a TorchScript archive")
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["files"]["model.pt"] = hashlib.sha256(b"not a TorchScript archive").hexdigest()
    (target / "manifest.json").write_text(json.dumps(manifest))
    proc, out_path = run_loader(loader, target, _inputs(artifact), tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("recserve-cpp-loader: error: "), \
        (proc.returncode, proc.stderr)
    assert not out_path.exists()
