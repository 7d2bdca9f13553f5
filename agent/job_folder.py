"""A job's result folder, made ready for its processes and handed to the account that runs
them (``agent.accounts``), with a copy of the model's code beside the results and the owner's
uploads granted to that account.

The agent walks folders a job owns as root: it never follows a link the job may have put
there (``O_NOFOLLOW`` on every component, ownership changed through file descriptors).
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

from django.conf import settings

from agent.accounts import RunAs, service_gid
from agent.environment import job_dirs
from jobs import jobwrites
from jobs.models import TrainingJob

log = logging.getLogger("edt.execution")


# Where WMLA keeps the code a job ran with, in its result folder.
CODE_FOLDER = "_submitted_code"


def _fix(fd: int, uid: int, gid: int, dir_mode: int | None,
         file_mode: Callable[[int], int] | None) -> None:
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (uid if uid >= 0 else st.st_uid, gid if gid >= 0 else st.st_gid):
        os.fchown(fd, uid, gid)
    if stat.S_ISDIR(st.st_mode) and dir_mode is not None:
        os.fchmod(fd, dir_mode)
    elif stat.S_ISREG(st.st_mode) and file_mode is not None:
        os.fchmod(fd, file_mode(stat.S_IMODE(st.st_mode)))


def hand_over(top: Path, *, uid: int, gid: int, dir_mode: int | None = None,
              file_mode: Callable[[int], int] | None = None) -> None:
    """Give ``top`` and everything under it to ``uid``:``gid`` (-1 keeps one), set folders to
    ``dir_mode`` and files to ``file_mode(mode)``. Through descriptors only
    (``jobs.jobwrites.change_tree``): links, devices and files with a second name (a hard link
    the job made to a file of the host's) are left alone; the top comes last, so when it is
    right an earlier walk finished."""
    jobwrites.change_tree(top, lambda fd, _folder: _fix(fd, uid, gid, dir_mode, file_mode))


def enterable_not_listable(folder: Path) -> None:
    """Others may pass through ``folder`` to a path they know, but not list or change it."""
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & 0o007 != 0o001:
        os.chmod(folder, mode & 0o770 | 0o001)


def _private_file(mode: int) -> int:
    return mode & 0o770


def _group_read(mode: int) -> int:
    return (mode & 0o700) | ((mode & 0o500) >> 3)


def _upload_folder(path: str, uploads: Path) -> Path | None:
    """The folder directly under ``uploads`` that holds ``path`` (one upload), if any.
    (``models/migrations/0002_modeldefinition_upload.py`` keeps a copy of its own as the
    migration was written: a migration must not change with the code.)"""
    try:
        resolved = Path(path).resolve()
        uploads = uploads.resolve()
    except OSError:
        return None
    for candidate in (resolved, *resolved.parents):
        if candidate.parent == uploads:
            return candidate
    return None


def grant_uploads(job: TrainingJob, user: RunAs) -> None:
    """Let ``user`` (the owner's account) read the owner's uploaded dataset and model: their
    folders go to its group, mode 0750/0640. Another user's upload is never granted."""
    folders = []
    dataset = job.dataset
    if dataset is not None and dataset.uploaded and dataset.owner_id == job.owner_id:
        uploads = Path(settings.EDT_UPLOAD_ROOT) / "datasets"
        folders.append((uploads, _upload_folder(dataset.train_path, uploads)))
    if job.model.owner_id == job.owner_id:
        uploads = Path(settings.EDT_MODEL_ROOTS[0]) / "uploads"
        folders.append((uploads, _upload_folder(job.model.location, uploads)))
    for uploads, folder in folders:
        if folder is None:
            continue
        # The owner's account must pass through ``uploads`` (but not list it) to its folder.
        if uploads.is_dir() and not uploads.is_symlink():
            enterable_not_listable(uploads)
            mode = stat.S_IMODE(uploads.parent.stat().st_mode)
            if not mode & 0o001:
                os.chmod(uploads.parent, mode | 0o001)
        st = folder.lstat()
        if st.st_gid == user.gid and stat.S_IMODE(st.st_mode) == 0o750:
            continue  # granted at an earlier launch
        hand_over(folder, uid=-1, gid=user.gid, dir_mode=0o750, file_mode=_group_read)


def _not_code(folder: str, names: list[str]) -> set[str]:
    """What a copy of the model's code leaves out of each folder: caches. (Anything but
    folders, plain files and links is left out by the copy itself, looked at on descriptors.)"""
    return {"__pycache__"} & set(names)


def _copy_code(location: Path, root: Path) -> None:
    """Keep the model's code beside the results, as WMLA does: a copy of the model folder in
    ``$RESULT_DIR/_submitted_code/<model folder>/``, made once per job. The job owns that
    place, so the copy goes through descriptors (``jobs.jobwrites.copy_tree``): a folder the
    job swaps for a link or renames mid-way cannot send a byte elsewhere. Links in the model's
    folder are kept as links, never followed: the agent (root) must not copy a file the
    model's owner could not read. A copy that fails is a missing convenience, not a failed
    launch."""
    if not location.is_dir():
        return
    try:
        jobwrites.copy_tree(location, root, (CODE_FOLDER, location.name), skip=_not_code)
    except OSError as exc:
        log.warning("the code of %s was not kept beside the results: %s", location, exc)


def _trial_config(job: TrainingJob, root: Path) -> None:
    """A hyper-parameter search's trial finds its values in ``config.json``, as on WMLA: in
    the folder it runs in (``open("config.json")``) and in its copy of the model's code
    (``$RESULT_DIR/_submitted_code/<model folder>/config.json``). Written through
    descriptors, as everything in the job's folder (``jobs.jobwrites.write_file``)."""
    if not job.hpo_trials.exists():
        return
    data = json.dumps(job.hyper_parameters or {}, indent=2).encode()
    for parts in (("config.json",), (CODE_FOLDER, Path(job.model.location).name, "config.json")):
        try:
            jobwrites.write_file(root, parts, data)
        except OSError as exc:
            log.warning("config.json of job %s not written to %s: %s", job.pk, "/".join(parts),
                        exc)


def prepare_job_dir(job: TrainingJob, user: RunAs | None) -> Path:
    """The job's result folder, ready for its processes and handed to ``user``. The folder
    and those above it are the service's; everything in it may be the job's from an earlier
    launch, so in it the agent works through descriptors only (``jobs.jobwrites``)."""
    dirs = job_dirs(job)
    root = Path(dirs["RESULT_DIR"])
    if user is not None and user.isolated:
        root.parent.mkdir(parents=True, exist_ok=True)
        # The result root: every job's account may enter it, none may list the jobs.
        enterable_not_listable(root.parent)
    root.mkdir(parents=True, exist_ok=True)
    folders = [Path(dirs[key]).name for key in ("LOG_DIR", "CHECKPOINT_DIR", "SAVED_MODEL_DIR")
               if Path(dirs[key]).parent == root]
    jobwrites.make_folders(root, [*folders, "tmp"])
    _copy_code(Path(job.model.location), root)
    _trial_config(job, root)
    if user is not None and user.isolated:
        hand_over(root, uid=user.uid, gid=service_gid(), dir_mode=0o2770,
                  file_mode=_private_file)
    elif user is not None:
        hand_over(root, uid=user.uid, gid=user.gid)
    return root
