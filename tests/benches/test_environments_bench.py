"""bench/environments.py: one layer built, then reused; its last line the JSON other tools
read, and its temporary folder gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.harness import REPO


@pytest.mark.slow
def test_environments_bench_builds_a_layer_and_reuses_it(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "bench.environments", "--reuses", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result) == {"first_build_s", "reuse_s", "layer_bytes"}
    assert result["first_build_s"] > 0 and result["reuse_s"] > 0
    # Only what the base lacks: two small packages, not torch.
    assert 0 < result["layer_bytes"] < 10 << 20
    assert not list(tmp_path.glob("edt-bench-environments-*"))
