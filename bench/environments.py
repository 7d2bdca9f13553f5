"""A model's requirements as a layer on a base environment: the first build, then its reuse.

``.venv/bin/python -m bench.environments [--reuses 5]`` (about 5 s, needs the package index).
The product's own interpreter stands for the base (it holds torch); the layer is a small
requirement set, one the base holds (six) and two it lacks (toolz, tabulate), built by
``environments.build.build_layer`` as the agent builds one, the first time a job needs it.

The reuse path is what a second job of the same owner asking for the same set does on that
host: find the ready layer's folder by its key (``layer_folder``) and check that its Python
runs and imports the requirements (one process start). Its target is under 1 s.

JSON keys: ``first_build_s`` (the first build, seconds), ``reuse_s`` (the median reuse,
seconds), ``layer_bytes`` (the layer's size on disk: what the base lacks, not torch).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import install, print_result, table
from environments import build
from environments.spec import layer_key

REQUIREMENTS = ["six", "tabulate", "toolz"]
OWNER = "bench"
REUSE_TARGET_S = 1.0


def reuse(root: Path, key: str) -> float:
    """Seconds for a job of the same owner to find the ready layer and run its Python."""
    started = time.perf_counter()
    python = build.layer_folder(root, OWNER, key) / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"no layer at {python}")
    subprocess.run([str(python), "-c", "import six, tabulate, toolz"], check=True,
                   timeout=60, env={"PATH": "/usr/bin:/bin"})
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuses", type=int, default=5, help="reuse runs (median reported)")
    args = parser.parse_args()
    install()
    tmp = Path(tempfile.mkdtemp(prefix="edt-bench-environments-"))
    try:
        base = sys.executable
        started = time.perf_counter()
        installed, _ = build.probe(base)
        probe_s = time.perf_counter() - started
        key = layer_key("product", "", REQUIREMENTS)
        folder = build.layer_folder(tmp, OWNER, key)
        folder.parent.mkdir(parents=True)
        built = build.build_layer(base, installed, REQUIREMENTS, folder, tmp / "build.log",
                                  timeout_s=300, max_bytes=1 << 30, account=None)
        times = [reuse(tmp, key) for _ in range(max(1, args.reuses))]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reuse_s = statistics.median(times)
    print(table([
        ["step", "seconds"],
        ["probe the base (once per base build)", f"{probe_s:.3f}"],
        ["first build of the layer", f"{built.seconds:.3f}"],
        [f"reuse: median of {len(times)}", f"{reuse_s:.3f}",
         "ok" if reuse_s < REUSE_TARGET_S else f"over the {REUSE_TARGET_S:g} s target"],
        ["reuse: worst", f"{max(times):.3f}"],
        ["layer size", build.format_bytes(built.size_bytes)],
    ], title=f"A layer of {', '.join(REQUIREMENTS)} on the product's Python ({base})"))
    print_result({"first_build_s": round(built.seconds, 3), "reuse_s": round(reuse_s, 3),
                  "layer_bytes": built.size_bytes})


if __name__ == "__main__":
    main()
