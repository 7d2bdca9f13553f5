"""bench/runtime_tf.py at its smallest (the quick MLP, one worker, one round): both sides
train, the table names them, and the last line is the JSON with ``overhead_ratio_tf_1``.
Needs the [tensorflow] extra, which the test extra installs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.benches.support import REPO

pytestmark = [pytest.mark.slow, pytest.mark.tensorflow]


def test_it_compares_fabric_model_with_a_gradient_tape_loop_and_ends_with_its_json():
    done = subprocess.run(
        [sys.executable, "-m", "bench.runtime_tf", "--quick", "--workers", "1", "--rounds", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FabricModel" in done.stdout and "GradientTape loop" in done.stdout, done.stdout
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(last) == {"overhead_ratio_tf_1", "cpu_ratio_tf_1"}, last
    assert 0.2 < last["overhead_ratio_tf_1"] < 5 and last["cpu_ratio_tf_1"] > 0, last
