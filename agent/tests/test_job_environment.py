"""agent.job_environment: which interpreter a job's process gets on a host, and what is built for
it first. The builds themselves (environments.build) are stood in here: they are tested on
their own; this checks the choices, the cache per host and owner, and the failures."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from agent import job_environment as je
from agent.accounts import RunAs, user_python
from environments import build
from environments.models import Environment, EnvironmentBuild

pytestmark = pytest.mark.django_db


class FakeBuilds:
    """Records each build and makes an interpreter file where a real build would."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.calls, self.fail = tmp, [], None

    def _built(self, folder: Path, installed: dict) -> build.Built:
        python = folder / "bin" / "python"
        python.parent.mkdir(parents=True, exist_ok=True)
        python.write_text("")
        return build.Built(python=str(python), installed=installed, modules=sorted(installed),
                           size_bytes=10, seconds=0.5)

    def base(self, packages, folder, log, timeout_s):
        self.calls.append(("base", folder.name, tuple(packages)))
        pins = dict(p.split("==") for p in packages if "==" in p)
        return self._built(folder, {"torch": "2.14.1", **pins})

    def layer(self, base_python, base_installed, requirements, folder, log, timeout_s,
              max_bytes, account):
        self.calls.append(("layer", tuple(requirements), account, base_python))
        if self.fail:
            raise build.BuildError(self.fail, "uv: " + self.fail)
        return self._built(folder, {**base_installed, "six": "1.16.0"})


@pytest.fixture
def builds(tmp_path, settings, monkeypatch):
    settings.EDT_ENVIRONMENTS_DIR = tmp_path / "environments"
    fake = FakeBuilds(tmp_path)
    monkeypatch.setattr(build, "build_base", fake.base)
    monkeypatch.setattr(build, "build_layer", fake.layer)
    monkeypatch.setattr(build, "adopt_base", lambda packages, folder: None)
    return fake


@pytest.fixture
def vision(job):
    env = Environment.objects.create(name="vision", packages="torch==2.14.1")
    job.environment = env
    job.save()
    return env


def _python(job, host="host1", user=None) -> tuple[str, str]:
    log = io.BytesIO()
    job.refresh_from_db()
    python = je.job_python(job, je.environment_of(job), host, user, log)
    return python, log.getvalue().decode()


def test_the_products_environment_is_the_agents_own_python_and_nothing_is_built(job, builds):
    assert je.environment_of(job).name == "product"  # the tests' cluster default
    assert _python(job) == (user_python(), "")
    assert builds.calls == []


def test_a_base_is_built_once_per_host_and_reused(job, builds, vision):
    first, said = _python(job)
    assert "building environment vision on host1" in said
    assert _python(job)[0] == first
    assert builds.calls == [("base", "vision", ("torch==2.14.1",))]
    _python(job, host="host2")  # another host builds its own
    assert [c[1] for c in builds.calls] == ["vision", "vision"]
    assert EnvironmentBuild.objects.filter(environment=vision, state="READY").count() == 2


def test_a_models_requirements_make_a_layer_of_its_owner_built_as_that_account(
        job, builds, vision):
    (Path(job.model.location) / "requirements.txt").write_text("six==1.16.0\n# a comment\n")
    alice = RunAs(200_000 + job.owner_id, 200_000 + job.owner_id, "edt-user-1", isolated=True)
    python, _ = _python(job, user=alice)
    layer = Environment.objects.get(base=vision, owner=job.owner)
    job.refresh_from_db()
    assert job.environment == layer  # the job page names the layer that ran it
    kind, requirements, account, base_python = builds.calls[-1]
    assert (kind, requirements, account) == ("layer", ("six==1.16.0",), (alice.uid, alice.gid))
    assert python.startswith(str(je.environments_root() / "users")) and python != base_python
    # The owner's folder of layers is the owner's; a second job of the same set reuses it.
    assert os.stat(Path(python).parents[2]).st_uid == (alice.uid if os.geteuid() == 0
                                                       else os.geteuid())
    # The job's other processes (its workers) read its row, which names the layer now: they
    # get the same layer, never a layer built on the layer.
    assert _python(job, user=alice)[0] == python
    assert [c[0] for c in builds.calls] == ["base", "layer"]
    assert Environment.objects.filter(base__isnull=False).count() == 1


def test_a_layer_that_cannot_be_built_fails_with_the_installers_message(job, builds, vision):
    job.model.requirements = "no-such-package-xyz"
    job.model.save()
    builds.fail = "Because no-such-package-xyz was not found in the package registry"
    with pytest.raises(je.EnvironmentUnavailable, match="no-such-package-xyz was not found"):
        _python(job)
    failed = EnvironmentBuild.objects.get(environment__base=vision)
    assert failed.state == "FAILED" and "not found" in failed.log


def test_a_group_that_does_not_build_models_requirements_says_so_in_the_log(job, builds, vision):
    job.model.requirements = "six"
    job.model.save()
    group = job.instance_group
    group.allow_model_requirements = False
    group.save()
    python, said = _python(job)
    assert "does not build models' requirements" in said
    assert [c[0] for c in builds.calls] == ["base"]
    assert python == EnvironmentBuild.objects.get(environment=vision).python


def test_a_requirements_file_that_is_a_link_is_refused_not_followed(job, builds, vision,
                                                                     tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("six\n")
    (Path(job.model.location) / "requirements.txt").symlink_to(secret)
    with pytest.raises(je.EnvironmentUnavailable, match="cannot be read"):
        _python(job)


def test_a_requirement_line_that_points_the_installer_elsewhere_is_refused(job, builds, vision):
    job.model.requirements = "--extra-index-url http://evil.example/simple"
    job.model.save()
    with pytest.raises(je.EnvironmentUnavailable, match="line 1"):
        _python(job)


def test_the_tensorflow_environment_is_built_at_start_once_a_tensorflow_model_exists(
        model_def, settings):
    from models.models import ModelDefinition

    settings.EDT_DEFAULT_ENVIRONMENT = "default"
    assert {e.name for e in je.environments_in_use()} == {"default"}
    ModelDefinition.objects.filter(pk=model_def.pk).update(framework="TensorFlow")
    assert {e.name for e in je.environments_in_use()} == {"default", "tensorflow"}
    settings.EDT_DEFAULT_ENVIRONMENT = "product"  # an admin's choice holds for TensorFlow too
    assert {e.name for e in je.environments_in_use()} == {"product"}


def test_a_tensorflow_job_runs_in_the_tensorflow_environment_built_for_it(
        owner, model_def, cluster, builds, settings, monkeypatch):
    from environments.spec import TENSORFLOW_PACKAGES
    from jobs.services import job_submit

    warm_started = []
    monkeypatch.setattr(je.warm.pools, "start",
                        lambda python, kind="torch": warm_started.append((python, kind)))

    settings.EDT_DEFAULT_ENVIRONMENT = "default"
    model_def.framework = "TensorFlow"
    model_def.save()
    job = job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"],
                     max_workers=2)
    assert job.environment.name == "tensorflow"  # chosen at submit, shown on its page
    python, said = _python(job)
    assert "building environment tensorflow on host1" in said
    assert [(kind, name, sorted(packages)) for kind, name, packages in builds.calls] == [
        ("base", "tensorflow", sorted(TENSORFLOW_PACKAGES))]
    assert python.endswith("/bases/tensorflow/bin/python"), python
    # Its warm processes: the torch one, and the one with TensorFlow imported, from the start.
    assert warm_started == [(python, "torch"), (python, "tensorflow")]
