"""A server with many models stops as promptly as one with a single model."""
import json
import shutil

import numpy as np
from servers import ServeProcess

from recserve.client import Client, random_request
from recserve.manifest import MANIFEST_FILE

MODELS = 101


def test_sigterm_with_101_models_exits_0_within_the_grace_period(tmp_path, artifact):
    """Releasing each version with a full garbage collection took 4 s for 101 models: the engine
    outlived a 3 s grace period and was killed (exit 1)."""
    repo = tmp_path / "repo"
    for i in range(MODELS):
        shutil.copytree(artifact, repo / f"m{i}" / "1")
        manifest = json.loads((repo / f"m{i}" / "1" / MANIFEST_FILE).read_text())
        manifest["name"] = f"m{i}"
        (repo / f"m{i}" / "1" / MANIFEST_FILE).write_text(json.dumps(manifest))
    proc = ServeProcess(repo, "--grace-period", "3", "--poll-interval", "0")
    with Client(proc.target) as client:
        assert len(client.model_info().models) == MODELS
        dense, sparse = random_request(client.model_info("m0").models[0], 5, seed=7)
        first = client.predict("m0", dense, sparse)
        np.testing.assert_array_equal(client.predict(f"m{MODELS - 1}", dense, sparse), first)
    assert proc.terminate(timeout=60) == 0, proc.output()[-2000:]
    assert "did not stop within the grace period" not in proc.output()
