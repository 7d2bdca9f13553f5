"""A model's own requirements on a real cluster: the root host agent builds the layer as the
job owner's account with uv, the job trains in it to FINISHED, a second job of the same owner
and set reuses it without building, and a requirement that does not exist fails the job at
once with the installer's own message.

The package comes from a folder of wheels this test writes (the agent's ``UV_FIND_LINKS``,
offline), as a cluster's own index would serve it: the test needs no network."""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from environments.models import Environment, EnvironmentBuild
from jobs import states
from jobs.models import TrainingJob
from jobs.services import job_submit
from models.models import ModelDefinition
from tests.e2e.harness import SCRIPT, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# A small pure-Python package the product's own environment does not hold.
EXTRA = "edt_e2e_colour"
DISTRIBUTION = "edt-e2e-colour"


def _wheel(folder: Path) -> Path:
    """A wheel of ``EXTRA`` (one module) in ``folder``, readable by every job account."""
    folder.mkdir(mode=0o755)
    files = {f"{EXTRA}.py": "RED = '\\033[31m'\n",
             f"{EXTRA}-1.0.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: 1.0\n",
             f"{EXTRA}-1.0.dist-info/WHEEL":
                 "Wheel-Version: 1.0\nGenerator: edt-tests\nRoot-Is-Purelib: true\n"
                 "Tag: py3-none-any\n"}
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    files[f"{EXTRA}-1.0.dist-info/RECORD"] = "\n".join(
        [*record, f"{EXTRA}-1.0.dist-info/RECORD,,"]) + "\n"
    path = folder / f"{EXTRA}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
    path.chmod(0o644)
    return path


def _start(e2e) -> None:
    wheels = e2e.tmp / "wheels"
    _wheel(wheels)
    e2e.start_agent(1, env={"UV_FIND_LINKS": str(wheels), "UV_OFFLINE": "1"})
    e2e.start_scheduler()
    e2e.wait_ready()


def _model(e2e, records, name: str, requirements: str) -> ModelDefinition:
    """The e2e points model, importing ``EXTRA`` first, with a requirements.txt."""
    folder = e2e.tmp / "models" / "e2e" / name
    folder.mkdir(parents=True)
    (folder / "main.py").write_text(f"import {EXTRA}  # noqa: F401\n" + Path(SCRIPT).read_text())
    (folder / "requirements.txt").write_text(requirements)
    return ModelDefinition.objects.create(
        owner=records["owner"], name=name, location=str(folder), main_file="main.py",
        dataset=records["model"].dataset)


def _submit(e2e, records, model, name: str) -> TrainingJob:
    return job_submit(
        user=records["owner"], model=model, instance_group=records["instance_group"],
        max_workers=2, name=name,
        env_vars={"TEST_EPOCHS": "1", "TEST_SAMPLES": "32", "TEST_BATCH": "4",
                  "TEST_ENGINES": "2", "EDT_STEP_LOG": str(e2e.tmp / f"{name}.steps.jsonl")})


def _ended(job: TrainingJob, e2e, timeout: float = 240) -> TrainingJob:
    wait_until(lambda: TrainingJob.objects.get(pk=job.pk).is_terminal, f"job {job.name} to end",
               timeout, on_fail=e2e.dump_logs)
    return TrainingJob.objects.get(pk=job.pk)


def test_a_models_requirements_build_a_layer_its_jobs_train_in_and_share(e2e, e2e_records):
    _start(e2e)
    model = _model(e2e, e2e_records, "colored", f"{DISTRIBUTION}==1.0\n")
    first = _ended(_submit(e2e, e2e_records, model, "first"), e2e)
    assert first.state == states.FINISHED, (first.error, e2e.dump_logs())
    layer = first.environment
    assert layer.base.name == "product" and layer.owner == e2e_records["owner"]
    build = EnvironmentBuild.objects.get(environment=layer)
    assert build.state == "READY" and DISTRIBUTION in build.installed
    assert build.size_bytes < 20 * 2**20  # the base's packages (torch) are not copied into it
    log = (Path(first.result_dir) / "log" / "environment" / "stdout").read_text()
    assert f"building environment {layer.name}" in log and DISTRIBUTION in log
    if os.geteuid() == 0:  # built by the owner's account, in the owner's own folder
        folder = Path(build.python).parent.parent
        assert os.lstat(folder).st_uid == 200_000 + e2e_records["owner"].pk

    second = _ended(_submit(e2e, e2e_records, model, "second"), e2e)
    assert second.state == states.FINISHED, (second.error, e2e.dump_logs())
    assert second.environment == layer
    assert EnvironmentBuild.objects.get(pk=build.pk).started == build.started  # not built again
    assert not (Path(second.result_dir) / "log" / "environment" / "stdout").read_text().count(
        "building environment")
    assert Environment.objects.filter(base__isnull=False).count() == 1


def test_a_requirement_that_does_not_exist_fails_the_job_at_once_with_the_installers_words(
        e2e, e2e_records):
    _start(e2e)
    model = _model(e2e, e2e_records, "missing", "edt-no-such-package-4f1c9a\n")
    job = _ended(_submit(e2e, e2e_records, model, "missing"), e2e)
    assert job.state == states.FAILED and job.attempt == 1, (job.state, job.error)
    assert "edt-no-such-package-4f1c9a" in job.error
    assert "not found" in job.error, job.error
    assert not (Path(job.result_dir) / "log" / "driver").exists()  # no process ever started
