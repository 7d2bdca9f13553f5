# ruff: noqa - written as WMLA users write their model folders, on purpose
# An ELog of the WMLA 4.x samples' shape: a metrics dict per line, written to $LOG_DIR/stdout.
import os
import time
from pathlib import PurePath

MARK = "model-folder-elog-4.x"


class ELog(object):
    def __init__(self, subId, f):
        self.trainingId = os.environ.get("TRAINING_ID", os.environ.get("DLI_EXECID", ""))
        self.subId = subId
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, type, value, tb):
        self.close()

    @staticmethod
    def open(subId=None):
        folder = os.environ.get("LOG_DIR", "/tmp")
        if subId is not None:
            folder = str(PurePath(folder, subId))
        os.makedirs(folder, exist_ok=True)
        return ELog(subId, open(str(PurePath(folder, "stdout")), "a"))

    def recordText(self, text):
        stamp = "[" + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()) + "]"
        if self.f:
            self.f.write(stamp + " " + text + "\n")
            self.f.flush()

    def recordTrain(self, title, iteration, global_steps, metrics):
        text = title + ",\tTimestamp: " + str(int(round(time.time() * 1000)))
        text += ",\tGlobal steps: " + str(global_steps)
        text += ",\tIteration: " + str(iteration)
        for name, value in metrics.items():
            text += ",\t{}: ".format(name) + str(float("%.5f" % value))
        self.recordText(text)

    def recordTest(self, title, metrics):
        text = title + ",\tTimestamp: " + str(int(round(time.time() * 1000)))
        for name, value in metrics.items():
            text += ",\t{}: ".format(name) + str(float("%.5f" % value))
        self.recordText(text)

    def close(self):
        if self.f:
            self.f.close()
