"""The search's loop on real job rows: the test plays the agents (starts each trial's job,
stores its test metrics, ends it) and checks what the search decides."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from hpo import services
from hpo.models import HpoTask, HpoTrial
from hpo.space import parse_search
from jobs import states
from jobs.lifecycle import job_end, job_start
from jobs.models import JobMetric, TrainingJob

PARAMS = [
    {"name": "learning_rate", "type": "Range", "dataType": "DOUBLE", "minDbVal": 0.001,
     "maxDbVal": 0.1, "step": 0.001},
    {"name": "batch_size", "type": "Range", "dataType": "INT", "minIntVal": 16,
     "maxIntVal": 64, "step": 16},
    {"name": "optimizer", "type": "Discrete", "dataType": "STR",
     "discreateStrVal": ["SGD", "Adam"]},
]


def _loss(params: dict, epoch: int) -> float:
    """A made-up objective: best near learning_rate 0.03, lower with more epochs."""
    return (params["learning_rate"] - 0.03) ** 2 * 100 + (0.1 if params["optimizer"] == "SGD"
                                                          else 0) + 1 / (epoch + 1)


def _create(owner, model_def, cluster, seed=None, **algo) -> HpoTask:
    search = parse_search({"algorithm": "Random", "maxJobNum": 6, "maxParalleJobNum": 2,
                           "objectiveMetric": "loss", "objective": "minimize", **algo}, PARAMS)
    return services.hpo_create(user=owner, model=model_def,
                               instance_group=cluster["instance_group"], search=search,
                               trial_job={"max_workers": 2}, seed=seed)


def _report(job: TrainingJob, loss: float) -> None:
    JobMetric.objects.create(job=job, kind=JobMetric.Kind.TEST, values={"loss": loss})


def _play(task: HpoTask, epochs: int, objective=_loss) -> None:
    """One round of the agents: each running trial's job starts, or reports one more
    epoch, or (after ``epochs``) finishes; a job asked to stop ends KILLED."""
    for trial in task.trials.filter(job__isnull=False).select_related("job"):
        job = TrainingJob.objects.get(pk=trial.job_id)
        if job.is_terminal:
            continue
        if job.stop_requested_at:
            job_end(job, states.KILLED, source="test")
        elif job.state == states.PENDING:
            job_start(job, source="test")
        elif job.metrics.count() < epochs:
            _report(job, objective(trial.params, job.metrics.count()))
        else:
            job_end(job, states.FINISHED, source="test")


def _run(task: HpoTask, epochs: int = 2, rounds: int = 400, objective=_loss) -> HpoTask:
    for _ in range(rounds):
        services.advance(task.pk)
        task.refresh_from_db()
        running = task.trials.filter(state=HpoTrial.RUNNING).count()
        assert running <= task.search["max_parallel"]
        if not task.is_active:
            return task
        _play(task, epochs, objective)
    raise AssertionError(f"the search did not end in {rounds} rounds: {task.state}")


def _within(value, spec) -> bool:
    if spec["type"] == "Discrete":
        return value in spec["discreateStrVal"]
    low, high, step = ((spec["minIntVal"], spec["maxIntVal"], spec["step"])
                       if spec["dataType"] == "INT"
                       else (spec["minDbVal"], spec["maxDbVal"], spec["step"]))
    steps = (value - low) / step
    return low <= value <= high and math.isclose(steps, round(steps), abs_tol=1e-6)


@pytest.mark.parametrize("algorithm", ["Random", "Tpe", "Bayesian"])
def test_each_algorithm_finishes_a_small_search_within_the_declared_space(
        owner, model_def, cluster, algorithm):
    task = _run(_create(owner, model_def, cluster, algorithm=algorithm))
    assert task.state == HpoTask.FINISHED, task.error
    trials = list(task.trials.all())
    assert [t.number for t in trials] == list(range(6))
    assert all(t.state == HpoTrial.COMPLETE for t in trials)
    for trial in trials:
        for spec in PARAMS:
            assert _within(trial.params[spec["name"]], spec), (trial.params, spec)
        job = trial.job
        assert job.owner == owner and job.max_workers == 2
        assert job.env_vars["SUBID"] == str(trial.number)
        assert job.hyper_parameters["learning_rate"] == trial.params["learning_rate"]
    best = services.best_trial(task)
    assert best.value == min(t.value for t in trials)
    assert len({tuple(sorted(t.params.items())) for t in trials}) == len(trials)


def test_maximize_takes_the_largest(owner, model_def, cluster):
    task = _run(_create(owner, model_def, cluster, objective="maximize", maxJobNum=4))
    values = [t.value for t in task.trials.all()]
    assert services.best_trial(task).value == max(values)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hyperband_stops_trials_that_fall_behind_and_raises_those_it_keeps(
        owner, model_def, cluster, seed):
    task = _create(owner, model_def, cluster, seed=seed, algorithm="Hyperband", maxJobNum=9,
                   maxParalleJobNum=9, hyperbandEta=3,
                   algoParams=[{"name": "ResourceName", "value": "epochs"},
                               {"name": "ResourceValue", "value": "9"}])
    priorities: dict[int, int] = {}
    for _ in range(200):
        services.advance(task.pk)
        task.refresh_from_db()
        for trial in task.trials.exclude(job=None):
            priorities[trial.number] = max(priorities.get(trial.number, 0),
                                           TrainingJob.objects.get(pk=trial.job_id).priority)
        if not task.is_active:
            break
        _play(task, 9)
    assert task.state == HpoTask.FINISHED, task.error
    pruned = list(task.trials.filter(state=HpoTrial.PRUNED))
    assert pruned, "Hyperband stopped no trial"
    for trial in pruned:
        job = TrainingJob.objects.get(pk=trial.job_id)
        assert job.state == states.KILLED
        assert "Stopped early by Hyperband" in trial.error
        assert job.metrics.count() < 9  # it did not train its whole budget
    complete = task.trials.filter(state=HpoTrial.COMPLETE)
    assert complete and all(t.job.hyper_parameters["epochs"] == 9 for t in complete)
    promoted = [t for t in task.trials.all() if t.rung >= 1]
    assert promoted, "no trial passed a rung"
    # The rule: base priority + 1000 per rung passed; never lowered below the base.
    assert all(priorities[t.number] >= 5000 + 1000 * t.rung for t in promoted), priorities
    assert all(priorities[t.number] >= 5000 for t in task.trials.all())


def test_a_failed_trial_counts_and_the_search_goes_on(owner, model_def, cluster):
    task = _create(owner, model_def, cluster, maxJobNum=3, maxParalleJobNum=1)
    services.advance(task.pk)
    first = task.trials.get()
    job_start(first.job, source="test")
    job_end(first.job, states.FAILED, source="test", error="Traceback: boom")
    task = _run(task)
    assert task.state == HpoTask.FINISHED
    states_ = list(task.trials.values_list("state", flat=True))
    assert states_ == [HpoTrial.FAILED, HpoTrial.COMPLETE, HpoTrial.COMPLETE]
    assert "boom" in task.trials.get(number=0).error


def test_trials_failing_in_a_row_fail_the_search(owner, model_def, cluster):
    task = _create(owner, model_def, cluster, maxJobNum=10, maxParalleJobNum=1)
    for _ in range(3):
        services.advance(task.pk)
        trial = task.trials.filter(state=HpoTrial.RUNNING).get()
        job_start(trial.job, source="test")
        job_end(trial.job, states.FAILED, source="test", error="ImportError: no module x")
    services.advance(task.pk)
    task.refresh_from_db()
    assert task.state == HpoTask.FAILED
    assert "3 trials failed in a row" in task.error and "no module x" in task.error
    assert task.trials.count() == 3


def test_a_metric_the_model_never_reports_fails_the_search_naming_it(
        owner, model_def, cluster):
    task = _create(owner, model_def, cluster, objectiveMetric="val_acc")
    task = _run(task)
    assert task.state == HpoTask.FAILED
    assert "'val_acc'" in task.error and "it reported: loss" in task.error
    assert not task.trials.filter(state=HpoTrial.RUNNING).exists()


def test_stop_asks_every_running_trial_to_stop(owner, model_def, cluster, other):
    task = _create(owner, model_def, cluster)
    services.advance(task.pk)
    running = [t.job for t in task.trials.all()]
    assert len(running) == 2
    job_start(running[0], source="test")
    with pytest.raises(Exception, match="your own"):
        services.hpo_stop(task=task, user=other)
    services.hpo_stop(task=task, user=owner)
    task.refresh_from_db()
    assert task.state == HpoTask.STOPPED
    assert set(task.trials.values_list("state", flat=True)) == {HpoTrial.STOPPED}
    started, waiting = (TrainingJob.objects.get(pk=j.pk) for j in running)
    assert started.stop_requested_at is not None  # the agents stop it and free its slots
    assert waiting.state == states.KILLED  # it held none
    with pytest.raises(ValidationError):
        services.hpo_stop(task=task, user=owner)


def test_the_time_limit_ends_the_search(owner, model_def, cluster):
    task = _create(owner, model_def, cluster, maxJobNum=-1, maxRunTime=0)
    task = _run(task)
    assert task.state in (HpoTask.FAILED, HpoTask.FINISHED)
    assert task.trials.count() == 0 or not task.trials.filter(state=HpoTrial.RUNNING).exists()


def test_delete_removes_an_ended_search_and_its_trials_jobs(owner, model_def, cluster):
    task = _run(_create(owner, model_def, cluster, maxJobNum=2))
    jobs = list(task.trials.values_list("job_id", flat=True))
    services.hpo_delete(task=task, user=owner)
    assert not HpoTask.objects.filter(pk=task.pk).exists()
    assert not TrainingJob.objects.filter(pk__in=jobs).exists()


def test_the_objective_comes_from_val_dict_list_when_the_folder_ships_its_own_emetrics(
        owner, model_def, cluster, tmp_path):
    task = _create(owner, model_def, cluster, maxJobNum=1, maxParalleJobNum=1)
    services.advance(task.pk)
    job = task.trials.get().job
    job_start(job, source="test")
    folder = Path(job.result_dir)
    folder.mkdir(parents=True)
    (folder / "val_dict_list.json").write_text(
        json.dumps([{"steps": 1, "loss": 0.9}, {"steps": 2, "loss": 0.25}]))
    job_end(job, states.FINISHED, source="test")
    services.advance(task.pk)
    task.refresh_from_db()
    assert task.state == HpoTask.FINISHED
    assert task.trials.get().value == 0.25


def test_a_link_planted_as_val_dict_list_is_not_followed(owner, model_def, cluster, tmp_path):
    task = _create(owner, model_def, cluster, maxJobNum=1, maxParalleJobNum=1)
    services.advance(task.pk)
    job = task.trials.get().job
    job_start(job, source="test")
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps([{"loss": 0.001}]))
    folder = Path(job.result_dir)
    folder.mkdir(parents=True)
    (folder / "val_dict_list.json").symlink_to(secret)
    job_end(job, states.FINISHED, source="test")
    services.advance(task.pk)
    task.refresh_from_db()
    assert task.state == HpoTask.FAILED
    assert task.trials.get().value is None and "'loss'" in task.error


def test_a_trial_is_judged_only_once_its_last_metrics_had_time_to_land(
        owner, model_def, cluster, settings):
    settings.EDT_HPO_SETTLE_S = 3600
    task = _create(owner, model_def, cluster, maxJobNum=1, maxParalleJobNum=1)
    services.advance(task.pk)
    job = task.trials.get().job
    job_start(job, source="test")
    job_end(job, states.FINISHED, source="test")
    services.advance(task.pk)
    assert task.trials.get().state == HpoTrial.RUNNING  # no metric yet: not failed yet
    _report(job, 0.5)  # the event arrives after the job ended
    settings.EDT_HPO_SETTLE_S = 0
    services.advance(task.pk)
    task.refresh_from_db()
    assert task.state == HpoTask.FINISHED and task.trials.get().value == 0.5


def test_a_trials_test_metric_wakes_the_scheduler_and_another_jobs_does_not(
        owner, model_def, cluster, job, monkeypatch):
    from events import rows
    from events.ingest import ingest

    woken = []
    monkeypatch.setattr(rows, "wake_scheduler", lambda reason, **data: woken.append(data))
    task = _create(owner, model_def, cluster, maxJobNum=1, maxParalleJobNum=1)
    services.advance(task.pk)
    trial_job = task.trials.get().job
    for n, target in enumerate((job, trial_job)):
        assert ingest({"type": "metrics.test", "job_id": str(target.pk), "source": "driver",
                       "ts": 1000.0 + n, "epoch": 0, "loss": 0.5})
    assert woken == [{"job": trial_job.pk}]  # Hyperband decides at once, not at the timer
