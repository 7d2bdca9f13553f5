"""A job cannot make the root agent write, change or open anything outside the job's folder.

The job's account owns everything below its result folder, so it can swap any folder there
for a link, or rename it away, at any moment: also in the middle of the agent's work. The
folder the links point at stands in for the product's ``site-packages``: the test owns it, the
job cannot write to it. Each path the agent (or the event consumer) takes through a job's
folder as root is raced here, once at a chosen moment (a hook between two copies, so the race
is won every time) and once by a real process running as the job's account that swaps and
renames in a loop while the agent works. Nothing may ever land in, or change, the test's folder;
the agent's work either completes in the real folder (wherever the job moved it) or fails
cleanly.
"""

from __future__ import annotations

import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from agent import job_folder
from agent.accounts import RunAs
from agent.job_folder import prepare_job_dir
from jobs import jobfiles, services
from runtime import checkpoint
from tests.security.test_result_links import _job_account

JOB_UID = 200_123
ROUNDS = 100
FILES = 40

# The model's code: files before and after a package, a package two folders deep, and the
# ".pth" a job would like to see in site-packages.
SOURCE = {
    "a.py": "A = 1\n",
    "pkg/__init__.py": "",
    "pkg/one.py": "ONE = 1\n",
    "pkg/sub/evil.pth": "import os; os.system('id')\n",
    "pkg/sub/two.py": "TWO = 2\n",
    "z.py": "Z = 1\n",
}
# The folders of the copy the job swaps: the copies' folder, the copy, a folder in it.
SWAPPED = ("_submitted_code", "_submitted_code/{code}", "_submitted_code/{code}/pkg")


def _user() -> RunAs | None:
    return RunAs(JOB_UID, JOB_UID, "edt-user-test", isolated=True) if os.geteuid() == 0 else None


@pytest.fixture
def source(job) -> Path:
    location = Path(job.model.location)
    for rel, text in SOURCE.items():
        (location / rel).parent.mkdir(parents=True, exist_ok=True)
        (location / rel).write_text(text)
    return location


@pytest.fixture
def site_packages(tmp_path: Path):
    """The test's own folder, where nothing of the job's may ever land; checked at the end."""
    folder = tmp_path / "site-packages"
    folder.mkdir(mode=0o755)
    before = os.stat(folder)
    yield folder
    assert os.listdir(folder) == [], "the agent wrote into a folder the job cannot write"
    after = os.stat(folder)
    assert (after.st_uid, after.st_gid, after.st_mode, after.st_mtime_ns) == (
        before.st_uid, before.st_gid, before.st_mode, before.st_mtime_ns
    ), "the agent changed a folder the job cannot write"


def _swap(folder: Path, target: Path) -> Path:
    """What the job does: rename ``folder`` away and put a link to ``target`` in its place."""
    moved = folder.with_name(folder.name + ".moved")
    os.rename(folder, moved)
    os.symlink(target, folder)
    return moved


def _copied(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


@pytest.mark.django_db
@pytest.mark.parametrize("swapped", SWAPPED)
def test_a_folder_swapped_for_a_link_between_two_copies_takes_nothing_outside(
    job, source, site_packages, monkeypatch, swapped
):
    result = Path(job.result_dir)
    code = source.name
    folder = result / swapped.format(code=code)
    real_skip = job_folder._not_code
    moved: list[Path] = []

    def swap_then_skip(path: str, names: list[str]):
        # Called as the copy reaches pkg/sub: a.py or z.py and pkg/one.py may be copied, the
        # rest not yet. The job swaps its folder exactly then.
        if path.endswith("pkg/sub") and not moved:
            moved.append(_swap(folder, site_packages))
        return real_skip(path, names)

    monkeypatch.setattr(job_folder, "_not_code", swap_then_skip)
    expected = _copied(source)
    prepare_job_dir(job, _user())
    assert moved, "the copy never reached the moment of the swap"
    # The copy completed in the real folders, wherever the job renamed them.
    if swapped == "_submitted_code":
        got = _copied(moved[0] / code)
    elif swapped.endswith("pkg"):
        got = {k.replace("pkg.moved/", "pkg/", 1): v
               for k, v in _copied(result / "_submitted_code" / code).items()}
    else:
        got = _copied(moved[0])
    assert got == expected


@pytest.mark.django_db
def test_the_copy_does_not_follow_a_link_in_the_models_folder(job, source, site_packages):
    # The model's owner links a folder of the test's into his model: the copy keeps the link
    # as a link and writes nothing through it (nor reads through it).
    (site_packages.parent / "private").mkdir()
    (site_packages.parent / "private" / "secret").write_text("SECRET")
    os.symlink(site_packages.parent / "private", source / "linked")
    root = prepare_job_dir(job, _user())
    kept = root / "_submitted_code" / source.name
    assert (kept / "linked").is_symlink()
    assert _copied(kept) == _copied(source)
    assert "SECRET" not in "".join(_copied(kept).values())


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["log", "checkpoint", "tmp", "_submitted_code"])
def test_a_link_planted_where_the_agent_makes_a_folder_is_replaced_not_followed(
    job, source, site_packages, name
):
    result = Path(job.result_dir)
    result.mkdir(parents=True)
    os.symlink(site_packages, result / name)
    root = prepare_job_dir(job, _user())
    assert (root / name).is_dir() and not (root / name).is_symlink()


@pytest.mark.django_db
def test_handing_the_folder_over_never_changes_a_file_with_a_second_name(
    job, source, tmp_path
):
    if os.geteuid() != 0:
        pytest.skip("only root hands a folder over to another account")
    # A file of the host's (root's) the job made a second name for in its folder, as
    # protected_hardlinks allows for a file it may write, or always where it is off.
    host_file = tmp_path / "host-file"
    host_file.write_text("host\n")
    host_file.chmod(0o644)
    result = Path(job.result_dir)
    (result / "log").mkdir(parents=True)
    os.link(host_file, result / "log" / "stolen")
    prepare_job_dir(job, _user())
    st = host_file.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o644)


@pytest.mark.django_db
def test_the_fence_is_never_written_through_a_second_name(job, tmp_path):
    host_file = tmp_path / "host-file"
    host_file.write_text("host\n")
    folder = Path(job.result_dir) / "checkpoint"
    folder.mkdir(parents=True)
    os.link(host_file, folder / checkpoint.FENCE_FILE)
    with pytest.raises(OSError):
        checkpoint.advance_fence(str(folder), 3)
    assert host_file.read_text() == "host\n"


# --- the same, raced by a real process of the job's account, in a loop ----------------------

SWAPPER = r"""
import os, sys
# It works only through a descriptor on its result folder, as a job inside it would.
root, target, names = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
print("ready", flush=True)
i = 0
while not os.path.lexists(f"/proc/self/fd/{root}/stop"):
    i += 1
    for rel in names:
        try:
            os.rename(rel, f"{rel}.{i}", src_dir_fd=root, dst_dir_fd=root)
            os.symlink(target, rel, dir_fd=root)
            os.stat(f"/proc/self/fd/{root}/{rel}", follow_symlinks=False)  # a moment longer
            os.unlink(rel, dir_fd=root)  # the next launch copies again
        except OSError:
            pass
print(i, flush=True)
"""


@pytest.mark.slow
@pytest.mark.django_db
def test_a_job_swapping_and_renaming_in_a_loop_never_gets_a_write_outside(
    job, source, site_packages
):
    for i in range(FILES):  # a longer copy: more moments for the job to swap in
        (source / "pkg" / f"m{i:03}.py").write_text(f"M = {i}\n")
    user = _user()
    root = prepare_job_dir(job, user)
    python, account = _job_account()
    names = [s.format(code=source.name) for s in SWAPPED]
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        proc = subprocess.Popen([python, "-I", "-S", "-c", SWAPPER, str(fd), str(site_packages),
                                 *names], cwd="/", stdin=subprocess.DEVNULL, pass_fds=(fd,),
                                stdout=subprocess.PIPE, **account)
    finally:
        os.close(fd)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        for _ in range(ROUNDS):
            try:
                prepare_job_dir(job, user)
            except OSError:
                pass  # failing cleanly is allowed: writing outside is not
            assert os.listdir(site_packages) == []
    finally:
        (root / "stop").touch()
        out, _ = proc.communicate(timeout=30)
    assert int(out.split()[-1]) > ROUNDS, "the job's swapper hardly ran"



# --- removing a job's folder -----------------------------------------------------------------


@pytest.mark.django_db
def test_removing_a_job_folder_opens_nothing_behind_a_link_swapped_in(
    job, tmp_path, monkeypatch
):
    # The job swaps a folder for a link to a FIFO just as the removal enters it. Removing
    # through descriptors (as shutil.rmtree does) never deletes through the link; it must not
    # open what is behind it either: a FIFO would hold the removal (a request of the console)
    # for ever, a device would be opened by root.
    result = Path(job.result_dir)
    (result / "checkpoint" / "epoch-1").mkdir(parents=True)
    (result / "checkpoint" / "epoch-1" / "state.pth").write_text("state")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real_open = os.open
    swapped: list[bool] = []

    def swap_then_open(path, flags, mode=0o777, *, dir_fd=None):
        if path == "epoch-1" and dir_fd is not None and not swapped:
            os.rename(path, "epoch-1.moved", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.symlink(fifo, path, dir_fd=dir_fd)
            swapped.append(True)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", swap_then_open)
    left: list[str] = []
    remover = threading.Thread(
        target=lambda: left.extend(services.remove_result_folder(result)), daemon=True)
    remover.start()
    remover.join(10)
    monkeypatch.undo()
    if remover.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets the removal go on
        remover.join(10)
        pytest.fail("the removal opened a FIFO through a link the job swapped in, and waited")
    assert swapped, "the removal never entered the folder"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    # What the job moved out of the way while the removal ran is named, not silently kept.
    assert not result.exists() or left


# --- measuring a job's folder (the results quota) --------------------------------------------


def test_measuring_a_job_folder_opens_nothing_behind_a_link_swapped_in(tmp_path, monkeypatch):
    # The agent (root) measures every job's folder for the results quota, again and again: a
    # job that swaps a folder for a link just as the walk enters it must not get root to open
    # what the link points at (a FIFO here; a device would be opened for real).
    result = tmp_path / "job-1"
    (result / "checkpoint" / "epoch-1").mkdir(parents=True)
    (result / "checkpoint" / "epoch-1" / "state.pth").write_bytes(b"s" * 8192)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    real_open = os.open
    opened: list[str] = []

    def swap_then_open(path, flags, mode=0o777, *, dir_fd=None):
        if path == "epoch-1" and dir_fd is not None and not opened:
            os.rename(path, "epoch-1.moved", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.symlink(fifo, path, dir_fd=dir_fd)
            opened.append("swapped")
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        if not stat.S_ISDIR(os.fstat(fd).st_mode) and not stat.S_ISREG(os.fstat(fd).st_mode):
            opened.append(f"opened {path}")
        return fd

    monkeypatch.setattr(os, "open", swap_then_open)
    sizes: list[int] = []
    walker = threading.Thread(target=lambda: sizes.append(jobfiles.allocated_bytes(result)),
                              daemon=True)
    walker.start()
    walker.join(10)
    monkeypatch.undo()
    if walker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets the walk go on
        walker.join(10)
        pytest.fail("the walk opened a FIFO through a link the job swapped in, and waited")
    assert opened[:1] == ["swapped"], "the walk never entered the folder"
    assert opened == ["swapped"], "root opened what a link the job swapped in points at"
    assert sizes[0] > 0
