"""WMLA's scheduler and Conductor views of an exec, which notebooks and IBM's ``dlicmd.py``
call to follow a job and read its processes' whole output:

- ``GET /platform/rest/deeplearning/v1/scheduler/applications?applicationid=<appId>``, then
  ``.../scheduler/applications/<appId>/driver/logs/<stdout|stderr|launcherlog>`` and
  ``.../scheduler/applications/<appId>/executor/<n>/logs/<type>`` (``dlicmd --exec-outlogs``,
  ``--exec-errlogs``, ``--exec-launcherlogs``);
- ``GET /platform/rest/conductor/v1/instances/<sigId>/applications?state=RUNNING``, then
  ``.../applications/<driverId>/logs/<stdout|stderr>/download`` and
  ``.../applications/<driverId>/<executorId>/logs/<stdout|stderr>/download``.

An application is one of our jobs (appId ``edt-42``, driver id = the exec's ``submissionId``,
executor id = the worker's name); every lookup goes through
``TrainingJob.objects.visible_to(user)``, so another user's job is a 404 here as on
``/execs``. A process's ``stdout`` is its whole output (stderr is merged into it);
``stderr`` is a separate file only when one was written, and ``launcherlog`` is empty: our
launcher writes its lines into ``stdout``.
"""

from __future__ import annotations

import re

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response

from console.wmla import results
from console.wmla.representation import (
    app_id,
    conductor_app_json,
    filter_by_state,
    job_pk_from,
    scheduler_app_json,
)
from console.wmla.views import WmlaView, doc
from jobs.models import TrainingJob
from resources.models import InstanceGroup

SCHEDULER_LOG_TYPES = {"stdout": "stdout", "stderr": "stderr", "launcherlog": ""}
MAX_APPLICATIONS = 100  # the newest: each one walks its log folder
APP_REF = OpenApiParameter("app_ref", str, OpenApiParameter.PATH,
                           description="App id (edt-42), driver id (submissionId) or exec id.")
LAST_LINES = OpenApiParameter("lastlines", int, description="Only the log's last N lines.")


def _text(text: str, *, download: str = "") -> HttpResponse:
    if download:
        response = HttpResponse(text.encode("utf-8"), content_type="application/octet-stream")
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", download)  # a worker's name comes from a host's
        response["Content-Disposition"] = f"attachment;filename={safe}"
        return response
    return HttpResponse(text, content_type="text/plain; charset=utf-8")


class ApplicationView(WmlaView):
    def get_app(self, reference: str, queryset=None) -> TrainingJob:
        pk = job_pk_from(reference)
        queryset = self.jobs() if queryset is None else queryset
        job = queryset.filter(pk=pk).first() if pk is not None else None
        if job is None:
            raise NotFound(f"Application '{reference}' not found.")
        return job

    def worker_named(self, job: TrainingJob, executor: str, *, by_number: bool) -> str:
        """The worker ``executor`` names: its number in ``task12n`` (from 1), or its id."""
        workers = scheduler_app_json(job, results.process_names(job.result_dir))["task12n"]
        key = "executorId" if by_number else "id"
        found = next((w["id"] for w in workers if w[key] == executor), None)
        if found is None:
            raise NotFound(f"Application {app_id(job)} has no executor '{executor}'.")
        return found


# --- the deep-learning API's scheduler view (IBM's dlicmd) --------------------------------


class SchedulerApplicationsView(ApplicationView):
    @doc("Applications (WMLA scheduler view)", op="wmla_scheduler_applications", params=[
        OpenApiParameter("applicationid", str, description="An app id (edt-42)")])
    def get(self, request):
        queryset = self.jobs().order_by("-id")
        reference = request.query_params.get("applicationid", "").strip()
        if reference:
            pk = job_pk_from(reference)
            queryset = queryset.filter(pk=pk) if pk is not None else queryset.none()
        return Response([scheduler_app_json(job, results.process_names(job.result_dir))
                         for job in queryset[:MAX_APPLICATIONS]])


def _last_lines(text: str, request) -> str:
    """WMLA's ``?lastlines=N`` on the scheduler's log endpoints (IBM's CPD notebook reads an
    executor's log with ``lastlines=1000``): the last N lines, the whole log without it."""
    raw = request.query_params.get("lastlines", "").strip()
    if not raw:
        return text
    if not raw.isdigit() or int(raw) < 1:
        raise ValidationError({"lastlines": "lastlines must be a whole number of at least 1."})
    lines = text.splitlines(keepends=True)
    return "".join(lines[-int(raw):])


def _scheduler_stream(log_type: str) -> str:
    if log_type not in SCHEDULER_LOG_TYPES:
        raise ValidationError(
            {"logType": f"The log type must be one of {', '.join(SCHEDULER_LOG_TYPES)}."}
        )
    return SCHEDULER_LOG_TYPES[log_type]


class SchedulerDriverLogView(ApplicationView):
    @doc("The driver's log (stdout, stderr, launcherlog)", response=OpenApiTypes.STR,
         params=[APP_REF, LAST_LINES], op="wmla_scheduler_driver_log")
    def get(self, request, app_ref: str, log_type: str):
        stream = _scheduler_stream(log_type)
        job = self.get_app(app_ref)
        text = results.process_log(job.result_dir, results.DRIVER, stream) if stream else ""
        return _text(_last_lines(text, request))


class SchedulerExecutorLogView(ApplicationView):
    @doc("An executor's log, by its number in task12n (from 1)", response=OpenApiTypes.STR,
         params=[APP_REF, LAST_LINES], op="wmla_scheduler_executor_log")
    def get(self, request, app_ref: str, executor: str, log_type: str):
        stream = _scheduler_stream(log_type)
        job = self.get_app(app_ref)
        worker = self.worker_named(job, executor, by_number=True)
        text = results.process_log(job.result_dir, worker, stream) if stream else ""
        return _text(_last_lines(text, request))


# --- Conductor's view (notebooks) ------------------------------------------------------------


class ConductorView(ApplicationView):
    def in_group(self, sig: str):
        """This user's jobs in the instance group ``sig`` (its id, or its name)."""
        groups = InstanceGroup.objects.all()
        number = sig.isascii() and sig.isdigit() and len(sig) <= 18
        group = groups.filter(pk=int(sig)).first() if number else None
        group = group or (groups.filter(name=sig).first() if "\x00" not in sig else None)
        if group is None:
            raise NotFound(f"Instance group '{sig}' not found.")
        return self.jobs().filter(instance_group=group)


class ConductorApplicationsView(ConductorView):
    @doc("Applications of an instance group (Conductor)", op="wmla_conductor_applications",
         params=[OpenApiParameter("state", str, description="WMLA state names, comma-separated")])
    def get(self, request, sig: str):
        queryset = filter_by_state(self.in_group(sig), request.query_params.get("state", ""))
        return Response([conductor_app_json(job, results.process_names(job.result_dir))
                         for job in queryset.order_by("-id")[:MAX_APPLICATIONS]])


class ConductorDriverLogView(ConductorView):
    @doc("Download the driver's stdout or stderr (Conductor)", response=OpenApiTypes.BINARY,
         params=[APP_REF], op="wmla_conductor_driver_log")
    def get(self, request, sig: str, app_ref: str, stream: str):
        job = self.get_app(app_ref, self.in_group(sig))
        text = results.process_log(job.result_dir, results.DRIVER, stream)
        return _text(text, download=f"{app_id(job)}-driver-{stream}.txt")


class ConductorExecutorLogView(ConductorView):
    @doc("Download an executor's stdout or stderr (Conductor)", response=OpenApiTypes.BINARY,
         params=[APP_REF], op="wmla_conductor_executor_log")
    def get(self, request, sig: str, app_ref: str, executor: str, stream: str):
        job = self.get_app(app_ref, self.in_group(sig))
        worker = self.worker_named(job, executor, by_number=False)
        text = results.process_log(job.result_dir, worker, stream)
        return _text(text, download=f"{app_id(job)}-{worker}-{stream}.txt")
