"""The environment a model's jobs run in, and the check before submit: which of the modules
its main file imports that environment does not provide (``environments.imports``).

The warnings are advice: a model is saved, and its jobs submitted, whatever they say. The
console shows them on the model's page and the Train form, ``/api/v1/models`` and WMLA's
``/execs`` return them, dlicmd prints them.

The model and the instance group are taken as they come (this layer sits below ``models``
and ``resources``): a model has ``location``, ``main_file``, ``environment`` and
``requirements``; an instance group has ``name``, ``default_environment`` and
``allow_model_requirements``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Container
from functools import cache
from importlib import metadata
from pathlib import Path

from django.conf import settings

from environments import imports
from environments.models import Environment, EnvironmentBuild
from environments.spec import BUILTIN, DEFAULT_NAME, TENSORFLOW_NAME, distribution_name

# Past this many, the rest of the missing imports are counted, not named.
MAX_LISTED = 20


def environment_for(model, instance_group=None) -> Environment:
    """The model's environment, else the instance group's default, else the cluster's
    (``EDT_DEFAULT_ENVIRONMENT``; for a TensorFlow model, ``tensorflow`` where that is
    ``default``). Raises ``Environment.DoesNotExist`` when the cluster's default has been
    removed."""
    if model is not None and model.environment_id:
        return model.environment
    if instance_group is not None and instance_group.default_environment_id:
        return instance_group.default_environment
    return named(cluster_default(getattr(model, "framework", None)))


def cluster_default(framework: str | None) -> str:
    """The name of the environment a model of ``framework`` runs in when neither it nor its
    instance group names one. The built-in ``default`` has no TensorFlow, so a TensorFlow
    model gets the built-in ``tensorflow`` instead; a default an admin chose holds for all."""
    name = settings.EDT_DEFAULT_ENVIRONMENT
    if framework == "TensorFlow" and name == DEFAULT_NAME:
        return TENSORFLOW_NAME
    return name


def framework_version(framework: str) -> str:
    """The version of ``framework`` ("PyTorch" or "TensorFlow") that a model of it runs on
    where neither it nor its instance group names an environment: the pin of the cluster's
    default environment for it, or what the product's own Python holds for ``product``; ""
    when that environment pins none or it is not installed (not an error)."""
    distribution = "tensorflow" if framework == "TensorFlow" else "torch"
    try:
        environment = named(cluster_default(framework))
    except Environment.DoesNotExist:
        return ""
    if environment.is_product:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return ""
    for line in environment.requirements():
        if distribution_name(line) == distribution:
            return line.partition("==")[2].split(";")[0].strip()
    return ""


def named(name: str) -> Environment:
    """The environment called ``name``; a built-in one (``default``, ``product``) is made
    again if it is missing. Raises ``Environment.DoesNotExist`` for any other missing name."""
    if name in BUILTIN:
        return Environment.objects.get_or_create(name=name, defaults=BUILTIN[name])[0]
    return Environment.objects.get(name=name)


class ImportableHere(Container[str]):
    """The product's own interpreter: what this process can import. The console runs on the
    product's Python, as the agents do (``agent.accounts.user_python``; an agent with its own
    ``EDT_USER_PYTHON`` may hold more or less). ``find_spec`` of a top-level name runs no code
    of the module."""

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or not name.isidentifier():
            return False
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False


class _Either(Container[str]):
    def __init__(self, *parts: Container[str]) -> None:
        self.parts = parts

    def __contains__(self, name: object) -> bool:
        return any(name in part for part in self.parts)


def provided_modules(environment: Environment) -> Container[str] | None:
    """The top-level modules ``environment`` lets a job import: the union of its ready builds'
    (hosts may differ; a job may run on any), or for the product's own Python, what this
    interpreter finds. None when it is built on no host yet: nothing to check against."""
    if environment.is_product:
        return ImportableHere()
    lists = list(EnvironmentBuild.objects.filter(
        environment=environment, state=EnvironmentBuild.State.READY,
    ).values_list("modules", flat=True))
    if not lists:
        return None
    return {name for modules in lists if isinstance(modules, list)
            for name in modules if isinstance(name, str)}


@cache
def _product_path_modules() -> frozenset[str]:
    """The runtime's modules (pyedt, fabric_model, pth_parameter_mgr...): the agent puts the
    product's folder and wmla_compat on every job's path, whatever its environment
    (``agent.environment.build_env``)."""
    base = Path(settings.BASE_DIR)
    return frozenset(imports.local_modules(base) | imports.local_modules(base / "wmla_compat"))


def _requirement_names(text: str) -> list[str]:
    """The requirement lines of ``text``, leniently: a line the rules refuse (refused at
    registration, and by the agent) is left out rather than failing the check."""
    lines = (raw.split("#", 1)[0].strip() for raw in text.splitlines())
    return [line for line in lines if line and not line.startswith("-")
            and "/" not in line and ":" not in line.split(";", 1)[0]]


def model_requirements(model) -> list[str]:
    """The model's own requirement lines and its folder's requirements.txt's."""
    try:
        text = imports.read_requirements_txt(Path(model.location))
    except (OSError, ValueError):
        text = ""
    return _requirement_names(f"{model.requirements or ''}\n{text}")


def _requirements_advice(environment: Environment, instance_group) -> str | None:
    """How to get a missing module in: None when the model's requirements are installed in
    ``environment`` for ``instance_group``'s jobs, else why not (``agent.job_environment``)."""
    if environment.is_product:
        return "pick another environment (the product's own Python installs no requirements)"
    if not settings.EDT_MODEL_REQUIREMENTS:
        return "pick another environment (this cluster installs no model requirements)"
    if instance_group is not None and not instance_group.allow_model_requirements:
        return (f"pick another environment (instance group {instance_group.name} does not "
                "install models' requirements)")
    return None


def _read_main(model) -> tuple[bytes | None, list[str]]:
    """The main file's source, or None and what to say instead."""
    name = model.main_file or "main.py"
    try:
        return imports.read_model_file(Path(model.location), name, imports.MAIN_MAX_BYTES), []
    except imports.FileTooLarge:
        return None, [f"{name} is larger than {imports.MAIN_MAX_BYTES // 1024 // 1024} MiB: "
                      "its imports were not checked"]
    except OSError:
        # Missing, a link or not readable by the console: registration and the agent's launch
        # say so in their own words.
        return None, []


def _unparsable(name: str, exc: Exception) -> str:
    if isinstance(exc, SyntaxError):
        return (f"{name} line {exc.lineno}: {type(exc).__name__}: {exc.msg} "
                "(the job would fail at once)")
    return f"{name} cannot be read as Python ({exc}): the job would fail at once"


def import_warnings(model, instance_group=None) -> list[str]:
    """What stands in the way of ``model``'s main file importing its modules in the
    environment its jobs run in (in ``instance_group``: its default environment, and whether
    it installs models' requirements); [] when nothing does, or nothing can be said."""
    source, said = _read_main(model)
    if source is None:
        return said
    name = model.main_file or "main.py"
    try:
        environment = environment_for(model, instance_group)
    except Environment.DoesNotExist:
        return [f"the cluster's default environment {settings.EDT_DEFAULT_ENVIRONMENT} does "
                "not exist: the model's imports cannot be checked"]
    provided = provided_modules(environment)
    advice = _requirements_advice(environment, instance_group)
    try:
        if provided is None:
            imports.imported_modules(source)  # a syntax error is worth saying all the same
            return [f"environment {environment.name} is not built on any host yet: its "
                    "imports cannot be checked"]
        missing = imports.missing_imports(
            source, Path(model.location), _Either(provided, _product_path_modules()),
            [] if advice else model_requirements(model), main_file=name)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        return [_unparsable(name, exc)]
    advice = advice or "add it to requirements.txt or pick another environment"
    warnings = [f"`{module}` is not in environment {environment.name}: {advice}"
                for module in missing[:MAX_LISTED]]
    if len(missing) > MAX_LISTED:
        warnings.append(f"{len(missing) - MAX_LISTED} more imports are not in environment "
                        f"{environment.name} either")
    return warnings
