"""bench/gpu.py runs on a machine without a GPU: ``--device cpu --quick`` trains both sides
through the runtime and the plain loop, skips the NVML parts with "no GPU", resumes a
checkpoint, and ends with one JSON line holding its figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.benches.support import REPO

MODELS = ("resnet", "transformer")


@pytest.mark.slow
@pytest.mark.timeout(660)  # the run itself is bounded at 600 s (3 minutes on loaded 2 cores)
def test_gpu_bench_runs_on_cpu_and_reports_its_figures(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--device", "cpu",
                           "--quick"], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["device"] == "cpu"
    assert result["target_ratio"] == 0.97
    for name in MODELS:
        for key in (f"fabric_vs_plain_{name}", f"amp_vs_fp32_{name}",
                    f"fabric_samples_per_s_{name}", f"plain_samples_per_s_{name}"):
            value = result[key]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
        amp = result[f"fabric_vs_plain_amp_{name}"]
        assert amp is None or (isinstance(amp, float) and amp > 0)
        assert result[f"amp_loss_finite_{name}"] is True
    assert result["checkpoint_resume_equal"] is True
    assert result["checkpoint_output_max_abs_diff"] == 0.0
    # No CUDA run: the NVML memory figures are left out and the table says why.
    assert "gpu_memory_released" not in result
    assert "GPU memory: no GPU (skipped)" in done.stdout
    if not result["gpus"]:
        assert result["gpu"] == "no GPU"
    # Nothing of the run is left in its temporary folder.
    assert not list(tmp_path.glob("bench-gpu-*"))
