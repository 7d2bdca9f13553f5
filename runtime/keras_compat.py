"""What WMLA's TensorFlow samples relied on in their era's Keras, made true again in Keras 2
(``tf_keras``, the ``tf.keras`` of ``TF_USE_LEGACY_KERAS=1``).

``tf.keras.optimizers.Adam(lr=0.001)``: Keras up to TensorFlow 2.10 took ``lr`` as the
learning rate; ``tf_keras``'s optimizers (2.11 on) log that ``lr`` is deprecated and *drop
it*, so a sample asking for ``lr=0.01`` silently trains at the default 0.001. Here ``lr`` is
the learning rate again when ``learning_rate`` is not given. Keras 3 refuses ``lr`` with an
error naming it, which needs nothing.

Nothing here imports TensorFlow: :func:`honour_lr` patches ``tf_keras`` only when the script
has loaded TensorFlow already (a PyTorch job never does).
"""

from __future__ import annotations

import os
import sys
from typing import Any


def legacy_keras_wanted() -> bool:
    return os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes")


def honour_lr() -> bool:
    """Make ``lr=`` the learning rate of ``tf_keras`` optimizers; returns whether patched."""
    if "tensorflow" not in sys.modules and "tf_keras" not in sys.modules:
        return False
    if "tf_keras" not in sys.modules and not legacy_keras_wanted():
        return False
    try:
        from tf_keras.src.optimizers import optimizer as base
    except ImportError:
        return False
    cls = base._BaseOptimizer
    if getattr(cls, "_edt_honours_lr", False):
        return True
    process, build = cls._process_kwargs, cls._build_learning_rate

    def _process_kwargs(self: Any, kwargs: dict[str, Any]) -> None:
        lr = kwargs.pop("lr", None)
        if lr is not None:
            self._edt_lr = lr
        process(self, kwargs)

    def _build_learning_rate(self: Any, learning_rate: Any) -> Any:
        lr = self.__dict__.pop("_edt_lr", None)
        return build(self, lr if lr is not None else learning_rate)

    cls._process_kwargs = _process_kwargs
    cls._build_learning_rate = _build_learning_rate
    cls._edt_honours_lr = True
    return True
