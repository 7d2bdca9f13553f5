"""Checkpoints survive what a disk and a scheduler do to them.

- the latest checkpoint and the two before it are kept, each listed in the manifest with
  its sha256, size, epoch and position;
- a corrupt, truncated or missing latest checkpoint is skipped, saying which and why, and
  the one before is loaded (also by a real training process resuming);
- a write that fails inside (ENOSPC in write or fsync, an I/O error between the renames)
  or whose process is SIGKILLed mid-write leaves the previous checkpoint loadable and no
  temporary file behind (a killed writer's are removed by the next load or write);
- a checkpoint crafted to run code when unpickled is refused, and the code does not run.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime import checkpoint, events
from runtime.checkpoint import CheckpointError, ResultWriter, load_latest, load_state_file
from runtime.state import Position, dumps, loads, snapshot
from runtime.tests.helpers import REPO, run_standalone, steps, wait_until


def _blob(epoch: int, size: int = 8) -> bytes:
    torch.manual_seed(epoch)
    model = torch.nn.Linear(size, size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return dumps(snapshot(model, opt, Position(epoch=epoch, global_step=10 * epoch)))


def _tmp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".tmp-"))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "checkpoint"


@pytest.fixture
def writer(tmp_path: Path, ckpt: Path) -> ResultWriter:
    return ResultWriter(str(tmp_path), str(ckpt))


@pytest.fixture
def event_log(tmp_path: Path):
    """events.emit() writes to tmp_path/events.jsonl for the test; returns a reader."""
    events.configure(source="test", log_dir=str(tmp_path))
    path = tmp_path / "events.jsonl"
    try:
        yield lambda: [json.loads(line) for line in path.read_text().splitlines()]
    finally:
        events.configure(source="standalone")


def test_it_keeps_the_latest_three_checkpoints_with_their_hashes(writer: ResultWriter,
                                                                 ckpt: Path) -> None:
    blobs = {epoch: _blob(epoch) for epoch in (1, 2, 3, 4)}
    for epoch in (1, 2, 3, 4):
        manifest = writer.save_checkpoint(blobs[epoch])
        assert manifest is not None and manifest["epoch"] == epoch
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "edt_state.2.pth", "edt_state.3.pth", "edt_state.pth", "manifest.json"]
    manifest = _manifest(ckpt)
    assert manifest["file"] == "edt_state.pth" and manifest["epoch"] == 4
    entries = manifest["checkpoints"]
    assert [(e["seq"], e["file"], e["epoch"]) for e in entries] == [
        (4, "edt_state.pth", 4), (3, "edt_state.3.pth", 3), (2, "edt_state.2.pth", 2)]
    for e in entries:
        data = (ckpt / e["file"]).read_bytes()
        assert data == blobs[e["epoch"]]
        assert e["sha256"] == hashlib.sha256(data).hexdigest() and e["bytes"] == len(data)
        assert e["position"] == loads(data)["position"]
    assert load_latest(str(ckpt)) == blobs[4]


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "deleted"])
def test_it_falls_back_to_the_previous_checkpoint_when_the_latest_is_damaged(
    writer: ResultWriter, ckpt: Path, event_log, capsys, damage: str
) -> None:
    for epoch in (1, 2):
        writer.save_checkpoint(_blob(epoch))
    latest = ckpt / "edt_state.pth"
    if damage == "flipped byte":
        data = bytearray(latest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        latest.write_bytes(bytes(data))
    elif damage == "truncated":
        latest.write_bytes(latest.read_bytes()[:100])
    else:
        latest.unlink()
    assert load_latest(str(ckpt)) == _blob(1)
    why = {"flipped byte": "edt_state.pth: sha256 mismatch",
           "truncated": "edt_state.pth has 100 bytes, the manifest says",
           "deleted": "file missing"}[damage]
    err = capsys.readouterr().err
    assert "[edt] checkpoint: skipping edt_state.pth (checkpoint 2, epoch 2): " + why in err
    assert "trying the one before" in err
    assert "[edt] checkpoint: using checkpoint 1 (epoch 1)" in err
    skipped = [e for e in event_log() if e["type"] == "checkpoint.skipped"]
    assert [(e["epoch"], e["seq"]) for e in skipped] == [(2, 2)]
    assert why in skipped[0]["reason"]


def test_it_goes_back_as_far_as_it_must_and_says_when_nothing_is_left(
    writer: ResultWriter, ckpt: Path, capsys
) -> None:
    for epoch in (1, 2, 3):
        writer.save_checkpoint(_blob(epoch))
    (ckpt / "edt_state.pth").write_bytes(b"garbage")
    (ckpt / "edt_state.2.pth").write_bytes(b"more garbage")
    assert load_latest(str(ckpt)) == _blob(1)
    (ckpt / "edt_state.1.pth").unlink()
    assert load_latest(str(ckpt)) is None
    assert "(checkpoint 1, epoch 1): file missing; trying none left" in capsys.readouterr().err


def test_a_training_process_resumes_from_the_checkpoint_before_a_corrupt_one(
    tmp_path: Path,
) -> None:
    # Checkpoints after epochs 1 and 2 of the runtime's test model, the second corrupted.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = tmp_path / "checkpoint"
    writer = ResultWriter(str(tmp_path), str(ckpt))
    for epoch in (1, 2):
        writer.save_checkpoint(dumps(snapshot(model, opt,
                                              Position(epoch=epoch, global_step=6 * epoch))))
    data = bytearray((ckpt / "edt_state.pth").read_bytes())
    data[-100] ^= 0xFF
    (ckpt / "edt_state.pth").write_bytes(bytes(data))
    run = run_standalone(tmp_path, TEST_EPOCHS="2")
    assert run.returncode == 0, run.stderr
    assert ("[edt] checkpoint: skipping edt_state.pth (checkpoint 2, epoch 2): "
            "edt_state.pth: sha256 mismatch" in run.stderr)
    assert "Resuming from checkpoint at epoch 1" in run.stdout + run.stderr
    resumed = steps(tmp_path)
    assert (resumed[0]["epoch"], resumed[0]["batch"], resumed[0]["global_step"]) == (1, 0, 7)
    assert {s["epoch"] for s in resumed} == {1}
    assert (tmp_path / "model" / "train" / "model_epoch_final.pth").exists()


# -- failures inside a write ---------------------------------------------------------


class _HalfWriter:
    """A file whose write() stores half the bytes, then fails as a full disk does."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data: bytes) -> int:
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str):
        return getattr(self._f, name)

    def __enter__(self) -> _HalfWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


@pytest.mark.parametrize("where", ["write", "fsync", "rename", "manifest"])
def test_a_failed_write_keeps_the_previous_checkpoint_and_no_temp_file(
    writer: ResultWriter, ckpt: Path, event_log, capsys, monkeypatch, where: str
) -> None:
    writer.save_checkpoint(_blob(1))
    before = _manifest(ckpt)
    if where == "write":
        real_fdopen = os.fdopen
        monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _HalfWriter(real_fdopen(fd, *a, **k)))
        code = "ENOSPC"
    elif where == "fsync":
        def fsync(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", fsync)
        code = "ENOSPC"
    else:
        # "rename": the previous state has already moved to its numbered name when this
        # fails; "manifest": the new state is in place, but no manifest lists it.
        real_replace = os.replace
        target = "edt_state.pth" if where == "rename" else "manifest.json"

        def replace(src, dst) -> None:
            if os.path.basename(dst) == target:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        code = "EIO"
    assert writer.save_checkpoint(_blob(2)) is None
    monkeypatch.undo()
    assert _tmp_files(ckpt) == []
    assert _manifest(ckpt) == before
    assert load_latest(str(ckpt)) == _blob(1)
    assert (f"[edt] checkpoint: could not save the checkpoint of epoch 2 ({code}: "
            in capsys.readouterr().err)
    failed = [e for e in event_log() if e["type"] == "checkpoint.failed"]
    assert len(failed) == 1 and failed[0]["epoch"] == 2 and code in failed[0]["error"]
    # The disk has room again: the next checkpoint goes in, the history intact.
    assert writer.save_checkpoint(_blob(3)) is not None
    assert [e["epoch"] for e in _manifest(ckpt)["checkpoints"]] == [3, 1]
    assert load_latest(str(ckpt)) == _blob(3)
    assert _tmp_files(ckpt) == []


_KILLED_WRITER = r"""
import os, sys, time
import torch
from runtime import checkpoint
from runtime.state import Position, dumps, snapshot

folder, ready, point = sys.argv[1:4]
torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024)  # a 4 MB state, 8 MB with momentum
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(1, 1024)).sum().backward()
opt.step()
blob = dumps(snapshot(model, opt, Position(epoch=2, global_step=20)))


def wait_to_be_killed():
    open(ready, "w").close()
    time.sleep(600)


real_fdopen, real_replace = os.fdopen, os.replace


class HalfWritten:
    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        wait_to_be_killed()

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def replace(src, dst):
    name = os.path.basename(dst)
    if point == "rename" and name == "edt_state.pth":
        wait_to_be_killed()
    real_replace(src, dst)


if point == "write":
    os.fdopen = lambda fd, *a, **k: HalfWritten(real_fdopen(fd, *a, **k))
os.replace = replace
checkpoint.ResultWriter(None, folder).save_checkpoint(blob)
raise SystemExit("the writer was never stopped")
"""


@pytest.mark.parametrize("point", ["write", "rename"])
def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint_loadable(
    tmp_path: Path, writer: ResultWriter, ckpt: Path, point: str
) -> None:
    """``write``: SIGKILL with half of the new state in its temporary file; ``rename``:
    after the previous state moved to its numbered name, before the new one took its
    place (the new state complete in its temporary file)."""
    writer.save_checkpoint(_blob(1))
    ready = tmp_path / "ready"
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(ckpt), str(ready), point],
                            env=env, cwd=REPO, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None,
                   f"the writer to reach {point}", timeout=60)
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    stale = _tmp_files(ckpt)
    assert stale, "the killed writer left no temporary file: it was not mid-write"
    if point == "write":
        assert 0 < (ckpt / stale[0]).stat().st_size < 8 * 1024 * 1024
    # The next reader finds the previous checkpoint and removes the killed writer's file.
    assert load_latest(str(ckpt)) == _blob(1)
    assert _tmp_files(ckpt) == []
    assert writer.save_checkpoint(_blob(3)) is not None
    assert [e["epoch"] for e in _manifest(ckpt)["checkpoints"]] == [3, 1]
    assert load_latest(str(ckpt)) == _blob(3)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "edt_state.1.pth", "edt_state.pth", "manifest.json"]


def test_it_removes_only_the_temp_files_of_dead_writers(tmp_path: Path, ckpt: Path) -> None:
    ckpt.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host = checkpoint.socket.gethostname()
    names = {
        "dead": f".tmp-{dead.stdout.strip()}@{host}-abc123",
        "mine": f".tmp-{os.getpid()}@{host}-def456",
        "other host, fresh": ".tmp-1@elsewhere-ghi789",
        "other host, old": ".tmp-1@elsewhere-jkl012",
    }
    for name in names.values():
        (ckpt / name).write_bytes(b"partial")
    old = time.time() - 2 * checkpoint.STALE_TMP_S
    os.utime(ckpt / names["other host, old"], (old, old))
    assert load_latest(str(ckpt)) is None
    assert _tmp_files(ckpt) == sorted([names["mine"], names["other host, fresh"]])


# -- hostile files ---------------------------------------------------------------------


class _Payload:
    """Unpickling this calls Path.touch(marker): code execution, made observable."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_a_checkpoint_that_would_run_code_is_refused_and_the_code_never_runs(
    tmp_path: Path, writer: ResultWriter, ckpt: Path, event_log, capsys
) -> None:
    writer.save_checkpoint(_blob(1))
    marker = tmp_path / "payload-ran"
    buf = io.BytesIO()
    torch.save({"format": "edt-state/1", "model": _Payload(marker), "optimizer": {},
                "position": Position(epoch=2).as_dict()}, buf)
    evil = buf.getvalue()
    # Planted as the latest checkpoint, with a manifest that vouches for it.
    (ckpt / "edt_state.pth").replace(ckpt / "edt_state.1.pth")
    (ckpt / "edt_state.pth").write_bytes(evil)
    manifest = _manifest(ckpt)
    first = dict(manifest["checkpoints"][0], file="edt_state.1.pth")
    planted = dict(first, seq=2, file="edt_state.pth", epoch=2, bytes=len(evil),
                   sha256=hashlib.sha256(evil).hexdigest())
    manifest["checkpoints"] = [planted, first]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))

    assert load_latest(str(ckpt)) == _blob(1)
    assert not marker.exists()
    err = capsys.readouterr().err
    assert ("skipping edt_state.pth (checkpoint 2, epoch 2): refused: not a plain "
            "weights-only training state, loading it would run pickled code") in err
    assert "(WeightsUnpickler error: Unsupported global: GLOBAL getattr" in err
    skipped = [e for e in event_log() if e["type"] == "checkpoint.skipped"]
    assert "refused" in skipped[0]["reason"]
    with pytest.raises(CheckpointError, match="refused: .* would run pickled code"):
        load_state_file(str(ckpt / "edt_state.pth"))
    assert not marker.exists()
    # The payload is real: the unsafe way to load it runs it.
    torch.load(ckpt / "edt_state.pth", weights_only=False)
    assert marker.exists()
