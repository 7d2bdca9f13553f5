"""Logger and user callbacks written the way each WMLA release writes them are called the way
they are declared."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from runtime.callbacks import Callback, LoggerCallback, UserCallbacks, call, log_metrics
from runtime.reports import Reports
from runtime.wmla import ELog, EMetrics


class OldStyle(LoggerCallback):
    """WMLA 1.2.3 / 2.2 / 2.3 samples: two numbers, the accuracy in percent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def log_train_metrics(self, loss, acc, completed_batch, worker=0):  # noqa: ANN001, ANN201
        self.calls.append(("train", (float(loss), acc / 100.0, completed_batch, worker)))

    def log_test_metrics(self, loss, acc, completed_batch, worker=0):  # noqa: ANN001, ANN201
        self.calls.append(("test", (float(loss), acc / 100.0, completed_batch, worker)))


class Wmla4Style(LoggerCallback):
    """WMLA 4.x samples: a metrics dict; ``worker`` has a default."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def log_train_metrics(self, metrics, completed_batch, epoch, worker=0):  # noqa: ANN001, ANN201
        self.calls.append(("train", (dict(metrics), completed_batch, epoch, worker)))

    def log_test_metrics(self, metrics, completed_batch, epoch):  # noqa: ANN001, ANN201
        self.calls.append(("test", (dict(metrics), completed_batch, epoch)))


class DocStyle:
    """The runtime's documented names, no base class."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def log_train_metrics(self, metrics, iteration, epoch, workers):  # noqa: ANN001, ANN201
        self.calls.append(("train", (dict(metrics), iteration, epoch, workers)))

    def log_test_metrics(self, metrics, iteration, epoch):  # noqa: ANN001, ANN201
        self.calls.append(("test", (dict(metrics), iteration, epoch)))


class VarArgs:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def log_train_metrics(self, *args):  # noqa: ANN002, ANN201
        self.calls.append(args)


def test_old_style_callbacks_get_loss_and_accuracy_in_percent() -> None:
    cb = OldStyle()
    log_metrics(cb, "log_train_metrics", {"loss": 0.5, "accuracy": 0.25}, 7, 1, 2)
    log_metrics(cb, "log_test_metrics", {"loss": 0.4, "accuracy": 0.75}, 8, 1, 2)
    assert cb.calls == [("train", (0.5, 0.25, 7, 2)), ("test", (0.4, 0.75, 8, 2))]


def test_old_style_callbacks_get_nan_when_the_model_reports_no_accuracy() -> None:
    cb = OldStyle()
    log_metrics(cb, "log_train_metrics", {"loss": 0.5}, 3, 0, 1)
    (_, (loss, acc, batch, worker)), = cb.calls
    assert (loss, batch, worker) == (0.5, 3, 1)
    assert math.isnan(acc)


def test_a_single_metric_of_another_name_is_the_accuracy() -> None:
    cb = OldStyle()
    log_metrics(cb, "log_train_metrics", {"loss": 1.0, "metric_0": 0.5}, 1, 0, 1)
    assert cb.calls[0][1][1] == 0.5


def test_wmla4_callbacks_get_the_metrics_dict() -> None:
    cb = Wmla4Style()
    log_metrics(cb, "log_train_metrics", {"loss": 0.5, "accuracy": 0.25}, 7, 1, 3)
    log_metrics(cb, "log_test_metrics", {"loss": 0.4}, 8, 1, 3)
    assert cb.calls == [("train", ({"loss": 0.5, "accuracy": 0.25}, 7, 1, 3)),
                        ("test", ({"loss": 0.4}, 8, 1))]


def test_documented_callbacks_and_varargs_get_every_argument() -> None:
    doc, var = DocStyle(), VarArgs()
    log_metrics(doc, "log_train_metrics", {"loss": 0.5}, 7, 1, 3)
    log_metrics(doc, "log_test_metrics", {"loss": 0.4}, 8, 2, 3)
    log_metrics(var, "log_train_metrics", {"loss": 0.5}, 7, 1, 3)
    assert doc.calls == [("train", ({"loss": 0.5}, 7, 1, 3)), ("test", ({"loss": 0.4}, 8, 2))]
    assert var.calls == [({"loss": 0.5}, 7, 1, 3)]


def test_a_logger_without_the_method_is_skipped() -> None:
    log_metrics(object(), "log_test_metrics", {"loss": 0.4}, 8, 2, 3)


def test_reports_call_old_style_loggers_for_train_and_test() -> None:
    """The failure the issue saw: ``float(loss)`` on a metrics dict in the test call."""
    cb = OldStyle()
    reports = Reports(cb, metrics_interval_s=1000.0)
    reports.handle({"kind": "train", "epoch": 0, "iteration": 1, "steps_per_epoch": 2,
                    "global_step": 1, "metrics": {"loss": 2.0, "accuracy": 0.5},
                    "samples": 4, "workers": 2})
    reports.handle({"kind": "test", "epoch": 0, "metrics": {"loss": 1.5, "accuracy": 0.75},
                    "samples": 8})
    assert cb.calls == [("train", (2.0, 0.5, 1, 2)), ("test", (1.5, 0.75, 1, 2))]


class EpochSaveModel(Callback):
    """WMLA 2.3 sample: ``on_epoch_end(self, epoch, save_model=False)``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def on_epoch_end(self, epoch, save_model=False):  # noqa: ANN001, ANN201
        self.seen.append((epoch, save_model))


class KerasStyle(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def on_epoch_end(self, epoch, logs=None):  # noqa: ANN001, ANN201
        self.seen.append(("epoch", epoch, logs))

    def on_batch_end(self, batch, logs):  # noqa: ANN001, ANN201
        self.seen.append(("batch", batch, logs))

    def on_epoch_begin(self, epoch):  # noqa: ANN001, ANN201
        self.seen.append(("begin", epoch))


def test_user_callbacks_get_only_the_arguments_they_declare() -> None:
    a, b = EpochSaveModel(), KerasStyle()
    cbs = UserCallbacks([a, b], model="m", params={"epochs": 2})
    cbs.fire("on_epoch_begin", 0)
    cbs.fire("on_batch_end", 3, {"loss": 1.0})
    cbs.fire("on_epoch_end", 1, {"loss": 0.5})
    cbs.fire("on_train_end")
    assert a.seen == [(1, False)]  # its own default, not the logs dict
    assert b.seen == [("begin", 0), ("batch", 3, {"loss": 1.0}), ("epoch", 1, {"loss": 0.5})]
    assert a.params == {"epochs": 2} and a.model == "m"


def test_call_passes_a_defaulted_parameter_only_under_its_name() -> None:
    seen: list[tuple] = []

    class Obj:
        def m(self, x, flag=None):  # noqa: ANN001, ANN201
            seen.append((x, flag))

    call(Obj(), "m", 1, 2, names=(frozenset({"x"}), frozenset({"other"})))
    call(Obj(), "m", 1, 2, names=(frozenset({"x"}), frozenset({"flag"})))
    assert seen == [(1, None), (1, 2)]
    assert call(Obj(), "missing", 1) is None


def test_elog_leaves_out_a_metric_the_model_does_not_report(capsys: pytest.CaptureFixture) -> None:
    with ELog.open() as log:
        log.recordTrain("Train", 3, 4, 0.5, math.nan, 0)
        log.recordTest("Test", 0.25, math.nan / 100.0, 0)
        log.recordTrain("Train", 5, 6, {"loss": 0.5})
        log.recordTest("Test", 0.25, 0.0, 0)
        log.recordText("on_epoch_end, epoch=1")
    lines = capsys.readouterr().out.splitlines()
    assert "Accuracy" not in lines[0] and "Accuracy" not in lines[1]
    assert lines[0].endswith("Iteration: 3,\tLoss: 0.5")
    assert lines[1].endswith("Loss: 0.25")
    assert "Accuracy" not in lines[2]
    assert lines[3].endswith("Loss: 0.25,\tAccuracy: 0")  # a real 0 is still shown
    assert lines[4].endswith("] on_epoch_end, epoch=1") and lines[4].startswith("[")


def test_emetrics_leaves_out_nan_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESULT_DIR", str(tmp_path))
    with EMetrics.open() as em:
        em.record(EMetrics.TEST_GROUP, 2, {"loss": 0.5, "accuracy": math.nan})
    record = json.loads((tmp_path / "evaluation-metrics.txt").read_text())
    assert record["values"] == {"loss": {"type": 3, "value": 0.5}}


def test_default_logger_lines_show_no_accuracy_without_a_metric(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from runtime.callbacks import ELogLogger

    reports = Reports(ELogLogger(str(tmp_path)), metrics_interval_s=1000.0)
    reports.handle({"kind": "train", "epoch": 0, "iteration": 1, "steps_per_epoch": 1,
                    "global_step": 1, "metrics": {"loss": 2.0}, "samples": 4, "workers": 1})
    reports.handle({"kind": "test", "epoch": 0, "metrics": {"loss": 1.5}, "samples": 8})
    out = [line for line in capsys.readouterr().out.splitlines()
           if "Train," in line or "Test," in line]
    assert len(out) == 2 and not any("Accuracy" in line for line in out), out


def test_default_logger_appends_each_record_at_once_and_numbers_them(tmp_path: Path) -> None:
    from runtime.callbacks import ELogLogger

    result = tmp_path / "result"  # made by the first record
    result_file = result / "evaluation-metrics.txt"
    logger = ELogLogger(str(result))
    logger.log_train_metrics({"loss": 2.0}, 1, 0, 1)
    # Flushed as it is recorded: a reader of the running job's file sees it at once.
    first = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert [r["meta"]["rindex"] for r in first] == [1]
    logger.log_train_metrics({"loss": 1.5}, 2, 0, 1)
    logger.log_test_metrics({"loss": 1.0}, 1, 0)
    logger.on_train_end()
    logger.log_test_metrics({"loss": 0.9}, 1, 1)  # after the end: appended, not lost
    records = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert [(r["grouplabel"], r["meta"]["rindex"]) for r in records] == [
        ("Train", 1), ("Train", 2), ("Test", 3), ("Test", 4)]
    assert records[1]["values"] == {"loss": {"type": 3, "value": 1.5}}
