"""bench/gpu.py runs on a machine without a GPU: ``--device cpu --quick`` trains both sides
through the runtime and the plain loop, skips the NVML parts with "no GPU", resumes a
checkpoint, and ends with one JSON line holding its figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

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
        # One round: its own ratio is the headline's.
        assert result[f"fabric_vs_plain_rounds_{name}"] == [result[f"fabric_vs_plain_{name}"]]
    assert result["checkpoint_resume_equal"] is True
    assert result["checkpoint_output_max_abs_diff"] == 0.0
    # The overhead part: each side's microseconds a step, and what the runtime adds.
    fabric, plain = result["host_us_per_step_fabric"], result["host_us_per_step_plain"]
    assert fabric > 0 and plain > 0, (fabric, plain)
    assert result["host_overhead_us_per_step"] == pytest.approx(fabric - plain, abs=0.11)
    assert (f"host work a step (the MLP 8 wide, one sample): FabricModel {fabric:,.0f} us, "
            f"plain {plain:,.0f} us; the runtime adds "
            f"{result['host_overhead_us_per_step']:,.0f} us") in done.stdout, done.stdout
    # No CUDA run: the NVML memory figures are left out and the table says why.
    assert "gpu_memory_released" not in result
    assert "GPU memory: no GPU (skipped)" in done.stdout
    if not result["gpus"]:
        assert result["gpu"] == "no GPU"
    # Nothing of the run is left in its temporary folder.
    assert not list(tmp_path.glob("bench-gpu-*"))


@pytest.mark.timeout(300)
def test_the_memory_part_reads_memory_while_a_worker_trains_and_after_it_left(tmp_path):
    # The part's own mechanics on the CPU, NVML stood in for: a job that would train for 1000
    # epochs is stopped after its warm-up, and memory is read before, during and after it.
    # Memory "frees" once the worker is gone, as the NVIDIA driver frees a dead process's.
    from bench import gpu

    readings = iter([100, 900, 300])

    def used_mb() -> int:
        return next(readings, 110)

    w = gpu.WORKLOADS["cpu"]["resnet"][0]
    result = gpu.memory_part(tmp_path / "memory", w, device="cpu", used_mb=used_mb)

    assert result["gpu_memory_baseline_mb"] == 100
    assert result["gpu_memory_training_mb"] == 900
    # 300 is not back at the baseline; the part looks again, and 110 is (within 16 MiB).
    assert result["gpu_memory_after_mb"] == 110
    assert result["gpu_memory_released"] is True
    assert 0 <= result["gpu_memory_release_s"] < 30
    steps = (tmp_path / "memory" / "steps.jsonl").read_text().splitlines()
    assert len(steps) >= w.warmup  # it read "training" only once the worker trained
    # The job was stopped long before its 1000 epochs: far fewer steps than one epoch's worth
    # times 1000.
    assert len(steps) < 1000 * w.steps


def test_a_part_that_fails_is_reported_and_the_others_still_run(capsys):
    from bench import gpu

    failed: dict[str, str] = {}

    def broken() -> None:
        raise TypeError("got multiple values for keyword argument 'BENCH_EPOCHS'")

    assert gpu._part("memory", failed, broken) is None
    assert gpu._part("checkpoint", failed, lambda: {"ok": 1}) == {"ok": 1}
    assert failed == {"memory": "TypeError: got multiple values for keyword argument "
                                "'BENCH_EPOCHS'"}
    assert "Traceback" in capsys.readouterr().err
    result = gpu._summary("cuda", [], {}, {}, {})
    result["failed_parts"] = failed
    table = gpu._table(result, {}, 1)
    assert "FAILED memory: TypeError" in table
    assert "GPU memory:" not in table  # not "skipped" nor "not measured": it failed, and says so


def test_parts_choose_what_runs_and_an_unknown_part_is_refused(tmp_path):
    bench = [sys.executable, str(REPO / "bench" / "gpu.py"), "--device", "cpu", "--quick"]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([*bench, "--parts", "checkpoint"], cwd=REPO, capture_output=True,
                          text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["checkpoint_resume_equal"] is True and result["failed_parts"] == {}
    assert not any(key.startswith("fabric_vs_plain") for key in result), result
    assert "[checkpoint done in" in done.stderr  # the part's progress line

    refused = subprocess.run([*bench, "--parts", "throughput,speed"], cwd=REPO,
                             capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2
    assert ("unknown part(s) speed: choose from throughput, memory, checkpoint, overhead, "
            "profile") in refused.stderr


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_the_profile_part_profiles_the_same_steps_on_both_sides(tmp_path):
    out = tmp_path / "profile"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--device", "cpu",
                           "--quick", "--models", "transformer", "--parts", "profile",
                           "--profile-dir", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed_parts"] == {}
    sides = result["profile_transformer"]
    assert set(sides) == {"fabric", "plain"}
    for side, figures in sides.items():
        assert figures["steps"] == 20, side
        assert figures["host_ms_per_step"] > 0, side
        # The plain loop reads its loss once a step (loss.item()): the profile sees it.
        if side == "plain":
            assert figures["reads_per_step"].get("aten::_local_scalar_dense", 0) >= 1
        for suffix in (".txt", ".json", ".trace.json.gz"):
            assert (out / f"transformer-{side}{suffix}").stat().st_size > 0, (side, suffix)
        assert "Self CPU" in (out / f"transformer-{side}.txt").read_text()
        assert f"profile transformer {side}: host" in done.stdout


def test_the_profile_counts_the_device_busy_once_and_no_annotated_span():
    """Kineto lists a kernel's time twice (its own row, and the operator that launched it)
    and gives annotated ranges (the profiler's step) their whole span as device time: the
    device's busy time is the kernels' rows alone."""
    from torch.autograd import DeviceType

    from bench.profiling import summary

    def row(key, cpu_us, device_us, device=DeviceType.CPU, annotation=False, count=2):
        return SimpleNamespace(key=key, count=count, self_cpu_time_total=cpu_us,
                               self_device_time_total=device_us, device_type=device,
                               is_user_annotation=annotation)

    averages = [row("aten::convolution", 300, 4000),  # its kernel's time, again
                row("sm90_conv_kernel", 0, 4000, DeviceType.CUDA),
                row("ProfilerStep*", 500, 19000, DeviceType.CUDA, annotation=True),
                row("aten::item", 20, 0), row("Memcpy DtoH", 0, 10, DeviceType.CUDA)]
    figures = summary(averages, steps=2)
    assert figures["device_ms_per_step"] == 2.005
    assert figures["host_ms_per_step"] == 0.41
    assert figures["reads_per_step"] == {"aten::item": 1.0}


def test_throughput_keeps_the_best_of_each_side_and_says_each_rounds_ratio(monkeypatch, tmp_path):
    """On a GPU a side moves by 10-20% from one run to the next: the table gives the best of
    each side and, beside it, each round's own ratio, so a reader sees the spread."""
    from bench import gpu

    # samples/s in the order each side runs: round 0's float32 then AMP, then round 1's.
    fabric_runs = iter([1000.0, 900.0, 1300.0, 1200.0])
    plain_runs = iter([1100.0, 1000.0, 1000.0, 1000.0])
    monkeypatch.setattr(gpu, "_fabric_has_precision", lambda: True)
    monkeypatch.setattr(gpu, "run_fabric",
                        lambda tmp, w, device, amp=False: (next(fabric_runs), 0.01))
    monkeypatch.setattr(gpu, "run_plain",
                        lambda tmp, w, device, amp=False: (next(plain_runs), 0.01, 0.5))

    c = gpu.throughput_part(tmp_path, gpu.WORKLOADS["cpu"]["resnet"][0], "cpu", rounds=2)

    assert (c["fabric"], c["plain"]) == (1300.0, 1100.0)  # each side's best round
    assert (c["fabric_amp"], c["amp"]) == (1200.0, 1000.0)
    assert c["ratios"] == [0.909, 1.3]
    assert c["amp_ratios"] == [0.9, 1.2]
    result = gpu._summary("cpu", [], {"resnet": c})
    result["failed_parts"] = {}
    assert result["fabric_vs_plain_resnet"] == 1.182
    assert result["fabric_vs_plain_rounds_resnet"] == [0.909, 1.3]
    assert result["fabric_vs_plain_amp_rounds_resnet"] == [0.9, 1.2]
    assert "each round's ratio: float32 0.909, 1.300; AMP 0.900, 1.200" in gpu._table(
        result, {"resnet": c}, 2)
