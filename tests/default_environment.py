"""The default job environment for the tests that train in it, built as an agent builds it
(``environments.build.build_base``, from the host's package index) and kept between runs of
this checkout: a complete one already there is used as it is.

It takes minutes and several GB the first time, so the test run starts it in the background
as it begins (``start_in_background``, from ``conftest.py``) and the tests that need it run
late (marker ``late``), when it is done; they wait for it on the same lock.

Run alone: ``.venv/bin/python -m tests.default_environment`` builds it and says where.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from environments import build
from environments.spec import DEFAULT_NAME, DEFAULT_PACKAGES

REPO = Path(__file__).resolve().parents[1]
# Where it is kept: a machine-wide cache when the run is root's (every checkout on the machine,
# CI's fresh clones included, adopts the one built first in 2 s instead of 2-3 minutes of
# building while the tests run: the packages' own caches work the same way), else the
# checkout. Never under var/, whose entries every process's settings make private but for its
# own folders: every job account must reach the base's python. EDT_TEST_ENVIRONMENTS_DIR
# chooses another.
SHARED = Path("/var/cache/edt/test-environments")


def _folder() -> Path:
    if os.environ.get("EDT_TEST_ENVIRONMENTS_DIR"):
        return Path(os.environ["EDT_TEST_ENVIRONMENTS_DIR"])
    return SHARED if os.geteuid() == 0 else REPO / ".test-environments"


FOLDER = _folder()
BUILD_TIMEOUT_S = 3600.0
# The one test module that needs it: the run starts the build when it may run that one.
USERS = ("tests/wmla/test_wmla_default_environment.py",)


def _reachable(folder: Path) -> None:
    """Search permission (never read) on the folders down to ``folder``: from the checkout,
    or from /var/cache for the machine-wide one."""
    stop = SHARED.parents[1] if folder.is_relative_to(SHARED.parent) else REPO.parent
    for part in (folder, *folder.parents):
        if part == stop or part == part.parent:
            break
        part.chmod(part.stat().st_mode | 0o711)


def ensure(folder: Path = FOLDER) -> Path:
    """``folder``, whose ``bases/default`` holds the default set: built now unless a complete
    one is there. A second caller (another xdist worker, the background build) waits."""
    folder.mkdir(parents=True, exist_ok=True)
    _reachable(folder)
    base = folder / "bases" / DEFAULT_NAME
    with open(folder / ".test-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if build.adopt_base(list(DEFAULT_PACKAGES), base) is None:
            started = time.monotonic()
            build.build_base(list(DEFAULT_PACKAGES), base, folder / "build.log",
                             BUILD_TIMEOUT_S)
            print(f"built the default environment at {base} in "
                  f"{time.monotonic() - started:.0f} s", flush=True)
    return folder


def needed(args: list[str], markexpr: str, root: Path) -> bool:
    """Whether a run of ``args`` (paths, maybe ``::test`` ids; none: the whole suite) under
    ``-m markexpr`` may run a test that needs the environment."""
    if "not slow" in markexpr.replace("  ", " "):
        return False
    paths = [a.split("::")[0] for a in args if not a.startswith("-")]
    if not paths:
        return True
    for user in USERS:
        target = (root / user).resolve()
        for path in paths:
            given = (root / path).resolve()
            if target == given or given in target.parents:
                return True
    return False


def start_in_background() -> subprocess.Popen:
    """Build it in a process of its own while the run's other tests go on."""
    FOLDER.mkdir(parents=True, exist_ok=True)
    with open(FOLDER / "background.log", "ab") as out:
        return subprocess.Popen(  # noqa: S603 - this interpreter, this module
            [sys.executable, "-m", "tests.default_environment"], cwd=REPO, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


if __name__ == "__main__":
    print(ensure())
