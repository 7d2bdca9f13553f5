#! /usr/bin/env python
# ruff: noqa - written as WMLA users write their model folders, on purpose
# Callbacks of the WMLA TensorFlow samples' shape: callbacks, elog and emetrics come from the
# product.
from callbacks import LoggerCallback
from elog import ELog
from emetrics import EMetrics


class EDTLoggerCallback(LoggerCallback):
    def __init__(self):
        self.gs = 0

    def log_train_metrics(self, loss, acc, completed_batch, worker=0):
        acc = acc / 100.0
        self.gs += 1
        with EMetrics.open() as em:
            em.record(EMetrics.TEST_GROUP, completed_batch, {"loss": loss, "accuracy": acc})
        with ELog.open() as log:
            log.recordTrain("Train", completed_batch, self.gs, loss, acc, worker)

    def log_test_metrics(self, loss, acc, completed_batch, worker=0):
        acc = acc / 100.0
        with ELog.open() as log:
            log.recordTest("Test", loss, acc, worker)
