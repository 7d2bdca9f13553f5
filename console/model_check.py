"""The New model page's step 1, checked before step 2: the folder or the archive and its main
file, with what it holds listed. Without it a wrong main file was only reported after step 2,
on a page where the browser had forgotten the chosen archive (a file input is never refilled).

``POST /models/check-location/`` takes the step's fields as the form posts them and answers
JSON: ``{"ok": true, "files": [...], "more": false}`` or ``{"ok": false, "errors": {field:
[message, ...]}}``. An archive is only listed (its table of contents), never unpacked: the
upload itself still goes through ``models.services.model_create_from_archive`` and its checks.
"""

from __future__ import annotations

import tarfile
import zipfile
from pathlib import PurePosixPath
from typing import BinaryIO

from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_POST

from console.objects import LIST_LIMIT, folder_listing
from models.locations import model_folder
from models.validation import check_main_file

# Reading a table of contents is cheap, but an archive may claim millions of entries.
MEMBERS_MAX = 100_000


def archive_files(archive: BinaryIO) -> list[str]:
    """The files a zip or tar(.gz) archive holds, as paths relative to the folder it unpacks
    to: a single top folder is the model folder itself, as the upload service unpacks it.
    Raises ValueError naming the problem for anything else."""
    names = _member_names(archive)
    if not names:
        raise ValueError("The archive is empty.")
    tops = {PurePosixPath(n).parts[0] for n in names}
    if len(tops) == 1 and all(len(PurePosixPath(n).parts) > 1 for n in names):
        names = [PurePosixPath(*PurePosixPath(n).parts[1:]).as_posix() for n in names]
    return sorted(names)


def _member_names(archive: BinaryIO) -> list[str]:
    try:
        archive.seek(0)
        if zipfile.is_zipfile(archive):
            archive.seek(0)
            with zipfile.ZipFile(archive) as z:
                infos = z.infolist()
                _bounded(len(infos))
                return [i.filename.rstrip("/") for i in infos if not i.is_dir()]
        archive.seek(0)
        with tarfile.open(fileobj=archive, mode="r:*") as t:
            names = []
            for member in t:
                _bounded(len(names))
                if member.isfile():
                    names.append(member.name.removeprefix("./"))
            return names
    except tarfile.TarError:
        raise ValueError("This is not a .zip or .tar.gz archive.") from None
    finally:
        archive.seek(0)


def _bounded(count: int) -> None:
    if count > MEMBERS_MAX:
        raise ValueError(f"The archive holds more than {MEMBERS_MAX:,} entries.")


def _archive_answer(archive, main_file: str) -> dict:
    try:
        files = archive_files(archive)
    except (ValueError, zipfile.BadZipFile, OSError) as exc:
        return {"ok": False, "errors": {"archive": [str(exc)]}}
    main = (main_file or "main.py").strip().removeprefix("./")
    if main not in files:
        return {"ok": False, "files": files[:LIST_LIMIT], "more": len(files) > LIST_LIMIT,
                "errors": {"main_file": [f"'{main}' is not a file in the archive."]}}
    return {"ok": True, "files": files[:LIST_LIMIT], "more": len(files) > LIST_LIMIT}


def _folder_answer(location: str, main_file: str, user) -> dict:
    try:
        folder = model_folder(location, owner=user)
    except ValidationError as exc:
        return {"ok": False, "errors": {"location": exc.messages}}
    listing = folder_listing(str(folder))
    files = [e.path for e in listing.entries if e.size is not None]
    try:
        check_main_file(folder, main_file)
    except ValidationError as exc:
        return {"ok": False, "files": files, "more": listing.more,
                "errors": exc.message_dict}
    return {"ok": True, "files": files, "more": listing.more}


@login_required
@require_POST
def check_location(request: HttpRequest) -> JsonResponse:
    """Step 1 of the New model page, judged now: the archive or folder and the main file."""
    archive = request.FILES.get("archive")
    main_file = request.POST.get("main_file", "main.py")
    if archive is not None:
        answer = _archive_answer(archive, main_file)
    elif request.POST.get("location", "").strip():
        answer = _folder_answer(request.POST["location"].strip(), main_file, request.user)
    else:
        answer = {"ok": False, "errors": {
            "location": ["Give the model's folder, or upload it as an archive."]}}
    return JsonResponse(answer, status=200 if answer["ok"] else 400)
