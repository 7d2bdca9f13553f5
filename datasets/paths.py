"""Confinement of user-typed paths to the configured roots (no ``..``, no symlink escapes)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from django.core.exceptions import ValidationError


def confine(path: str, roots: Sequence[Path], *, must_be_dir: bool = True) -> Path:
    """Resolve ``path`` (absolute, or relative to the first root) and return it if it lies inside
    one of ``roots`` after following symlinks; raise ``ValidationError`` naming the problem."""
    if not path or not path.strip():
        raise ValidationError("This path is empty.")
    if "\x00" in path:
        raise ValidationError("This path contains a NUL character.")
    if ".." in PurePosixPath(path).parts:
        raise ValidationError("Paths may not contain '..'.")
    candidate = Path(path)
    if not candidate.is_absolute():
        candidate = roots[0] / candidate
    resolved = candidate.resolve()
    if not any(resolved == root or root in resolved.parents for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise ValidationError(f"'{path}' is outside the allowed data roots ({allowed}).")
    if must_be_dir and not resolved.is_dir():
        raise ValidationError(f"'{path}' is not an existing folder.")
    return resolved
