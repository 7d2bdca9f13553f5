"""End-to-end: real driver and worker processes, real gloo process groups.

Rank 0 writes one JSON line per committed step (epoch, batch, rank, size, generation,
samples, index_sum, loss); the tests assert on those lines, in the manner of Horovod's
elastic tests. The test model is float64, so a run at any size must reproduce the
standalone run's losses and weights (the global batch and sample order never change).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from runtime.config import DRIVER_EXIT_FAILED, DRIVER_EXIT_STOPPED
from runtime.tests.launcher import LocalJob

from .helpers import (
    SCRIPT,
    assert_every_sample_once,
    assert_same_training,
    base_env,
    driver_log,
    events,
    run_job,
    run_standalone,
    standalone_reference,
    steps,
    wait_for_joiners,
    wait_for_step,
    wait_until,
)

SAMPLES = 192  # 12 steps of 16 (batch 4 x engines 4) per epoch


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same training standalone: the ground truth every elastic run must match."""
    return standalone_reference(tmp_path_factory, SAMPLES)


@pytest.fixture(scope="module")
def real_reference(tmp_path_factory) -> Path:
    """The script's real-training variant (dropout, BatchNorm, augmentation, schedules,
    clipping, bfloat16 with a loss scale) trained standalone."""
    out = tmp_path_factory.mktemp("standalone_real")
    proc = run_standalone(out, TEST_SAMPLES=str(SAMPLES), TEST_MODEL="real")
    assert proc.returncode == 0, proc.stderr
    return out


def _reference(request: pytest.FixtureRequest, model: str, mlp: str) -> Path:
    return request.getfixturevalue(mlp if model == "mlp" else "real_reference")


@pytest.fixture(scope="module")
def fixed_four(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fixed4")
    run_job(out, 4, TEST_SAMPLES=str(SAMPLES))
    return out


@pytest.mark.slow
def test_it_trains_standalone_with_wmla_result_layout(reference: Path) -> None:
    assert {s["size"] for s in steps(reference)} == {1}
    assert (reference / "checkpoint" / "manifest.json").exists()
    assert (reference / "model" / "train" / "model_epoch_1.pth").exists()
    assert (reference / "model" / "train" / "model_epoch_final_optimizer_state.pth").exists()
    metrics = (reference / "evaluation-metrics.txt").read_text().splitlines()
    assert any('"grouplabel": "Test"' in line for line in metrics)
    kinds = [e["type"] for e in events(reference)]
    assert kinds[0] == "job.state" and kinds[-1] == "job.state"
    assert events(reference)[-1]["state"] == "FINISHED"
    assert {"metrics.train", "metrics.test", "epoch.end", "checkpoint.saved"} <= set(kinds)
    assert_every_sample_once(reference, SAMPLES, 2)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow
def test_it_trains_on_a_fixed_number_of_workers(tmp_path: Path, reference: Path,
                                                workers: int) -> None:
    run_job(tmp_path, workers, TEST_SAMPLES=str(SAMPLES))
    assert {s["size"] for s in steps(tmp_path)} == {workers}
    assert_same_training(tmp_path, reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)
    log = driver_log(tmp_path)
    assert "Train,\tTimestamp: " in log and "Global steps: 24" in log
    ev = [e for e in events(tmp_path) if e["type"] != "log"]
    assert ev[-1]["type"] == "job.state" and ev[-1]["state"] == "FINISHED"
    assert all(e["source"] == "driver" for e in ev)


@pytest.mark.slow
def test_it_trains_on_four_workers(fixed_four: Path, reference: Path) -> None:
    assert {s["size"] for s in steps(fixed_four)} == {4}
    assert_same_training(fixed_four, reference)


@pytest.mark.slow
def test_reading_batches_in_the_training_thread_trains_as_loader_threads_do(
        tmp_path: Path, real_reference: Path) -> None:
    # Without loader threads, each worker reads the next step's augmented samples while
    # it waits for the all-reduce: the same samples, the same draws, the same training.
    run_job(tmp_path, 2, TEST_SAMPLES=str(SAMPLES), TEST_MODEL="real", TEST_LOADER_THREADS="0")
    assert {s["size"] for s in steps(tmp_path)} == {2}
    assert_same_training(tmp_path, real_reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "real"])
def test_it_keeps_the_mathematics_when_rescaled_1_4_2_3(tmp_path: Path, model: str,
                                                         request: pytest.FixtureRequest) -> None:
    reference = _reference(request, model, "fixed_four")
    hold = tmp_path / "hold"
    hold.mkdir()
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), TEST_HOLD_DIR=str(hold),
                   TEST_HOLD_AT="0:2,0:6,1:3", TEST_MODEL=model)
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        wait_for_step(tmp_path, lambda s: s["batch"] >= 1, "the first steps at size 1")
        for w in ("w1", "w2", "w3"):
            job.add_worker(w)
        wait_for_joiners(job, ["w1", "w2", "w3"])
        (hold / "go-0-2").touch()
        wait_for_step(tmp_path, lambda s: s["size"] == 4, "size 4")
        # Both leave requests reach the driver while step 6 is held, so both leave at its
        # end: asked while training ran, a fast machine let one leave a step before the other.
        wait_until(lambda: (hold / "at-0-6").exists(), "the job held at step 6")
        leavers = [threading.Thread(target=job.remove_worker, args=(w,)) for w in ("w3", "w2")]
        for t in leavers:
            t.start()
        wait_until(lambda: set(job.status()["leaving"]) == {"w2", "w3"}, "both leave requests")
        (hold / "go-0-6").touch()
        for t in leavers:
            t.join()
        assert job.workers["w3"].returncode == 0 and job.workers["w2"].returncode == 0
        assert job.status()["left"] == {"w3": "reclaimed", "w2": "reclaimed"}
        wait_for_step(tmp_path, lambda s: s["size"] == 2, "size 2")
        job.add_worker("w4")
        wait_for_joiners(job, ["w4"])
        (hold / "go-1-3").touch()
        assert job.wait(120) == 0, driver_log(tmp_path)
    sizes = [s["size"] for s in steps(tmp_path)]
    assert [v for i, v in enumerate(sizes) if i == 0 or sizes[i - 1] != v] == [1, 4, 2, 3]
    assert_same_training(tmp_path, reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)
    changes = [e for e in events(tmp_path) if e["type"] == "generation.changed"]
    assert [e["size"] for e in changes] == [1, 4, 2, 3]
    # Each rescale says how long it took, in the events and in the job's log.
    assert all(e["duration_s"] >= 0 for e in changes)
    log = driver_log(tmp_path)
    for before, after in ((1, 4), (4, 2), (2, 3)):
        assert f"[edt] rescaled {before} -> {after} workers" in log
    left = {e["worker_id"]: e["reason"] for e in events(tmp_path) if e["type"] == "worker.left"}
    assert left["w2"] == left["w3"] == "reclaimed"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "real"])
def test_it_survives_a_worker_killed_mid_iteration(tmp_path: Path, model: str,
                                                   request: pytest.FixtureRequest) -> None:
    reference = _reference(request, model, "reference")
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="3",
                   EDT_PEER_TIMEOUT_S="8", TEST_MODEL=model)
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        job.add_worker("w1", env_extra={"TEST_KILL_AT": "0:5"})
        job.add_worker("w2")
        assert job.wait(150) == 0, driver_log(tmp_path)
        assert job.workers["w1"].returncode == -9
    rows = steps(tmp_path)
    sizes = [s["size"] for s in rows]
    assert sizes[0] == 3 and sizes[-1] == 2
    first_small = next(i for i, s in enumerate(rows) if s["size"] == 2)
    before, after = rows[first_small - 1], rows[first_small]
    # The killed step is redone right after the last committed one, in the next generation,
    # and the survivors noticed well within the peer timeout (8 s).
    assert after["epoch"] == before["epoch"] == 0
    assert after["batch"] == before["batch"] + 1 and after["batch"] in (5, 6)
    assert after["generation"] == before["generation"] + 1
    timeline = "\n".join(
        f"{e['ts'] - before['ts']:+.2f}s {e.get('source')} {e['type']} "
        f"{e.get('worker_id') or ''} {e.get('reason') or e.get('line') or ''}"
        for e in events(tmp_path) if before["ts"] - 1 <= e["ts"] <= after["ts_start"] + 1)
    assert after["ts_start"] - before["ts"] < 8, timeline
    lost = [e for e in events(tmp_path) if e["type"] == "worker.left" and e["worker_id"] == "w1"]
    assert lost and lost[0]["reason"] == "lost"
    assert_same_training(tmp_path, reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)


@pytest.mark.slow
def test_it_goes_on_when_rank_0_dies_handing_out_the_first_state(tmp_path: Path,
                                                                 reference: Path) -> None:
    """Rank 0 of the first generation is SIGKILLed while it reads the state it is about to
    broadcast, the others waiting for it. Nobody has trained a step: the survivors form the
    next generation, one hands out its own (identical) initial state, and a replacement
    joins them as it would any job."""
    hold = tmp_path / "hold"
    hold.mkdir()
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="3",
                   EDT_PEER_TIMEOUT_S="4", TEST_HOLD_DIR=str(hold), TEST_HOLD_STATE="1",
                   TEST_HOLD_AT="0:3")
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        for w in ("w0", "w1", "w2"):
            job.add_worker(w)
        held = wait_until(lambda: next(iter(hold.glob("at-state-*")), None), "rank 0 held")
        victim = held.name.removeprefix("at-state-")
        status = job.status()
        assert (status["generation"], status["members"][0]) == (1, victim), status
        for w in ("w0", "w1", "w2"):
            (hold / f"go-state-{w}").touch()  # later reads of the state pass
        job.kill_worker(victim)
        # The survivors train, and are held in step 3 until the replacement has registered.
        wait_until((hold / "at-0-3").exists, "the survivors in step 3", timeout=60)
        job.add_worker("w3")
        wait_until(lambda: "w3" in job.status()["joining"], "w3 registered", timeout=60)
        (hold / "go-0-3").touch()
        wait_for_step(tmp_path, lambda r: r["size"] == 3, "the replacement training",
                      timeout=60)
        assert job.wait(150) == 0, driver_log(tmp_path)
    rows = steps(tmp_path)
    assert rows[0]["size"] == 2 and (rows[0]["epoch"], rows[0]["batch"]) == (0, 0), rows[0]
    assert _first_step_at(tmp_path, 3)["batch"] == 4
    left = {e["worker_id"]: e["reason"] for e in events(tmp_path) if e["type"] == "worker.left"}
    assert left[victim] == "lost"
    assert_same_training(tmp_path, reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)


@pytest.mark.slow
def test_eight_workers_go_on_at_seven_when_rank_0_dies_mid_broadcast(tmp_path: Path) -> None:
    """Rank 0 of eight is SIGKILLed while it sends 40 MB of state: some members have it,
    some wait for it from a member that failed in turn. Every survivor must come out of the
    broadcast at the driver's word and train at seven, then eight with a replacement; before
    the fix, three members stayed stuck in the broadcast in most runs (the job went on at 4)."""
    hold = tmp_path / "hold"
    hold.mkdir()
    workers = [f"w{i}" for i in range(8)]
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="8", TEST_ENGINES="8",
                   TEST_HOLD_DIR=str(hold), TEST_HOLD_STATE="1", TEST_HOLD_AT="0:3",
                   TEST_STATE_MB="40")
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        for w in workers:
            job.add_worker(w)
        held = wait_until(lambda: next(iter(hold.glob("at-state-*")), None), "rank 0 held",
                          timeout=120)
        for w in workers:
            (hold / f"go-state-{w}").touch()
        time.sleep(0.15)  # rank 0 is then sending: where it dies is what this test varies
        job.kill_worker(held.name.removeprefix("at-state-"))
        wait_until((hold / "at-0-3").exists, "the survivors in step 3", timeout=60)
        assert job.status()["size"] == 7, job.status()
        job.add_worker("w8")
        wait_until(lambda: "w8" in job.status()["joining"], "w8 registered", timeout=60)
        (hold / "go-0-3").touch()
        wait_for_step(tmp_path, lambda r: r["size"] == 8, "eight again", timeout=60)
        assert job.wait(150) == 0, driver_log(tmp_path)
    left = {e["worker_id"]: e["reason"] for e in events(tmp_path) if e["type"] == "worker.left"}
    assert "late" not in left.values(), left
    assert_every_sample_once(tmp_path, SAMPLES, 2)


@pytest.mark.slow
@pytest.mark.parametrize("who", ["joiner", "member"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_worker_killed_as_the_next_generation_forms_costs_only_itself(
        tmp_path: Path, reference: Path, who: str, when: str) -> None:
    """A joiner (or a member) is SIGKILLed as generation 2 forms, before it publishes its
    address in the driver's store or right after. The others must not wait for it as long
    as a collective would (an hour): they form generation 3 without it, within the peer
    timeout, nobody is dropped as late, and the training is the standalone one."""
    hold = tmp_path / "hold"
    hold.mkdir()
    # A peer timeout that leaves room for gloo's give-up on the dead (see connect_timeout_s).
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="3",
                   EDT_PEER_TIMEOUT_S="12", TEST_HOLD_DIR=str(hold), TEST_HOLD_AT="0:3")
    dies = {"joiner": "w3", "member": "w1"}[who]
    dying = {"TEST_DIE_FORMING": f"2:{when}"}
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        for w in ("w0", "w1", "w2"):
            job.add_worker(w, env_extra=dying if w == dies else None)
        wait_until((hold / "at-0-3").exists, "the three in step 3", timeout=60)
        job.add_worker("w3", env_extra=dying if dies == "w3" else None)
        wait_until(lambda: "w3" in job.status()["joining"], "w3 registered", timeout=60)
        (hold / "go-0-3").touch()
        assert job.wait(150) == 0, driver_log(tmp_path)
    changed = {e["generation"]: e for e in events(tmp_path) if e["type"] == "generation.changed"}
    assert changed[2]["size"] == 4, changed
    survivors = [w for w in ("w0", "w1", "w2", "w3") if w != dies]
    assert sorted(changed[3]["members"]) == survivors, changed
    assert changed[3]["ts"] - changed[2]["ts"] < 10, changed  # the collectives' wait: 1 h
    left = {e["worker_id"]: e["reason"] for e in events(tmp_path) if e["type"] == "worker.left"}
    assert left[dies] == "lost" and "late" not in left.values(), left
    assert {r["generation"] for r in steps(tmp_path)} == {1, 3}
    assert_same_training(tmp_path, reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)


def _first_step_at(result_dir: Path, size: int) -> dict:
    return next(r for r in steps(result_dir) if r["size"] == size)


@pytest.mark.slow
def test_a_step_three_peer_timeouts_long_is_waited_for_not_taken_for_a_dead_peer(
        tmp_path: Path, reference: Path) -> None:
    # w0's step 3 takes 9 s; w1 waits for it in the all-reduce. Both stay alive on their
    # links, so nothing re-forms and the training is the standalone one.
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="2",
                   EDT_PEER_TIMEOUT_S="3")
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0", env_extra={"TEST_SLOW_AT": "0:3:9"})
        job.add_worker("w1")
        assert job.wait(150) == 0, driver_log(tmp_path)
    rows = steps(tmp_path)
    slow = next(r for r in rows if (r["epoch"], r["batch"]) == (0, 3))
    assert slow["ts"] - slow["ts_start"] >= 9
    assert {r["generation"] for r in rows} == {1}
    assert "re-forming" not in driver_log(tmp_path)
    left = {e["worker_id"]: e["reason"] for e in events(tmp_path) if e["type"] == "worker.left"}
    assert left == {"w0": "finished", "w1": "finished"}
    assert_same_training(tmp_path, reference)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_member_lost_during_a_long_step_releases_the_others_within_the_peer_timeout(
        tmp_path: Path, reference: Path, how: str) -> None:
    """w1 is held inside step 3 while w0 and w2 wait for it in the all-reduce, then killed
    (its sockets close) or frozen (they stay open: only the driver's word can release the
    others). Either way the survivors train at size 2 well within the peer timeout, not
    after the collective's own timeout (10 minutes here)."""
    hold = tmp_path / "hold"
    hold.mkdir()
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="3",
                   EDT_PEER_TIMEOUT_S="4", EDT_COLLECTIVE_TIMEOUT_S="600")
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        job.add_worker("w1", env_extra={"TEST_HOLD_DIR": str(hold), "TEST_HOLD_AT": "0:3"})
        job.add_worker("w2")
        wait_until((hold / "at-0-3").exists, "w1 inside step 3")
        lost_at = time.time()
        if how == "SIGKILL":
            job.kill_worker("w1")
        else:
            job.workers["w1"].send_signal(signal.SIGSTOP)
        wait_for_step(tmp_path, lambda r: r["size"] == 2, "a step at size 2")
        job.kill_worker("w1")  # a frozen one too, so that the job can end
        assert job.wait(150) == 0, driver_log(tmp_path)
    after = _first_step_at(tmp_path, 2)
    assert (after["epoch"], after["batch"]) == (0, 3)
    # SIGKILL: the driver's link closes at once. SIGSTOP: the link falls silent, and the
    # driver calls the member lost after the 4 s peer timeout.
    bound = 3 if how == "SIGKILL" else 4 + 3
    assert after["ts_start"] - lost_at < bound, driver_log(tmp_path)
    assert_same_training(tmp_path, reference)
    assert_every_sample_once(tmp_path, SAMPLES, 2)


@pytest.mark.slow
def test_it_resumes_from_the_checkpoint_after_losing_the_driver(tmp_path: Path,
                                                                 reference: Path) -> None:
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), EDT_MIN_WORKERS="2",
                   EDT_PEER_TIMEOUT_S="3", TEST_DELAY_S="0.003")
    manifest = tmp_path / "checkpoint" / "manifest.json"
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        job.add_worker("w1")
        wait_until(manifest.exists, "the first checkpoint")
        job.kill_driver()
        codes = job.wait_workers(30)
        assert codes == {"w0": 3, "w1": 3}, codes
    before = len(steps(tmp_path))
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        job.add_worker("w1")
        assert job.wait(120) == 0, driver_log(tmp_path)
    resumed = steps(tmp_path)[before:]
    assert (resumed[0]["epoch"], resumed[0]["batch"]) == (1, 0)
    assert resumed[0]["global_step"] == 13
    assert "Resuming from checkpoint at epoch 1" in driver_log(tmp_path)
    assert_same_training(tmp_path, reference)


@pytest.mark.slow
def test_it_fails_the_job_when_the_dataset_function_raises(tmp_path: Path) -> None:
    env = base_env(tmp_path, TEST_FAIL="dataset_raises")
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        rc = job.wait(60)
        assert job.workers["w0"].returncode == 1
    assert rc == DRIVER_EXIT_FAILED
    log = driver_log(tmp_path)
    assert "FileNotFoundError: no such dataset: /nowhere/train" in log
    assert "Traceback (most recent call last)" in log
    ev = events(tmp_path)
    assert [e["state"] for e in ev if e["type"] == "job.state"] == ["RUNNING", "FAILED"]
    errors = [e for e in ev if e["type"] == "error"]
    assert errors and "get_datasets" in errors[0]["traceback"]


@pytest.mark.parametrize(
    ("fail", "message"),
    [
        ("bad_return", "datasets_function must return (train_dataset, test_dataset)"),
        ("nan_loss", "loss is nan at epoch 0 iteration 1"),
    ],
)
@pytest.mark.slow
def test_it_fails_standalone_on_bad_user_code(tmp_path: Path, fail: str, message: str) -> None:
    proc = run_standalone(tmp_path, TEST_FAIL=fail)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr
    states = [e for e in events(tmp_path) if e["type"] == "job.state"]
    assert states[-1]["state"] == "FAILED" and message in states[-1]["error"]


@pytest.mark.slow
def test_it_hands_state_over_when_the_last_worker_leaves_and_stops_pull_failures(
    tmp_path: Path,
) -> None:
    env = base_env(tmp_path, TEST_SAMPLES=str(SAMPLES), TEST_EPOCHS="1000",
                   TEST_CKPT_FREQ="0", EDT_MAX_WORKERS="1")
    with LocalJob(SCRIPT, env=env) as job:
        job.start_driver()
        job.add_worker("w0")
        wait_for_step(tmp_path, lambda s: s["global_step"] >= 3, "a few steps")
        # The job is at its maximum, so this joiner is never admitted: PULL_FAILED twice.
        job.add_worker("w1", env_extra={"EDT_PULL_WEIGHT_TIME_OUT": "1",
                                        "EDT_PULL_FAILED_LIMITS": "2"})
        assert job.workers["w1"].wait(60) == 4
        log = (tmp_path / "log" / "w1" / "stdout").read_text()
        assert log.count("PULL_FAILED: no model weights within 1.0s") == 2
        assert {s["size"] for s in steps(tmp_path)} == {1}
        # The only worker leaves: it hands its state to the driver, and the next worker
        # carries on from the very next step (no checkpoint file involved: freq is 0).
        assert job.remove_worker("w0") == 0
        last = steps(tmp_path)[-1]
        assert job.status()["size"] == 0
        job.add_worker("w2")
        wait_for_step(tmp_path, lambda s: s["worker_id"] == "w2", "w2 training")
        resumed = next(s for s in steps(tmp_path) if s["worker_id"] == "w2")
        assert resumed["global_step"] == last["global_step"] + 1
        job.stop(checkpoint=True)
        assert job.wait(60) == DRIVER_EXIT_STOPPED
        assert job.workers["w2"].returncode == 0
    ev = [e for e in events(tmp_path) if e["type"] != "log"]
    assert ev[-1]["state"] == "KILLED"
    assert any(e["type"] == "checkpoint.saved" for e in ev)
    assert os.path.exists(tmp_path / "checkpoint" / "edt_state.pth")
    assert time.time() - ev[-1]["ts"] < 60
