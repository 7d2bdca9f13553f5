"""Build ``$FABRIC_HOME/libs/fabric.zip`` so WMLA model files import unchanged::

    path = os.path.join(os.getenv("FABRIC_HOME"), "libs", "fabric.zip")
    sys.path.insert(0, path)
    from fabric_model import FabricModel          # also: callbacks, emetrics, elog,
                                                  # pth_parameter_mgr, pyedt.fabric_model

The zip holds this ``runtime`` package (without its tests and the host-side tools) and, at its
top, the files of ``wmla_compat/``: WMLA's module names as thin modules over the runtime, the
same files the project installs. Torch and numpy come from the job's Python environment.

``python -m runtime.fabric_home DEST`` builds it from the command line.
"""

from __future__ import annotations

import io
import os
import sys
import zipfile
from pathlib import Path

from .checkpoint import atomic_write

PACKAGE = Path(__file__).resolve().parent
# Beside this package in the project's folder, where jobs find the runtime too (their
# PYTHONPATH names that folder).
WMLA_NAMES = PACKAGE.parent / "wmla_compat"
# Used on the host, never by model code: this builder.
HOST_ONLY = {"fabric_home.py"}


def zip_members() -> list[tuple[Path, str]]:
    """Each file of ``fabric.zip`` and its name in the zip."""
    runtime = [(path, f"runtime/{path.name}") for path in sorted(PACKAGE.glob("*.py"))
               if path.name not in HOST_ONLY]
    names = [(path, path.relative_to(WMLA_NAMES).as_posix())
             for path in sorted(WMLA_NAMES.rglob("*.py"))]
    if not names:
        raise FileNotFoundError(f"WMLA's module names are missing from {WMLA_NAMES}")
    return runtime + names


def build_fabric_home(dest_dir: str | os.PathLike) -> str:
    """Write ``<dest_dir>/libs/fabric.zip`` (atomically) and return its path."""
    libs = Path(dest_dir) / "libs"
    libs.mkdir(parents=True, exist_ok=True)
    target = libs / "fabric.zip"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path, name in zip_members():
            zf.write(path, name)
    # A temp file of its own, then a rename: launch threads of one agent, or agents sharing
    # the volume, may build at the same moment.
    atomic_write(str(target), buf.getvalue())
    os.chmod(target, 0o644)  # readable by every job's account, whatever the umask
    return str(target)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m runtime.fabric_home FABRIC_HOME")
    print(build_fabric_home(sys.argv[1]))
