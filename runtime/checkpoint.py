"""Result files: checkpoints (atomic, verified, with history), the final model, ONNX.

Layout under ``RESULT_DIR`` (WMLA's, plus the history of checkpoints)::

    checkpoint/edt_state.pth        latest full training state (model, optimizer, position)
    checkpoint/edt_state.<seq>.pth  the previous ones, newest first in the manifest (KEEP in all)
    checkpoint/manifest.json        {"file", "path", "sha256", "bytes", "epoch", "position",
                                     "ts", "seq", "checkpoints": [entry, ...]}
    model/train/model_epoch_<N>.pth           model state_dict after epoch N (1-based)
    model/train/model_epoch_<N>_optimizer_state.pth
    model/train/model_epoch_final.pth (+ _optimizer_state.pth), model/model.onnx
    (a Keras model: model_epoch_<N>.keras and model_epoch_final.keras instead of the .pth)

Every file is written to a temporary name in the same folder (``.tmp-<pid>@<host>-*``),
fsynced, then renamed, so a crash leaves either the old file or the new one, never half of
one; a failed write removes its temporary file, and the next write or load removes those a
killed writer left behind. Each manifest entry (``seq``, ``file``, ``sha256``, ``bytes``,
``epoch``, ``position``, ``ts``) describes one state; the manifest is written last.

A new checkpoint ``n`` is saved as: write and fsync the temporary file; rename the current
``edt_state.pth`` (checkpoint ``n-1``) to ``edt_state.<n-1>.pth``; rename the temporary file
to ``edt_state.pth``; write the manifest; delete states beyond ``keep``. A crash between
two of these steps leaves a manifest whose entries each sit under ``edt_state.pth`` or
``edt_state.<seq>.pth``, so loading looks for an entry's bytes under both names and trusts
only a file whose size and sha256 match.

Loading walks the manifest newest first and takes the first state that is intact (size and
sha256 match) and is a plain training state read with ``torch.load(weights_only=True)``:
a pickle that would run code is refused, never executed. Each state skipped is reported
(a ``[edt] checkpoint:`` line on stderr and a ``checkpoint.skipped`` event). A checkpoint
that cannot be written (disk full, I/O error) is reported the same way
(``checkpoint.failed``) and training goes on from memory; the previous checkpoints stay.

Fencing: a job may have a stale attempt still running (a superseded driver on a partitioned
host, a redelivered launch). The host agent raises ``checkpoint/.attempt`` to the attempt it
is starting (:func:`advance_fence`, never lowered, under an exclusive ``flock``); a writer
that knows its own attempt (``EDT_ATTEMPT``) commits a checkpoint, the final model or the
ONNX file only while holding a shared lock on that file and reading an attempt no newer than
its own. A stale attempt's write is refused (``checkpoint.fenced``), so once the agent has
started attempt ``n``, no attempt before ``n`` changes the job's results.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import socket
import stat
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from . import events
from . import state as state_mod
from .config import KEEP_EPOCH_MODELS, attempt_from_environ, best_by

STATE_FILE = "edt_state.pth"
MANIFEST = "manifest.json"
KEEP = 3  # the latest checkpoint and the two before it
# The best epoch by the job's chosen test metric (EDT_KEEP_BEST_BY), beside its model files.
BEST_FILE = "best.json"
_EPOCH_MODEL = re.compile(r"^model_epoch_(\d+)(?:(?:_optimizer_state)?\.pth|\.keras)$")
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600.0  # a temporary file this old is stale even if its writer looks alive

FENCE_FILE = ".attempt"
FENCE_LOCK_WAIT_S = 30.0  # how long advance_fence waits for writers still committing

_TMP_NAME = re.compile(r"^\.tmp-(\d+)@(.*)-[^-]*$")
_NUMBERED = re.compile(r"^edt_state\.(\d+)\.pth$")


class CheckpointError(Exception):
    """A checkpoint that must not be loaded: missing, corrupt, or not a plain state."""


class _Fenced(Exception):
    """A newer attempt of the job has started: this writer's commit is refused."""


def _say(message: str) -> None:
    print(f"[edt] checkpoint: {message}", file=sys.stderr, flush=True)


def _fsync_dir(folder: str) -> None:
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(dir_fd)


def _tmp_prefix() -> str:
    return f"{TMP_PREFIX}{os.getpid()}@{socket.gethostname()}-"


def _write_tmp(folder: str, data: bytes) -> str:
    """Write ``data`` to a new temporary file in ``folder``, fsynced; returns its path.
    On any failure the temporary file is removed before the error propagates."""
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(), dir=folder)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide results from the console
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file, fsync, rename, fsync the folder."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = _write_tmp(folder, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def clean_stale_tmp(folder: str | None, max_age_s: float = STALE_TMP_S) -> list[str]:
    """Remove temporary files left by writers that died (SIGKILL, power loss) in ``folder``.

    A file is stale when its writer was a process on this host that no longer exists, or
    when it is older than ``max_age_s`` (writers on other hosts sharing the folder). Files
    of live writers, this process included, are left alone. Returns the paths removed."""
    if not folder or not os.path.isdir(folder):
        return []
    host, now, removed = socket.gethostname(), time.time(), []
    for name in os.listdir(folder):
        if not name.startswith(TMP_PREFIX):
            continue
        path = os.path.join(folder, name)
        m = _TMP_NAME.match(name)
        try:
            age = now - os.stat(path).st_mtime
        except OSError:
            continue
        stale = age > max_age_s
        if not stale and m and m.group(2) == host:
            pid = int(m.group(1))
            stale = pid != os.getpid() and not _alive(pid)
        if stale:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# -- fencing -----------------------------------------------------------------------------


def _parse_fence(raw: bytes) -> int | None:
    try:
        return int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None  # empty (never written, or torn by a crash): no fence


def _open_fence(checkpoint_dir: str, flags: int) -> int:
    # The job may own its folders: never follow a link it put there (the agent runs as root).
    # Nor be held up by a FIFO planted in its place: open without blocking, and accept only a
    # plain file.
    dir_fd = os.open(checkpoint_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fd = os.open(FENCE_FILE, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    # A second name may be the job's hard link to a file of the host's, which the agent (root)
    # would otherwise truncate and write.
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        raise OSError(f"{checkpoint_dir}/{FENCE_FILE} is not a plain file with one name")
    return fd


def read_fence(checkpoint_dir: str | None) -> int | None:
    """The newest attempt the agent started for this job, or None when there is no fence."""
    if not checkpoint_dir:
        return None
    try:
        fd = _open_fence(checkpoint_dir, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return _parse_fence(os.pread(fd, 64, 0))
    finally:
        os.close(fd)


def advance_fence(checkpoint_dir: str, attempt: int, wait_s: float = FENCE_LOCK_WAIT_S) -> int:
    """Raise the job's fence to ``attempt`` (never lower it); returns the fence now, which is
    newer than ``attempt`` when a later attempt got there first.

    Waits up to ``wait_s`` for writers committing under a shared lock; past that (a writer
    frozen mid-commit) the fence is raised anyway, and that one commit may still land."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    fd = _open_fence(checkpoint_dir, os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    _say(f"a writer holds {FENCE_FILE} for over {wait_s:.0f}s; fencing anyway")
                    break
                time.sleep(0.01)
        current = _parse_fence(os.pread(fd, 64, 0))
        if current is not None and current >= attempt:
            return current
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{attempt}\n".encode(), 0)
        os.fsync(fd)
        return attempt
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def fenced(checkpoint_dir: str | None, attempt: int | None):
    """Yields whether ``attempt`` may commit now; while the block runs the fence cannot move
    past it (a shared lock). No attempt, or no fence file: always allowed."""
    if attempt is None or not checkpoint_dir:
        yield True
        return
    try:
        fd = _open_fence(checkpoint_dir, os.O_RDONLY)
    except FileNotFoundError:
        yield True
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        fence = _parse_fence(os.pread(fd, 64, 0))
        yield fence is None or fence <= attempt
    finally:
        os.close(fd)


# -- reading ----------------------------------------------------------------------------


def read_manifest(checkpoint_dir: str) -> dict[str, Any] | None:
    """The manifest, with ``checkpoints`` (entries newest first) filled in for manifests
    written before the history existed; None when there is none. Raises CheckpointError
    when it exists but cannot be read."""
    path = os.path.join(checkpoint_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from exc
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} is not a manifest")
    if "checkpoints" not in manifest and "sha256" in manifest:
        entry = {k: manifest.get(k) for k in ("file", "sha256", "bytes", "epoch", "position")}
        manifest["checkpoints"] = [{"seq": 0, **entry}]
    entries = manifest.get("checkpoints")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise CheckpointError(f"{path} has no list of checkpoints")
    return manifest


def _candidates(checkpoint_dir: str, entry: dict[str, Any]) -> list[str]:
    names = [os.path.basename(str(entry.get("file") or STATE_FILE))]
    if names[0] == STATE_FILE:
        # A write interrupted after its first rename left this one under its numbered name.
        names.append(f"edt_state.{entry.get('seq', 0)}.pth")
    return [os.path.join(checkpoint_dir, n) for n in names]


def read_entry(checkpoint_dir: str, entry: dict[str, Any]) -> bytes:
    """The verified blob of one manifest entry; raises CheckpointError saying why not."""
    want = entry.get("sha256")
    if not isinstance(want, str):
        raise CheckpointError("its manifest entry has no sha256")
    problems = []
    for path in _candidates(checkpoint_dir, entry):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        except OSError as exc:
            problems.append(f"{os.path.basename(path)}: {exc}")
            continue
        if entry.get("bytes") is not None and len(data) != entry["bytes"]:
            problems.append(f"{os.path.basename(path)} has {len(data)} bytes, "
                            f"the manifest says {entry['bytes']}")
            continue
        if hashlib.sha256(data).hexdigest() != want:
            problems.append(f"{os.path.basename(path)}: sha256 mismatch")
            continue
        check_state(data)
        return data
    raise CheckpointError("; ".join(problems) or "file missing")


def check_state(data: bytes) -> dict[str, Any]:
    """Load a state blob the only safe way (``weights_only=True``); CheckpointError if it is
    a pickle that would run code, or anything but an EDT training state."""
    try:
        return state_mod.loads(data)
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is not loadable
        text = str(exc)
        detail = next((ln.strip() for ln in text.splitlines() if "Unsupported global" in ln),
                      text.splitlines()[0] if text else type(exc).__name__)
        detail = detail.split(". Please use", 1)[0]  # torch's advice is to trust the file
        if "Weights only load failed" in text:
            raise CheckpointError(
                f"refused: not a plain weights-only training state, loading it would run "
                f"pickled code ({detail})") from exc
        raise CheckpointError(f"not an EDT training state ({type(exc).__name__}: {detail})"
                              ) from exc


def load_state_file(path: str) -> dict[str, Any]:
    """Read one state file (no manifest) with ``weights_only=True``; raises CheckpointError."""
    with open(path, "rb") as f:
        return check_state(f.read())


def load_latest(checkpoint_dir: str | None) -> bytes | None:
    """The newest verified state blob, or None when there is none.

    Corrupt, missing or refused states are skipped, newest first, each reported with the
    reason; temporary files left by a killed writer are removed."""
    if not checkpoint_dir or not os.path.isdir(checkpoint_dir):
        return None
    clean_stale_tmp(checkpoint_dir)
    try:
        manifest = read_manifest(checkpoint_dir)
    except CheckpointError as exc:
        _say(f"not resuming from a checkpoint: {exc}")
        events.emit("checkpoint.skipped", path=os.path.join(checkpoint_dir, MANIFEST),
                    epoch=None, reason=str(exc))
        return None
    if manifest is None:
        return None
    entries = manifest["checkpoints"]
    for i, entry in enumerate(entries):
        try:
            data = read_entry(checkpoint_dir, entry)
        except CheckpointError as exc:
            path = _candidates(checkpoint_dir, entry)[0]
            fallback = "the one before" if i + 1 < len(entries) else "none left"
            _say(f"skipping {os.path.basename(path)} (checkpoint {entry.get('seq')}, epoch "
                 f"{entry.get('epoch')}): {exc}; trying {fallback}")
            events.emit("checkpoint.skipped", path=path, epoch=entry.get("epoch"),
                        seq=entry.get("seq"), reason=str(exc))
            continue
        if i:
            _say(f"using checkpoint {entry.get('seq')} (epoch {entry.get('epoch')})")
        return data
    return None


# -- writing ----------------------------------------------------------------------------


class ResultWriter:
    """Writes a job's results; used by the driver and by standalone training."""

    def __init__(self, result_dir: str | None, checkpoint_dir: str | None,
                 keep: int = KEEP, *, attempt: int | None = None,
                 keep_epoch_models: int = KEEP_EPOCH_MODELS, keep_best_by: str = "") -> None:
        self.result_dir = result_dir
        self.checkpoint_dir = checkpoint_dir
        self.keep = max(1, keep)
        self.keep_epoch_models = max(0, keep_epoch_models)
        self.best_by = best_by(keep_best_by)
        # The job attempt this process belongs to (``EDT_ATTEMPT`` by default): its writes
        # are refused once the agent has started a newer one (see ``fenced``).
        self.attempt = attempt if attempt is not None else attempt_from_environ()
        self._lock = threading.Lock()  # one checkpoint rotation at a time

    def _refuse(self, what: str, epoch: object = None) -> None:
        fence = read_fence(self.checkpoint_dir)
        _say(f"not saving {what}: this is attempt {self.attempt} and attempt {fence} has "
             "started since (a stale process of the job)")
        events.emit("checkpoint.fenced", path=self.checkpoint_dir, epoch=epoch,
                    attempt=self.attempt, fence=fence)

    @property
    def train_model_dir(self) -> str | None:
        return os.path.join(self.result_dir, "model", "train") if self.result_dir else None

    def save_checkpoint(self, blob: bytes) -> dict[str, Any] | None:
        """Save a state blob as the newest checkpoint; returns the manifest.

        Returns None when there is no checkpoint folder, or when the disk refused the write
        (reported as ``checkpoint.failed``; the previous checkpoints stay as they were)."""
        if not self.checkpoint_dir:
            return None
        st = state_mod.loads(blob)
        epoch = st["position"]["epoch"]
        try:
            with self._lock:
                manifest = self._rotate_in(blob, st["position"])
        except _Fenced:
            self._refuse(f"the checkpoint of epoch {epoch}", epoch)
            return None
        except OSError as exc:
            reason = f"{errno.errorcode.get(exc.errno or 0, 'OSError')}: {exc}"
            _say(f"could not save the checkpoint of epoch {epoch} ({reason}); the previous "
                 "checkpoint is kept and training goes on")
            events.emit("checkpoint.failed", path=os.path.join(self.checkpoint_dir, STATE_FILE),
                        epoch=epoch, error=reason)
            return None
        try:
            self._save_model_files(st, str(epoch))
            self._prune_epoch_models()
        except OSError as exc:
            _say(f"could not save model_epoch_{epoch} files: {exc}")
            events.emit("checkpoint.failed", path=self.train_model_dir, epoch=epoch,
                        error=str(exc))
        return manifest

    def _rotate_in(self, blob: bytes, pos: dict[str, Any]) -> dict[str, Any]:
        folder = self.checkpoint_dir
        assert folder is not None
        os.makedirs(folder, exist_ok=True)
        clean_stale_tmp(folder)
        try:
            old = read_manifest(folder)
        except CheckpointError as exc:
            _say(f"starting a new history: {exc}")
            old = None
        entries = [dict(e) for e in old["checkpoints"]] if old else []
        seq = 1 + max([_seq(n) for n in os.listdir(folder)]
                      + [e["seq"] for e in entries if isinstance(e.get("seq"), int)], default=0)
        latest = os.path.join(folder, STATE_FILE)
        tmp = _write_tmp(folder, blob)
        # The renames and the manifest are the commit: done under the fence's shared lock, so
        # a newer attempt's start waits for them, and a stale attempt commits nothing.
        try:
            with fenced(folder, self.attempt) as current:
                if not current:
                    raise _Fenced
                return self._commit(folder, tmp, blob, pos, entries, seq, latest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # gone already when the commit renamed it
            raise

    def _commit(self, folder: str, tmp: str, blob: bytes, pos: dict[str, Any],
                entries: list[dict[str, Any]], seq: int, latest: str) -> dict[str, Any]:
        try:
            # The current latest keeps its bytes under its numbered name. If that name
            # exists already, an earlier write died after this rename and edt_state.pth
            # holds an unlisted state, which the rename below replaces.
            if entries and entries[0].get("file") == STATE_FILE:
                numbered = f"edt_state.{entries[0].get('seq', 0)}.pth"
                numbered_path = os.path.join(folder, numbered)
                if os.path.exists(latest) and not os.path.exists(numbered_path):
                    os.replace(latest, numbered_path)
                entries[0]["file"] = numbered
            os.replace(tmp, latest)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(folder)
        entry = {
            "seq": seq,
            "file": STATE_FILE,
            "sha256": hashlib.sha256(blob).hexdigest(),
            "bytes": len(blob),
            "epoch": pos["epoch"],
            "position": pos,
            "ts": time.time(),
        }
        kept = [entry, *entries][: self.keep]
        manifest = {**entry, "path": latest, "checkpoints": kept}
        atomic_write(os.path.join(folder, MANIFEST), json.dumps(manifest, indent=1).encode())
        keep_files = {e["file"] for e in kept}
        for name in os.listdir(folder):
            if _NUMBERED.match(name) and name not in keep_files:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(folder, name))
        return manifest

    def save_final(self, blob: bytes) -> list[str]:
        st = state_mod.loads(blob)
        with fenced(self.checkpoint_dir, self.attempt) as current:
            if not current:
                self._refuse("the final model")
                return []
            return self._save_model_files(st, "final")

    def save_onnx(self, onnx_bytes: bytes) -> list[str]:
        if not self.result_dir:
            return []
        path = os.path.join(self.result_dir, "model", "model.onnx")
        with fenced(self.checkpoint_dir, self.attempt) as current:
            if not current:
                self._refuse("model.onnx")
                return []
            atomic_write(path, onnx_bytes)
        return [path]

    def _save_model_files(self, st: dict[str, Any], tag: str) -> list[str]:
        folder = self.train_model_dir
        if not folder:
            return []
        clean_stale_tmp(folder)
        if "keras_file" in st:
            # A Keras model: Keras's own format, which keras.models.load_model reads (the
            # architecture, the weights and the optimizer's state in one file).
            keras_path = os.path.join(folder, f"model_epoch_{tag}.keras")
            atomic_write(keras_path, st["keras_file"].numpy().tobytes())
            return [keras_path]
        model_path = os.path.join(folder, f"model_epoch_{tag}.pth")
        opt_path = os.path.join(folder, f"model_epoch_{tag}_optimizer_state.pth")
        atomic_write(model_path, _torch_bytes(st["model"]))
        atomic_write(opt_path, _torch_bytes(st["optimizer"]))
        return [model_path, opt_path]


    def best(self) -> dict[str, Any] | None:
        """The best epoch so far by ``keep_best_by``, as kept in ``model/train/best.json``
        (it survives a restart of the job): ``{"metric", "mode", "value", "epoch", "files"}``."""
        folder = self.train_model_dir
        if not folder or not self.best_by:
            return None
        try:
            with open(os.path.join(folder, BEST_FILE), encoding="utf-8") as f:
                best = json.load(f)
        except (OSError, ValueError):
            return None
        return best if best.get("metric") == self.best_by[0] else None

    def note_test(self, epoch: int, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """Record ``epoch``'s test metrics; returns the new best when this epoch is it.

        The test of epoch ``e`` (counted from 0) is of the weights saved as
        ``model_epoch_<e + 1>`` (a checkpoint is tagged with the epoch it resumes at)."""
        value = metrics.get(self.best_by[0]) if self.best_by else None
        folder = self.train_model_dir
        if not isinstance(value, int | float) or not folder:
            return None
        name, mode = self.best_by
        best = self.best()
        if best is not None and not (value > best["value"] if mode == "max"
                                     else value < best["value"]):
            return None
        best = {"metric": name, "mode": mode, "value": value, "epoch": epoch,
                "files": f"model_epoch_{epoch + 1}"}
        os.makedirs(folder, exist_ok=True)
        atomic_write(os.path.join(folder, BEST_FILE), json.dumps(best).encode())
        return best

    def _prune_epoch_models(self) -> list[str]:
        """Remove the per-epoch model files beyond the last ``keep_epoch_models`` epochs, but
        the best epoch's by ``keep_best_by`` (a long run's results stay small); returns the
        names removed. This process writes the folder as the job's own account: nobody else's
        files are in it."""
        folder = self.train_model_dir
        if not folder or not self.keep_epoch_models:
            return []
        found: dict[int, list[str]] = {}
        for name in os.listdir(folder):
            m = _EPOCH_MODEL.match(name)
            if m:
                found.setdefault(int(m.group(1)), []).append(name)
        best = self.best()
        kept_best = best["epoch"] + 1 if best else None
        old = [e for e in sorted(found)[:-self.keep_epoch_models] if e != kept_best]
        removed = [name for epoch in old for name in found[epoch]]
        for name in removed:
            try:
                os.unlink(os.path.join(folder, name))
            except FileNotFoundError:
                pass
        return removed


def _seq(name: str) -> int:
    m = _NUMBERED.match(name)
    return int(m.group(1)) if m else 0
