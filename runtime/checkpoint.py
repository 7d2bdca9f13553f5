"""Result files: checkpoints (atomic), the final model, ONNX, in WMLA's layout.

Layout under ``RESULT_DIR``::

    checkpoint/edt_state.pth        latest full training state (model, optimizer, position)
    checkpoint/manifest.json        {"file", "sha256", "bytes", "epoch", "position", "ts"}
    model/train/model_epoch_<N>.pth           model state_dict after epoch N (1-based)
    model/train/model_epoch_<N>_optimizer_state.pth
    model/train/model_epoch_final.pth (+ _optimizer_state.pth), model/model.onnx

Every file is written to a temporary name in the same folder, fsynced, then renamed,
so a crash leaves either the old file or the new one, never half of one. The manifest
is written last; a checkpoint whose sha256 does not match it is ignored.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import time
from typing import Any

import torch

from . import state as state_mod

STATE_FILE = "edt_state.pth"
MANIFEST = "manifest.json"


def atomic_write(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide results from the console
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_latest(checkpoint_dir: str | None) -> bytes | None:
    """The latest verified state blob, or None when there is none (or it is corrupt)."""
    if not checkpoint_dir:
        return None
    manifest_path = os.path.join(checkpoint_dir, MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        with open(os.path.join(checkpoint_dir, manifest["file"]), "rb") as f:
            data = f.read()
    except (OSError, ValueError, KeyError):
        return None
    if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        return None
    state_mod.loads(data)  # refuses anything that is not a training state
    return data


class ResultWriter:
    """Writes a job's results; used by the driver and by standalone training."""

    def __init__(self, result_dir: str | None, checkpoint_dir: str | None) -> None:
        self.result_dir = result_dir
        self.checkpoint_dir = checkpoint_dir

    @property
    def train_model_dir(self) -> str | None:
        return os.path.join(self.result_dir, "model", "train") if self.result_dir else None

    def save_checkpoint(self, blob: bytes) -> dict[str, Any] | None:
        """Atomically write a state blob and its manifest; returns the manifest."""
        if not self.checkpoint_dir:
            return None
        st = state_mod.loads(blob)
        pos = st["position"]
        path = os.path.join(self.checkpoint_dir, STATE_FILE)
        atomic_write(path, blob)
        manifest = {
            "file": STATE_FILE,
            "path": path,
            "sha256": hashlib.sha256(blob).hexdigest(),
            "bytes": len(blob),
            "epoch": pos["epoch"],
            "position": pos,
            "ts": time.time(),
        }
        atomic_write(
            os.path.join(self.checkpoint_dir, MANIFEST), json.dumps(manifest, indent=1).encode()
        )
        self._save_model_files(st, str(pos["epoch"]))
        return manifest

    def save_final(self, blob: bytes) -> list[str]:
        return self._save_model_files(state_mod.loads(blob), "final")

    def save_onnx(self, onnx_bytes: bytes) -> list[str]:
        if not self.result_dir:
            return []
        path = os.path.join(self.result_dir, "model", "model.onnx")
        atomic_write(path, onnx_bytes)
        return [path]

    def _save_model_files(self, st: dict[str, Any], tag: str) -> list[str]:
        folder = self.train_model_dir
        if not folder:
            return []
        model_path = os.path.join(folder, f"model_epoch_{tag}.pth")
        opt_path = os.path.join(folder, f"model_epoch_{tag}_optimizer_state.pth")
        atomic_write(model_path, _torch_bytes(st["model"]))
        atomic_write(opt_path, _torch_bytes(st["optimizer"]))
        return [model_path, opt_path]
