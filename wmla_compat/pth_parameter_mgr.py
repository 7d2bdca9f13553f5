"""WMLA's ``pth_parameter_mgr``: the hyper-parameters the job was submitted with.

See :mod:`runtime.wmla` for where they come from (``EDT_HPARAMS`` / ``EDT_HPARAMS_FILE``).
"""

from runtime.wmla import (
    expose_module_names,
    getEpoch,
    getLearningRate,
    getOptimizer,
    getTestBatchSize,
    getTestData,
    getTrainBatchSize,
    getTrainData,
)

expose_module_names()

__all__ = [
    "getEpoch",
    "getLearningRate",
    "getOptimizer",
    "getTestBatchSize",
    "getTestData",
    "getTrainBatchSize",
    "getTrainData",
]
