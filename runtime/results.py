"""Where the state rank 0 hands over ends up: result files, announced as events.

The driver does this with what its workers upload; a standalone run does it itself. Both
write through :class:`runtime.checkpoint.ResultWriter` (atomic, fenced by the job attempt)
and announce each file written (``checkpoint.saved``, ``model.saved``).
"""

from __future__ import annotations

from . import checkpoint, events
from .config import KEEP_EPOCH_MODELS


class Results:
    """A job's checkpoints, final model and ONNX file."""

    def __init__(self, result_dir: str | None, checkpoint_dir: str | None,
                 keep_epoch_models: int = KEEP_EPOCH_MODELS, keep_best_by: str = "") -> None:
        self.writer = checkpoint.ResultWriter(result_dir, checkpoint_dir,
                                              keep_epoch_models=keep_epoch_models,
                                              keep_best_by=keep_best_by)

    def note_test(self, epoch: int, metrics: dict[str, float]) -> None:
        """An epoch's test metrics: the best epoch by ``keep_best_by`` keeps its model files."""
        best = self.writer.note_test(epoch, metrics)
        if best:
            events.emit("checkpoint.best", epoch=best["epoch"], metric=best["metric"],
                        value=best["value"])

    def save_checkpoint(self, blob: bytes) -> None:
        manifest = self.writer.save_checkpoint(blob)
        if manifest:
            events.emit("checkpoint.saved", path=manifest["path"], epoch=manifest["epoch"],
                        sha256=manifest["sha256"])

    def save_final(self, blob: bytes) -> None:
        for path in self.writer.save_final(blob):
            events.emit("model.saved", path=path, format=path.rsplit(".", 1)[-1])

    def save_onnx(self, onnx_bytes: bytes) -> None:
        for path in self.writer.save_onnx(onnx_bytes):
            events.emit("model.saved", path=path, format="onnx")
