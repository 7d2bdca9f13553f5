"""The WMLA-compatible endpoints. Thin: parse WMLA's shapes, call the services, render WMLA's
shapes. Every exec is looked up through ``TrainingJob.objects.visible_to(user)``, so another
user's exec is a 404, as on ``/api/v1``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from django.conf import settings
from django.http import HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import permissions, status
from rest_framework.exceptions import APIException, NotAcceptable, NotFound, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from console import streaming
from console.api.errors import call_service
from console.wmla import hpo, results, schema  # noqa: F401 - registers the OpenAPI auth schemes
from console.wmla.args import FRAMEWORKS, ArgsError, parse_args_string
from console.wmla.auth import (
    AUTHENTICATION_CLASSES,
    BasicCredentialsAuthentication,
    raw_token_from,
    token_issue,
    token_revoke,
    token_ttl,
)
from console.wmla.representation import (
    app_id,
    exec_id,
    exec_json,
    filter_by_state,
    job_pk_from,
)
from console.wmla.submit import exec_delete, exec_submit
from environments.services import framework_version, import_warnings
from hpo import services as hpo_services
from hpo.models import HpoTask
from jobs import services as job_services
from jobs import states
from jobs.models import TrainingJob
from resources.models import Host, InstanceGroup


class PlainTextRenderer(BaseRenderer):
    """dlicmd asks for ``text/plain`` on logs and results; errors then come as JSON text."""

    media_type = "text/plain"
    format = "txt"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, str):
            return data.encode(self.charset)
        return json.dumps(data).encode(self.charset)


class LenientNegotiation(DefaultContentNegotiation):
    """A client asking for something else (a browser's text/html) gets JSON, not a 406."""

    def select_renderer(self, request, renderers, format_suffix=None):
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except NotAcceptable:
            return renderers[0], renderers[0].media_type


TAG = ["WMLA compatibility"]
EXEC_REF = OpenApiParameter("exec_ref", str, OpenApiParameter.PATH,
                            description="Exec id (alice-42), app id (edt-42) or job id (42).")


def doc(summary: str, *, request=None, response=OpenApiTypes.OBJECT, params=(), op=None):
    return extend_schema(summary=summary, tags=TAG, request=request, responses=response,
                         parameters=list(params), operation_id=op)


SORT_FIELDS = {"id": "id", "createTime": "created", "priority": "priority", "state": "state"}


def _form(request) -> dict:
    """The request's form or JSON object; a JSON array or scalar body counts as empty."""
    return request.data if hasattr(request.data, "get") else {}


class WmlaView(APIView):
    authentication_classes = AUTHENTICATION_CLASSES
    permission_classes = [permissions.IsAuthenticated]
    renderer_classes = [JSONRenderer, PlainTextRenderer]
    content_negotiation_class = LenientNegotiation
    throttle_classes: list = []

    def jobs(self):
        return (
            TrainingJob.objects.visible_to(self.request.user)
            .with_workers()
            .with_allocation_reason()
            .select_related("owner", "model", "dataset", "instance_group", "wmla_exec",
                            "environment")
        )

    def get_job(self, identifier: str) -> TrainingJob:
        pk = job_pk_from(identifier)
        job = self.jobs().filter(pk=pk).first() if pk is not None else None
        if job is None:
            raise NotFound(f"Exec '{identifier}' not found.")
        return job


# --- logon --------------------------------------------------------------------------------


class LogonView(APIView):
    """``GET /auth/v1/logon`` (and conductor's path) with Basic credentials -> a token."""

    authentication_classes = [BasicCredentialsAuthentication]
    permission_classes = [permissions.IsAuthenticated]
    renderer_classes = [JSONRenderer, PlainTextRenderer]
    content_negotiation_class = LenientNegotiation
    throttle_classes: list = []

    @doc("Log on with Basic credentials; returns accessToken")
    def get(self, request):
        raw, row = token_issue(user=request.user)
        return Response(
            {
                "accessToken": raw,
                "tokenType": "Bearer",
                "expiresIn": int(token_ttl().total_seconds()),
                "expiresAt": row.expires.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "userName": request.user.get_username(),
            }
        )

    post = get


class LogoffView(WmlaView):
    @doc("End the token sent with this request")
    def post(self, request):
        raw = raw_token_from(request)
        if raw is None:
            raise ValidationError(
                {"detail": "Send the token to end in 'Authorization: Bearer' or 'X-Auth-Token'."}
            )
        token_revoke(raw)
        return Response({"message": "Logged off."})

    get = post


# --- execs --------------------------------------------------------------------------------


class ExecListView(WmlaView):
    @doc("List execs", op="wmla_execs_list", params=[
        OpenApiParameter("limit", int), OpenApiParameter("state", str),
        OpenApiParameter("sort_by", str, description="id|createTime|priority|state : asc|desc"),
    ])
    def get(self, request):
        params = request.query_params
        queryset = filter_by_state(self.jobs(), params.get("state", ""))
        sort_by = params.get("sort_by", "id:desc").strip() or "id:desc"
        field, _, direction = sort_by.partition(":")
        if field not in SORT_FIELDS or direction.lower() not in ("", "asc", "desc"):
            raise ValidationError(
                {"sort_by": f"Use <field>:asc|desc with field one of {', '.join(SORT_FIELDS)}."}
            )
        order = ("-" if direction.lower() != "asc" else "") + SORT_FIELDS[field]
        queryset = queryset.order_by(order, "-id" if order.startswith("-") else "id")
        limit_param = params.get("limit", "").strip()
        if limit_param:
            if not limit_param.isdigit() or int(limit_param) < 1:
                raise ValidationError({"limit": "limit must be a positive integer."})
            queryset = queryset[: min(int(limit_param), 10000)]
        return Response([exec_json(job) for job in queryset])

    @doc("Submit an exec: multipart file (model tar.gz), args (dlicmd flags), sigName, data",
         request=OpenApiTypes.OBJECT, params=[
             OpenApiParameter("args", str), OpenApiParameter("sigName", str)])
    def post(self, request):
        form = _form(request)
        raw_args = request.query_params.get("args") or form.get("args") or ""
        if not isinstance(raw_args, str):
            raise ValidationError({"args": "args must be a string of dlicmd flags."})
        try:
            parsed = parse_args_string(raw_args)
        except ArgsError as exc:
            raise ValidationError({"args": str(exc)}) from exc
        uploads = request.FILES.getlist("file")
        sig_name = request.query_params.get("sigName") or form.get("sigName") or ""
        if not isinstance(sig_name, str):
            raise ValidationError({"sigName": "sigName must be an instance group's name."})
        job = call_service(
            exec_submit,
            user=request.user,
            parsed=parsed,
            raw_args=raw_args,
            upload=uploads[0] if uploads else None,
            form_data=form.get("data"),
            sig_name=sig_name,
        )
        return Response(
            {
                "id": exec_id(job),
                "execId": exec_id(job),
                "appId": app_id(job),
                "submissionId": exec_json(job)["submissionId"],
                "sigId": str(job.instance_group_id),
                "sigName": job.instance_group.name,
                "jobId": job.pk,
                "state": job.wmla_state,
                # Ours: what the check before submit found (WMLA's clients ignore keys they
                # do not know; dlicmd prints them).
                "warnings": import_warnings(job.model, job.instance_group),
            },
            status=status.HTTP_200_OK,
        )


    @doc("Delete all your ended execs (dlicmd --exec-delete-all)", op="wmla_execs_delete_all")
    def delete(self, request):
        # Only the caller's own, as WMLA's "for current user" (an admin's too); active execs
        # stay, as a single DELETE refuses them.
        ended = self.jobs().filter(owner=request.user, state__in=states.TERMINAL)
        deleted = []
        for job in ended.order_by("id"):
            deleted.append(exec_id(job))
            exec_delete(job=job)
        kept = self.jobs().filter(owner=request.user).count()
        return Response({"deleted": deleted, "kept": kept,
                         "message": f"{len(deleted)} execs deleted; {kept} active kept."})


class ExecDetailView(WmlaView):
    @doc("Get an exec", op="wmla_execs_get", params=[EXEC_REF])
    def get(self, request, exec_ref: str):
        return Response(exec_json(self.get_job(exec_ref), detail=True))

    @doc("Delete an ended exec", params=[EXEC_REF])
    def delete(self, request, exec_ref: str):
        # Visible means owned or admin: the same rule /api/v1 applies to deletes.
        job = self.get_job(exec_ref)
        identifier = exec_id(job)
        exec_delete(job=job)
        return Response({"id": identifier, "message": f"Exec {identifier} deleted."})


class ExecStopView(WmlaView):
    @doc("Stop an exec", request=None, params=[EXEC_REF])
    def post(self, request, exec_ref: str):
        job = call_service(job_services.job_kill, job=self.get_job(exec_ref), user=request.user)
        return Response(exec_json(self.get_job(str(job.pk)), detail=True))

    put = post


class ExecPriorityView(WmlaView):
    """Not in WMLA: change an exec's priority (``dlicmd --exec-priority``)."""

    @doc("Change an exec's priority (not in WMLA)", request=OpenApiTypes.OBJECT,
         params=[EXEC_REF])
    def post(self, request, exec_ref: str):
        job = self.get_job(exec_ref)
        value = _form(request).get("priority", request.query_params.get("priority"))
        try:
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise TypeError(value)
            priority = int(value)
        except (TypeError, ValueError):
            raise ValidationError(
                {"priority": f"priority must be an integer, not {value!r}."}
            ) from None
        call_service(job_services.job_set_priority, job=job, priority=priority, user=request.user)
        return Response(exec_json(self.get_job(str(job.pk)), detail=True))

    put = post


class ExecLogView(WmlaView):
    @doc("An exec's training log (ELog lines; stderr files)", response=OpenApiTypes.STR, params=[
        EXEC_REF, OpenApiParameter("logType", str, enum=list(results.LOG_TYPES))])
    def get(self, request, exec_ref: str):
        job = self.get_job(exec_ref)
        log_type = request.query_params.get("logType", "outlog").strip() or "outlog"
        if log_type not in results.LOG_TYPES:
            raise ValidationError(
                {"logType": f"logType must be one of {', '.join(results.LOG_TYPES)}."}
            )
        text = results.train_log(job.result_dir, log_type)
        if request.accepted_renderer.format == PlainTextRenderer.format:
            return HttpResponse(text, content_type="text/plain; charset=utf-8")
        # WMLA answers a JSON string by default: its notebooks call ``.json()`` on it.
        return HttpResponse(json.dumps(text), content_type="application/json")


class ExecResultView(WmlaView):
    @doc("An exec's result folder as a zip", response=OpenApiTypes.BINARY, params=[EXEC_REF])
    def get(self, request, exec_ref: str):
        job = self.get_job(exec_ref)
        refused = results.zip_refusal(job.result_dir)
        if refused:
            raise ZipTooLarge(refused)
        try:
            archive = results.zip_results(job.result_dir)
        except streaming.ZipTooBig as exc:
            raise ZipTooLarge(str(exc)) from None
        if archive is None:
            raise NotFound(
                f"Exec {exec_id(job)} has no results yet (state {job.wmla_state})."
            )
        filename = f"{exec_id(job)}-result.zip"
        size = results.zip_size(archive)
        # The zip waits in a temporary file (on disk past its first MB: WMLA's clients
        # want its size first) and is sent from there in chunks (console.streaming).
        response = streaming.stream(request, streaming.FileChunks(archive, size),
                                    filename=filename, content_type="application/zip",
                                    length=size)
        # As WMLA sends it: no spaces (dlicmd splits on ';' and takes the item starting
        # 'filename='), the size last (notebooks take what follows 'size=').
        response["Content-Disposition"] = f"attachment;filename={filename};size={size}"
        return response


class ZipTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "too_large"


class FrameworksView(WmlaView):
    @doc("Deep-learning frameworks")
    def get(self, request):
        def version(name: str) -> str:
            # What a job of that framework runs on by default (its environment's pin).
            return framework_version("TensorFlow" if name == "edtTensorflow" else "PyTorch")

        return Response(
            [
                {
                    "name": name,
                    "description": "",
                    "desc": [
                        description,
                        "Examples:",
                        f"$ python dlicmd.py --exec-start {name} <connection-options> --ig <ig> "
                        "--cs-datastore-meta type=fs,data_path=<dataset> --model-main main.py",
                    ],
                    "frameworkVersion": version(name),
                }
                for name, description in FRAMEWORKS.items()
            ]
        )


class ConfView(WmlaView):
    @doc("Client configuration")
    def get(self, request):
        return Response(
            {
                "MSD_ENABLED": "false",
                "EDT_ENABLED": "true",
                "frameworks": list(FRAMEWORKS),
                "maxWorkersLimit": settings.EDT_MAX_WORKERS_LIMIT,
                "tokenExpiresIn": int(token_ttl().total_seconds()),
                "apiVersion": "v1",
            }
        )


class StatusView(WmlaView):
    @doc("Cluster summary")
    def get(self, request):
        hosts = Host.objects.all()
        counts = Counter(states.WMLA_NAMES[s] for s in self.jobs().values_list("state", flat=True))
        return Response(
            {
                "status": "OK",
                "time": timezone.now().strftime("%Y-%m-%dT%H:%M:%SZ"),
                "user": request.user.get_username(),
                "hosts": {
                    "total": hosts.count(),
                    "up": hosts.filter(state=Host.State.UP).count(),
                },
                "instanceGroups": [
                    {"name": ig.name, "id": str(ig.pk), "policy": ig.policy}
                    for ig in InstanceGroup.objects.all()
                ],
                "execs": dict(sorted(counts.items())),
            }
        )


@require_GET
def cli_source(request):
    """``/ui/tools/dlicmd.py``, where WMLA users download the CLI: ours is one file that needs
    only ``requests``."""
    path = Path(__file__).resolve().parent.parent / "cli" / "dlicmd.py"
    response = HttpResponse(path.read_bytes(), content_type="text/x-python; charset=utf-8")
    response["Content-Disposition"] = "attachment;filename=dlicmd.py"
    return response


# --- hyper-parameter search ------------------------------------------------------------------

HPO_NAME = OpenApiParameter("name", str, OpenApiParameter.PATH,
                            description="The search's name, as POST answered it.")


class HypersearchListView(WmlaView):
    @doc("List your hyper-parameter searches", op="wmla_hypersearch_list")
    def get(self, request):
        tasks = HpoTask.objects.visible_to(request.user).select_related("owner")
        return Response([hpo.task_json(task) for task in tasks])

    @doc("Start a hyper-parameter search: multipart data (JSON: modelSpec, algoDef, "
         "hyperParams) and file (the model folder as a tar.gz); answers its name",
         request=OpenApiTypes.OBJECT, response=OpenApiTypes.STR, op="wmla_hypersearch_start")
    def post(self, request):
        uploads = request.FILES.getlist("file")
        task = hpo.hypersearch_submit(user=request.user, form=_form(request),
                                      upload=uploads[0] if uploads else None)
        return Response(task.name)

    @doc("Delete all your ended hyper-parameter searches", op="wmla_hypersearch_delete_all")
    def delete(self, request):
        return hpo.delete_ended(request.user)


class HypersearchDetailView(WmlaView):
    @doc("A hyper-parameter search with its experiments and best", params=[HPO_NAME],
         op="wmla_hypersearch_get")
    def get(self, request, name: str):
        return Response(hpo.task_json(hpo.task_for(request.user, name), detail=True))

    @doc("Stop a hyper-parameter search and its running sub-trainings", request=None,
         params=[HPO_NAME], op="wmla_hypersearch_stop")
    def put(self, request, name: str):
        task = call_service(hpo_services.hpo_stop, task=hpo.task_for(request.user, name),
                            user=request.user)
        return Response(hpo.task_json(task, detail=True))

    @doc("Delete an ended hyper-parameter search", params=[HPO_NAME],
         op="wmla_hypersearch_delete")
    def delete(self, request, name: str):
        task = hpo.task_for(request.user, name)
        call_service(hpo_services.hpo_delete, task=task, user=request.user)
        return Response({"hpoName": name, "message": f"Search {name} deleted."})
