#! /usr/bin/env python
# ruff: noqa - written as WMLA users write their model folders, on purpose
# A logger callback of the WMLA 4.x samples' shape: a metrics dict.
from __future__ import print_function

import elog
from callbacks import LoggerCallback
from elog import ELog
from emetrics import EMetrics

print("EDTCALLBACK elog from", elog.MARK, flush=True)


class EDTLoggerCallback(LoggerCallback):
    def __init__(self):
        self.gs = 0

    def log_train_metrics(self, metrics, completed_batch, epoch, worker=0):
        self.gs += 1
        with EMetrics.open() as em:
            em.record(EMetrics.TEST_GROUP, completed_batch, metrics)
        with ELog.open() as log:
            log.recordTrain("Train", completed_batch, self.gs, metrics)

    def log_test_metrics(self, metrics, completed_batch, epoch):
        with ELog.open() as log:
            log.recordTest("Test", metrics)
