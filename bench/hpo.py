"""Benchmark: one Hyperband search run twice through the real components, with its trials on
fixed-size jobs (1 slot each, WMLA's way) and on elastic jobs (up to every slot, priority
raised per rung passed), on one host agent's 4 CPU slots, side by side in one run.

The real scheduler (whose leader runs the search's loop, ``hpo.services``), event consumer
and host agent (subprocesses, product defaults) on a SQLite file and the local Redis. Both
searches have the same seed, so the same trial numbers get the same values and the same
Hyperband brackets. Each trial is a ``FabricModel`` job whose model stands in for an
accelerator: every sample costs ``--sample-ms`` of wall time and no CPU (a sleep in forward),
so a step's time falls with the workers as on GPUs, even on a 2-core machine; the global batch
is the same at any size. Its objective is a learning curve in the learning rate and the
epoch, reported through WMLA's ``emetrics`` (deterministic: both searches see the same
values, and the best configuration leads at every epoch, so Hyperband never stops it).

Figures, from the database: **time to the best trial** (the search's start to the end of its
best trial), the search's **wall time**, and **slot-seconds** held by its trials.

Run: ``.venv/bin/python -m bench.hpo [--trials 9] [--sample-ms 12]`` (needs Redis on
``REDIS_URL``; about 5 minutes on 2 cores). Prints a table; the last line is one JSON object:
``hpo_fixed_s``, ``hpo_elastic_s`` (time to the best trial), ``hpo_elastic_vs_fixed`` (their
ratio; target <= 0.8), ``same_best``, and the wall times and slot-seconds of each side.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

from bench import harness

SLOTS = 4
RESOURCE = 9  # epochs: Hyperband's rungs at 1, 3 and 9 with eta 3
SEED = 20261129

MAIN = textwrap.dedent('''
    import json
    import math
    import os
    import sys
    import time

    sys.path.insert(0, os.path.join(os.environ["FABRIC_HOME"], "libs", "fabric.zip"))
    from emetrics import EMetrics  # noqa: E402
    from fabric_model import FabricModel  # noqa: E402

    import torch  # noqa: E402
    from torch.utils.data import TensorDataset  # noqa: E402

    with open("config.json") as f:
        hyper = json.load(f)
    RATE = float(hyper["learning_rate"])
    SAMPLE_S = float(os.environ["BENCH_SAMPLE_MS"]) / 1000


    class Accelerator(torch.nn.Module):
        """A linear model whose every sample costs SAMPLE_S of wall time and no CPU."""

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            time.sleep(SAMPLE_S * x.shape[0])
            return self.fc(x)


    def get_dataset():
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(272, 4, generator=g), torch.randint(0, 2, (272,), generator=g)
        return TensorDataset(x[:256], y[:256]), TensorDataset(x[256:], y[256:])


    class Curve:
        """The objective: best at learning rate 0.01, falling with each epoch."""

        def __init__(self):
            self.metrics = EMetrics.open(os.environ.get("SUBID"))

        def log_test_metrics(self, metrics, iteration, epoch):
            value = (math.log10(RATE) + 2) ** 2 + 1.0 / (epoch + 1)
            self.metrics.record(EMetrics.TEST_GROUP, epoch + 1, {"objective": value})

        def on_train_end(self):
            self.metrics.close()


    model = Accelerator()
    FabricModel(model, get_dataset, torch.nn.functional.cross_entropy,
                torch.optim.SGD(model.parameters(), lr=RATE),
                driver_logger_callback=Curve()).train(int(hyper["epochs"]), 8, 4,
                                                      num_dataloader_threads=0)
''').lstrip()


def search_json(trials: int) -> tuple[dict, list]:
    algo = {"algorithm": "Hyperband", "maxJobNum": trials, "maxParalleJobNum": SLOTS,
            "objectiveMetric": "objective", "objective": "minimize", "hyperbandEta": 3,
            "algoParams": [{"name": "ResourceName", "value": "epochs"},
                           {"name": "ResourceValue", "value": RESOURCE}]}
    params = [{"name": "learning_rate", "type": "Range", "dataType": "DOUBLE",
               "minDbVal": 0.0001, "maxDbVal": 1.0, "log": True}]
    return algo, params


class Cluster(harness.ProductCluster):
    """The product's processes and the records the searches need."""

    def __init__(self, tmp: Path, sample_ms: float) -> None:
        super().__init__(tmp, "hpo", MAIN)
        self.sample_ms = sample_ms

    def start(self) -> None:  # one host; the searches' figures were measured on these timings
        self.processes.start_agent(1, slots=SLOTS)
        self.processes.start_events()
        self.processes.start_scheduler()
        self.processes.wait_ready(180)


def run_search(cluster: Cluster, name: str, max_workers: int, trials: int,
               log) -> dict[str, Any]:
    from hpo import services
    from hpo.models import HpoTask
    from hpo.space import parse_search

    algo, params = search_json(trials)
    task = services.hpo_create(
        user=cluster.owner, model=cluster.model, instance_group=cluster.group,
        search=parse_search(algo, params), seed=SEED,
        trial_job={"max_workers": max_workers,
                   "env_vars": {**harness.mark_env(), "BENCH_SAMPLE_MS": str(cluster.sample_ms)}})
    log(f"{name}: search {task.name} started, trials on at most {max_workers} slot(s)")

    def ended() -> bool:
        task.refresh_from_db()
        return not task.is_active

    harness.wait_for(ended, f"the {name} search to end", timeout=1800, interval=1.0)
    return figures(HpoTask.objects.get(pk=task.pk), name, log)


def _slot_seconds(job) -> float:
    total = 0.0
    for alloc in job.allocations.all():
        end = alloc.released_at or job.finished
        if end is not None:
            total += (end - alloc.granted_at).total_seconds()
    return total


def figures(task, name: str, log) -> dict[str, Any]:
    from hpo import services

    best = services.best_trial(task)
    if best is None:
        raise SystemExit(f"the {name} search found no best trial: {task.state} {task.error}")
    trials = list(task.trials.select_related("job"))
    states = {t.state for t in trials}
    out = {
        "best_s": (best.ended - task.started).total_seconds(),
        "wall_s": (task.finished - task.started).total_seconds(),
        "slot_s": sum(_slot_seconds(t.job) for t in trials if t.job is not None),
        "best_rate": best.params["learning_rate"], "best_trial": best.number,
        "best_value": best.value, "trials": len(trials),
        "pruned": sum(t.state == "PRUNED" for t in trials), "states": sorted(states),
    }
    log(f"{name}: {task.state}; best trial {best.number} (learning rate "
        f"{out['best_rate']:.4g}) after {out['best_s']:.1f} s; {out['pruned']} stopped early")
    return out


def table(fixed: dict, elastic: dict) -> str:
    rows = [["", "fixed (1 slot a trial)", f"elastic (up to {SLOTS})", "elastic / fixed"]]
    for key, label in (("best_s", "time to the best trial (s)"), ("wall_s", "search (s)"),
                       ("slot_s", "slot-seconds held")):
        ratio = elastic[key] / fixed[key] if fixed[key] else float("nan")
        rows.append([label, f"{fixed[key]:.1f}", f"{elastic[key]:.1f}", f"{ratio:.2f}"])
    rows.append(["best trial (learning rate)", f"{fixed['best_trial']} ({fixed['best_rate']:.4g})",
                 f"{elastic['best_trial']} ({elastic['best_rate']:.4g})", ""])
    rows.append(["trials (stopped early)", f"{fixed['trials']} ({fixed['pruned']})",
                 f"{elastic['trials']} ({elastic['pruned']})", ""])
    return harness.table(rows, title="Hyperband search, fixed-size vs elastic trials")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--sample-ms", type=float, default=12.0)
    args = parser.parse_args()
    harness.install()

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    tmp = Path(tempfile.mkdtemp(prefix="edt-bench-hpo-"))
    harness.django_on_sqlite(tmp)
    cluster = Cluster(tmp, args.sample_ms)
    try:
        cluster.start()
        fixed = run_search(cluster, "fixed", 1, args.trials, log)
        elastic = run_search(cluster, "elastic", SLOTS, args.trials, log)
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(fixed, elastic))
    harness.print_result({
        "hpo_fixed_s": round(fixed["best_s"], 2), "hpo_elastic_s": round(elastic["best_s"], 2),
        "hpo_elastic_vs_fixed": round(elastic["best_s"] / fixed["best_s"], 3),
        "same_best": fixed["best_trial"] == elastic["best_trial"],
        "fixed_wall_s": round(fixed["wall_s"], 2), "elastic_wall_s": round(elastic["wall_s"], 2),
        "fixed_slot_s": round(fixed["slot_s"], 1), "elastic_slot_s": round(elastic["slot_s"], 1),
        "trials": args.trials, "slots": SLOTS, "sample_ms": args.sample_ms,
    })


if __name__ == "__main__":
    main()
