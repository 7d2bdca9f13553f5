"""bench/runtime.py's harness: its step counter counts the whole lines of a log being
appended to, reading only what is new, and ``--steps`` too short for a round is refused
before anything starts."""

from __future__ import annotations

import subprocess
import sys

from bench.runtime import _LineCount
from tests.benches.support import REPO


def test_it_counts_whole_lines_as_they_are_appended(tmp_path):
    log = tmp_path / "steps.jsonl"
    with _LineCount(log) as lines:
        assert lines.now() == 0  # no file yet
        log.write_text('{"step": 1}\n{"st')
        assert lines.now() == 1  # the second line is half written
        with log.open("a") as f:
            f.write('ep": 2}\n{"step": 3}\n')
        assert lines.now() == 3
        assert lines.now() == 3  # nothing new, nothing counted twice


def test_too_few_steps_for_a_round_are_refused_by_name():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "runtime.py"), "--steps", "5"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--steps must be at least 20" in run.stderr and "got 5" in run.stderr
