"""bench/live.py's job page part: the CPU slowdown it is asked for is checked before anything
starts, and said beside the figures it produced."""

from __future__ import annotations

import subprocess
import sys

from bench import job_page
from tests.benches.support import REPO


def test_a_cpu_slowdown_under_1_is_refused_by_name_before_anything_starts():
    done = subprocess.run([sys.executable, "-m", "bench.live", "--cpu-slowdown", "0.5"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "--cpu-slowdown must be 1 (no slowdown) or more" in done.stderr


def test_the_figures_split_long_tasks_at_load_and_say_the_slowdown():
    tasks = [{"start": 100.0, "ms": 300.0}, {"start": 2000.0, "ms": 80.0},
             {"start": 2500.0, "ms": 120.0}]
    figures = job_page._figures(tasks, loaded_at=1500.0, load_s=1.25, cpu_slowdown=10)
    assert figures["job_page_cpu_slowdown"] == 10
    assert figures["job_page_load_longest_task_ms"] == 300.0
    assert figures["job_page_longest_task_ms"] == 120.0
    assert figures["job_page_long_tasks"] == 2
    assert figures["job_page_long_tasks_total_ms"] == 200.0
