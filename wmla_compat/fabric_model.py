"""WMLA's module name for the EDT API: ``from fabric_model import FabricModel``.

Importing it also makes WMLA's ``callbacks``, ``elog`` and ``emetrics`` importable where they are
not on the path (a model folder's own copies still come first): see
:func:`runtime.wmla.expose_module_names`.
"""

from runtime import FabricModel
from runtime.keras_compat import honour_lr
from runtime.wmla import expose_module_names

expose_module_names()
# A TensorFlow sample imports TensorFlow first: its tf.keras optimizers take ``lr=`` again.
honour_lr()

__all__ = ["FabricModel"]
