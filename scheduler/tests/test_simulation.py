"""The trace-driven simulator (``scheduler.simulation``): its reading of the traces, its
clock, what each policy does with a small workload, and its figures."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from scheduler.simulation.engine import Costs, SimJob, Simulator
from scheduler.simulation.report import isolated_s, percentile, summarize
from scheduler.simulation.traces import AppTrace, load_apps
from scheduler.simulation.workload import load, max_workers, synthetic

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "pollux-osdi21"
NO_COST = Costs(grow_s=0.0, shrink_s=0.0, start_s=0.0)


def linear_app(name="lin", step_1=1.0, overhead=0.0) -> AppTrace:
    """An application whose step at global batch 8 takes ``step_1`` s on one GPU, and
    ``step_1 / n + overhead`` on n GPUs (measured on one host, 1, 2 and 4 GPUs)."""
    curves = {(1, 1): [(1.0, step_1 / 8), (8.0, step_1)]}
    for n in (2, 4):
        curves[(1, n)] = [(1.0, step_1 / 8 + overhead), (8.0 / n, step_1 / n + overhead)]
    return AppTrace(name, curves, steps={8: 100, 32: 25})


def job(name, arrival=0.0, app="lin", replicas=1, max_workers=4, priority=5000):
    return SimJob(name, arrival, app, replicas, 8, max_workers, priority)


# --- traces ---------------------------------------------------------------------------------

def test_it_reads_a_measured_shape_and_interpolates_the_local_batch():
    app = linear_app(overhead=0.1)
    assert app.step_time(1, 1, 8) == pytest.approx(1.0)
    assert app.step_time(4, 1, 8) == pytest.approx(0.35)
    assert app.step_time(2, 1, 8) == pytest.approx(0.6)


def test_it_accumulates_gradients_beyond_the_largest_local_batch_measured():
    app = linear_app()
    # 16 samples on one GPU that holds 8: two passes of 8.
    assert app.step_time(1, 1, 16) == pytest.approx(2 * app.step_time(1, 1, 8))


def test_it_adds_an_interpolated_overhead_for_a_shape_never_measured():
    app = linear_app(overhead=0.1)
    # 3 GPUs on one host: compute of 8/3 on one GPU plus the overhead between 2 and 4 GPUs.
    assert app.step_time(3, 1, 8) == pytest.approx(1.0 / 3 + 0.1, rel=0.01)
    # On 2 hosts (never measured) it takes the nearest measured host count's overhead.
    assert app.step_time(4, 2, 8) == pytest.approx(0.25 + 0.1, rel=0.01)


def test_it_interpolates_the_steps_to_target_in_log_log():
    app = linear_app()
    assert app.steps_to_target(8) == 100
    assert app.steps_to_target(16) == pytest.approx(50, rel=0.01)


def test_it_refuses_a_shape_that_cannot_exist():
    with pytest.raises(ValueError, match="3 GPUs on 4 hosts"):
        linear_app().step_time(3, 4, 8)


def test_it_reads_the_papers_traces_and_workloads():
    apps = load_apps(DATA / "traces")
    assert {"cifar10", "imagenet", "ncf", "deepspeech2", "yolov3", "bert"} <= apps.keys()
    jobs = load(DATA / "workloads" / "workload-1.csv", apps, "request", 64)
    assert len(jobs) == 160
    assert all(1 <= j.max_workers == min(j.num_replicas, 64) for j in jobs)
    # cifar10 at batch 2048: measured down to local batch 32, so it splits over 64 GPUs.
    assert max_workers(apps["cifar10"], 2048, 4, "scalable", 64) == 64


def test_it_names_an_application_without_traces(tmp_path):
    path = tmp_path / "w.csv"
    path.write_text("name,time,application,num_replicas,batch_size\nx-0,1,gpt9,1,8\n")
    with pytest.raises(ValueError, match="w.csv:2: no traces for application 'gpt9'"):
        load(path, {"lin": linear_app()}, "request", 4)


# --- the engine -----------------------------------------------------------------------------

def run(policy, jobs, hosts=None, costs=NO_COST, apps=None, interval_s=1000.0):
    sim = Simulator(hosts or {"h1": 4}, apps or {"lin": linear_app()}, policy, costs,
                    interval_s=interval_s)
    return {r.job.name: r for r in sim.run(jobs).results}


def test_a_job_alone_finishes_after_its_steps_at_its_size_plus_its_start():
    results = run("fairshare", [job("a", arrival=5.0)], costs=Costs(0.5, 0.2, 2.0))
    # 100 steps of batch 8 on 4 GPUs at 0.25 s each, after a 2 s start.
    assert results["a"].jct == pytest.approx(2.0 + 25.0)


def test_the_fixed_baseline_makes_a_job_wait_for_all_its_replicas():
    jobs = [job("a", replicas=4), job("b", arrival=1.0, replicas=2)]
    results = run("fixed", jobs)
    assert results["a"].jct == pytest.approx(25.0)  # 4 GPUs: 100 x 0.25 s
    assert results["b"].jct == pytest.approx(25.0 - 1.0 + 50.0)  # then 100 x 0.5 s
    assert results["b"].rescales == 0


def test_fair_share_shrinks_the_first_job_for_the_second_and_charges_each_rescale():
    costs = Costs(grow_s=1.0, shrink_s=0.5, start_s=0.0)
    results = run("fairshare", [job("a"), job("b", arrival=10.0)], costs=costs)
    # a: 40 steps alone on 4 GPUs (10 s), a shrink (0.5 s), its 60 steps left on 2 (30 s).
    assert results["a"].jct == pytest.approx(40.5)
    assert results["a"].rescales == 1
    # b: 61 steps on 2 GPUs until a ends at 40.5 s, a grow (1 s), 39 steps on 4 (9.75 s).
    assert results["b"].jct == pytest.approx(40.5 + 1.0 + 9.75 - 10.0)
    assert results["b"].rescales == 1


def test_a_job_holds_its_slots_until_it_ends_and_one_on_reclaimed_slots_waits_the_handoff():
    costs = Costs(grow_s=0.0, shrink_s=0.0, start_s=0.0, finish_s=1.0, handoff_s=2.0)
    results = run("fairshare", [job("a"), job("b", arrival=10.0)], costs=costs)
    # a: 40 steps on 4 GPUs (10 s), 60 on 2 (30 s), then it ends 1 s after its last step.
    assert results["a"].jct == pytest.approx(41.0)
    # b starts on a's reclaimed slots 2 s after the decision: 58 steps on 2 GPUs until a
    # ends at 41 s, then grows onto free slots (no hand-over): 42 steps on 4 (10.5 s), +1 s.
    assert results["b"].jct == pytest.approx(41.0 + 10.5 + 1.0 - 10.0)


def test_goodput_decides_while_a_job_is_ending_without_negative_work_left():
    # bench/cluster_real.py's two kinds, as measured there. A job past its last step holds
    # its slots for finish_s; the policy is told it has nothing left, never a rounding below
    # zero (goodput's urgency took a fractional power of it: complex numbers).
    measured = {"parallel": {1: .4544, 2: .2377, 3: .1589, 4: .158},
                "serial": {1: .3054, 2: .2732, 3: .2609, 4: .2629}}
    apps = {kind: AppTrace(kind, {(k, n): [(96 / n, t)] for n, t in steps.items()
                                  for k in range(1, min(n, 2) + 1)},
                           {96: 300 if kind == "parallel" else 180})
            for kind, steps in measured.items()}
    kinds = ("parallel", "serial")
    jobs = [SimJob(f"j{i}", 15.0 * i, kinds[i % 2], 4, 96, 4) for i in range(8)]
    costs = Costs(start_s=2.5, finish_s=1.0, handoff_s=0.5)
    results = run("goodput", jobs, hosts={"h1": 2, "h2": 2}, costs=costs, apps=apps,
                  interval_s=2.0)
    assert sorted(results) == [f"j{i}" for i in range(8)]
    assert all(r.jct > 0 for r in results.values())


def test_goodput_learns_each_jobs_throughput_and_gives_the_slots_to_the_one_that_scales():
    apps = {"lin": linear_app(), "flat": linear_app("flat", overhead=10.0)}
    jobs = [job("scales", app="lin", max_workers=8), job("flat", app="flat", max_workers=8)]
    hosts = {"h1": 4, "h2": 4}
    fair = run("fairshare", jobs, hosts=hosts, apps=apps, interval_s=5.0)
    good = run("goodput", jobs, hosts=hosts, apps=apps, interval_s=5.0)
    # Fair share keeps them 4/4 to the end (100 steps at 0.25 s). Goodput measures, after
    # 10 s, that "flat" is slower on 4 GPUs than on 1, keeps it at its bound (2, half its fair
    # share) and gives "scales" 6: its 60 steps left at 1/6 s each.
    assert fair["scales"].jct == pytest.approx(25.0)
    assert good["scales"].jct == pytest.approx(10.0 + 10.0)
    # "flat" never measured 1 GPU, so the model cannot know how much faster it is there: it
    # ends at 3 (its best guess), a little later than under fair share, never starved.
    assert good["flat"].jct < 1.05 * fair["flat"].jct


def test_goodput_learns_from_an_earlier_job_of_the_same_application_and_batch():
    """"first" (max 1 GPU) measures that "flat" trains 10x faster on 1 GPU than on 4. The next
    "flat" job starts on 4 (its fair share); once it has measured there, it knows its kin's
    1 GPU too, drops to it and gives "scales" 7. Without kin it never learns 1 GPU."""
    apps = {"lin": linear_app(), "flat": linear_app("flat", overhead=10.0)}
    jobs = [job("first", app="flat", max_workers=1),
            job("flat", app="flat", arrival=200.0, max_workers=8),
            job("scales", app="lin", arrival=200.0, max_workers=8)]
    hosts = {"h1": 4, "h2": 4}
    runs = {kin: {r.job.name: r for r in Simulator(hosts, apps, "goodput", NO_COST, 5.0,
                                                    kin=kin).run(jobs).results}
            for kin in (True, False)}
    # 10 s on 4 GPUs at 10.25 s a step, then its other steps at 1 s on 1 GPU.
    assert runs[True]["flat"].jct == pytest.approx(10.0 + 100.0 - 10.0 / 10.25)
    # 40 steps in 10 s on 4 GPUs, its other 60 on 7.
    assert runs[True]["scales"].jct == pytest.approx(10.0 + 60.0 / 7)
    assert runs[False]["flat"].jct > 5 * runs[True]["flat"].jct


def test_the_adapting_what_if_trains_at_the_batch_that_makes_progress_fastest():
    """One GPU, 0.1 s a sample, 8 samples a pass: a step of 8 takes 0.8 s; a step of 32 takes 4
    passes (3.2 s) and is worth 100 / 20 = 5 steps of 8. Adapting, the job makes 5 / 3.2 =
    1.5625 steps of 8 a second instead of 1.25, and may use as many GPUs as 32 splits over."""
    app = AppTrace("acc", {(1, 1): [(1.0, 0.1), (8.0, 0.8)]}, steps={8: 100, 32: 20})
    assert app.progress_rate(1, 1, 8) == pytest.approx(1.25)
    assert app.progress_rate(1, 1, 8, adapt=True) == pytest.approx(1.5625)
    # A job already at the largest batch has nothing to adapt to.
    assert app.progress_rate(1, 1, 32, adapt=True) == pytest.approx(1 / 3.2)
    sims = {adapt: Simulator({"h1": 1}, {"acc": app}, "goodput", NO_COST, 1000.0,
                             adapt_batch=adapt) for adapt in (False, True)}
    [kept], [adapted] = (sims[a].run([job("a", app="acc", max_workers=1)]).results
                         for a in (False, True))
    assert (kept.jct, adapted.jct) == (pytest.approx(80.0), pytest.approx(64.0))
    assert sims[True]._adapted_max(job("a", app="acc", max_workers=1)) == 1  # 1 slot here
    wide = Simulator({"h1": 64}, {"acc": app}, "goodput", NO_COST, adapt_batch=True)
    assert wide._adapted_max(job("a", app="acc", max_workers=1)) == 32


def test_every_policy_finishes_every_job_of_a_paper_workload():
    apps = load_apps(DATA / "traces")
    jobs = load(DATA / "workloads" / "workload-3.csv", apps, "scalable", 64)[:40]
    hosts = {f"h{i}": 4 for i in range(16)}
    for policy in ("fixed", "fifo", "priority", "fairshare", "goodput"):
        result = Simulator(hosts, apps, policy).run(jobs)
        assert sorted(r.job.name for r in result.results) == sorted(j.name for j in jobs)
        assert all(r.jct > 0 for r in result.results)
        assert 0 < result.utilisation <= 1.0 + 1e-9


# --- figures --------------------------------------------------------------------------------

def test_a_lone_job_on_its_whole_cluster_has_a_finish_time_fairness_of_one():
    apps = {"lin": linear_app()}
    sim = Simulator({"h1": 4}, apps, "fairshare", NO_COST)
    result = sim.run([job("a")])
    summary = summarize(result, apps, total=4, slots_per_host=4)
    assert summary.ftf_mean == pytest.approx(1.0)
    assert summary.jct_mean_s == pytest.approx(25.0)
    assert isolated_s(result.results[0], apps["lin"], 4, 4) == pytest.approx(25.0)


def test_percentile_is_the_nearest_rank():
    assert percentile([5, 1, 3, 2, 4], 0.99) == 5
    assert percentile([5, 1, 3, 2, 4], 0.5) == 3
    assert not math.isnan(percentile([1.0], 0.99))


def test_a_synthetic_workload_is_reproducible():
    apps = {"lin": linear_app()}
    assert synthetic(50, apps, 64, seed=3) == synthetic(50, apps, 64, seed=3)


def test_two_instance_groups_share_the_hosts_by_weight():
    jobs = [SimJob("a", 0.0, "lin", 1, 8, 8, group="prod"),
            SimJob("b", 10.0, "lin", 1, 8, 8, group="research")]
    apps = {"lin": linear_app()}
    hosts = {"h1": 4, "h2": 4}
    seen: dict[str, list[int]] = {"a": [], "b": []}
    sim = Simulator(hosts, apps, "fairshare", NO_COST, interval_s=1000.0,
                    weights={"prod": 3, "research": 1})
    apply = sim._apply

    def record(r, placement, *args):
        seen[r.job.name].append(sum(placement.values()))
        apply(r, placement, *args)

    sim._apply = record
    results = {r.job.name: r for r in sim.run(jobs).results}
    # prod's job alone takes all 8; research's job arrives and gets its weighted share, 2.
    assert seen["a"][:2] == [8, 6]
    assert seen["b"][0] == 2
    assert results["a"].rescales >= 1 and results["b"].jct > 0
