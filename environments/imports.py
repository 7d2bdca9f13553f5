"""What a model's main file imports, and which of those an environment does not provide: the
check before submit (``environments.services.import_warnings`` says it on the model's pages,
in the APIs and on the Train form, as warnings: the model is saved and can be trained anyway).

Only the main file is read, with ``ast`` (nothing of it runs). An import is *required* unless
it is relative (the model's own package), of the standard library or ``__future__``, of a
module or package in the model's own folder, under ``if TYPE_CHECKING:``, or inside a ``try``
whose handlers catch ``ImportError`` (the model copes without it). Imports inside functions
count: they fail when the function runs, usually during training.

A module is provided when the environment holds it, or when the model's requirements name a
distribution of the same name (PEP 503-normalised: ``timm`` for ``import timm``). Import and
distribution names often differ (``sklearn`` is scikit-learn's, ``PIL`` pillow's, ``cv2``
opencv-python's), and nothing short of installing a distribution says which modules it holds.
So: a requirement that matches no import by name might be the one providing any import left
over, and while there is such a requirement, the imports left over are not reported (rather
no warning than a wrong one).

No Django here: the model's folder is the owner's and can change at any moment, so it is read
the way ``jobs.jobfiles`` reads a job's folder (no link followed, size-capped, never a FIFO),
but this layer sits below ``jobs``.
"""

from __future__ import annotations

import ast
import os
import re
import stat
import sys
from collections.abc import Container, Iterable, Iterator
from pathlib import Path, PurePosixPath

# A main file bigger than this is not read (real training scripts are a few hundred lines).
MAIN_MAX_BYTES = 1024 * 1024
# The agent reads a model's requirements.txt with the same cap (agent.job_environment).
REQUIREMENTS_FILE = "requirements.txt"
REQUIREMENTS_MAX_BYTES = 64 * 1024
# A folder of tens of thousands of entries is data, not code: its module names are not all read.
MAX_ENTRIES = 10_000

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted under the file's name opens at once instead of waiting for a writer.
_LEAF = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

# What an ``except`` catching a failed import names (``except Exception`` catches it too).
_CATCHES_IMPORT = frozenset({"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})
_NEVER_MISSING = frozenset({"__future__", "__main__"})
_EXTENSION = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\.(?:[A-Za-z0-9_-]+\.)?(?:so|pyd)$")


class FileTooLarge(ValueError):
    """The file is over the size the check reads."""


# --- reading the model's folder ------------------------------------------------------------


def _parts(relative: str) -> list[str]:
    parts = [p for p in PurePosixPath(relative).parts if p not in ("", ".")]
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise FileNotFoundError(relative)
    return parts


def _open_folder(folder: Path, parts: Iterable[str] = ()) -> int:
    """A descriptor on ``folder/parts...``, no link followed at any component."""
    fd = os.open(folder, _DIR)
    try:
        for part in parts:
            nxt = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_model_file(folder: Path, relative: str, limit: int) -> bytes:
    """The plain file ``folder/relative``; ``OSError`` when it is missing, a link, a FIFO or
    unreadable, ``FileTooLarge`` when it holds more than ``limit`` bytes."""
    parts = _parts(relative)
    dir_fd = _open_folder(folder, parts[:-1])
    try:
        fd = os.open(parts[-1], _LEAF, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{relative} is not a regular file")
        os.set_blocking(fd, True)
        data = f.read(limit + 1)
    if len(data) > limit:
        raise FileTooLarge(f"{relative} is larger than {limit // 1024} KiB")
    return data


def read_requirements_txt(folder: Path) -> str:
    """The text of the model folder's requirements.txt; "" when it has none."""
    try:
        data = read_model_file(folder, REQUIREMENTS_FILE, REQUIREMENTS_MAX_BYTES)
    except FileNotFoundError:
        return ""
    return data.decode("utf-8", "replace")


def _module_name(entry: os.DirEntry) -> str | None:
    """The top-level module name a folder entry can be imported as, if any."""
    name = entry.name
    try:
        is_dir = entry.is_dir(follow_symlinks=False)
    except OSError:
        return None
    if is_dir:  # a package, or a namespace package without __init__.py
        return name if name.isidentifier() else None
    stem, dot, suffix = name.partition(".")
    if dot and suffix in ("py", "pyc") and stem.isidentifier():
        return stem
    matched = _EXTENSION.match(name)
    return matched.group(1) if matched else None


def local_modules(folder: Path, subfolder: str = "") -> set[str]:
    """The top-level modules and packages in ``folder`` (or its ``subfolder``): the model's own
    code, which the agent puts on the job's path (the main file's folder is first there)."""
    try:
        fd = _open_folder(folder, _parts(subfolder) if subfolder else ())
    except OSError:
        return set()
    names: set[str] = set()
    try:
        with os.scandir(fd) as entries:
            for count, entry in enumerate(entries):
                if count >= MAX_ENTRIES:
                    break
                name = _module_name(entry)
                if name:
                    names.add(name)
    finally:
        os.close(fd)
    return names


# --- reading the main file's imports ---------------------------------------------------------


def _catches_import_error(handlers: list[ast.ExceptHandler]) -> bool:
    for handler in handlers:
        if handler.type is None:  # a bare except
            return True
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        for node in types:
            name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
            if name in _CATCHES_IMPORT:
                return True
    return False


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _required_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` outside optional blocks. A stack, not recursion: a
    deeply nested file must not exhaust Python's recursion limit."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, optional = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if not optional:
                yield node
            continue
        if isinstance(node, (ast.Try, ast.TryStar)):
            guarded = optional or _catches_import_error(node.handlers)
            stack.extend((child, guarded) for child in node.body)
            rest = [*node.handlers, *node.orelse, *node.finalbody]
            stack.extend((child, optional) for child in rest)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend((child, optional) for child in node.orelse)
            continue
        stack.extend((child, optional) for child in ast.iter_child_nodes(node))


def imported_modules(source: str | bytes) -> set[str]:
    """The top-level modules ``source`` must be able to import: relative imports, the
    standard library, ``__future__`` and optional imports left out. Raises ``SyntaxError``
    (and ``ValueError`` for a NUL byte) when it is not Python."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in _required_imports(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in _NEVER_MISSING}


def normalised(name: str) -> str:
    """A module or distribution name as PEP 503 compares distribution names."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(line: str) -> str:
    return normalised(re.split(r"[\[<>=!~;\s@]", line.strip(), maxsplit=1)[0])


def missing_imports(main_source: str | bytes, folder: Path, provided: Container[str],
                    requirements: list[str], main_file: str = "") -> list[str]:
    """The modules ``main_source`` imports that neither ``provided`` (the environment's), the
    model's ``folder`` (and the main file's own folder in it) nor ``requirements`` give, sorted.
    ``SyntaxError`` / ``ValueError`` as ``imported_modules``."""
    imported = imported_modules(main_source)
    main_dir = PurePosixPath(main_file).parent.as_posix() if main_file else "."
    local = local_modules(folder)
    if main_dir not in ("", "."):
        local |= local_modules(folder, main_dir)
    named = {_requirement_name(line) for line in requirements}
    left = {n for n in imported - local
            if n not in provided and normalised(n) not in named}
    # A requirement matching no import by name may be what provides one under another name
    # (scikit-learn for sklearn): then what is left is unknown, not missing.
    if left and named - {normalised(n) for n in imported}:
        return []
    return sorted(left)
