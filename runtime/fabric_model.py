"""``FabricModel``: the user-facing API WMLA documents for elastic distributed training,
plus the other names WMLA's sample models use."""

from __future__ import annotations

import io
import math
import os
import tempfile
import time
import zipfile
from dataclasses import replace
from typing import Any

import torch

from .config import JobEnv
from .optimization import check_clip, check_precision, check_scaler, schedules

_TF_MODULES = ("keras", "tensorflow", "tf_keras")
TENSORFLOW, PYTORCH = "tensorflow", "pytorch"


def framework_of(model: Any) -> str:
    """``"pytorch"`` or ``"tensorflow"`` (a Keras model), told by the model's classes, so
    that telling them apart never imports TensorFlow."""
    if isinstance(model, torch.nn.Module):
        return PYTORCH
    if any((c.__module__ or "").split(".")[0] in _TF_MODULES for c in type(model).__mro__):
        return TENSORFLOW
    raise TypeError("model must be a torch.nn.Module (PyTorch) or a tf.keras.Model "
                    f"(TensorFlow), got {type(model).__name__}")


def _check_torch_args(loss_function: Any, optimizer: Any) -> None:
    if not callable(loss_function):
        raise TypeError("loss_function must be callable for PyTorch models")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim optimizer, got {type(optimizer)}")


def _check_keras_args(loss_function: Any, optimizer: Any, torch_only: dict[str, Any]) -> None:
    """What a Keras model takes: loss and optimizer as Keras objects or names (checked
    against Keras when training starts, where TensorFlow is loaded); none of the options
    that exist only for PyTorch."""
    if not (callable(loss_function) or isinstance(loss_function, str)):
        raise TypeError("loss_function must be a tf.keras.losses instance, a function or a "
                        f"loss name for Keras models, got {type(loss_function).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer) or not (
            isinstance(optimizer, str) or hasattr(optimizer, "apply_gradients")):
        raise TypeError("optimizer must be a tf.keras.optimizers instance or a name for "
                        f"Keras models, got {type(optimizer).__name__}")
    given = [name for name, value in torch_only.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} exist only for PyTorch models; a Keras model "
                         "is trained in float32 with its optimizer's own schedule")


def _check_count(name: str, value: Any, least: int, what: str) -> None:
    """A count argument of ``train()``: an int (a bool is not one) of at least ``least``,
    refused at the call with the name and value, before any process starts."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def effective_batch(
    batch_size: int,
    engines_number: int | None,
    effective_batch_size: int | None,
    default_engines: int,
) -> tuple[int, int]:
    """WMLA's effective batch size rules; returns ``(engines_number, global_batch)``.

    - only ``effective_batch_size``: engines_number = effective_batch_size / batch_size;
    - both: engines_number is the larger of the two;
    - neither: engines_number = the job's max workers (1 standalone).
    The global batch is ``batch_size x engines_number`` (or exactly
    ``effective_batch_size`` when it alone decides and is not a multiple).
    """
    if effective_batch_size is not None and effective_batch_size <= 0:
        raise ValueError("effective_batch_size must be a positive integer")
    if engines_number is not None and engines_number <= 0:
        raise ValueError("engines_number must be a positive integer")
    if effective_batch_size is None:
        engines = engines_number or default_engines
        return engines, batch_size * engines
    from_effective = math.ceil(effective_batch_size / batch_size)
    if engines_number is None or from_effective >= engines_number:
        return from_effective, effective_batch_size
    return engines_number, batch_size * engines_number


class FabricModel:
    """An elastic distributed training model, with the constructor and ``train`` WMLA documents.

    ``FabricModel(model, datasets_function, loss_function, optimizer, metrics=None,
    worker_logger_callback=None, driver_logger_callback=None, save_to_onnx=False,
    keras_custom_objects=None, fn_batch_collate=None)``; WMLA sample names are accepted
    too: ``driver_logger=``, ``worker_logger=``, ``user_callback=[...]``,
    ``enable_onnx=``, ``fn_step_train=``, ``fn_test=``, ``scaleup_function=``. After
    ``train()``, ``download(out_dir=None)`` packs the trained model (WMLA 4.x notebooks).

    Beyond WMLA (:mod:`runtime.optimization`): ``precision=`` ("32", "bf16-mixed",
    "16-mixed"), ``grad_scaler=`` (a ``torch.amp.GradScaler``, or True/False),
    ``clip_grad_norm=`` and ``lr_scheduler=`` (a scheduler, a dict with ``scheduler``,
    ``interval`` "step" or "epoch" and ``monitor``, or a list of them). The runtime owns
    them so that they move with the training state when the job is rescaled.
    """

    def __init__(
        self,
        model: Any,
        datasets_function: Any,
        loss_function: Any,
        optimizer: Any,
        metrics: list[Any] | None = None,
        worker_logger_callback: Any = None,
        driver_logger_callback: Any = None,
        save_to_onnx: bool = False,
        keras_custom_objects: dict[str, Any] | None = None,
        fn_batch_collate: Any = None,
        *,
        driver_logger: Any = None,
        worker_logger: Any = None,
        user_callback: list[Any] | None = None,
        enable_onnx: bool | None = None,
        fn_step_train: Any = None,
        fn_test: Any = None,
        scaleup_function: Any = None,
        precision: str | None = None,
        grad_scaler: Any = None,
        clip_grad_norm: float | None = None,
        lr_scheduler: Any = None,
    ) -> None:
        self.framework = framework_of(model)
        if not callable(datasets_function):
            raise TypeError("datasets_function must be a function returning (train, test)")
        if self.framework == TENSORFLOW:
            _check_keras_args(loss_function, optimizer, {
                "fn_step_train": fn_step_train, "fn_test": fn_test, "precision": precision,
                "grad_scaler": grad_scaler, "clip_grad_norm": clip_grad_norm,
                "lr_scheduler": lr_scheduler})
        else:
            _check_torch_args(loss_function, optimizer)
        if metrics is not None and not isinstance(metrics, list | tuple):
            metrics = [metrics]
        self.model = model
        self.datasets_function = datasets_function
        self.loss_function = loss_function
        self.optimizer = optimizer
        self.metrics = list(metrics or [])
        self.worker_logger_callback = worker_logger_callback or worker_logger
        self.driver_logger_callback = driver_logger_callback or driver_logger
        self.save_to_onnx = bool(save_to_onnx or enable_onnx)
        self.keras_custom_objects = keras_custom_objects
        self.fn_batch_collate = fn_batch_collate
        self.user_callbacks = list(user_callback if isinstance(user_callback, list | tuple)
                                   else [user_callback] if user_callback is not None else [])
        self.fn_step_train = fn_step_train
        self.fn_test = fn_test
        # Accepted for WMLA compatibility; the constant global batch already keeps the
        # mathematics the same at every size, so there is nothing to rescale.
        self.scaleup_function = scaleup_function
        self.precision = check_precision(precision)
        self.grad_scaler = check_scaler(grad_scaler, self.precision, fn_step_train is not None)
        self.clip_grad_norm = check_clip(clip_grad_norm)
        self.lr_schedulers = schedules(lr_scheduler, optimizer) if self.framework == PYTORCH else []
        # What download() packs: set when train() has finished here (name, result folder).
        self.trained: tuple[str, str | None] | None = None

    def get_optimizer(self) -> Any:
        return self.optimizer

    def get_loss_function(self) -> Any:
        return self.loss_function

    def train(
        self,
        epoch_number: int,
        batch_size: int,
        engines_number: int | None = None,
        num_dataloader_threads: int = 4,
        validation_freq: int = 1,
        checkpoint_freq: int = 1,
        effective_batch_size: int | None = None,
    ) -> Any:
        """Train; the role (standalone, driver, worker) comes from ``EDT_ROLE``.

        ``num_dataloader_threads`` threads read the next step's batches while this one
        trains; with 0, as ``DataLoader``'s ``num_workers=0``, the training thread reads
        them itself while it waits for the gradients' all-reduce (the better choice when
        every core already trains)."""
        _check_count("epoch_number", epoch_number, 1, "a positive integer")
        _check_count("batch_size", batch_size, 1, "a positive integer")
        _check_count("num_dataloader_threads", num_dataloader_threads, 0,
                     "0 (read in the training thread) or more")
        env = JobEnv.from_environ()
        default_engines = 1 if env.role == "standalone" else (env.max_workers or 1)
        engines, global_batch = effective_batch(
            batch_size, engines_number, effective_batch_size, default_engines
        )
        if env.max_workers is None and env.role != "standalone":
            env = _with_max_workers(env, engines)
        cfg = {
            "epochs": epoch_number,
            "batch_size": batch_size,
            "engines_number": engines,
            "global_batch": global_batch,
            "num_dataloader_threads": num_dataloader_threads,
            "validation_freq": int(validation_freq or 0),
            "checkpoint_freq": int(checkpoint_freq or 0),
        }
        result = _run_role(self, env, cfg)
        name = env.job_id if env.job_id != "local" else f"edt-notebook-{int(time.time() * 1000)}"
        self.trained = (name, env.result_dir)
        return result

    def download(self, out_dir: str | None = None) -> str:
        """WMLA 4.x notebooks' ``edt_m.download()`` / ``edt_m.download(out_dir=...)``: the
        model trained by ``train()`` in this process as ``<out_dir>/<job name>.zip``
        (``out_dir`` defaults to the temporary folder, ``/tmp`` as in WMLA).

        The zip holds the result folder's ``model/`` tree (``model/train/model_epoch_final.pth``
        and, when saved, ``model/model.onnx``); with no result folder (a notebook without
        ``RESULT_DIR``), ``model/train/model_epoch_final.pth`` from the model in memory.
        Prints ``Save model:  <path>`` as WMLA does and returns the path."""
        if self.trained is None:
            raise RuntimeError("download() needs a finished train() in this process: there "
                               "is no trained model yet")
        name, result_dir = self.trained
        return _save_model_zip(self.model, name, result_dir, out_dir or tempfile.gettempdir())


def _run_role(fm: FabricModel, env: JobEnv, cfg: dict[str, Any]) -> Any:
    # Imported here, each role only its own side: a driver never loads the training loop,
    # and a process that imports the runtime only for its events loads neither.
    if env.role == "driver":
        from .driver import run_driver

        return run_driver(env, fm.driver_logger_callback, cfg)
    if env.role == "worker" and not env.driver_addr:
        raise RuntimeError("EDT_ROLE=worker needs EDT_DRIVER_ADDR (host:port of the driver)")
    if env.role == "worker" and not env.secret:
        raise RuntimeError("EDT_ROLE=worker needs EDT_JOB_SECRET (the job's secret)")
    if fm.framework == TENSORFLOW:
        # TensorFlow is loaded here, by the training processes of a Keras model only.
        from .keras_trainer import run_keras_trainer

        run_keras_trainer(fm, cfg, env)
        return None
    from .worker import run_trainer

    run_trainer(fm, cfg, env)
    return None


def _with_max_workers(env: JobEnv, n: int) -> JobEnv:
    os.environ.setdefault("EDT_MAX_WORKERS", str(n))
    return replace(env, max_workers=n)


def _model_files(result_dir: str | None) -> list[tuple[str, str]]:
    """Each file under ``<result_dir>/model`` and its name in the zip."""
    if not result_dir:
        return []
    base = os.path.join(result_dir, "model")
    out = []
    for folder, _dirs, files in os.walk(base):
        for f in sorted(files):
            path = os.path.join(folder, f)
            if not f.endswith(".tmp") and os.path.isfile(path):
                out.append((path, "model/" + os.path.relpath(path, base).replace(os.sep, "/")))
    return out


def _save_model_zip(model: torch.nn.Module, name: str, result_dir: str | None,
                    out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.zip")
    tmp = f"{path}.{os.getpid()}.tmp"
    files = _model_files(result_dir)
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for src, arc in files:
            zf.write(src, arc)
        if not any(arc.endswith(".pth") for _src, arc in files):
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            zf.writestr("model/train/model_epoch_final.pth", buf.getvalue())
    os.replace(tmp, path)
    print("Save model: ", path, flush=True)
    return path
