"""WMLA's URL layout: logon at ``/auth/v1`` (and Conductor's ``/platform/rest/conductor/v1``),
the deep-learning API at ``/platform/rest/deeplearning/v1``. Trailing slashes are optional, as
dlicmd posts to ``/execs/``."""

from django.urls import re_path

from console.wmla import applications, views

DL = r"^platform/rest/deeplearning/v1"
EXEC = DL + r"/execs/(?P<exec_ref>[^/]+)"
SCHED = DL + r"/scheduler/applications"
SC_APPS = r"^platform/rest/conductor/v1/instances/(?P<sig>[^/]+)/applications"
STREAM = r"/logs/(?P<stream>stdout|stderr)(?:/download)?/?$"

urlpatterns = [
    re_path(r"^auth/v1/logon/?$", views.LogonView.as_view(), name="wmla-logon"),
    re_path(r"^auth/v1/logoff/?$", views.LogoffView.as_view(), name="wmla-logoff"),
    re_path(
        r"^platform/rest/conductor/v1/auth/logon/?$",
        views.LogonView.as_view(),
        name="wmla-conductor-logon",
    ),
    re_path(
        r"^platform/rest/conductor/v1/auth/logoff/?$",
        views.LogoffView.as_view(),
        name="wmla-conductor-logoff",
    ),
    re_path(DL + r"/execs/?$", views.ExecListView.as_view(), name="wmla-execs"),
    re_path(DL + r"/execs/frameworks/?$", views.FrameworksView.as_view(), name="wmla-frameworks"),
    re_path(EXEC + r"/?$", views.ExecDetailView.as_view(), name="wmla-exec"),
    re_path(EXEC + r"/stop/?$", views.ExecStopView.as_view(), name="wmla-exec-stop"),
    re_path(EXEC + r"/priority/?$", views.ExecPriorityView.as_view(), name="wmla-exec-priority"),
    re_path(EXEC + r"/log/?$", views.ExecLogView.as_view(), name="wmla-exec-log"),
    re_path(EXEC + r"/result/?$", views.ExecResultView.as_view(), name="wmla-exec-result"),
    re_path(DL + r"/hypersearch/?$", views.HypersearchListView.as_view(),
            name="wmla-hypersearch"),
    re_path(DL + r"/hypersearch/(?P<name>[^/]+)/?$", views.HypersearchDetailView.as_view(),
            name="wmla-hypersearch-task"),
    re_path(DL + r"/conf/?$", views.ConfView.as_view(), name="wmla-conf"),
    re_path(DL + r"/status/?$", views.StatusView.as_view(), name="wmla-status"),
    re_path(SCHED + r"/?$", applications.SchedulerApplicationsView.as_view(),
            name="wmla-scheduler-apps"),
    re_path(SCHED + r"/(?P<app_ref>[^/]+)/driver/logs/(?P<log_type>[^/]+)/?$",
            applications.SchedulerDriverLogView.as_view(), name="wmla-scheduler-driver-log"),
    re_path(SCHED + r"/(?P<app_ref>[^/]+)/executor/(?P<executor>[^/]+)/logs/(?P<log_type>[^/]+)/?$",
            applications.SchedulerExecutorLogView.as_view(), name="wmla-scheduler-executor-log"),
    re_path(SC_APPS + r"/?$", applications.ConductorApplicationsView.as_view(),
            name="wmla-conductor-apps"),
    re_path(SC_APPS + r"/(?P<app_ref>[^/]+)" + STREAM,
            applications.ConductorDriverLogView.as_view(), name="wmla-conductor-driver-log"),
    re_path(SC_APPS + r"/(?P<app_ref>[^/]+)/(?P<executor>[^/]+)" + STREAM,
            applications.ConductorExecutorLogView.as_view(), name="wmla-conductor-executor-log"),
    re_path(r"^ui/tools/dlicmd\.py$", views.cli_source, name="wmla-cli-download"),
]
