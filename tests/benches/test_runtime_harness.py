"""bench/runtime.py's harness: its step counter counts, and its step reader parses, the
whole lines of a log being appended to, reading only what is new; ``--steps`` too short for
a round is refused before anything starts; ``--control`` measures the DDP loop against
itself beside the comparison; ``--same-allocator`` runs both sides under the host-memory
setting the workers make."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bench.harness import LineCount as _LineCount
from bench.harness import StepRows as _StepRows
from tests.benches.support import REPO


def test_it_counts_whole_lines_as_they_are_appended(tmp_path):
    log = tmp_path / "steps.jsonl"
    with _LineCount(log) as lines:
        assert lines.now() == 0  # no file yet
        log.write_text('{"step": 1}\n{"st')
        assert lines.now() == 1  # the second line is half written
        with log.open("a") as f:
            f.write('ep": 2}\n{"step": 3}\n')
        assert lines.now() == 3
        assert lines.now() == 3  # nothing new, nothing counted twice


def test_it_parses_whole_lines_as_they_are_appended(tmp_path):
    log = tmp_path / "steps.jsonl"
    with _StepRows(log) as steps:
        assert steps() == []  # no file yet
        log.write_text('{"step": 1}\n{"st')
        assert steps() == [{"step": 1}]  # the second line is half written
        with log.open("a") as f:
            f.write('ep": 2}\n\n{"step": 3}\n')
        assert steps() == [{"step": 1}, {"step": 2}, {"step": 3}]
        assert steps() == [{"step": 1}, {"step": 2}, {"step": 3}]  # nothing read twice


def test_too_few_steps_for_a_round_are_refused_by_name():
    run = subprocess.run([sys.executable, "-m", "bench.runtime", "--steps", "5"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--steps must be at least 20" in run.stderr and "got 5" in run.stderr


def _one_quick_mlp_round(tmp_path, flag: str) -> tuple[list[str], str]:
    """One round of the quick MLP at one worker with ``flag``: the table's lines, stderr."""
    run = subprocess.run([sys.executable, "-m", "bench.runtime", "--quick",
                          "--models", "mlp", "--workers", "1", "--rounds", "1",
                          "--parts", "throughput", flag],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout.strip().splitlines(), run.stderr


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_the_control_runs_ddp_against_itself_and_reports_its_noise(tmp_path):
    lines, stderr = _one_quick_mlp_round(tmp_path, "--control")
    assert any("control: DDP against DDP" in line for line in lines), lines
    # Every round is reported as it ends, the control's and the comparison's.
    for side in ("fabric (control: DDP)", "ddp", "fabric"):
        assert f"mlp 1 worker(s) round 1/1 {side}: " in stderr, stderr[-3000:]
    result = json.loads(lines[-1])
    for key in ("noise_ratio_mlp_1", "noise_cpu_ratio_mlp_1", "overhead_ratio_mlp_1"):
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_same_allocator_starts_both_sides_with_the_workers_host_memory_setting(tmp_path):
    lines, _ = _one_quick_mlp_round(tmp_path, "--same-allocator")
    assert "both sides keep freed host memory" in lines[0], lines
    result = json.loads(lines[-1])
    assert result["same_allocator"] is True and result["overhead_ratio_mlp_1"] > 0
