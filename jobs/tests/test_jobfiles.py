"""The one way into a job's folder: no link followed at any component, nothing above the
folder reached, only plain files opened, and nothing that could block."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from jobs import jobfiles


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A secret outside the job's folder, and a folder of secrets."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret").write_text("SECRET")
    (folder / "model.onnx").write_text("SECRET")
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A job's result folder with one result."""
    folder = tmp_path / "job-1"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "model.onnx").write_text("onnx!")
    return folder


def _read(root: Path, relative) -> str:
    with jobfiles.open_file(root, relative) as handle:
        return handle.read().decode()


def test_a_plain_file_below_the_folder_is_read(root):
    assert _read(root, "model/model.onnx") == "onnx!"
    assert _read(root, ("model", "model.onnx")) == "onnx!"


@pytest.mark.parametrize("relative", [
    "../outside/secret", "model/../../outside/secret", "model/../model/model.onnx",
    "/etc/passwd", "", "model//model.onnx", "./model/model.onnx", "model/", "a\0b",
])
def test_paths_that_are_not_plainly_below_the_folder_are_refused(root, outside, relative):
    with pytest.raises(jobfiles.Refused):
        jobfiles.open_file(root, relative)
    assert jobfiles.open_download(root, relative) is None


def test_a_link_at_the_last_component_is_refused(root, outside):
    os.symlink(outside / "secret", root / "model" / "link.onnx")
    with pytest.raises(OSError) as raised:
        jobfiles.open_file(root, "model/link.onnx")
    assert raised.value.errno == errno.ELOOP


def test_a_link_at_a_middle_component_is_refused(root, outside):
    os.symlink(outside, root / "checkpoint")
    (root / "log").mkdir()
    os.symlink(outside, root / "log" / "driver")
    for relative in ("checkpoint/secret", "log/driver/secret"):
        with pytest.raises(OSError):
            jobfiles.open_file(root, relative)
        assert jobfiles.open_download(root, relative) is None


def test_a_link_to_a_folder_inside_the_folder_is_refused_too(root):
    os.symlink(root / "model", root / "checkpoint")
    with pytest.raises(OSError):
        jobfiles.open_file(root, "checkpoint/model.onnx")


def _refused_at_once(call) -> BaseException | None:
    """Run ``call`` in a thread; fail if it is still waiting after 10 s (a blocked open)."""
    outcome: list[BaseException | None] = []

    def run():
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the open waited on the FIFO"
    return outcome[0]


def test_a_fifo_is_refused_without_blocking(root):
    os.mkfifo(root / "model" / "model.onnx.fifo")
    error = _refused_at_once(lambda: jobfiles.open_file(root, "model/model.onnx.fifo"))
    assert isinstance(error, jobfiles.Refused)
    error = _refused_at_once(lambda: jobfiles.list_files(root))
    assert error is None
    assert [name for name, _ in jobfiles.list_files(root)] == ["model/model.onnx"]
    assert [name for name, _ in jobfiles.walk_files(root)] == ["model/model.onnx"]


def test_a_folder_and_a_second_name_of_a_file_are_refused(root, tmp_path):
    with pytest.raises(jobfiles.Refused):
        jobfiles.open_file(root, "model")
    # A hard link may name a file the job could not read itself.
    os.link(root / "model" / "model.onnx", root / "model" / "again.onnx")
    for relative in ("model/model.onnx", "model/again.onnx"):
        with pytest.raises(jobfiles.Refused):
            jobfiles.open_file(root, relative)
    assert jobfiles.list_files(root) == []


def test_downloads_are_only_the_results_and_the_logs(root):
    (root / "log" / "driver").mkdir(parents=True)
    (root / "log" / "driver" / "stdout").write_text("hi\n")
    (root / "_submitted_code").mkdir()
    (root / "_submitted_code" / "main.py").write_text("print()")
    (root / "notes.txt").write_text("not a result")
    assert jobfiles.list_downloads(root) == [("model/model.onnx", 5), ("log/driver/stdout", 3)]
    assert jobfiles.open_download(root, "notes.txt") is None
    assert jobfiles.open_download(root, "_submitted_code/main.py") is None
    with jobfiles.open_download(root, "log/driver/stdout") as handle:
        assert handle.read() == b"hi\n"


def test_a_walk_never_follows_a_link_and_skips_what_it_is_told(root, outside):
    (root / "checkpoint" / "epoch-1").mkdir(parents=True)
    (root / "checkpoint" / "epoch-1" / "state.pth").write_text("state")
    (root / "tmp").mkdir()
    (root / "tmp" / "cache.bin").write_text("scratch")
    os.symlink(outside, root / "checkpoint" / "epoch-2")
    os.symlink(outside / "secret", root / "model" / "latest.onnx")
    os.symlink(outside, root / "log")
    found = {name: handle.read() for name, handle in jobfiles.walk_files(root, skip={"tmp"})}
    assert found == {"checkpoint/epoch-1/state.pth": b"state", "model/model.onnx": b"onnx!"}
    assert jobfiles.list_files(root, ("log",)) == []
    assert [name for name, _ in jobfiles.walk_files(root, ("checkpoint",))] == [
        "checkpoint/epoch-1/state.pth"]


def test_a_walk_stops_at_its_depth_limit(root, monkeypatch):
    monkeypatch.setattr(jobfiles, "MAX_DEPTH", 2)
    deep = root / "model" / "a" / "b"
    deep.mkdir(parents=True)
    (root / "model" / "a" / "one").write_text("1")
    (deep / "two").write_text("2")
    assert [name for name, _ in jobfiles.list_files(root)] == [
        "model/model.onnx", "model/a/one"]


def test_the_services_own_files_replace_what_the_job_planted(root, outside):
    (root / "log").mkdir()
    os.symlink(outside / "secret", root / "log" / "console.jsonl")
    os.symlink(outside, root / "log" / "driver")
    os.mkfifo(root / "log" / "driver.fifo")
    for parts in (("log", "console.jsonl"), ("log", "driver", "stdout"), ("log", "driver.fifo")):
        fd = _open_append(root, parts)
        os.write(fd, b"line\n")
        os.close(fd)
        assert (root.joinpath(*parts)).read_bytes() == b"line\n"
        assert not root.joinpath(*parts).is_symlink()
    assert (outside / "secret").read_text() == "SECRET"
    assert sorted(p.name for p in outside.iterdir()) == ["model.onnx", "secret"]


def _open_append(root: Path, parts: tuple[str, ...]) -> int:
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    result: list[int] = []
    error = _refused_at_once(
        lambda: result.append(jobfiles.open_beneath(root, parts, flags, make_dirs=True)))
    assert error is None, error
    return result[0]


def test_without_make_dirs_a_planted_entry_is_refused_not_replaced(root, outside):
    os.symlink(outside / "secret", root / "model" / "out.txt")
    with pytest.raises(OSError):
        jobfiles.open_beneath(root, ("model", "out.txt"), os.O_WRONLY | os.O_APPEND)
    assert (root / "model" / "out.txt").is_symlink()
    assert (outside / "secret").read_text() == "SECRET"
