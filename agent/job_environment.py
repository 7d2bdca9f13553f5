"""The interpreter a job's process runs with on this host: its environment's, built here the
first time a job needs it.

An admin's environment (a base) is built by the agent's own account into a folder jobs read
and never write. A model's own requirements (its folder's ``requirements.txt`` and the
model's list) make a layer on that base, built by the job owner's account, never by root: a
requirement is code (an sdist's setup.py runs while it installs). A layer is cached by its key
(the base and the requirement set) in the owner's own folder, so every job of that owner that
asks for the same set on this host shares one build, and no other user's job imports it.

Each build's output goes to the job's log (``log/environment/stdout``); a build that fails
fails the job at once with the installer's own message (a ``LaunchError``).
"""

from __future__ import annotations

import fcntl
import functools
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from agent import warm
from agent.accounts import RunAs, user_python
from environments import build
from environments.models import Environment, EnvironmentBuild
from environments.services import cluster_default, environment_for
from environments.spec import RequirementError, layer_key, requirement_lines
from jobs import jobfiles
from jobs.models import TrainingJob
from models.models import ModelDefinition

REQUIREMENTS_FILE = "requirements.txt"
REQUIREMENTS_MAX_BYTES = 64 * 1024

# One build of an environment at a time on this host: a job's driver and its workers (or two
# jobs) that need the same one wait for the first build instead of starting a second.
_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


class EnvironmentUnavailable(Exception):
    """The job's environment cannot be had on this host; the message says why, for its owner."""


def _lock(environment: Environment) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(environment.pk, threading.Lock())


def environment_of(job: TrainingJob) -> Environment:
    """The base environment chosen for ``job`` at submit (or now, for a job from before).
    Once a layer of the model's requirements was built for it, the job's row names the layer
    (for its page): its other processes start from the layer's base, and find the layer by
    its key, never build a layer on the layer."""
    environment = job.environment or environment_for(job.model, job.instance_group)
    return environment.base if environment.is_layer else environment


def job_python(job: TrainingJob, environment: Environment, host: str, user: RunAs | None,
               log: BinaryIO) -> str:
    """The interpreter for ``job``'s processes on ``host`` in ``environment``; builds what is
    missing first, its output to ``log``."""
    requirements = model_requirements(job)
    if environment.is_product:
        python, installed = user_python(), None
    else:
        base = _base(environment, host, log)
        python, installed = base.python, base.installed
    if not requirements:
        return python
    if not (settings.EDT_MODEL_REQUIREMENTS and job.instance_group.allow_model_requirements):
        log.write(f"--- the model's requirements are not installed: instance group "
                  f"{job.instance_group.name} does not build models' requirements\n".encode())
        return python
    layer = _layer(job, environment, requirements)
    built = _ready(layer, host, log,
                   lambda: _build_layer(layer, python, installed, user, log))
    TrainingJob.objects.filter(pk=job.pk).update(environment=layer)
    return built.python


def model_requirements(job: TrainingJob) -> list[str]:
    """The model's requirement set: its folder's requirements.txt and its own list. A line
    that is not a plain requirement fails the job (it was refused at registration too)."""
    text = job.model.requirements or ""
    try:
        # The owner can write the model's folder: read without following a link, size-capped.
        with jobfiles.open_file(job.model.location, REQUIREMENTS_FILE) as f:
            text += "\n" + f.read(REQUIREMENTS_MAX_BYTES + 1).decode("utf-8", "replace")
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise EnvironmentUnavailable(f"{REQUIREMENTS_FILE} cannot be read: {exc}") from None
    try:
        return requirement_lines(text)
    except RequirementError as exc:
        raise EnvironmentUnavailable(f"The model's requirements are refused: {exc}") from None


def _layer(job: TrainingJob, base: Environment, requirements: list[str]) -> Environment:
    """The owner's layer of ``requirements`` on ``base``: found by its key, else recorded."""
    key = layer_key(base.name, base.packages, requirements)
    fields = {"name": f"{base.name}+{job.owner.username}-{key[:10]}"[:64], "base": base,
              "packages": "\n".join(requirements)}
    try:
        with transaction.atomic():
            return Environment.objects.get_or_create(owner=job.owner, key=key,
                                                     defaults=fields)[0]
    except IntegrityError:  # another process recorded it first
        return Environment.objects.get(owner=job.owner, key=key)


def _ready(environment: Environment, host: str, log: BinaryIO,
           make: Callable[[], build.Built]) -> EnvironmentBuild:
    """``environment``'s ready build on ``host``, built now when there is none."""
    with _lock(environment), _machine_lock(environment):
        found = EnvironmentBuild.objects.filter(environment=environment, host=host,
                                                state=EnvironmentBuild.State.READY).first()
        if found is not None and os.path.exists(found.python):
            return found
        EnvironmentBuild.objects.update_or_create(
            environment=environment, host=host,
            defaults={"state": EnvironmentBuild.State.BUILDING, "started": timezone.now(),
                      "ended": None, "log": ""})
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} building environment "
                  f"{environment.name} on {host} (its first use here)\n".encode())
        log.flush()
        try:
            built = make()
        except build.BuildError as exc:
            _record(environment, host, EnvironmentBuild.State.FAILED, log=exc.log_tail)
            raise EnvironmentUnavailable(
                f"Environment {environment.name} cannot be built on {host}: {exc}") from None
        log.write(f"--- environment {environment.name} ready in {built.seconds:.1f} s\n"
                  .encode())
        return _record(environment, host, EnvironmentBuild.State.READY, built=built)


def _record(environment: Environment, host: str, state: str, *, built: build.Built | None = None,
            log: str = "") -> EnvironmentBuild:
    fields: dict[str, object] = {"state": state, "ended": timezone.now(), "log": log[-20000:]}
    if built is not None:
        fields.update(python=built.python, installed=built.installed, modules=built.modules,
                      size_bytes=built.size_bytes, seconds=built.seconds)
    return EnvironmentBuild.objects.update_or_create(environment=environment, host=host,
                                                     defaults=fields)[0]


def environments_root() -> Path:
    """Where this machine's environments live: ``bases/<name>`` and ``users/<owner>/<key>``.
    Agents of one machine share them (one builds, the others wait on its lock)."""
    return Path(settings.EDT_ENVIRONMENTS_DIR)


@contextmanager
def _machine_lock(environment: Environment) -> Iterator[None]:
    """One build of an environment at a time on this machine, across agent processes."""
    locks = environments_root() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{environment.pk}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build_base(environment: Environment, host: str, log: BinaryIO) -> build.Built:
    folder = environments_root() / "bases" / environment.name
    packages = environment.requirements()
    adopted = build.adopt_base(packages, folder)
    if adopted is not None:
        log.write(f"--- {folder} already holds environment {environment.name}: used as it "
                  "is\n".encode())
        return adopted
    folder.parent.mkdir(parents=True, exist_ok=True)
    return build.build_base(packages, folder, log, settings.EDT_ENVIRONMENT_BUILD_TIMEOUT_S)


@functools.cache
def _installed_in(python: str) -> dict[str, str]:
    """What the product's own Python (a job's interpreter in the ``product`` environment)
    holds, asked once per process: a layer on it installs none of these again."""
    return build.probe(python)[0]


def _build_layer(layer: Environment, base_python: str, base_installed: dict[str, str] | None,
                 user: RunAs | None, log: BinaryIO) -> build.Built:
    """``layer`` on the interpreter ``base_python`` (an admin's environment's, or the
    product's own when ``base_installed`` is None), by the job owner's account."""
    account = (user.uid, user.gid) if user is not None else None
    owner_key = str(user.uid) if user is not None else "agent"
    folder = build.layer_folder(environments_root(), owner_key, layer.key)
    _owners_folder(folder.parent, user)
    if base_installed is None:
        base_installed = _installed_in(base_python)
    return build.build_layer(base_python, base_installed, layer.requirements(), folder, log,
                             settings.EDT_LAYER_BUILD_TIMEOUT_S, settings.EDT_LAYER_MAX_BYTES,
                             account)


def _owners_folder(folder: Path, user: RunAs | None) -> None:
    """The owner's own folder of layers, made by this (root) agent and handed to the owner:
    every folder above it is the agent's, so nothing on the way is the owner's to swap."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise EnvironmentUnavailable(f"{folder} is not a folder")
    if user is not None and (st.st_uid, st.st_gid) != (user.uid, user.gid):
        os.chown(folder, user.uid, user.gid, follow_symlinks=False)


def prepare(environment: Environment, host: str, log: BinaryIO) -> EnvironmentBuild | None:
    """Have ``environment`` (a base) ready on ``host``: its ready build, built now if needed;
    None for the product's own Python, which needs none."""
    if environment.is_product:
        return None
    return _base(environment, host, log)


def _base(environment: Environment, host: str, log: BinaryIO) -> EnvironmentBuild:
    """``environment``'s ready build on ``host``, with a warm process of its interpreter (a
    base is the agent's own: a root process may run it) so its jobs' processes start warm."""
    built = _ready(environment, host, log, lambda: _build_base(environment, host, log))
    warm.pools.start(built.python)
    if "tensorflow" in (built.installed or {}):
        # One with TensorFlow imported too, so that even the first TensorFlow job's processes
        # here fork from it rather than import TensorFlow themselves (``WarmPools.start_for``).
        warm.pools.start(built.python, "tensorflow")
    return built


def environments_in_use() -> list[Environment]:
    """The base environments jobs will ask for: the cluster's default (and its TensorFlow
    one, once a TensorFlow model is registered) and each instance group's and model's own."""
    names = {settings.EDT_DEFAULT_ENVIRONMENT}
    if ModelDefinition.objects.filter(framework="TensorFlow").exists():
        names.add(cluster_default("TensorFlow"))
    used = Environment.objects.filter(
        Q(name__in=names) | Q(instance_groups__isnull=False)
        | Q(model_definitions__isnull=False), base__isnull=True)
    return list(used.distinct())


def prepare_all(host: str, log: BinaryIO) -> None:
    """At the agent's start, in the background: build what this host's jobs will need, so a
    job's first launch here does not wait for it. A build that fails is recorded (its log on
    the Environments page) and tried again at the next job that needs it."""
    for environment in environments_in_use():
        try:
            prepare(environment, host, log)
        except EnvironmentUnavailable as exc:
            log.write(f"--- {exc}\n".encode())
