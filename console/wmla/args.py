"""The ``args`` string of ``POST /execs``: WMLA's dlicmd submit flags, parsed with argparse.

WMLA sends the whole command line in one string, for example::

    --exec-start edtPyTorch --cs-datastore-meta type=fs,data_path=cifar10 --model-dir resnet
    --edt-options maxWorkers=4 --model-main main.py --msd-env EDT_PULL_FAILED_LIMITS=3 --lr 0.1

Flags this module knows are taken; flags it does not know (``--lr 0.1`` above) and everything
after a lone ``--`` go to the user's script unchanged, in order. dlicmd flags that only make sense
on WMLA's Kubernetes deployment (memory limits, images, node selectors) are accepted and ignored,
so a script written for WMLA still submits.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

from jobs.validation import ARGS_MAX_BYTES

FRAMEWORKS = {
    "edtPyTorch": "PyTorch - Elastic Distributed Training (EDT)",
    "edtTensorflow": "TensorFlow - Elastic Distributed Training (EDT)",
}
# The model's framework (models.ModelDefinition.Framework) each --exec-start trains with.
MODEL_FRAMEWORKS = {"edtPyTorch": "PyTorch", "edtTensorflow": "TensorFlow"}
EXEC_STARTS = {model: name for name, model in MODEL_FRAMEWORKS.items()}

# dlicmd flags with a value that have no meaning here: taken from the string and dropped.
_IGNORED_WITH_VALUE = (
    "--consumer", "--conda-env-name", "--conda-home", "--conda-env-yaml", "--conda-package",
    "--workerMemory", "--workerCPULimit", "--workerGPULimit", "--workerMemoryLimit",
    "--numPs", "--numDriver", "--driverDeviceType", "--driverDeviceNum", "--driverMemory",
    "--driverCPULimit", "--driverGPULimit", "--driverMemoryLimit", "--msd-attr", "--msd-label",
    "--msd-image-name", "--msd-image-pull-secret", "--msd-image-pull-policy",
    "--msd-task0-node-selector", "--msd-task12n-node-selector", "--msd-pending-timeout",
    "--lsf-gpu-syntax", "--msd-podaffinity-rule", "--msd-podaffinity-topology-key",
    "--msd-pack-id", "--cs-rmq-meta", "--cs-url-meta", "--cs-url-bearer", "--submit-user",
    "--sc-runasuser", "--sc-runasgroup", "--sc-fsgroup", "--debug-level",
)


class ArgsError(ValueError):
    """The args string cannot be used; the message says which flag and why."""


class _Parser(argparse.ArgumentParser):
    # argparse prints and exits on errors; an API must answer 400 instead.
    def error(self, message: str):  # type: ignore[override]
        raise ArgsError(message)


def _positive_int(flag: str):
    def convert(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, not '{value}'") from None
        if number < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be at least 1, not {number}")
        return number

    return convert


def _build_parser() -> _Parser:
    p = _Parser(prog="args", add_help=False, allow_abbrev=False)
    p.add_argument("--exec-start", dest="framework")
    p.add_argument("--model-main", dest="model_main")
    p.add_argument("--model-dir", dest="model_dir")
    p.add_argument("--numWorker", dest="num_worker", type=_positive_int("--numWorker"))
    p.add_argument(
        "--workerDeviceNum", dest="worker_device_num", type=_positive_int("--workerDeviceNum")
    )
    p.add_argument("--workerDeviceType", dest="worker_device_type", choices=["cpu", "gpu"])
    p.add_argument("--edt-options", dest="edt_options", action="append", default=[])
    p.add_argument("--cs-datastore-meta", dest="datastore_meta")
    p.add_argument("--msd-env", dest="msd_env", action="append", default=[])
    # The range (jobs.priority) is the jobs service's to check, so the message is the same
    # everywhere.
    p.add_argument("--msd-priority", dest="priority", type=int)
    p.add_argument("--appName", dest="app_name")
    p.add_argument("--ig", dest="instance_group")
    for flag in _IGNORED_WITH_VALUE:
        p.add_argument(flag, dest=f"_ignored_{flag.strip('-')}", action="append")
    return p


_PARSER = _build_parser()


@dataclass
class SubmitArgs:
    framework: str
    model_main: str
    model_dir: str = ""
    max_workers: int = 1
    devices_per_worker: int = 1
    worker_device_type: str = ""
    data_path: str = ""
    env_vars: dict[str, str] = field(default_factory=dict)
    priority: int | None = None
    app_name: str = ""
    instance_group: str = ""
    user_args: list[str] = field(default_factory=list)

    @property
    def user_args_string(self) -> str:
        return shlex.join(self.user_args)


def _pairs(text: str, flag: str) -> dict[str, str]:
    """``a=1,b=2`` -> {"a": "1", "b": "2"}; a part without ``=`` is an error naming the flag."""
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ArgsError(f"{flag} expects name=value pairs separated by commas, got '{part}'")
        out[key.strip()] = value.strip()
    return out


def _check_bounds(text: str) -> None:
    # Before any parsing work: the same bound as /api/v1.
    if not text or not text.strip():
        raise ArgsError("args is empty: it must hold at least --exec-start and --model-main")
    if len(text) > ARGS_MAX_BYTES:
        raise ArgsError(f"args may be at most {ARGS_MAX_BYTES} bytes long")
    if "\x00" in text:
        raise ArgsError("args contains a NUL character")


def parse_args_string(text: str) -> SubmitArgs:
    """Parse a WMLA ``args`` string. Raises ``ArgsError`` with a message naming the flag."""
    _check_bounds(text)
    tokens, passthrough = _split(text)
    known, unknown = _PARSER.parse_known_args(tokens)
    _check_required(known)
    return SubmitArgs(
        framework=known.framework,
        model_main=known.model_main,
        model_dir=known.model_dir or "",
        max_workers=_max_workers(known),
        devices_per_worker=known.worker_device_num or 1,
        worker_device_type=known.worker_device_type or "",
        data_path=_data_path(known),
        env_vars=_env_vars(known),
        priority=known.priority,
        app_name=known.app_name or "",
        instance_group=known.instance_group or "",
        user_args=[*unknown, *passthrough],
    )


def _split(text: str) -> tuple[list[str], list[str]]:
    """The words of ``text`` split like a shell's: ours, and those after a lone ``--``."""
    try:
        tokens = shlex.split(text)
    except ValueError as exc:  # an unclosed quote
        raise ArgsError(f"args cannot be split into words: {exc}") from exc
    if "--" in tokens:
        cut = tokens.index("--")
        return tokens[:cut], tokens[cut + 1 :]
    return tokens, []


def _check_required(known: argparse.Namespace) -> None:
    if not known.framework:
        raise ArgsError(
            f"--exec-start <framework> is required; supported: {', '.join(FRAMEWORKS)}"
        )
    if known.framework not in FRAMEWORKS:
        raise ArgsError(
            f"--exec-start '{known.framework}' is not a framework here; "
            f"supported: {', '.join(FRAMEWORKS)}"
        )
    if not known.model_main:
        raise ArgsError("--model-main <file> is required: the script to run in the model folder")


def _max_workers(known: argparse.Namespace) -> int:
    """``--numWorker``, unless ``--edt-options maxWorkers=N`` says otherwise (the last wins)."""
    max_workers = known.num_worker or 1
    for option in known.edt_options:
        for key, value in _pairs(option, "--edt-options").items():
            if key != "maxWorkers":
                raise ArgsError(f"--edt-options: unknown option '{key}' (supported: maxWorkers)")
            max_workers = _to_positive("--edt-options maxWorkers", value)
    return max_workers


def _data_path(known: argparse.Namespace) -> str:
    if not known.datastore_meta:
        return ""
    meta = _pairs(known.datastore_meta, "--cs-datastore-meta")
    if meta.get("type", "fs") != "fs":
        raise ArgsError(f"--cs-datastore-meta type '{meta['type']}' is not supported (fs)")
    return meta.get("data_path", "")


def _env_vars(known: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in known.msd_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ArgsError(f"--msd-env expects NAME=value, got '{item}'")
        env[name] = value
    return env


def _to_positive(flag: str, value: str) -> int:
    try:
        return _positive_int(flag)(value)
    except argparse.ArgumentTypeError as exc:
        raise ArgsError(str(exc)) from None
