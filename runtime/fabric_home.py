"""Build ``$FABRIC_HOME/libs/fabric.zip`` so WMLA model files import unchanged::

    path = os.path.join(os.getenv("FABRIC_HOME"), "libs", "fabric.zip")
    sys.path.insert(0, path)
    from fabric_model import FabricModel          # also: callbacks, emetrics, elog,
                                                  # pth_parameter_mgr, pyedt.fabric_model

The zip holds this ``runtime`` package (without its tests) and WMLA's module names as
thin shims over it. Torch and numpy come from the job's Python environment.

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

SHIMS = {
    "fabric_model.py": '"""WMLA: from fabric_model import FabricModel."""\n'
    "from runtime import FabricModel\n\n__all__ = [\"FabricModel\"]\n",
    "callbacks.py": '"""WMLA: from callbacks import Callback, LoggerCallback."""\n'
    "from runtime.callbacks import Callback, LoggerCallback\n\n"
    "__all__ = [\"Callback\", \"LoggerCallback\"]\n",
    "emetrics.py": '"""WMLA: from emetrics import EMetrics."""\n'
    "from runtime.wmla import EMetrics\n\n__all__ = [\"EMetrics\"]\n",
    "elog.py": '"""WMLA: from elog import ELog."""\nfrom runtime.wmla import ELog\n\n'
    "__all__ = [\"ELog\"]\n",
    "pth_parameter_mgr.py": '"""WMLA: import pth_parameter_mgr."""\n'
    "from runtime.wmla import (getEpoch, getLearningRate, getOptimizer, getTestData,\n"
    "                          getTrainBatchSize, getTrainData)\n",
    "pyedt/__init__.py": "from runtime import FabricModel\n\n__all__ = [\"FabricModel\"]\n",
    "pyedt/fabric_model.py": "from runtime import FabricModel\n\n__all__ = [\"FabricModel\"]\n",
    "pyedt/callbacks.py": "from runtime.callbacks import Callback, LoggerCallback\n",
}


def build_fabric_home(dest_dir: str | os.PathLike) -> str:
    """Write ``<dest_dir>/libs/fabric.zip`` (atomically) and return its path."""
    libs = Path(dest_dir) / "libs"
    libs.mkdir(parents=True, exist_ok=True)
    target = libs / "fabric.zip"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in sorted(PACKAGE.glob("*.py")):
            zf.write(path, f"runtime/{path.name}")
        for name, text in SHIMS.items():
            zf.writestr(name, text)
    # A temp file of its own, then a rename: launch threads of one agent, or agents sharing
    # the volume, may build at the same moment.
    atomic_write(str(target), buf.getvalue())
    os.chmod(target, 0o644)  # readable by every job's account, whatever the umask
    return str(target)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m runtime.fabric_home FABRIC_HOME")
    print(build_fabric_home(sys.argv[1]))
