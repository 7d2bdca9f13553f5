"""The shape of the code, checked: imports go down the layers only, and no function is longer
than a screen. Complexity is ruff's job (C901, PLR0915 in pyproject.toml); length and layering
have no ruff rule, so they are checked here, on the source itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A package may import its own modules and anything listed before it; two
# packages on the same line are peers and may not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("runtime",),
    ("config",),
    ("environments",),
    ("resources",),
    ("datasets",),
    ("models",),
    ("jobs",),
    ("events",),
    # Hyper-parameter search submits and stops ordinary jobs; the scheduler runs its loop.
    ("hpo",),
    # The scheduler and the host agents talk through Celery task names (config.celery), never
    # through each other's modules.
    ("agent", "scheduler"),
    ("console",),
]
RANK = {package: rank for rank, line in enumerate(LAYERS) for package in line}
# config is the Django project: its settings, URLs and ASGI app name the top layer's modules by
# design (that is how Django finds them), so those three are its only upward imports.
WIRING = {"config/urls.py", "config/asgi.py", "config/settings.py"}
MAX_LINES = 60


def _sources() -> list[Path]:
    out = []
    for package in RANK:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/tests/" in rel or "/migrations/" in rel:
                continue
            out.append(path)
    return out


def _imported_packages(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & RANK.keys()


def test_the_sources_are_found():
    rels = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"scheduler/policy.py", "agent/supervisor.py", "runtime/worker.py"} <= rels


def test_imports_only_go_down_the_layers():
    upward = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in WIRING:
            continue
        own = rel.split("/")[0]
        for target in _imported_packages(ast.parse(path.read_text(), rel)):
            if target != own and RANK[target] >= RANK[own]:
                upward.append(f"{rel} imports {target}")
    assert not upward, "imports against the layers (see docs/architecture.md):\n" + "\n".join(
        upward
    )


def test_runtime_never_imports_django():
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in _sources()
        if p.relative_to(ROOT).parts[0] == "runtime"
        and any(
            isinstance(n, (ast.Import, ast.ImportFrom))
            and any(
                name.split(".")[0] == "django"
                for name in ([a.name for a in n.names] if isinstance(n, ast.Import)
                             else [n.module or ""])
            )
            for n in ast.walk(ast.parse(p.read_text()))
        )
    ]
    assert not offenders, f"runtime/ runs in user processes and must not import Django: {offenders}"


@pytest.mark.parametrize("folder", sorted(RANK))
def test_no_function_is_longer_than_a_screen(folder):
    long = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(folder + "/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{rel}:{node.lineno} {node.name} is {lines} lines")
    assert not long, f"functions over {MAX_LINES} lines:\n" + "\n".join(long)


# The one module that changes a job's state or a slot's holding and says so (issue: a change and
# its event written separately at each call site drift apart).
LIFECYCLE = "jobs/lifecycle.py"


def _state_changes_outside_lifecycle() -> list[str]:
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == LIFECYCLE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Attribute) and node.func.attr == "transition":
                found.append(f"{rel}:{node.lineno} calls transition()")
            said = any(isinstance(a, ast.Constant) and a.value == "slot.released"
                       for a in node.args)
            if said and not (isinstance(node.func, ast.Name) and node.func.id == "wake_scheduler"):
                found.append(f"{rel}:{node.lineno} builds a slot.released event")
    return found


def test_job_and_slot_changes_happen_in_the_lifecycle_module_only():
    found = _state_changes_outside_lifecycle()
    assert not found, f"change jobs and slots through {LIFECYCLE}:\n" + "\n".join(found)
