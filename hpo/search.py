"""The search's decisions, made by Optuna: which values the next trial gets (its sampler) and
whether a running trial stops at a Hyperband rung (its pruner).

Optuna's study is rebuilt in memory from the task's trial rows before each decision, rather
than kept in Optuna's own SQL storage: that storage would put a second schema (managed by
SQLAlchemy and Alembic, outside Django's migrations) and a second connection pool into the
product's database, and a study in it could drift from the jobs. The rows are the one record;
a rebuild is a few milliseconds for hundreds of trials. The sampler is seeded from the task's
seed and the number of trials so far, so a rebuilt study neither repeats itself nor depends on
which process asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hpo.space import Search

# Trials sampled at random before TPE or the Gaussian process models the results (Optuna's
# default is 10; a small search would otherwise never get past them).
STARTUP_MAX = 10
# A trial's own key among Optuna's system attributes: how many of its reports the pruner saw.
CHECKED = "edt_checked_steps"


def preload() -> None:
    """Import Optuna and its samplers (the Gaussian process's torch and scipy parts: seconds,
    once) before a search's step takes its database transaction, not inside it."""
    import optuna.samplers  # noqa: F401
    from optuna._gp import gp  # noqa: F401


def _startup(search: Search) -> int:
    budget = search.trial_budget()
    return STARTUP_MAX if budget is None else max(2, min(STARTUP_MAX, budget // 3))


def _sampler(search: Search, seed: int):
    import optuna

    if search.algorithm == "Tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=_startup(search))
    if search.algorithm == "Bayesian":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=_startup(search),
                                         warn_independent_sampling=False)
    # Random, and Hyperband (random configurations, stopped early at its rungs).
    return optuna.samplers.RandomSampler(seed=seed)


def _pruner(search: Search):
    import optuna

    if search.algorithm == "Hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=search.resource_value,
                                              reduction_factor=search.eta)
    return optuna.pruners.NopPruner()


@dataclass
class TrialRecord:
    """What the study needs of one stored trial."""

    number: int
    state: str  # HpoTrial's
    params: dict[str, Any]
    value: float | None
    reports: list[float]
    system_attrs: dict[str, Any]


def _frozen(record: TrialRecord, distributions: dict):
    from optuna.trial import TrialState, create_trial

    state = {"COMPLETE": TrialState.COMPLETE, "PRUNED": TrialState.PRUNED,
             "RUNNING": TrialState.RUNNING}.get(record.state, TrialState.FAIL)
    if state == TrialState.COMPLETE and record.value is None:
        state = TrialState.FAIL  # a completed trial without its objective taught nothing
    return create_trial(
        state=state,
        value=record.value if state == TrialState.COMPLETE else None,
        params={k: v for k, v in record.params.items() if k in distributions},
        distributions={k: d for k, d in distributions.items() if k in record.params},
        intermediate_values={i + 1: v for i, v in enumerate(record.reports)
                             if v is not None and math.isfinite(v)},
        system_attrs=dict(record.system_attrs),
    )


class Study:
    """A task's Optuna study, rebuilt from its trials."""

    def __init__(self, name: str, search: Search, seed: int,
                 records: list[TrialRecord]) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.search = search
        self.distributions = {p.name: p.distribution() for p in search.params}
        self.study = optuna.create_study(
            study_name=name, direction=search.direction,
            sampler=_sampler(search, (seed * 7919 + len(records)) % 2**32),
            pruner=_pruner(search),
        )
        self.ids: dict[int, int] = {}
        for record in sorted(records, key=lambda r: r.number):
            self.study.add_trial(_frozen(record, self.distributions))
            self.ids[record.number] = self.study.get_trials(deepcopy=False)[-1]._trial_id

    def ask(self) -> tuple[int, dict[str, Any]]:
        """The next trial's number and values, each within its distribution."""
        trial = self.study.ask(self.distributions)
        return trial.number, dict(trial.params)

    def check(self, number: int, reports: list[float], checked: int,
              last: int) -> tuple[int | None, dict[str, Any]]:
        """Report the running trial ``number``'s values after the first ``checked`` (those the
        study was built with), one step at a time up to step ``last``, asking the pruner after
        each, as a trial training in Optuna's own loop would: a rung is judged on the value
        at its own step, however late the search looks. Returns the step it is stopped at
        (None: it goes on) and the bookkeeping to keep (the rungs it reached, the steps
        checked)."""
        import optuna

        trial_id = self.ids[number]
        trial = optuna.trial.Trial(self.study, trial_id)
        stopped = None
        for step in range(checked + 1, min(len(reports), last) + 1):
            trial.report(reports[step - 1], step)
            if trial.should_prune():
                stopped = step
                break
        attrs = dict(self.study._storage.get_trial(trial_id).system_attrs)
        attrs[CHECKED] = stopped or max(checked, min(len(reports), last))
        return stopped, attrs

    def mark_pruned(self, number: int) -> None:
        """Tell the study a running trial was stopped early (the next ask sees it)."""
        from optuna.trial import TrialState

        self.study.tell(number, state=TrialState.PRUNED)


def rungs_passed(system_attrs: dict[str, Any]) -> int:
    """How many Hyperband rungs a trial reached (the pruner writes ``completed_rung_<k>``
    when a trial reaches rung k, before it decides whether the trial goes on)."""
    return sum(1 for key in system_attrs if key.startswith("completed_rung_"))
