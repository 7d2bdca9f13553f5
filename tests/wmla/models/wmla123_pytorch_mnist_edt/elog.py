# ruff: noqa - written as WMLA users write their model folders, on purpose
# An ELog of the WMLA 1.2.3 / 2.2 samples' shape: two numbers per line, written to
# $LOG_DIR/stdout (this folder's own copy must win over the product's).
import os
import time
from pathlib import PurePath

MARK = "model-folder-elog-1.2.3"


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
        if "LOG_DIR" in os.environ:
            folder = os.environ["LOG_DIR"]
        elif "JOB_STATE_DIR" in os.environ:
            folder = str(PurePath(os.environ["JOB_STATE_DIR"], "logs"))
        else:
            folder = "/tmp"
        if subId is not None:
            folder = str(PurePath(folder, subId))
        if not os.path.exists(folder):
            os.makedirs(folder)
        return ELog(subId, open(str(PurePath(folder, "stdout")), "a"))

    def recordText(self, text):
        stamp = "[" + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()) + "]"
        if self.f:
            self.f.write(stamp + " " + text + "\n")
            self.f.flush()

    def recordTrain(self, title, iteration, global_steps, loss, accuracy, worker):
        text = title + ",\tTimestamp: " + str(int(round(time.time() * 1000)))
        text += ",\tGlobal steps: " + str(global_steps)
        text += ",\tIteration: " + str(iteration)
        text += ",\tLoss: " + str(float("%.5f" % loss))
        text += ",\tAccuracy: " + str(float("%.5f" % accuracy))
        self.recordText(text)

    def recordTest(self, title, loss, accuracy, worker):
        text = title + ",\tTimestamp: " + str(int(round(time.time() * 1000)))
        text += ",\tLoss: " + str(float("%.5f" % loss))
        text += ",\tAccuracy: " + str(float("%.5f" % accuracy))
        self.recordText(text)

    def close(self):
        if self.f:
            self.f.close()
