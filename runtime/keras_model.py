"""What is TensorFlow-specific in training a ``tf.keras`` model elastically, behind the few
operations the runtime's loop needs (:mod:`runtime.keras_trainer`): resolve the loss, the
optimizer and the metrics WMLA lets a script name as strings; compute one micro-batch's
gradients; apply the step's summed gradients; get and set the weights and the optimizer's
state as the runtime's training-state blob.

TensorFlow is imported here, and this module is imported only when a script hands
``FabricModel`` a Keras model: PyTorch jobs and the product never load it.

The model's Keras is the one it was built with: Keras 3 (``keras``, what ``tf.keras`` is from
TensorFlow 2.16 on) or Keras 2 (``tf_keras``, what ``tf.keras`` is under
``TF_USE_LEGACY_KERAS=1``, the Keras of WMLA's TensorFlow samples).
"""

from __future__ import annotations

import importlib
import os
import tempfile
from types import ModuleType
from typing import Any

import numpy as np
import tensorflow as tf
import torch

from .errors import UserCodeError
from .state import Position, dumps, loads

KERAS_MODULES = ("keras", "tf_keras")


def is_keras_model(model: Any) -> bool:
    """Whether ``model`` is a Keras model, told by its class's module: no import needed."""
    roots = {c.__module__.split(".")[0] for c in type(model).__mro__}
    return bool(roots & {"keras", "tf_keras", "tensorflow"})


def keras_of(model: Any) -> ModuleType:
    """The Keras package ``model`` was built with (``keras`` or ``tf_keras``)."""
    for cls in type(model).__mro__:
        root = cls.__module__.split(".")[0]
        if root in KERAS_MODULES:
            return importlib.import_module(root)
    return tf.keras


def resolve_loss(spec: Any, keras: ModuleType, custom: dict[str, Any] | None) -> Any:
    """A loss object or function from WMLA's forms: an instance, a function, or a name
    (``"categorical_crossentropy"``, or a name in ``keras_custom_objects``)."""
    if isinstance(spec, str):
        if custom and spec in custom:
            spec = custom[spec]
        else:
            try:
                return keras.losses.get(spec)
            except ValueError as exc:
                raise ValueError(f"loss_function '{spec}' is not a Keras loss name") from exc
    if not callable(spec):
        raise TypeError("loss_function must be a tf.keras.losses instance, a function or a "
                        f"loss name, got {type(spec).__name__}")
    return spec


def resolve_optimizer(spec: Any, keras: ModuleType) -> Any:
    """A Keras optimizer from an instance or a name (``"adam"``, ``"sgd"``)."""
    if isinstance(spec, str):
        try:
            return keras.optimizers.get(spec)
        except ValueError as exc:
            raise ValueError(f"optimizer '{spec}' is not a Keras optimizer name") from exc
    if not hasattr(spec, "apply_gradients"):
        raise TypeError("optimizer must be a tf.keras.optimizers instance or a name, got "
                        f"{type(spec).__name__}")
    if not hasattr(spec, "build"):
        raise TypeError(f"{type(spec).__name__} is a legacy Keras optimizer, which cannot "
                        "move its state between workers; use tf.keras.optimizers instead")
    return spec


def _accuracy(keras: ModuleType) -> Any:
    """Keras's ``"accuracy"``: which accuracy depends on the labels' and outputs' shapes, as
    ``model.compile(metrics=["accuracy"])`` decides."""
    ops = tf

    def accuracy(y_true: Any, y_pred: Any) -> Any:
        y_true = ops.convert_to_tensor(y_true)
        if y_pred.shape[-1] == 1:
            return keras.metrics.binary_accuracy(y_true, y_pred)
        if len(y_true.shape) == len(y_pred.shape) and y_true.shape[-1] == y_pred.shape[-1]:
            return keras.metrics.categorical_accuracy(y_true, y_pred)
        return keras.metrics.sparse_categorical_accuracy(y_true, y_pred)

    return accuracy


def resolve_metric(spec: Any, keras: ModuleType, custom: dict[str, Any] | None) -> tuple[str, Any]:
    """``(name, fn(y_true, y_pred) -> value)`` for a metric name, function or instance."""
    if isinstance(spec, str):
        if spec in ("accuracy", "acc"):
            return spec, _accuracy(keras)
        if custom and spec in custom:
            return spec, resolve_metric(custom[spec], keras, None)[1]
        try:
            return spec, keras.metrics.get(spec)
        except ValueError as exc:
            raise ValueError(f"metric '{spec}' is not a Keras metric name") from exc
    if hasattr(spec, "update_state") and hasattr(spec, "result"):
        # A stateful metric: measured on each micro-batch on its own (its value is then
        # averaged over the step's samples like every other metric).
        def measured(y_true: Any, y_pred: Any, m: Any = spec) -> Any:
            m.reset_state()
            m.update_state(y_true, y_pred)
            return m.result()

        return spec.name, measured
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__), spec
    raise TypeError(f"metric must be a name, a function or a tf.keras.metrics instance, "
                    f"got {type(spec).__name__}")


def optimizer_variables(optimizer: Any) -> list[Any]:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class RandomLayers:
    """The generators of a model's random layers (Dropout, GaussianNoise, SpatialDropout...),
    which the runtime resets before each micro-batch.

    TensorFlow's own random ops keep a hidden state per op inside a ``tf.function``, which no
    seed set from outside resets: a worker that joined would draw other masks than the run it
    continues. So each layer draws from a generator whose state is a variable set here:
    Keras 3's layers have one (``seed_generator``); Keras 2's (``tf_keras``) draw from
    stateful ops unless their ``RandomGenerator`` is "stateful" (a ``tf.random.Generator``),
    which they are given here, before the training function is traced. The saved model is
    the same: a layer's generator is not among its weights. A random op a custom layer calls
    itself (``tf.random.uniform``) is not covered."""

    def __init__(self, model: Any) -> None:
        self.resets: list[Any] = []
        for layer in model._flatten_layers(include_self=False, recursive=True):
            seeds = getattr(layer, "seed_generator", None)  # Keras 3
            if seeds is not None and hasattr(seeds, "state"):
                self.resets.append(_keras3_reset(seeds.state))
                continue
            generator = getattr(layer, "_random_generator", None)  # Keras 2
            if generator is not None and hasattr(generator, "_rng_type"):
                stateful = type(generator)(seed=0, rng_type=generator.RNG_STATEFUL)
                stateful._maybe_init()
                layer._random_generator = stateful
                self.resets.append(stateful._generator.reset_from_seed)

    def reseed(self, seed: int) -> None:
        for i, reset in enumerate(self.resets):
            reset((seed + i * 0x9E3779B97F4A7C15) % (1 << 63))  # a stream per layer


def _keras3_reset(state: Any) -> Any:
    def reset(seed: int) -> None:
        state.assign(np.array([seed, 0], dtype=np.int64).astype(str(state.dtype)))

    return reset


class KerasModel:
    """One Keras model, its loss, optimizer and metrics, as the training loop uses them."""

    def __init__(self, fm: Any) -> None:
        self.model = fm.model
        self.keras = keras_of(fm.model)
        custom = fm.keras_custom_objects
        self.loss = resolve_loss(fm.loss_function, self.keras, custom)
        self.optimizer = resolve_optimizer(fm.optimizer, self.keras)
        named = [resolve_metric(m, self.keras, custom) for m in fm.metrics]
        self.metric_names = [n for n, _ in named]
        self.metric_fns = [f for _, f in named]
        self.variables: list[Any] = []
        self._grad_fn: Any = None

    def build(self, x: Any) -> None:
        """Create the weights (a subclassed model has none before its first call) and the
        optimizer's slots, so that every member holds the same variables in the same order."""
        if not self.model.built:
            self.model(x, training=False)
        self.variables = list(self.model.trainable_variables)
        if not (getattr(self.optimizer, "built", False)
                or getattr(self.optimizer, "_built", False)):
            self.optimizer.build(self.variables)
        self.size = int(sum(np.prod(v.shape) for v in self.variables))
        self.random_layers = RandomLayers(self.model)
        self._grad_fn = tf.function(self._gradients, reduce_retracing=True)

    def reseed(self, seed: int) -> None:
        """Start every random layer's draws (Dropout's masks) from ``seed``: the runtime
        gives each micro-batch its own, so a mask follows the micro-batch, not the worker."""
        self.random_layers.reseed(seed)

    def _gradients(self, x: Any, y: Any, scale: Any) -> tuple[Any, Any, Any]:
        with tf.GradientTape() as tape:
            out = self.model(x, training=True)
            loss = tf.reduce_mean(self.loss(y, out))
            scaled = loss * tf.cast(scale, loss.dtype)  # inside the tape, or it is not seen
        grads = tape.gradient(scaled, self.variables)
        flat = [tf.reshape(tf.cast(g, tf.float64), [-1]) if g is not None
                else tf.zeros([int(np.prod(v.shape))], tf.float64)
                for g, v in zip(grads, self.variables, strict=True)]
        return loss, out, tf.concat(flat, 0)

    def micro_batch(self, x: Any, y: Any, scale: float) -> tuple[float, list[float], np.ndarray]:
        """``(loss, metric values, gradients scaled by scale as one float64 vector)``."""
        loss, out, flat = self._grad_fn(x, y, tf.constant(scale, tf.float64))
        values = [_mean(fn(y, out)) for fn in self.metric_fns]
        return float(loss), values, flat.numpy()

    def evaluate(self, x: Any, y: Any) -> tuple[float, list[float]]:
        out = self.model(x, training=False)
        loss = _mean(self.loss(y, out))
        return loss, [_mean(fn(y, out)) for fn in self.metric_fns]

    def apply(self, flat: np.ndarray) -> None:
        """One optimizer step with the group's summed gradients."""
        grads, at = [], 0
        for v in self.variables:
            n = int(np.prod(v.shape))
            grads.append(tf.cast(tf.reshape(flat[at:at + n], v.shape), v.dtype))
            at += n
        self.optimizer.apply_gradients(zip(grads, self.variables, strict=True))

    def save_keras(self) -> bytes:
        """The model in Keras's own format (``.keras``: architecture, weights and, compiled,
        the optimizer's state), as ``keras.models.load_model`` reads it."""
        with tempfile.TemporaryDirectory(prefix="edt-keras-") as folder:
            path = os.path.join(folder, "model.keras")
            try:
                self.model.compile(optimizer=self.optimizer, loss=self.loss)
            except Exception:  # noqa: BLE001, S110 - saved uncompiled: weights and architecture
                pass
            self.model.save(path)
            with open(path, "rb") as f:
                return f.read()


def _mean(value: Any) -> float:
    return float(np.mean(np.asarray(value, dtype=np.float64)))


class KerasState:
    """The training state of a Keras model as the runtime's blob (the same ``edt-state/1``
    container the PyTorch path moves, so the driver, joiners and checkpoints handle it
    unchanged): the weights by position and name, the optimizer's variables, the position,
    and in what is uploaded for the results, the model as a ``.keras`` file."""

    def __init__(self, km: KerasModel) -> None:
        self.km = km
        self.pos = Position()
        self.has_state = False

    def _snapshot(self) -> dict[str, Any]:
        model = {f"{i:04d}:{w.name}": torch.from_numpy(np.array(w.numpy()))
                 for i, w in enumerate(self.km.model.weights)}
        opt = {f"{i:04d}:{v.name}": torch.from_numpy(np.array(v.numpy()))
               for i, v in enumerate(optimizer_variables(self.km.optimizer))}
        return {"format": "edt-state/1", "framework": "keras", "model": model,
                "optimizer": opt, "position": self.pos.as_dict()}

    def blob(self) -> bytes:
        return dumps(self._snapshot())

    def upload_blob(self) -> bytes:
        st = self._snapshot()
        st["keras_file"] = torch.frombuffer(bytearray(self.km.save_keras()), dtype=torch.uint8)
        return dumps(st)

    def load(self, blob: bytes) -> None:
        st = loads(blob)
        if st.get("framework") != "keras":
            raise UserCodeError("the job's saved state is not a Keras model's (was the "
                                "script changed from PyTorch to TensorFlow?)")
        _assign(self.km.model.weights, st["model"], "model weights")
        _assign(optimizer_variables(self.km.optimizer), st["optimizer"], "optimizer state")
        self.pos = Position(**st["position"])

    def progress(self) -> int:
        from .state import PROGRESS_EPOCH

        return self.pos.epoch * PROGRESS_EPOCH + self.pos.global_step if self.has_state else -1


def _assign(variables: list[Any], saved: dict[str, torch.Tensor], what: str) -> None:
    values = [saved[k] for k in sorted(saved)]
    if len(values) != len(variables):
        raise UserCodeError(f"the saved {what} has {len(values)} variables, the model "
                            f"{len(variables)}: the model changed since it was saved")
    for var, value in zip(variables, values, strict=True):
        if tuple(var.shape) != tuple(value.shape):
            raise UserCodeError(f"the saved {what} does not fit {var.name}: shape "
                                f"{tuple(value.shape)}, the model's {tuple(var.shape)}")
        var.assign(value.numpy())
