"""The one way a privileged process changes a job's folder: made, copied into, handed over and
removed through descriptors, never through a link. (The races against a job's account are in
tests/security/test_root_paths.py.)"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from jobs import jobwrites


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A model's folder: code, a package, a cache, a link, a FIFO and a hard-linked file."""
    folder = tmp_path / "model"
    (folder / "pkg" / "__pycache__").mkdir(parents=True)
    (folder / "main.py").write_text("print('hi')\n")
    (folder / "main.py").chmod(0o750)
    (folder / "pkg" / "util.py").write_text("X = 1\n")
    (folder / "pkg" / "__pycache__" / "util.pyc").write_bytes(b"\0")
    (folder / "notes").symlink_to("/etc/hostname")
    os.mkfifo(folder / "pipe")
    (tmp_path / "elsewhere").write_text("SECRET")
    os.link(tmp_path / "elsewhere", folder / "second-name")
    return folder


@pytest.fixture
def result(tmp_path: Path) -> Path:
    folder = tmp_path / "job-1"
    folder.mkdir()
    return folder


def _skip_caches(_folder: str, names: list[str]) -> set[str]:
    return {"__pycache__"} & set(names)


def test_a_copy_keeps_code_and_links_and_leaves_out_the_rest(source, result):
    assert jobwrites.copy_tree(source, result, ("_submitted_code", "model"), skip=_skip_caches)
    copy = result / "_submitted_code" / "model"
    assert (copy / "main.py").read_text() == "print('hi')\n"
    assert stat.S_IMODE((copy / "main.py").stat().st_mode) == 0o750
    assert (copy / "pkg" / "util.py").read_text() == "X = 1\n"
    assert os.readlink(copy / "notes") == "/etc/hostname"
    # No cache, no FIFO (it would hang a reader), no second name of a file from elsewhere.
    assert sorted(p.name for p in copy.iterdir()) == ["main.py", "notes", "pkg"]
    assert sorted(p.name for p in (copy / "pkg").iterdir()) == ["util.py"]


def test_a_copy_already_there_is_not_copied_over(source, result):
    (result / "_submitted_code" / "model").mkdir(parents=True)
    assert not jobwrites.copy_tree(source, result, ("_submitted_code", "model"))
    assert list((result / "_submitted_code" / "model").iterdir()) == []


def test_a_link_where_a_folder_is_made_is_replaced(result, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (result / "log").symlink_to(target)
    jobwrites.make_folders(result, ["log", "tmp"])
    assert (result / "log").is_dir() and not (result / "log").is_symlink()
    assert (result / "tmp").is_dir()
    assert list(target.iterdir()) == []


def test_a_file_where_a_folder_is_made_fails_cleanly(result):
    (result / "log").write_text("the job's")
    with pytest.raises(NotADirectoryError):
        jobwrites.make_folders(result, ["log"])
    assert (result / "log").read_text() == "the job's"


def test_a_change_reaches_folders_and_plain_files_only(result, tmp_path):
    (result / "a" / "b").mkdir(parents=True)
    (result / "a" / "b" / "f").write_text("f")
    (result / "link").symlink_to(tmp_path)
    os.mkfifo(result / "a" / "pipe")
    (tmp_path / "host").write_text("host")
    os.link(tmp_path / "host", result / "a" / "host")
    seen = []

    def record(fd: int, is_folder: bool) -> None:
        st = os.fstat(fd)
        seen.append((st.st_ino, is_folder))

    jobwrites.change_tree(result, record)
    inodes = {os.stat(result / p).st_ino: p for p in ("a", "a/b", "a/b/f", ".")}
    assert [(inodes[ino], folder) for ino, folder in seen] == [
        ("a/b/f", False), ("a/b", True), ("a", True), (".", True)]


def test_a_removal_removes_links_not_what_they_point_at(result, tmp_path):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "file").write_text("keep")
    (result / "a" / "b").mkdir(parents=True)
    (result / "a" / "b" / "f").write_text("f")
    (result / "a" / "link").symlink_to(kept)
    (result / "a" / "file-link").symlink_to(kept / "file")
    os.mkfifo(result / "a" / "pipe")
    left = []
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        jobwrites.remove_tree(fd, "job-1", lambda path, exc: left.append((path, exc)))
    finally:
        os.close(fd)
    assert left == []
    assert not result.exists()
    assert (kept / "file").read_text() == "keep"


def test_a_removal_names_what_it_could_not_remove(result, tmp_path, monkeypatch):
    (result / "a").mkdir()
    (result / "a" / "f").write_text("f")
    real_unlink = os.unlink

    def refuse(name, *, dir_fd=None):
        if name == "f":
            raise PermissionError(13, "Permission denied")
        return real_unlink(name, dir_fd=dir_fd)

    monkeypatch.setattr(os, "unlink", refuse)
    left = []
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        jobwrites.remove_tree(fd, "job-1", lambda path, exc: left.append(path))
    finally:
        os.close(fd)
    assert left == ["job-1/a/f", "job-1/a", "job-1"]


def test_a_file_put_in_place_replaces_what_is_there_and_writes_through_no_link(
        result: Path, tmp_path: Path):
    # The job planted links where the agent writes a trial's config.json: to a file of the
    # host, and (a folder on the way) to a folder of the host.
    target = tmp_path / "host-file"
    target.write_text("HOST")
    (result / "config.json").symlink_to(target)
    elsewhere = tmp_path / "host-folder"
    elsewhere.mkdir()
    (result / "_submitted_code").symlink_to(elsewhere)
    jobwrites.write_file(result, ("config.json",), b'{"lr": 0.1}')
    jobwrites.write_file(result, ("_submitted_code", "m", "config.json"), b'{"lr": 0.1}')
    assert target.read_text() == "HOST" and list(elsewhere.iterdir()) == []
    assert not (result / "config.json").is_symlink()
    assert (result / "config.json").read_text() == '{"lr": 0.1}'
    assert (result / "_submitted_code" / "m" / "config.json").read_text() == '{"lr": 0.1}'
    # A hard link the job made to a host file is replaced, never written into.
    (result / "config.json").unlink()
    os.link(target, result / "config.json")
    jobwrites.write_file(result, ("config.json",), b"{}")
    assert target.read_text() == "HOST" and (result / "config.json").read_text() == "{}"
    # A folder in its place is refused, not emptied.
    (result / "config.json").unlink()
    (result / "config.json").mkdir()
    with pytest.raises(OSError):
        jobwrites.write_file(result, ("config.json",), b"{}")
