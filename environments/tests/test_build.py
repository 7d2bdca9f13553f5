"""environments/build.py: a base (the product's interpreter, the host's pip), a layer on a base
(uv, the base's versions as constraints, only what the base lacks installed), their failures in
the installer's words, their limits, and a layer built by its owner's account.

The builds fetch small pure-Python packages from the index (PyPI: toolz, tabulate; the
product's venv holds six and requests, and none of those two). The product's own venv stands
for a base that holds torch.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

from environments import build

PRODUCT_PYTHON = str(Path(sys.prefix) / "bin" / "python")
KEY = "0123456789abcdef" * 4
ACCOUNT = (200123, 200123)
OTHER = (200124, 200124)  # another user's job account


@pytest.fixture(scope="module")
def product() -> dict[str, str]:
    """What the product's venv holds (probed once for the module)."""
    return build.probe(PRODUCT_PYTHON)[0]


def _owner_folder(root: Path, owner: str = "agent") -> Path:
    folder = build.layer_folder(root, owner, KEY)
    folder.parent.mkdir(parents=True)
    return folder


def _site(folder: Path) -> Path:
    return folder / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def _purelib(python: str) -> str:
    import subprocess

    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.parent.iterdir() if ".building-" in p.name]


# --- quick: names, versions, messages ----------------------------------------------------------


def test_layer_folder_is_the_owners_and_refuses_odd_names(tmp_path):
    assert build.layer_folder(tmp_path, "200007", KEY) == tmp_path / "users" / "200007" / KEY[:16]
    for owner, key in (("../x", KEY), ("a/b", KEY), ("", KEY), ("u", "../../etc")):
        with pytest.raises(ValueError):
            build.layer_folder(tmp_path, owner, key)


def test_constraints_are_the_bases_public_versions():
    assert build._constraints({"torch": "2.13.0+cpu", "six": "1.17.0", "odd": "unknown",
                               "pkg": "1.0rc1.post2.dev3"}) == [
        "pkg==1.0rc1.post2.dev3", "six==1.17.0", "torch==2.13.0"]
    assert build._same_version("2.13.0+cpu", "2.13.0")
    assert not build._same_version("1.16.0", "1.17.0")


def test_failure_is_the_installers_own_words():
    uv = ["Using Python 3.11.7 environment at: /x",
          "error: No solution found when resolving dependencies",
          "  cause: Because nonexistent-pkg-xyz was not found in the package registry and you",
          "  require nonexistent-pkg-xyz, we can conclude that your requirements are "
          "unsatisfiable."]
    assert build._failure(["/bin/uv", "pip", "compile"], 1, uv, 0) == (
        "No solution found when resolving dependencies: Because nonexistent-pkg-xyz was not "
        "found in the package registry and you require nonexistent-pkg-xyz, we can conclude "
        "that your requirements are unsatisfiable.")
    pip = ["Looking in links: /opt/wheels",
           "ERROR: Could not find a version that satisfies the requirement nope (from versions: "
           "none)", "ERROR: No matching distribution found for nope"]
    assert build._failure(["/v/bin/python", "-m", "pip"], 1, pip, 0) == (
        "Could not find a version that satisfies the requirement nope (from versions: none): "
        "No matching distribution found for nope")
    trace = ["Traceback (most recent call last):", '  File "<string>", line 1',
             "FileExistsError: [Errno 17] File exists: '/x'"]
    assert build._failure(["/p/python", "-I", "-S"], 1, trace, 0) == trace[-1]
    assert build._failure(["/bin/uv", "pip", "install"], -25, [], 10 << 20) == (
        "uv pip install was stopped: it wrote a file larger than the environment's limit of "
        "10 MiB")


# --- builds ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_base_is_the_products_python_with_its_packages_and_the_runtime(tmp_path):
    folder = tmp_path / "envs" / "tiny"
    log = io.BytesIO()
    built = build.build_base(["iniconfig", "packaging"], folder, log, timeout_s=120)

    assert built.python == str(folder / "bin" / "python")
    assert "iniconfig" in built.installed and "pip" in built.installed
    # The product's source root is on its path: a job imports the runtime.
    assert {"iniconfig", "runtime"} <= set(built.modules)
    assert (_site(folder) / build.PRODUCT_PTH).read_text().strip() == str(build.SOURCE_ROOT)
    meta = (folder / build.METADATA_FILE).read_text()
    assert '"iniconfig"' in meta and '"kind": "base"' in meta
    # pip's scripts name the folder it was renamed to, not the one it was built in.
    assert (folder / "bin" / "pip").read_text().startswith(f"#!{folder}/bin/python")
    assert _leftovers(folder) == []
    assert b"pip install" in log.getvalue()
    # Every account reads it, none but the builder's writes it.
    for path in [folder, *folder.rglob("*")]:
        mode = path.lstat().st_mode
        if not stat.S_ISLNK(mode):
            assert mode & 0o004 and not mode & 0o022, path
    assert built.size_bytes > 1 << 20 and built.seconds > 0

    # Found again complete (a fresh database, another checkout): used as it is, its product
    # path set to this checkout's; another package set, or a broken record, is built again.
    (_site(folder) / build.PRODUCT_PTH).write_text("/elsewhere\n")
    adopted = build.adopt_base(["packaging", "iniconfig"], folder)  # the same set, any order
    assert adopted is not None and adopted.python == built.python
    assert adopted.installed == built.installed and "runtime" in adopted.modules
    assert (_site(folder) / build.PRODUCT_PTH).read_text().strip() == str(build.SOURCE_ROOT)
    assert build.adopt_base(["iniconfig", "six"], folder) is None
    (folder / build.METADATA_FILE).write_text("{not json")
    assert build.adopt_base(["iniconfig", "packaging"], folder) is None


@pytest.mark.slow
def test_a_layer_sees_the_bases_torch_and_installs_only_what_the_base_lacks(tmp_path, product):
    folder = _owner_folder(tmp_path)
    log = tmp_path / "build.log"
    built = build.build_layer(PRODUCT_PYTHON, product, ["six", "toolz"], folder, log,
                              timeout_s=60, max_bytes=50 << 20, account=None)

    installed_here = {p.name for p in _site(folder).iterdir()}
    assert "toolz" in installed_here
    assert not {n for n in installed_here if n.startswith(("six", "torch"))}
    # What the job can import: the layer's and the base's.
    assert built.installed["torch"] == product["torch"]
    assert built.installed["six"] == product["six"]
    assert {"toolz", "torch", "six"} <= set(built.modules)
    assert "json" not in built.modules  # the standard library is not listed
    code = ("import importlib.util as u, toolz, six; "
            "print(u.find_spec('torch').origin); print(six.__file__); print(toolz.__file__)")
    out = _run(built.python, code)
    torch_at, six_at, toolz_at = out.splitlines()
    assert torch_at.startswith(sys.prefix) and six_at.startswith(sys.prefix)
    assert toolz_at.startswith(str(folder))
    assert "pip install --no-deps" in log.read_text()
    assert _leftovers(folder) == []
    assert (folder.parent / ".uv-cache").is_dir()


@pytest.mark.slow
def test_a_requirement_the_base_holds_at_that_version_is_not_installed_again(tmp_path, product):
    folder = _owner_folder(tmp_path)
    log = io.BytesIO()
    # requests and everything it needs are in the product's venv.
    built = build.build_layer(PRODUCT_PYTHON, product, ["six", "requests"], folder, log,
                              timeout_s=60, max_bytes=50 << 20, account=None)
    assert sorted(p.name for p in _site(folder).iterdir()) == [build.BASE_PTH]
    assert b"nothing to install" in log.getvalue()
    assert b"uv pip install" not in log.getvalue()
    assert built.installed["requests"] == product["requests"]
    # Built again (another process of the agent's, at the same time): the first one stays,
    # a job may run in it.
    first = (folder / build.METADATA_FILE).stat()
    again = build.build_layer(PRODUCT_PYTHON, product, ["six", "requests"], folder, log,
                              timeout_s=60, max_bytes=50 << 20, account=None)
    assert again.python == built.python
    assert (folder / build.METADATA_FILE).stat().st_ino == first.st_ino
    assert _leftovers(folder) == []


@pytest.mark.slow
def test_a_requirement_nowhere_fails_with_uvs_message_and_leaves_nothing(tmp_path, product):
    folder = _owner_folder(tmp_path)
    with pytest.raises(build.BuildError) as failed:
        build.build_layer(PRODUCT_PYTHON, product, ["nonexistent-pkg-xyz"], folder,
                          io.BytesIO(), timeout_s=60, max_bytes=50 << 20, account=None)
    assert str(failed.value).startswith(
        "No solution found when resolving dependencies: Because nonexistent-pkg-xyz was not "
        "found in the package registry")
    assert "uv pip compile" in failed.value.log_tail
    assert not folder.exists() and _leftovers(folder) == []


@pytest.mark.slow
def test_a_requirement_against_the_bases_version_fails_with_uvs_message(tmp_path, product):
    folder = _owner_folder(tmp_path)
    with pytest.raises(build.BuildError, match=r"^No solution found .*six==1\.16\.0"):
        build.build_layer(PRODUCT_PYTHON, product, ["six==1.16.0"], folder, io.BytesIO(),
                          timeout_s=60, max_bytes=50 << 20, account=None)


@pytest.mark.slow
def test_a_build_past_its_time_is_killed_whole(tmp_path, product, monkeypatch):
    """An installer that hangs (and what it started) is killed at the deadline."""
    pid_file = tmp_path / "pid"
    hang = tmp_path / "uv"
    hang.write_text(f"#!/bin/sh\nsleep 30 &\necho $! > {pid_file}\nwait\n")
    hang.chmod(0o755)
    monkeypatch.setattr(build, "_uv", lambda: str(hang))
    folder = _owner_folder(tmp_path)
    started = time.monotonic()
    with pytest.raises(build.BuildTimeout, match=r"^the build took longer than 1\.5 s$"):
        build.build_layer(PRODUCT_PYTHON, product, ["toolz"], folder, io.BytesIO(),
                          timeout_s=1.5, max_bytes=50 << 20, account=None)
    assert time.monotonic() - started < 10
    assert not _alive(int(pid_file.read_text()))
    assert not folder.exists() and _leftovers(folder) == []


@pytest.mark.slow
def test_a_layer_over_its_size_fails_and_leaves_nothing(tmp_path, product):
    folder = _owner_folder(tmp_path)
    # Each file fits (tabulate's largest is about 106 KiB), all of them do not.
    with pytest.raises(build.BuildError, match=r"^the environment takes .* more than its "
                                               r"limit of 146 KiB$"):
        build.build_layer(PRODUCT_PYTHON, product, ["toolz", "tabulate"], folder,
                          io.BytesIO(), timeout_s=60, max_bytes=150_000, account=None)
    assert not folder.exists() and _leftovers(folder) == []


@pytest.mark.slow
def test_a_file_larger_than_the_layer_may_be_stops_the_installer(tmp_path, product):
    folder = _owner_folder(tmp_path)
    with pytest.raises(build.BuildError, match=r"was stopped: it wrote a file larger than the "
                                               r"environment's limit of 48.8 KiB$"):
        build.build_layer(PRODUCT_PYTHON, product, ["tabulate"], folder, io.BytesIO(),
                          timeout_s=60, max_bytes=50_000, account=None)
    assert not folder.exists() and _leftovers(folder) == []


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="switching accounts needs root")
def test_a_layer_is_built_by_its_owners_account(product):
    # Not under pytest's tmp_path: its folders are root's own (0700).
    top = Path(tempfile.mkdtemp(prefix="edt-build-test-"))
    try:
        top.chmod(0o711)
        folder = build.layer_folder(top, str(ACCOUNT[0]), KEY)
        folder.parent.parent.mkdir()
        folder.parent.mkdir(mode=0o700)
        os.chown(folder.parent, *ACCOUNT)
        built = build.build_layer(PRODUCT_PYTHON, product, ["toolz"], folder,
                                  io.BytesIO(), timeout_s=60, max_bytes=50 << 20,
                                  account=ACCOUNT)
        # Everything the build made is the account's: its processes ran as it.
        made = [folder, *folder.rglob("*"), folder.parent / ".uv-cache"]
        assert {(p.lstat().st_uid, p.lstat().st_gid) for p in made} == {ACCOUNT}
        assert "toolz" in built.installed
        assert _run(built.python, "import toolz, six", user=ACCOUNT) == ""
        # Another user's job can neither change this layer nor the base every job imports.
        targets = [str(_site(folder)), _purelib(PRODUCT_PYTHON)]
        tries = ("import os\n"
                 f"for place in {targets!r}:\n"
                 "    try:\n"
                 "        open(os.path.join(place, 'planted.pth'), 'x').close()\n"
                 "        print('wrote', place)\n"
                 "    except OSError as exc:\n"
                 "        print('refused', exc.errno)\n")
        assert _run(PRODUCT_PYTHON, tries, user=OTHER).splitlines() == [
            f"refused {errno.EACCES}"] * 2
    finally:
        shutil.rmtree(top)


def _run(python: str, code: str, user: tuple[int, int] | None = None) -> str:
    import subprocess

    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30,
                          check=True, user=user[0] if user else None,
                          group=user[1] if user else None,
                          extra_groups=[] if user else None, env={"PATH": "/usr/bin:/bin"})
    return done.stdout.strip()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
