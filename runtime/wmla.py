"""WMLA helper APIs that model folders import: ``EMetrics``, ``ELog`` and the
``pth_parameter_mgr`` functions.

``$FABRIC_HOME/libs/fabric.zip`` (see :mod:`runtime.fabric_home`) exposes them under
WMLA's module names (``emetrics``, ``elog``, ``callbacks``, ``pth_parameter_mgr``,
``fabric_model``).

Hyper-parameters reach ``pth_parameter_mgr`` through the job environment:
``EDT_HPARAMS`` (a JSON object) or ``EDT_HPARAMS_FILE`` (a JSON file), with keys
``epochs``, ``batch_size`` (or ``train_batch_size``), ``optimizer`` (a torch.optim class
name, default ``SGD``), ``learning_rate`` (or ``lr``), ``momentum``, ``weight_decay``,
``betas``, ``eps``, ``train_data_dir``, ``test_data_dir``. The data folders default to
``EDT_TRAIN_DATA_DIR`` / ``EDT_TEST_DATA_DIR``, then ``$DATA_DIR/train`` /
``$DATA_DIR/test`` when they exist, then ``$DATA_DIR``.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from typing import Any

# -- EMetrics / ELog -----------------------------------------------------------------------


class EMetrics:
    """Appends metric records (JSON lines) to ``$RESULT_DIR/evaluation-metrics.txt``."""

    TEST_GROUP = "test"
    TRAIN_GROUP = "train"

    def __init__(self, sub_id: str | None, f: Any) -> None:
        self.training_id = os.environ.get("TRAINING_ID") or os.environ.get("EDT_JOB_ID", "")
        self.sub_id = sub_id
        self.f = f
        self.r_index = 1

    @staticmethod
    def open(subId: str | None = None) -> EMetrics:  # noqa: N803 - WMLA's name
        folder = os.environ.get("RESULT_DIR") or os.environ.get("LOG_DIR")
        f = None
        if folder:
            os.makedirs(folder, exist_ok=True)
            f = open(os.path.join(folder, "evaluation-metrics.txt"), "a", encoding="utf-8")  # noqa: SIM115
        return EMetrics(subId, f)

    def __enter__(self) -> EMetrics:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def record(self, group: str, iteration: int, values: dict[str, Any]) -> dict[str, Any]:
        meta = {"training_id": self.training_id, "time": int(time.time() * 1000),
                "rindex": self.r_index}
        if self.sub_id:
            meta["subid"] = str(self.sub_id)
        event = {
            "meta": meta,
            "grouplabel": group,
            "etimes": {"iteration": {"type": 2, "value": int(iteration)}},
            "values": {k: {"type": 3, "value": float(v)} for k, v in values.items()
                       if isinstance(v, int | float)},
        }
        self.r_index += 1
        if self.f is not None:
            self.f.write(json.dumps(event) + "\n")
            self.f.flush()
        return event

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


def _metrics_from(args: tuple) -> dict[str, Any]:
    """ELog accepts either a metrics dict or WMLA's older (loss, accuracy[, worker])."""
    if args and isinstance(args[0], dict):
        return dict(args[0])
    out: dict[str, Any] = {}
    if len(args) > 0:
        out["loss"] = args[0]
    if len(args) > 1:
        out["accuracy"] = args[1]
    return out


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


class ELog:
    """Prints WMLA's log lines:
    ``[YYYY-mm-dd HH:MM:SS] Train,\\tTimestamp: <ms>,\\tGlobal steps: N,\\tIteration: N,
    \\tLoss: x,\\tAccuracy: x`` and ``[...] Test,\\tTimestamp: <ms>,\\tLoss: x,...``."""

    @staticmethod
    def open(*args: Any, **kwargs: Any) -> ELog:
        return ELog()

    def __enter__(self) -> ELog:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

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


def getLearningRate() -> float:  # noqa: N802
    hp = hparams()
    return float(hp.get("learning_rate", hp.get("lr", 0.01)))


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
    kwargs: dict[str, Any] = {"lr": getLearningRate()}
    for key in ("momentum", "weight_decay", "betas", "eps", "nesterov", "alpha", "dampening"):
        if key in hp and key in accepted:
            value = hp[key]
            kwargs[key] = tuple(value) if key == "betas" else value
    return cls(model.parameters(), **kwargs)
