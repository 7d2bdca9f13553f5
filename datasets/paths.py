"""Confinement of user-typed paths to the configured roots (no ``..``, no symlink escapes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


def shared_dirs(entries: Sequence[str], roots: Sequence[Path]) -> list[Path]:
    """The folders of ``entries`` (absolute, or relative to the first root), resolved, that lie
    strictly inside one of ``roots``: an admin's list of folders every user may register."""
    shared = []
    for entry in entries or []:
        folder = Path(entry) if Path(entry).is_absolute() else roots[0] / entry
        folder = folder.resolve()
        if any(root in folder.parents for root in roots):
            shared.append(folder)
    return shared


def shared_data_dirs() -> list[Path]:
    """``EDT_SHARED_DATA_DIRS``: every user may register datasets from them."""
    return shared_dirs(getattr(settings, "EDT_SHARED_DATA_DIRS", []), settings.EDT_DATA_ROOTS)


@dataclass(frozen=True)
class Area:
    """Where one kind of folder may be registered: ``roots`` (each user's own area is
    ``<root>/<username>/``), the ``shared`` folders everyone may use, and the ``reserved``
    folders (the product's upload folders) no one may name, be inside of, or contain.
    ``what`` and ``thing`` name them in messages: "data", "a dataset"."""

    roots: Sequence[Path]
    shared: Sequence[Path]
    reserved: Sequence[Path]
    what: str
    thing: str


def _inside(folder: Path, tops: Sequence[Path]) -> bool:
    return any(folder == top or top in folder.parents for top in tops)


def _looked_up(path: str, own: Sequence[Path]) -> str:
    """A relative ``path`` is looked up in the owner's own area of the first root first."""
    if path and not Path(path).is_absolute() and own and (own[0] / path).exists():
        return str(own[0] / path)
    return path


def _check_not_reserved(resolved: Path, path: str, area: Area) -> None:
    for reserved in area.reserved:
        reserved = reserved.resolve()
        if _inside(resolved, [reserved]) or resolved in reserved.parents:
            raise ValidationError(
                f"'{path}' is the upload folder {reserved} or holds it: uploaded folders are "
                f"registered by uploading an archive, never by path."
            )


def owned_folder(path: str, *, owner, area: Area) -> Path:
    """The folder ``path`` resolved (links followed), if ``owner`` may register it in ``area``.

    The one rule for dataset and model folders. Everyone: never outside the roots (no ``..``,
    no link out), never a root itself or a folder holding one (it holds every user's folders),
    never an upload folder or a folder holding it. Admins: anywhere else under the roots. Other
    users: only inside their own area (``<root>/<username>/``, see ``user_area``) or a shared
    folder, so never another user's area nor a folder holding one. A relative path is looked
    up in the owner's area of the first root first, then under the first root."""
    roots = list(area.roots)
    own = [a for a in (user_area(owner, r) for r in roots) if a is not None]
    resolved = confine(_looked_up(path, own), roots, what=f"{area.what} roots")
    yours = f"{own[0]}/" if own else f"a shared {area.what} folder"
    if any(root == resolved or resolved in root.parents for root in roots):
        raise ValidationError(
            f"A {area.what} root itself cannot be {area.thing}: it holds every user's folders. "
            f"Name a folder inside it (yours are under {yours})."
        )
    _check_not_reserved(resolved, path, area)
    if is_admin(owner) or _inside(resolved, [*own, *area.shared]):
        return resolved
    shared = ", ".join(str(s) for s in area.shared)
    raise ValidationError(
        f"'{path}' is outside your own {area.what} folder: {area.thing} must be under {yours}"
        + (f" or a shared {area.what} folder ({shared})" if shared else "") + "."
    )


def data_area() -> Area:
    """Dataset folders: under ``EDT_DATA_ROOTS``; uploaded datasets' folders are reserved."""
    uploads = Path(settings.EDT_UPLOAD_ROOT) / "datasets"
    return Area(roots=list(settings.EDT_DATA_ROOTS), shared=shared_data_dirs(),
                reserved=[uploads], what="data", thing="a dataset folder")


def dataset_folder(path: str, *, owner) -> Path:
    """The folder ``path`` resolved, if ``owner`` may register it as a dataset folder
    (``owned_folder``'s rule in the data roots)."""
    return owned_folder(path, owner=owner, area=data_area())
