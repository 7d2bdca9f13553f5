"""A model folder that ships its own ``emetrics.py`` gets that copy in the training process, and
a folder without one gets the product's: started cold by the agent, and
forked from a warm process that has already imported the runtime."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from .helpers import REPO
from .test_warm import Warm

MODELS = Path(REPO) / "tests" / "wmla" / "models"
ARGS = ["--epochs", "2", "--batch-size", "16"]
MARK = "model-folder-emetrics"
# A folder's own emetrics.py, as WMLA samples ship one: WMLA's EMetrics interface, writing its
# own file, so the test can tell which copy recorded the metrics and which copy was imported.
OWN_EMETRICS = f'''
import json, os
MARK = "{MARK}"
print("EMETRICS from", MARK, flush=True)


class EMetrics:
    TEST_GROUP = "test"

    @staticmethod
    def open(subId=None):
        return EMetrics()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def record(self, group, iteration, values):
        path = os.path.join(os.environ["RESULT_DIR"], "own-emetrics.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps({{"mark": MARK, "group": group, "iteration": iteration}}) + "\\n")
'''


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    """Two copies of the WMLA 2.3 folder, whose edtcallback.py does ``from emetrics import
    EMetrics``: one shipping its own emetrics.py, one without. The main file is renamed
    main.py, the name the warm-process helper starts."""
    out = {}
    for kind in ("own", "product"):
        folder = tmp_path / kind
        shutil.copytree(MODELS / "wmla23_pytorch_mnist_edt", folder)
        (folder / "elastic-main.py").rename(folder / "main.py")
        out[kind] = folder
    (out["own"] / "emetrics.py").write_text(OWN_EMETRICS)
    return out


def _job_env(folder: Path, result: Path) -> dict[str, str]:
    """What the host agent gives a job's process (``agent.environment.build_env``): the product
    and ``wmla_compat`` (the product's ``emetrics``) on PYTHONPATH, then the model folder."""
    from agent.environment import build_env

    job = SimpleNamespace(pk=14, result_dir=str(result), dataset=None, env_vars={},
                          max_workers=1, hyper_parameters={},
                          model=SimpleNamespace(location=str(folder), framework="PyTorch"),
                          instance_group=SimpleNamespace(keep_epoch_models=5, keep_best_by=""))
    return build_env(job, "standalone")  # type: ignore[arg-type]


def _check(kind: str, out: str, result: Path) -> None:
    assert "job.state state=FINISHED" in out, out[-4000:]
    reports = out.count("] Train,\tTimestamp:")  # one log_train_metrics call each
    assert reports == 2, out[-4000:]
    own = result / "own-emetrics.jsonl"
    products = result / "evaluation-metrics.txt"
    # The folder's EDTLoggerCallback records to TEST_GROUP ("test"); the product's own default
    # logger, not used here, would write "Train" and "Test".
    recorded = [r for r in map(json.loads, products.read_text().splitlines())
                if r["grouplabel"] == "test"] if products.exists() else []
    if kind == "own":
        assert f"EMETRICS from {MARK}" in out
        lines = [json.loads(line) for line in own.read_text().splitlines()]
        assert len(lines) == reports and all(r["mark"] == MARK for r in lines)
        assert recorded == []
    else:
        assert MARK not in out and not own.exists()
        assert len(recorded) == reports and all("loss" in r["values"] for r in recorded)


@pytest.mark.slow
def test_a_folders_own_emetrics_wins_in_a_process_the_agent_starts(
        folders: dict[str, Path], tmp_path: Path, settings: object) -> None:
    settings.EDT_FABRIC_HOME = str(tmp_path / "fabric")  # type: ignore[attr-defined]
    for kind, folder in folders.items():
        result = tmp_path / f"result-{kind}"
        env = _job_env(folder, result)
        proc = subprocess.run([sys.executable, str(folder / "main.py"), *ARGS], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        _check(kind, proc.stdout + proc.stderr, result)


@pytest.mark.slow
def test_a_folders_own_emetrics_wins_in_a_process_forked_warm(
        folders: dict[str, Path], tmp_path: Path, settings: object) -> None:
    """The warm process has imported the runtime (``runtime.wmla`` included) before the job's
    path is known: nothing it imported may stand in for the folder's emetrics."""
    settings.EDT_FABRIC_HOME = str(tmp_path / "fabric")  # type: ignore[attr-defined]
    warm = Warm()
    try:
        for kind, folder in folders.items():
            result = tmp_path / f"result-{kind}"
            started = warm.spawn(folder, *ARGS, env=_job_env(folder, result))
            os.close(started["events"])  # no EDT_EVENTS_FD: the events go to the log
            assert warm.exit_of(started["pid"]) == 0, started["log"].read_text()[-4000:]
            _check(kind, started["log"].read_text(), result)
    finally:
        warm.close()
