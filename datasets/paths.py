"""Confinement of user-typed paths to the configured roots (no ``..``, no symlink escapes)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.core.exceptions import ValidationError

from config.ownership import is_admin


def confine(
    path: str, roots: Sequence[Path], *, must_be_dir: bool = True, what: str = "data roots"
) -> Path:
    """Resolve ``path`` (absolute, or relative to the first root) and return it if it lies inside
    one of ``roots`` after following symlinks; raise ``ValidationError`` naming the problem.
    ``what`` names the roots in that message ("data roots", "model roots")."""
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
        raise ValidationError(f"'{path}' is outside the allowed {what} ({allowed}).")
    if must_be_dir and not resolved.is_dir():
        raise ValidationError(f"'{path}' is not an existing folder.")
    return resolved


def user_area(user, root: Path) -> Path | None:
    """``<root>/<username>``: the part of a data root where ``user`` keeps their own data; None
    for a username that is no single, plain folder name."""
    name = user.get_username()
    if not name or name in (".", "..") or "/" in name or "\x00" in name:
        return None
    return root / name


def shared_data_dirs() -> list[Path]:
    """The folders of ``EDT_SHARED_DATA_DIRS`` (absolute, or relative to the first data root)
    that lie inside a data root: every user may register datasets from them."""
    roots = settings.EDT_DATA_ROOTS
    shared = []
    for entry in getattr(settings, "EDT_SHARED_DATA_DIRS", []) or []:
        folder = Path(entry) if Path(entry).is_absolute() else roots[0] / entry
        folder = folder.resolve()
        if any(root in folder.parents for root in roots):
            shared.append(folder)
    return shared


def dataset_folder(path: str, *, owner) -> Path:
    """The folder ``path`` resolved, if ``owner`` may register it as a dataset folder.

    Everyone: never a data root itself, never outside the roots (no ``..``, no link out).
    Admins: anywhere else under the data roots. Other users: only inside their own area
    (``<data root>/<username>/``, see ``user_area``) or a folder the admin shares with
    everyone (``EDT_SHARED_DATA_DIRS``). A relative path is looked up in the owner's area of
    the first data root first, then under the first data root."""
    roots = list(settings.EDT_DATA_ROOTS)
    own = [a for a in (user_area(owner, r) for r in roots) if a is not None]
    if path and not Path(path).is_absolute() and own and (own[0] / path).exists():
        path = str(own[0] / path)
    resolved = confine(path, roots)
    if resolved in roots:
        raise ValidationError("A data root itself cannot be a dataset: name a folder inside it.")
    if is_admin(owner):
        return resolved
    allowed = own + shared_data_dirs()
    if not any(resolved == a or a in resolved.parents for a in allowed):
        where = f"{own[0]}/..." if own else "a shared data folder"
        raise ValidationError(f"'{path}' is outside your own data folder ({where}).")
    return resolved
