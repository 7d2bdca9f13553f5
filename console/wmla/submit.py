"""``POST /execs``: turn a WMLA submission (args string, model tarball, data source) into a call
to ``models.services.model_create_from_archive`` and ``jobs.services.job_submit``.

Nothing here decides who may do what or which values are valid beyond WMLA's own syntax: the
services do, exactly as for ``/api/v1``.
"""

from __future__ import annotations

import io
import tarfile
import uuid
from pathlib import Path, PurePosixPath

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from rest_framework import status
from rest_framework.exceptions import APIException

from console.api.parsers import loads as json_loads
from console.wmla.args import MODEL_FRAMEWORKS, SubmitArgs
from console.wmla.models import WmlaExec
from datasets import services as dataset_services
from datasets.models import Dataset, Upload
from datasets.paths import dataset_folder
from datasets.uploads import remove_folder
from jobs import services as job_services
from jobs.models import TrainingJob
from models import services as model_services
from resources.models import InstanceGroup


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The exec is not in a state that allows this."


ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip", ".modeldir.tar")


def instance_group_for(sig_name: str) -> InstanceGroup:
    """The instance group named ``sig_name`` (or with that id); without a name, the only one."""
    groups = InstanceGroup.objects.all()
    names = ", ".join(groups.values_list("name", flat=True)) or "none defined yet"
    if not sig_name:
        if groups.count() == 1:
            return groups.get()
        raise ValidationError(
            {"sigName": f"Name the instance group (sigName=... or --ig ...); available: {names}."}
        )
    if "\x00" in sig_name:
        raise ValidationError({"sigName": "sigName contains a NUL character."})
    found = groups.filter(name=sig_name).first()
    if found is None and sig_name.isascii() and sig_name.isdigit() and len(sig_name) <= 18:
        found = groups.filter(pk=int(sig_name)).first()
    if found is None:
        raise ValidationError(
            {"sigName": f"No instance group named '{sig_name}'; available: {names}."}
        )
    return found


def data_path_from(form_data: object, fallback: str) -> tuple[str, list]:
    """The dataset path from the ``data`` form field (WMLA's ``dataSource`` list), which wins
    over ``--cs-datastore-meta`` as in dlicmd; returns (path, the parsed list)."""
    if form_data in (None, ""):
        return fallback, []
    try:
        parsed = json_loads(form_data) if isinstance(form_data, str) else form_data
    except ValueError as exc:  # also JSON nested too deep
        raise ValidationError({"data": f"data is not valid JSON: {exc}"}) from None
    sources = parsed.get("dataSource") if isinstance(parsed, dict) else parsed
    if not isinstance(sources, list) or not sources:
        raise ValidationError(
            {"data": 'Expected {"dataSource": [{"type": "fs", "location": {"paths": "..."}}]}.'}
        )
    first = sources[0]
    if not isinstance(first, dict) or first.get("type", "fs") != "fs":
        raise ValidationError({"data": "Only dataSource entries of type 'fs' are supported."})
    location = first.get("location")
    paths = location.get("paths") if isinstance(location, dict) else None
    if isinstance(paths, list):
        paths = paths[0] if paths else None
    if not isinstance(paths, str) or not paths.strip():
        raise ValidationError({"data": "dataSource[0].location.paths must name a dataset."})
    return paths.strip(), sources


def dataset_for(*, user, data_path: str) -> Dataset | None:
    """A dataset the user can see, named ``data_path``; or else a folder under the data roots
    (WMLA's data paths are relative to its data file system), registered once as the user's
    dataset, with its ``train*``/``test*`` sub-folders when it has them. No ``data_path``
    (``--cs-datastore-meta type=fs`` alone, as IBM's CPD notebook sends, or no flag at all):
    None, and the job runs without a dataset (no ``DATA_DIR``), as on WMLA."""
    if not data_path:
        return None
    if "\x00" in data_path:
        raise ValidationError({"data_path": "data_path contains a NUL character."})
    # Names are unique per owner: the user's own dataset first (an admin sees everyone's).
    named = Dataset.objects.visible_to(user).filter(name=data_path)
    by_name = named.filter(owner=user).first() or named.first()
    if by_name is not None:
        return by_name
    try:
        folder = dataset_folder(data_path, owner=user)
    except ValidationError as exc:
        raise ValidationError(
            {"data_path": [f"No dataset named '{data_path}' is visible to you, and", *exc.messages]}
        ) from exc
    subdirs = sorted(p for p in folder.iterdir() if p.is_dir())
    train = next((p for p in subdirs if p.name.lower().startswith("train")), folder)
    test = next((p for p in subdirs if p.name.lower().startswith("test")), folder)
    name = f"{user.get_username()}:{data_path}"[:100]
    existing = Dataset.objects.live().filter(name=name, owner=user).first()
    if existing is not None:
        return existing
    return dataset_services.dataset_create(
        owner=user, name=name, train_path=str(train), test_path=str(test),
        description="Registered by a WMLA-style submission (--cs-datastore-meta).",
    )


def _as_archive(upload) -> io.IOBase:
    """dlicmd uploads the main file alone when there is no --model-dir: wrap it in a tar.gz."""
    name = PurePosixPath(upload.name or "").name
    if name.lower().endswith(ARCHIVE_SUFFIXES):
        return upload
    if not name.endswith(".py"):
        return upload  # let the archive check name what is wrong with it
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = upload.read()
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    return buffer


def _model_name(parsed: SubmitArgs) -> str:
    base = parsed.app_name or Path(parsed.model_main).stem or "model"
    return f"{base[:60]}-{timezone.now():%Y%m%d%H%M%S}-{uuid.uuid4().hex[:6]}"


def _as_file_error(exc: ValidationError) -> ValidationError:
    """The archive's errors under WMLA's name for the upload, ``file`` (keeping the kind of
    error: the quota's is a 413)."""
    if hasattr(exc, "error_dict") and "archive" not in exc.error_dict:
        return exc
    messages = exc.message_dict["archive"] if hasattr(exc, "error_dict") else exc.messages
    return type(exc)({"file": messages})


def with_uploaded_model(*, user, parsed: SubmitArgs, upload, form_data: object, sig_name: str,
                        description: str, then):
    """The model folder a WMLA submission uploads (``file``), unpacked as the user's model
    with the dataset its data path names, then ``then(model=, dataset=, instance_group=,
    sources=)`` in the same transaction: if anything fails, nothing is stored and the
    unpacked folder is removed. Serves ``POST /execs`` and ``POST /hypersearch``."""
    if upload is None:
        raise ValidationError(
            {"file": "Upload the model folder as a tar.gz in the multipart field 'file'."}
        )
    if upload.size is not None and upload.size > settings.EDT_MAX_UPLOAD_BYTES:
        raise ValidationError(
            {"file": f"The upload is larger than {settings.EDT_MAX_UPLOAD_BYTES} bytes."}
        )
    instance_group = instance_group_for(sig_name or parsed.instance_group)
    data_path, sources = data_path_from(form_data, parsed.data_path)
    model = None
    try:
        with transaction.atomic():
            dataset = dataset_for(user=user, data_path=data_path)
            try:
                model = model_services.model_create_from_archive(
                    owner=user, name=_model_name(parsed), archive=_as_archive(upload),
                    dataset=dataset, main_file=parsed.model_main, description=description,
                    framework=MODEL_FRAMEWORKS.get(parsed.framework, "PyTorch"),
                )
            except ValidationError as exc:
                raise _as_file_error(exc) from exc
            return then(model=model, dataset=dataset, instance_group=instance_group,
                        sources=sources)
    except Exception:
        # The database rolled back, the model's Upload row with it: its folder is ours to remove.
        if model is not None and model.upload is not None:
            remove_folder(model.upload.folder, Upload.Kind.MODEL)
        raise


def exec_submit(
    *, user, parsed: SubmitArgs, raw_args: str, upload, form_data: object, sig_name: str
) -> TrainingJob:
    def submit(*, model, dataset, instance_group, sources) -> TrainingJob:
        job = job_services.job_submit(
            user=user,
            model=model,
            instance_group=instance_group,
            max_workers=parsed.max_workers,
            devices_per_worker=parsed.devices_per_worker,
            priority=parsed.priority,
            name=parsed.app_name,
            env_vars=parsed.env_vars,
            args=parsed.user_args_string,
            dataset=dataset,
        )
        WmlaExec.objects.create(
            job=job,
            framework=parsed.framework,
            app_name=parsed.app_name,
            args=raw_args,
            worker_device_type=parsed.worker_device_type,
            data_source=sources,
        )
        return job

    return with_uploaded_model(
        user=user, parsed=parsed, upload=upload, form_data=form_data, sig_name=sig_name,
        description="Uploaded by a WMLA-style submission (POST /execs).", then=submit,
    )


def exec_delete(*, job: TrainingJob) -> None:
    """Delete an ended exec with its result folder, and the model the WMLA submission
    created for it (with its unpacked folder) when no other job uses that model."""
    if not job.is_terminal:
        raise Conflict({"state": f"Exec is {job.wmla_state}; stop it before deleting it."})
    model = job.model
    submitted_here = WmlaExec.objects.filter(job=job).exists()
    with transaction.atomic():
        # The caller checked the exec is the user's; the job's owner deletes it.
        job_services.job_delete(job=job, user=job.owner)
        if submitted_here and not model.jobs.exists():
            model.delete()  # its unpacked folder goes once this commits (datasets.signals)
