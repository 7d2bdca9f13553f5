"""Print the slowest tests of a run and the time spent per folder, from the JUnit XML that
``./edt test`` keeps for every run (``var/test-reports/junit-<UTC time>.xml``).

    python scripts/slowest_tests.py                  # the latest report, 25 slowest
    python scripts/slowest_tests.py REPORT.xml -n 50 --depth 2

A test's time is its setup, call and teardown together (pytest's default ``junit_duration_report``).
Under pytest-xdist the per-folder totals are test time summed over workers, not wall time: the
run's wall time is the ``time`` of the report's test suite, printed first.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET  # noqa: S405 - our own pytest's report, not untrusted input
from collections import defaultdict
from pathlib import Path

REPORTS = Path(__file__).resolve().parent.parent / "var" / "test-reports"


def latest_report(folder: Path = REPORTS) -> Path:
    reports = sorted(folder.glob("junit-*.xml"), key=lambda p: p.stat().st_mtime)
    if not reports:
        sys.exit(f"no junit-*.xml under {folder}: run ./edt test first")
    return reports[-1]


def read_cases(report: Path) -> tuple[float, list[tuple[str, float, str]]]:
    """The suite's wall time and each test as (file::name, seconds, outcome)."""
    root = ET.parse(report).getroot()  # noqa: S314 - see the import
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    wall = sum(float(s.get("time", 0)) for s in suites)
    cases = []
    for case in root.iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        outcome = next((child.tag for child in case
                        if child.tag in ("failure", "error", "skipped")), "passed")
        cases.append((f"{path}.py::{case.get('name')}", float(case.get("time", 0)), outcome))
    return wall, cases


def folder_of(test: str, depth: int) -> str:
    """The first ``depth`` folders of a test's file (``tests/e2e`` for depth 2)."""
    parts = test.split("::", 1)[0].split("/")[:-1]
    return "/".join(parts[:depth]) or "."


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", type=Path, help="JUnit XML (default: the latest)")
    parser.add_argument("-n", "--top", type=int, default=25, help="how many tests to list")
    parser.add_argument("--depth", type=int, default=2, help="folder depth of the totals")
    args = parser.parse_args(argv)
    report = args.report or latest_report()
    wall, cases = read_cases(report)
    total = sum(seconds for _, seconds, _ in cases)
    print(f"{report}: {len(cases)} tests, {total:.0f} s of test time, {wall:.0f} s wall")

    print(f"\nslowest {args.top}:")
    for test, seconds, outcome in sorted(cases, key=lambda c: -c[1])[: args.top]:
        mark = "" if outcome == "passed" else f"  [{outcome}]"
        print(f"{seconds:8.1f} s  {test}{mark}")

    per_folder: dict[str, list[float]] = defaultdict(list)
    for test, seconds, _ in cases:
        per_folder[folder_of(test, args.depth)].append(seconds)
    print("\nper folder (test time, tests):")
    for folder, times in sorted(per_folder.items(), key=lambda kv: -sum(kv[1])):
        print(f"{sum(times):8.1f} s  {len(times):5d}  {folder}")


if __name__ == "__main__":
    main()
