"""WMLA helper APIs that model folders import: ``EMetrics``, ``ELog`` and the
``pth_parameter_mgr`` functions.

WMLA's module names for them (``emetrics``, ``elog``, ``pth_parameter_mgr``) are thin files
in ``wmla_compat/``, put in ``$FABRIC_HOME/libs/fabric.zip`` by :mod:`runtime.fabric_home`
(``pth_parameter_mgr`` is also installed with the project).

Hyper-parameters reach ``pth_parameter_mgr`` through the job environment:
``EDT_HPARAMS`` (a JSON object) or ``EDT_HPARAMS_FILE`` (a JSON file), with keys
``epochs``, ``batch_size`` (or ``train_batch_size``), ``test_batch_size``, ``optimizer`` (a
torch.optim class name, default ``SGD``), ``learning_rate`` (or ``lr``), ``momentum``,
``weight_decay``, ``betas``, ``eps``, ``lr_policy`` (``fixed``, ``step``, ``multistep``,
``exp``, ``plateau``) with ``stepsize``, ``stepvalue``, ``gamma``, ``train_data_dir``,
``test_data_dir``. The data folders default to
``EDT_TRAIN_DATA_DIR`` / ``EDT_TEST_DATA_DIR``, then ``$DATA_DIR/train`` /
``$DATA_DIR/test`` when they exist, then ``$DATA_DIR``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import inspect
import json
import math
import os
import sys
import time
from typing import Any

# -- EMetrics / ELog -----------------------------------------------------------------------


class EMetrics:
    """Appends metric records (JSON lines) to ``$RESULT_DIR/evaluation-metrics.txt``, as
    WMLA's ``emetrics`` does, and keeps the test records in ``$RESULT_DIR/val_dict_list.json``
    (``[{"steps": <iteration>, <metric>: <value>, ...}, ...]``, rewritten at each test record
    and at close), the file WMLA's hyper-parameter search reads.

    A test record is also a ``metrics.test`` event (``epoch`` = the iteration given): that is
    how a search here learns the trial's objective, over the job's own event channel, and how
    the job page charts it."""

    TEST_GROUP = "test"
    TRAIN_GROUP = "train"

    def __init__(self, sub_id: str | None, f: Any, folder: str | None = None) -> None:
        self.training_id = os.environ.get("TRAINING_ID") or os.environ.get("EDT_JOB_ID", "")
        self.sub_id = sub_id
        self.f = f
        self.folder = folder
        self.r_index = 1
        self.test_history: list[dict[str, Any]] = []

    @staticmethod
    def open(subId: str | None = None) -> EMetrics:  # noqa: N803 - WMLA's name
        folder = os.environ.get("RESULT_DIR") or os.environ.get("LOG_DIR")
        f = None
        if folder:
            os.makedirs(folder, exist_ok=True)
            f = open(os.path.join(folder, "evaluation-metrics.txt"), "a", encoding="utf-8")  # noqa: SIM115
        return EMetrics(subId, f, folder)

    def __enter__(self) -> EMetrics:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def record(self, group: str, iteration: int, values: dict[str, Any]) -> dict[str, Any]:
        meta = {"training_id": self.training_id, "time": int(time.time() * 1000),
                "rindex": self.r_index}
        if self.sub_id:
            meta["subid"] = str(self.sub_id)
        numbers = {k: float(v) for k, v in values.items() if _reported(v)}
        event = {
            "meta": meta,
            "grouplabel": group,
            "etimes": {"iteration": {"type": 2, "value": int(iteration)}},
            "values": {k: {"type": 3, "value": v} for k, v in numbers.items()},
        }
        self.r_index += 1
        if self.f is not None:
            self.f.write(json.dumps(event) + "\n")
            self.f.flush()
        if group == self.TEST_GROUP and numbers:
            self.test_history.append({"steps": int(iteration), **numbers})
            self._write_history()
            from runtime import events

            events.emit("metrics.test", epoch=max(0, int(iteration)), **{
                k: v for k, v in numbers.items() if math.isfinite(v)})
        return event

    def _write_history(self) -> None:
        if not self.folder or not self.test_history:
            return
        path = os.path.join(self.folder, "val_dict_list.json")
        with open(path + ".tmp", "w", encoding="utf-8") as out:
            json.dump(self.test_history, out)
        os.replace(path + ".tmp", path)

    def close(self) -> None:
        self._write_history()
        if self.f is not None:
            self.f.close()
            self.f = None


def _number(v: Any) -> float | None:
    """``v`` as a number, if it is one (a float, an int, a one-element tensor)."""
    if isinstance(v, bool | str | bytes) or v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _reported(v: Any) -> bool:
    """A value a log line or a metric record shows: a number, and not NaN (the value a model
    that reports no accuracy hands WMLA 1.2.3-2.3 callbacks)."""
    number = _number(v)
    return number is not None and not math.isnan(number)


def _metrics_from(args: tuple) -> dict[str, Any]:
    """ELog accepts either a metrics dict or WMLA's older (loss, accuracy[, worker]); a
    value that is not a number (a metric the model does not report) is left out."""
    if args and isinstance(args[0], dict):
        raw = dict(args[0])
    else:
        raw = dict(zip(("loss", "accuracy"), args[:2], strict=False))
    return {k: v if isinstance(v, int | float) else _number(v) for k, v in raw.items()
            if _reported(v)}


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


class ELog:
    """Prints WMLA's log lines:
    ``[YYYY-mm-dd HH:MM:SS] Train,\\tTimestamp: <ms>,\\tGlobal steps: N,\\tIteration: N,
    \\tLoss: x,\\tAccuracy: x`` and ``[...] Test,\\tTimestamp: <ms>,\\tLoss: x,...``;
    a metric the model does not report is left out (never ``Accuracy: 0``)."""

    def __init__(self, subId: str | None = None, f: Any = None) -> None:  # noqa: N803
        self.subId = subId  # noqa: N815 - WMLA's attribute names
        self.f = f

    @staticmethod
    def open(subId: str | None = None, *args: Any, **kwargs: Any) -> ELog:  # noqa: N803
        return ELog(subId)

    def __enter__(self) -> ELog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to close: the lines go to the process's output, which the job keeps."""

    def recordText(self, text: str) -> str:  # noqa: N802
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {text}"
        print(line, flush=True)
        return line

    @staticmethod
    def line(title: str, fields: list[tuple[str, Any]]) -> str:
        head = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {title}"
        parts = [head, f"Timestamp: {int(time.time() * 1000)}"]
        parts += [f"{k}: {_fmt(v)}" for k, v in fields]
        return ",\t".join(parts)

    def recordTrain(self, title: str, iteration: int, global_step: int, *args: Any) -> str:  # noqa: N802
        metrics = _metrics_from(args)
        fields = [("Global steps", global_step), ("Iteration", iteration)]
        fields += [(k[:1].upper() + k[1:], v) for k, v in metrics.items()]
        text = self.line(title, fields)
        print(text, flush=True)
        return text

    def recordTest(self, title: str, *args: Any) -> str:  # noqa: N802
        metrics = _metrics_from(args)
        text = self.line(title, [(k[:1].upper() + k[1:], v) for k, v in metrics.items()])
        print(text, flush=True)
        return text


# -- WMLA's generic module names ------------------------------------------------------------

# ``callbacks``, ``elog``, ``emetrics`` and ``monitor_pth`` are too generic to install at the
# top level of every environment the project goes into. A job finds them on its PYTHONPATH
# (``wmla_compat/``) or in ``fabric.zip``; anywhere else (``python elastic-main.py`` where the
# project is installed) they are served by this finder, which importing one of WMLA's own
# names (``fabric_model``, ``pth_parameter_mgr``, ``pyedt``) puts last on ``sys.meta_path``:
# every folder on ``sys.path`` is searched first, so a model folder's own ``elog.py`` or
# ``edtcallback.py`` always wins.
FALLBACK_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "callbacks": ("runtime.callbacks", ("Callback", "LoggerCallback")),
    "elog": ("runtime.wmla", ("ELog",)),
    "emetrics": ("runtime.wmla", ("EMetrics",)),
    "monitor_pth": ("runtime.wmla", ("PytorchMonitor",)),
}


class PytorchMonitor:
    """WMLA's ``from monitor_pth import PytorchMonitor`` (DLI's training insights), which IBM's
    learning-path PyTorch samples import. The insights here come from the ELog lines and the
    job's metrics, so the monitor only has to exist: it takes any arguments and every method
    of it does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class _FallbackNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if path is not None or fullname not in FALLBACK_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin="edt-runtime")

    def create_module(self, spec: Any) -> None:
        return None  # the default module

    def exec_module(self, module: Any) -> None:
        source, names = FALLBACK_MODULES[module.__name__]
        src = importlib.import_module(source)
        module.__dict__.update({name: getattr(src, name) for name in names})
        module.__all__ = list(names)


def expose_module_names() -> None:
    """Make ``callbacks``, ``elog``, ``emetrics`` and ``monitor_pth`` importable, after
    everything else."""
    if not any(isinstance(f, _FallbackNames) for f in sys.meta_path):
        sys.meta_path.append(_FallbackNames())


# -- pth_parameter_mgr --------------------------------------------------------------------


def hparams() -> dict[str, Any]:
    raw = os.environ.get("EDT_HPARAMS")
    if raw:
        return json.loads(raw)
    path = os.environ.get("EDT_HPARAMS_FILE")
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return {}


def _data_dir(kind: str) -> str:
    hp = hparams()
    explicit = hp.get(f"{kind}_data_dir") or os.environ.get(f"EDT_{kind.upper()}_DATA_DIR")
    if explicit:
        return explicit
    base = os.environ.get("DATA_DIR", "")
    if base and os.path.isdir(os.path.join(base, kind)):
        return os.path.join(base, kind)
    return base


def getTrainData(download: bool = False) -> str:  # noqa: N802, ARG001 - WMLA's signature
    return _data_dir("train")


def getTestData(download: bool = False) -> str:  # noqa: N802, ARG001
    return _data_dir("test")


def getEpoch() -> int:  # noqa: N802
    return int(hparams().get("epochs", hparams().get("epoch", 1)))


def getTrainBatchSize() -> int:  # noqa: N802
    hp = hparams()
    return int(hp.get("batch_size", hp.get("train_batch_size", 32)))


def getTestBatchSize() -> int:  # noqa: N802
    """The test loader's batch size: ``test_batch_size``, else the training one."""
    hp = hparams()
    return int(hp.get("test_batch_size", getTrainBatchSize()))


def _learning_rate() -> float:
    hp = hparams()
    return float(hp.get("learning_rate", hp.get("lr", 0.01)))


def getLearningRate(optimizer: Any = None) -> Any:  # noqa: N802
    """WMLA's two uses: ``getLearningRate()`` is the learning rate; ``getLearningRate(optimizer)``
    (IBM's PyTorch samples: ``scheduler = pth_parameter_mgr.getLearningRate(optimizer)``, then
    ``if scheduler: scheduler.step()`` each epoch) is the learning-rate policy as a torch
    scheduler over that optimizer, or None for a fixed rate."""
    if optimizer is None:
        return _learning_rate()
    return lr_scheduler(optimizer, hparams())


def lr_scheduler(optimizer: Any, hp: dict[str, Any]) -> Any:
    """The scheduler ``lr_policy`` names (WMLA's Train form's policies); None for ``fixed``."""
    from torch.optim import lr_scheduler as sched

    policy = str(hp.get("lr_policy", "fixed")).lower()
    gamma = float(hp.get("gamma", 0.1))
    if policy in ("", "fixed", "none"):
        return None
    if policy == "step":
        return sched.StepLR(optimizer, step_size=int(hp.get("stepsize", 1)), gamma=gamma)
    if policy == "multistep":
        steps = hp.get("stepvalue", [])
        milestones = [int(v) for v in (steps if isinstance(steps, list) else [steps])]
        return sched.MultiStepLR(optimizer, milestones=milestones, gamma=gamma)
    if policy in ("exp", "exponential"):
        return sched.ExponentialLR(optimizer, gamma=gamma)
    if policy == "plateau":
        return sched.ReduceLROnPlateau(optimizer, factor=gamma)
    raise ValueError(f"unknown lr_policy {policy!r} (fixed, step, multistep, exp or plateau)")


def getOptimizer(model: Any) -> Any:  # noqa: N802
    """A torch.optim optimizer over ``model.parameters()`` built from the hyper-parameters."""
    import torch

    hp = hparams()
    name = str(hp.get("optimizer", "SGD"))
    cls = next((getattr(torch.optim, n) for n in dir(torch.optim) if n.lower() == name.lower()),
               None)
    if cls is None or not isinstance(cls, type):
        raise ValueError(f"unknown optimizer {name!r} (expected a torch.optim class name)")
    accepted = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {"lr": _learning_rate()}
    for key in ("momentum", "weight_decay", "betas", "eps", "nesterov", "alpha", "dampening"):
        if key in hp and key in accepted:
            value = hp[key]
            kwargs[key] = tuple(value) if key == "betas" else value
    return cls(model.parameters(), **kwargs)
