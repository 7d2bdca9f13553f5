"""fabric.zip and the install take WMLA's module names from the same files in wmla_compat/."""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import fabric_model
import pth_parameter_mgr
import pyedt.fabric_model

from runtime.fabric_home import WMLA_NAMES, build_fabric_home
from runtime.wmla import FALLBACK_MODULES


def test_it_puts_every_wmla_name_at_the_top_of_the_zip_unchanged(tmp_path: Path) -> None:
    archive = zipfile.ZipFile(build_fabric_home(tmp_path))
    files = sorted(WMLA_NAMES.rglob("*.py"))
    assert {p.relative_to(WMLA_NAMES).as_posix() for p in files} >= {
        "fabric_model.py", "pth_parameter_mgr.py", "callbacks.py", "emetrics.py", "elog.py",
        "pyedt/__init__.py", "pyedt/fabric_model.py", "pyedt/callbacks.py"}
    for path in files:
        assert archive.read(path.relative_to(WMLA_NAMES).as_posix()) == path.read_bytes()


def test_it_leaves_the_host_side_tools_out_of_the_zip(tmp_path: Path) -> None:
    names = zipfile.ZipFile(build_fabric_home(tmp_path)).namelist()
    assert "runtime/worker.py" in names
    assert not [name for name in names if name.startswith("runtime/tests/")]
    assert "runtime/fabric_home.py" not in names


def test_the_install_imports_the_same_files() -> None:
    for module in (fabric_model, pth_parameter_mgr, pyedt.fabric_model):
        assert Path(module.__file__).resolve().is_relative_to(WMLA_NAMES)


def test_the_standalone_fallback_serves_what_the_compat_files_export() -> None:
    """Standalone, ``callbacks``/``elog``/``emetrics`` come from runtime.wmla's table rather
    than the files a job gets: the two must name the same things."""
    for name, (_source, exported) in FALLBACK_MODULES.items():
        tree = ast.parse((WMLA_NAMES / f"{name}.py").read_text())
        declared = next(
            ast.literal_eval(node.value) for node in tree.body
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__"
        )
        assert sorted(declared) == sorted(exported), name
