"""bench/gpu.py runs on a machine without a GPU: ``--device cpu --quick`` trains both sides
through the runtime and the plain loop, skips the NVML parts with "no GPU", resumes a
checkpoint, and ends with one JSON line holding its figures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from bench import phases
from tests.benches.support import REPO

MODELS = ("resnet", "transformer")


@pytest.mark.slow
@pytest.mark.timeout(660)  # the run itself is bounded at 600 s (3 minutes on loaded 2 cores)
def test_gpu_bench_runs_on_cpu_and_reports_its_figures(tmp_path):
    # A smoke run: one model (the harness is the same for both; the transformer is run by
    # the profile test below), every side, three windows of a few steps.
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu",
                           "--quick", "--alone", "--models", "resnet"], cwd=REPO,
                          capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["device"] == "cpu"
    assert result["target_ratio"] == 0.97
    assert not any(key.endswith("_transformer") for key in result), "only the model asked for"
    for name in ("resnet",):
        for key in (f"fabric_vs_plain_{name}", f"amp_vs_fp32_{name}",
                    f"fabric_samples_per_s_{name}", f"plain_samples_per_s_{name}"):
            value = result[key]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
        amp = result[f"fabric_vs_plain_amp_{name}"]
        assert amp is None or (isinstance(amp, float) and amp > 0)
        assert result[f"amp_loss_finite_{name}"] is True
        # Three windows a side (--quick): the headline is the median of their ratios.
        windows = result[f"fabric_vs_plain_windows_{name}"]
        assert len(windows) == 3 and result[f"fabric_vs_plain_{name}"] == sorted(windows)[1]
        # Each side timed small operations inside its own process, after its warm-up.
        ops = result[f"op_us_{name}"]
        assert set(ops) == {"fabric", "plain", "plain_amp", "fabric_amp", "fabric_alone"}, ops
        for side, figures in ops.items():
            assert set(figures) == {"add_us", "fwd_bwd_us", "fwd_bwd_amp_us"}, side
            assert all(v > 0 for v in figures.values()), (side, figures)
        assert (f"host us a call inside the fabric process: add_ "
                f"{ops['fabric']['add_us']:.2f}") in done.stdout
        # Each side's host time a step, by thread; a job's driver is counted on its own.
        threads = result[f"threads_{name}"]
        assert set(threads) == {"fabric", "plain", "plain_amp", "fabric_amp", "fabric_alone"}
        for side, by_thread in threads.items():
            assert by_thread["main"]["cpu_us"] > 0, (side, by_thread)
            assert ("driver" in by_thread) == (side in ("fabric", "fabric_amp")), side
        assert (f"host CPU a step in the fabric side: driver "
                f"{threads['fabric']['driver']['cpu_us']:,.0f} us") in done.stdout
        # FabricModel as one process, without a driver, beside the others.
        alone = result[f"fabric_alone_vs_plain_windows_{name}"]
        assert len(alone) == 3 and all(r > 0 for r in alone), alone
        assert result[f"fabric_alone_vs_plain_{name}"] == sorted(alone)[1]
        # Each side's step, cut where its model's hooks fire (bench/phases.py).
        cut = result[f"phases_{name}"]
        assert set(cut) == {"fabric", "plain", "plain_amp", "fabric_amp", "fabric_alone"}, cut
        for side, f in cut.items():
            assert f["steps"] > 0 and all(f[k] > 0 for k in phases.NAMES), (side, f)
        assert (f"host us a step in the fabric side: forward "
                f"{cut['fabric']['forward_us']:,.0f}, loss {cut['fabric']['loss_us']:,.0f}"
                ) in done.stdout
    assert result["checkpoint_resume_equal"] is True
    assert result["checkpoint_output_max_abs_diff"] == 0.0
    assert result["host"]["cores"] == os.cpu_count(), result["host"]
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


@pytest.mark.timeout(120)
def test_an_unknown_side_is_named_before_anything_runs():
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu",
                           "--sides", "fabric_alone,nope"], cwd=REPO, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 2, done.stdout + done.stderr
    assert ("unknown side(s) nope: choose from fabric_alone, plain_malloc, fabric_nomalloc, "
            "plain_control, plain_seeded" in done.stderr)


def test_each_added_side_is_compared_with_the_plain_loop_window_by_window():
    from bench import gpu
    from bench.harness import allocator_environment
    from runtime import allocator

    figures = {"fabric": [[(110.0, 0.1), (90.0, 0.1)]], "plain": [[(100.0, 0.1), (100.0, 0.1)]],
               "plain_amp": [[(100.0, 0.1)] * 2], "fabric_amp": [[(100.0, 0.1)] * 2],
               "plain_malloc": [[(95.0, 0.1), (105.0, 0.1)]]}
    out = gpu.window_summary(figures, amp_loss=0.5)
    assert out["extra"] == {"plain_malloc": {"samples_per_s": 100.0, "ratios": [0.95, 1.05]}}
    assert "processes" not in out  # one process a side: nothing to compare them by
    # That side is the plain loop with the worker's malloc settings, and nothing else.
    assert gpu.SIDES["plain_malloc"] == gpu.SIDES["plain"]
    assert gpu._side_env("plain_malloc") == allocator_environment()
    assert gpu._side_env("plain") == {} and gpu._side_env("fabric_alone") == {}
    # And FabricModel alone, the worker told that the job chose its allocator: it then
    # leaves glibc's settings as they are.
    assert gpu.SIDES["fabric_nomalloc"] == gpu.SIDES["fabric_alone"]
    env = gpu._side_env("fabric_nomalloc")
    assert allocator.user_chose(env) is not None
    assert not set(env) & set(allocator_environment())
    # The plain loop told to seed its generators each step, and nothing else.
    assert gpu.SIDES["plain_seeded"] == gpu.SIDES["plain"]
    assert gpu._side_env("plain_seeded") == {gpu.SEED_EACH_STEP: "1"}


def test_the_seeded_plain_loop_resets_the_generators_each_step_as_the_runtime_does(
        monkeypatch):
    import random

    import torch

    from bench import gpu
    from runtime import randomness

    monkeypatch.setenv(gpu.SEED_EACH_STEP, "1")
    seeding = gpu._seeding(torch.device("cpu"))

    def draws(step: int) -> tuple[float, float]:
        with seeding(step):
            return torch.rand(()).item(), random.random()

    first = draws(7)
    assert draws(7) == first  # the same step: the same draws, whatever came before
    assert draws(8) != first
    # The runtime's own seed for that forward pass: its code, not a copy of it.
    assert torch.initial_seed() == randomness.micro_batch_seed(0, 0, 8, 0)
    loaded = gpu._runtime_randomness(torch.device("cpu"))
    assert type(loaded).__module__ == "_bench_randomness"
    # Without the switch, the plain loop seeds nothing.
    monkeypatch.delenv(gpu.SEED_EACH_STEP)
    torch.manual_seed(123)
    with gpu._seeding(torch.device("cpu"))(7):
        assert torch.initial_seed() == 123


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
    bench = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--quick"]
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
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu",
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


def test_throughput_pairs_each_window_with_its_neighbour_and_takes_the_median_ratio():
    """On a GPU a side's speed drifts by 10-20% from one minute to the next: each window's
    ratio compares two sides trained a few seconds apart, and the headline is their median,
    which one window caught by a pause of the machine does not move."""
    from bench import gpu

    # (samples/s, median iteration s) of each side's windows, in order.
    figures = {"fabric": [[(1000.0, 0.010), (1300.0, 0.008), (700.0, 0.02)]],
               "plain": [[(1100.0, 0.009), (1000.0, 0.010), (1000.0, 0.01)]],
               "plain_amp": [[(1000.0, 0.010), (1000.0, 0.010), (500.0, 0.02)]],
               "fabric_amp": [[(900.0, 0.011), (1200.0, 0.008), (1000.0, 0.01)]]}

    c = gpu.window_summary(figures, amp_loss=0.5)

    assert c["ratios"] == [0.909, 1.3, 0.7]
    assert c["amp_ratios"] == [0.9, 1.2, 2.0]
    # Each side's median window, not its best: 1000 of FabricModel's 700, 1000 and 1300.
    assert (c["fabric"], c["plain"], c["fabric_amp"], c["amp"]) == (1000.0, 1000.0, 1000.0,
                                                                    1000.0)
    assert (c["fabric_it"], c["plain_it"]) == (0.010, 0.010)
    result = gpu._summary("cpu", [], {"resnet": c})
    result["failed_parts"] = {}
    assert result["fabric_vs_plain_resnet"] == 0.909  # the median ratio, not 1000 / 1000
    assert result["fabric_vs_plain_amp_resnet"] == 1.2
    assert result["fabric_vs_plain_windows_resnet"] == [0.909, 1.3, 0.7]
    assert result["fabric_vs_plain_amp_windows_resnet"] == [0.9, 1.2, 2.0]
    table = gpu._table(result, {"resnet": c}, 3)
    assert "median of 3 windows a side, trained in turns" in table
    assert "each window's ratio: float32 0.909, 1.300, 0.700; AMP 0.900, 1.200, 2.000" in table
    assert "resnet      float32          1,000.0   1,000.0  0.909   NO" in table


def test_each_process_is_paired_with_the_plain_loops_process_of_its_number():
    """One process of a program can be 10% faster than another of the same program for its
    whole life: with several a side, FabricModel's i-th process is paired with the plain
    loop's i-th, window by window, and the median is over all those pairs; each side's
    processes are listed, with how far the fastest is from the slowest."""
    from bench import gpu

    # Two processes a side, two windows each; the plain loop's second process is 20% slower.
    figures = {"fabric": [[(1000.0, 0.01), (1000.0, 0.01)], [(900.0, 0.01), (960.0, 0.01)]],
               "plain": [[(1000.0, 0.01), (1010.0, 0.01)], [(800.0, 0.01), (800.0, 0.01)]],
               "plain_amp": [[(1000.0, 0.01)] * 2] * 2, "fabric_amp": [[(1000.0, 0.01)] * 2] * 2,
               "plain_control": [[(990.0, 0.01), (1000.0, 0.01)], [(1000.0, 0.01), (840.0, 0.01)]]}

    c = gpu.window_summary(figures, amp_loss=0.5)

    assert c["ratios"] == [1.0, 0.99, 1.125, 1.2]
    assert c["plain"] == 900.0  # the median of all four of its windows
    assert c["processes"]["plain"] == [1005.0, 800.0]
    assert c["processes"]["fabric"] == [1000.0, 930.0]
    # The control, a second plain loop, paired the same way: the floor under the ratios.
    assert c["extra"]["plain_control"]["ratios"] == [0.99, 0.99, 1.25, 1.05]
    result = gpu._summary("cpu", [], {"resnet": c})
    result["failed_parts"] = {}
    assert result["fabric_vs_plain_resnet"] == 1.062
    assert result["processes_resnet"]["plain"] == [1005.0, 800.0]
    assert result["plain_control_vs_plain_resnet"] == 1.02
    table = gpu._table(result, {"resnet": c}, 2, 2)
    assert "median of 2 windows in each of 2 processes a side, trained in turns" in table
    assert "the plain side's processes: 1,005.0, 800.0/s (fastest / slowest 1.256)" in table
    assert "a second plain loop, the same program: 995.0/s, 1.020 of the plain loop" in table


@pytest.mark.parametrize("option", ["--processes", "--windows", "--rounds"])
def test_a_count_below_one_is_refused_before_anything_runs(option):
    # 0 once fell back to the default, unnoticed; nothing runs, the parser names the flag.
    done = subprocess.run([sys.executable, "-m", "bench.gpu", "--device", "cpu",
                           option, "0"], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"{option} 0: each must be at least 1" in done.stderr
    assert not done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_several_processes_a_side_each_train_their_own_windows(tmp_path):
    from bench import gpu
    from bench.runtime import Workload

    tiny = Workload("mlp", 4, 3, 2)  # windows of 3 steps after 2 of warm-up
    c = gpu.throughput_part(tmp_path, tiny, "cpu", windows=1,
                            chosen=("fabric", "plain", "plain_amp"), per_side=2)

    # A window of each process, paired by number: two ratios a side.
    assert len(c["ratios"]) == 2 and all(r > 0 for r in c["ratios"]), c["ratios"]
    assert set(c["processes"]) == {"fabric", "plain", "plain_amp"}
    assert all(len(v) == 2 and min(v) > 0 for v in c["processes"].values()), c["processes"]
    labels = {"fabric", "plain", "plain_amp", "fabric#2", "plain#2", "plain_amp#2"}
    assert set(c["op_us"]) == set(c["threads"]) == set(c["phases"]) == labels
    # Each process in its own folder, with its own steps.
    for label in labels:
        rows = (tmp_path / f"mlp-{label.replace('#', '-')}" / "steps.jsonl").read_text()
        assert len(rows.splitlines()) == 5, (label, rows)


def test_a_runtime_without_precision_has_no_amp_ratio():
    from bench import gpu

    figures = {"fabric": [[(1000.0, 0.01)]], "plain": [[(1000.0, 0.01)]],
               "plain_amp": [[(1500.0, 0.01)]]}
    c = gpu.window_summary(figures, amp_loss=0.5)
    assert c["fabric_amp"] is None and c["amp_ratios"] == []
    result = gpu._summary("cpu", [], {"resnet": c})
    result["failed_parts"] = {}
    assert result["fabric_vs_plain_amp_resnet"] is None
    assert "n/a (no FabricModel precision=)" in gpu._table(result, {"resnet": c}, 1)


def test_the_gate_pauses_after_the_warm_up_and_each_window_until_it_is_opened(tmp_path,
                                                                               monkeypatch):
    from bench import gate

    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    harness = os.open(fifo, os.O_RDWR)
    monkeypatch.setenv(gate.GATE, str(fifo))
    monkeypatch.setenv(gate.FIRST, "2")
    monkeypatch.setenv(gate.EVERY, "3")
    g = gate.Gate()
    passed: list[int] = []

    def train(steps: int) -> None:
        for step in range(1, steps + 1):
            g.after_step(step)
            passed.append(step)

    os.write(harness, b"ww")  # the warm-up's pause (after step 2) and one window's (step 5)
    trainer = threading.Thread(target=train, args=(9,), daemon=True)
    trainer.start()
    # It stops at the end of step 8, its third pause, with no byte left to read.
    deadline = time.monotonic() + 30
    while len(passed) < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    trainer.join(timeout=0.5)
    assert trainer.is_alive() and passed == [1, 2, 3, 4, 5, 6, 7], passed
    os.write(harness, b"w")
    trainer.join(timeout=30)
    assert not trainer.is_alive() and passed == list(range(1, 10))
    os.close(harness)


def test_each_side_times_small_operations_in_its_turn_after_its_warm_up(tmp_path,
                                                                        monkeypatch):
    from bench import gate, opcost

    fifo, out = tmp_path / "gate", tmp_path / "opcost.json"
    os.mkfifo(fifo)
    harness = os.open(fifo, os.O_RDWR)
    monkeypatch.setenv(gate.GATE, str(fifo))
    monkeypatch.setenv(gate.FIRST, "2")
    monkeypatch.setenv(opcost.OPCOST, str(out))
    g = gate.Gate()
    opcost.after_step(1, g)  # not the warm-up's last step: nothing, and no wait
    assert not out.exists()
    side = threading.Thread(target=opcost.after_step, args=(2, g), daemon=True)
    side.start()
    side.join(timeout=0.5)
    assert side.is_alive() and not out.exists()  # waiting for its turn
    os.write(harness, b"o")
    side.join(timeout=120)
    assert not side.is_alive()
    figures = json.loads(out.read_text())
    assert set(figures) == {"add_us", "fwd_bwd_us", "fwd_bwd_amp_us"}
    assert 0 < figures["add_us"] < figures["fwd_bwd_us"], figures
    os.close(harness)


def test_a_gate_without_a_harness_never_pauses(monkeypatch):
    from bench import gate

    monkeypatch.delenv(gate.GATE, raising=False)
    g = gate.Gate()
    for step in range(1, 50):
        g.after_step(step)  # would block forever on a real gate
    assert g.fd is None


@pytest.mark.timeout(300)
def test_a_side_that_cannot_start_or_train_is_named_with_where_to_look(tmp_path):
    from bench import gpu
    from bench.runtime import Workload

    nope = Workload("nope", 4, 3, 2)  # no such model: the script raises as it starts
    with pytest.raises(RuntimeError, match=r"the fabric side did not start \(driver exited "
                                           r"with 1 before listening\); see .*nope-fabric"):
        gpu.throughput_part(tmp_path / "a", nope, "cpu", windows=1)
    assert "unknown model 'nope'" in (tmp_path / "a" / "nope-fabric" / "log" / "driver"
                                      / "stdout").read_text()

    # A side that started and then died is named too, instead of waited for.
    with pytest.raises(RuntimeError, match=r"the plain side ended before its 2 warm-up steps; "
                                           r"see .*nope-plain"):
        gpu.throughput_part(tmp_path / "b", nope, "cpu", windows=1, chosen=("plain",))
    assert "unknown model 'nope'" in (tmp_path / "b" / "nope-plain" / "plain.log").read_text()


def test_the_run_names_the_host_that_launched_the_kernels():
    # Two machines with the same GPU but other processors gave other ratios: a run says
    # which processor, caches and torch it measured, in the JSON and the table.
    import torch

    from bench import gpu

    host = gpu.host_facts()
    assert host["cores"] == os.cpu_count()
    assert host["torch"] == torch.__version__ and host["cuda"] == torch.version.cuda
    assert isinstance(host["cpu"], str) and host["cpu"], host
    if os.path.isdir("/sys/devices/system/cpu/cpu0/cache"):
        assert "L1d " in host["caches"] and "L2 " in host["caches"], host
    result = {"device": "cpu", "gpu": "no GPU", "gpus": [], "failed_parts": {}, "host": host}
    table = gpu._table(result, {}, 1)
    assert f"  host: {host['cpu']}, {host['cores']} cores ({host['caches']}); torch " in table
