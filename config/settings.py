"""Settings, all read from the environment with defaults that are safe on a bare machine.

Embedded defaults: SQLite under ``var/``, an embedded Redis started by ``manage.py up`` when
``REDIS_URL`` is unset, CPU slots when a host has no GPU. Production sets ``DATABASE_URL``,
``REDIS_URL``, ``SECRET_KEY``, ``DEBUG=false``, ``ALLOWED_HOSTS`` and ``HTTPS=true``.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import dj_database_url

from config import service_files

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("EDT_VAR_DIR", BASE_DIR / "var")).resolve()


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def env_list(name: str, default: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


def _local_secret_key() -> str:
    # A development key that survives restarts (sessions stay valid), never ships in the repo
    # and is the service account's alone from the moment it is written.
    service_files.var_dir(VAR_DIR)
    return service_files.write_private_once(VAR_DIR / "secret_key", secrets.token_urlsafe(50))


DEBUG = env_bool("DEBUG", False)
SECRET_KEY = os.environ.get("SECRET_KEY") or _local_secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", "")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "axes",
    "environments",
    "resources",
    "datasets",
    "models",
    "jobs",
    "events",
    "hpo",
    "scheduler",
    "agent",
    "console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "config.csp.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Axes must be last: it inspects the result of authentication.
    "axes.middleware.AxesMiddleware",
]

AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.context_processors.console",
            ],
        },
    },
]

# Several processes (web, scheduler, event consumer, agents) share an embedded SQLite file. In
# the default rollback journal a reader that starts writing inside a deferred transaction gets
# "database is locked" at once, whatever the timeout: WAL lets readers go on beside the writer,
# and IMMEDIATE transactions take the write lock up front, where the busy timeout (seconds)
# applies.
SQLITE_OPTIONS = {
    "timeout": env_int("EDT_SQLITE_TIMEOUT_S", 30),
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}


def database(url: str) -> dict:
    """The database of ``url`` as every process of the product opens it. A SQLite file is
    created 0600 before SQLite first opens it (SQLite gives its -wal and -shm the same mode):
    no job's account ever reads the database."""
    db = dj_database_url.parse(url, conn_max_age=env_int("DB_CONN_MAX_AGE", 0))
    if db["ENGINE"] == "django.db.backends.sqlite3":
        db.setdefault("OPTIONS", {}).update(SQLITE_OPTIONS)
        name = str(db["NAME"])
        if name and ":memory:" not in name and not name.startswith("file:"):
            service_files.create_private_file(Path(name))
    return db


DATABASES = {
    "default": database(os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'db.sqlite3'}")
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def _redis_url() -> str:
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    # `manage.py up` writes the embedded Redis's address here for every process it starts.
    embedded = VAR_DIR / "redis.url"
    if embedded.exists():
        return embedded.read_text().strip()
    return "redis://127.0.0.1:6379/0"


REDIS_URL = _redis_url()

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            # redis-py 8 defaults socket_timeout to 5 s, the same as channels-redis's blocking
            # BZPOPMIN timeout: an idle consumer's read then times out and its WebSocket drops
            # every ~5 s. A longer socket timeout lets the BZPOPMIN return first.
            "hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
            "prefix": os.environ.get("EDT_CHANNEL_PREFIX", "edt"),
            # A consumer killed with its web server never leaves its groups; a short expiry
            # drops it (live consumers renew their membership well before, console.consumers),
            # so messages stop piling up for it ("over capacity").
            "group_expiry": env_int("EDT_CHANNEL_GROUP_EXPIRY_S", 120),
        },
    }
}

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": os.environ.get("EDT_CACHE_PREFIX", "edt"),
    }
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = os.environ.get("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", VAR_DIR / "staticfiles"))
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns on every request otherwise
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"
        if not DEBUG
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
# Serve straight from the finders when collectstatic has not run (one-command dev start).
WHITENOISE_USE_FINDERS = True
MEDIA_ROOT = Path(os.environ.get("MEDIA_ROOT", VAR_DIR / "media"))
MEDIA_URL = "/media/"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

# --- Where user data may live -------------------------------------------------------------
# Paths a user types (dataset folders, model locations) must resolve inside one of these roots.
EDT_DATA_ROOTS = [Path(p).resolve() for p in env_list("EDT_DATA_ROOTS", str(VAR_DIR / "data"))]
EDT_MODEL_ROOTS = [Path(p).resolve() for p in env_list("EDT_MODEL_ROOTS", str(VAR_DIR / "models"))]
# A user registers folders only in their own area, <root>/<username>/ (datasets.paths), or in
# these folders an admin shares with everyone (absolute, or relative to the first root).
EDT_SHARED_DATA_DIRS = env_list("EDT_SHARED_DATA_DIRS", "")
EDT_SHARED_MODEL_DIRS = env_list("EDT_SHARED_MODEL_DIRS", "")
EDT_RESULT_ROOT = Path(os.environ.get("EDT_RESULT_ROOT", VAR_DIR / "results")).resolve()
EDT_UPLOAD_ROOT = Path(os.environ.get("EDT_UPLOAD_ROOT", VAR_DIR / "uploads")).resolve()
EDT_MAX_UPLOAD_BYTES = env_int("EDT_MAX_UPLOAD_BYTES", 2 * 1024**3)
# The most a results zip holds, uncompressed (console.streaming.zip_refusal): past it a
# request is refused before any work, and the files are downloaded one by one.
EDT_RESULTS_ZIP_MAX_BYTES = env_int("EDT_RESULTS_ZIP_MAX_BYTES", 4 * 1024**3)
EDT_MAX_ARCHIVE_MEMBERS = env_int("EDT_MAX_ARCHIVE_MEMBERS", 100_000)
EDT_MAX_WORKERS_LIMIT = env_int("EDT_MAX_WORKERS_LIMIT", 1024)
EDT_CPU_SLOTS = env_int("EDT_CPU_SLOTS", 4)
EDT_HEARTBEAT_S = env_int("EDT_HEARTBEAT_S", 5)
EDT_HOST_TIMEOUT_S = env_int("EDT_HOST_TIMEOUT_S", 20)
EDT_SCHEDULER_INTERVAL_S = env_int("EDT_SCHEDULER_INTERVAL_S", 2)
EDT_DEFAULT_MAX_RESTARTS = env_int("EDT_DEFAULT_MAX_RESTARTS", 5)
# Execution: namespace of the scheduler lock and heartbeat keys in Redis; where runtime
# processes publish events; the unprivileged user (and its Python) that runs user code when the
# agent runs as root; WMLA's FABRIC_HOME with libs/fabric.zip.
EDT_REDIS_PREFIX = os.environ.get("EDT_REDIS_PREFIX", "edt")
EDT_EVENTS_REDIS_URL = os.environ.get("EDT_EVENTS_REDIS_URL") or None
# Fair share of the events path (agent.relay): what one process of a job may send, per second
# with a burst. Metrics and log lines over their limit are dropped (and the job's log says so);
# every other event is never dropped, only read more slowly (the job's own queue overflows,
# not anyone else's). The runtime sends one metrics event a second (EDT_METRICS_INTERVAL_S);
# the event consumer stores some hundreds to a few thousand a second.
EDT_EVENTS_METRICS_PER_S = env_int("EDT_EVENTS_METRICS_PER_S", 50)
EDT_EVENTS_METRICS_BURST = env_int("EDT_EVENTS_METRICS_BURST", 1000)
EDT_EVENTS_LOG_LINES_PER_S = env_int("EDT_EVENTS_LOG_LINES_PER_S", 100)
EDT_EVENTS_LOG_LINES_BURST = env_int("EDT_EVENTS_LOG_LINES_BURST", 2000)
EDT_EVENTS_OTHER_PER_S = env_int("EDT_EVENTS_OTHER_PER_S", 20)
EDT_EVENTS_OTHER_BURST = env_int("EDT_EVENTS_OTHER_BURST", 500)
EDT_EVENTS_MAX_BYTES = env_int("EDT_EVENTS_MAX_BYTES", 64 * 1024)
# The consumer trims only what it has read; when this many entries wait unread all the same
# (seconds of its work), every process is held to EDT_EVENTS_BEHIND_PER_S of each kind until
# it catches up.
EDT_EVENTS_BACKLOG_HIGH = env_int("EDT_EVENTS_BACKLOG_HIGH", 10_000)
EDT_EVENTS_BEHIND_PER_S = env_int("EDT_EVENTS_BEHIND_PER_S", 5)
# Redis's memory, the last resort with no consumer at all: past this length XADD trims.
EDT_EVENTS_STREAM_MAX = env_int("EDT_EVENTS_STREAM_MAX", 1_000_000)
# How often a job's log says how many of its events were dropped.
EDT_EVENTS_DROP_REPORT_S = env_int("EDT_EVENTS_DROP_REPORT_S", 10)
EDT_RUN_AS_USER = os.environ.get("EDT_RUN_AS_USER", "")
# Isolation between users, on by default wherever the agent runs as root: a job runs as
# uid = gid = this + its owner's id (no passwd entry needed; the range from 200000 up is one no
# real account uses), its results private to it and the console's group (EDT_SERVICE_GID;
# default: the group of EDT_RESULT_ROOT). EDT_RUN_AS_UID_BASE=0 turns it off (every job runs as
# the agent's account, root included); EDT_RUN_AS_USER alone runs every job as that one account
# (no isolation between users). An agent not running as root cannot switch accounts: it says at
# start-up, in its log and on the hosts page, that all jobs share its account.
EDT_RUN_AS_UID_BASE = env_int("EDT_RUN_AS_UID_BASE", 0 if EDT_RUN_AS_USER else 200_000)
EDT_SERVICE_GID = os.environ.get("EDT_SERVICE_GID", "")
# The interpreter of jobs (default: the agent's own). Under isolation the jobs' accounts must be
# able to run it and import torch and the runtime: the agent checks at start-up and, when root,
# makes the folders on the way to it traversable (o+x, never o+r). Point this at a shared
# environment (e.g. /opt/edt-venv/bin/python) when the agent's own may not be opened up.
EDT_USER_PYTHON = os.environ.get("EDT_USER_PYTHON", "")
# Job environments (environments/, docs/environments.md). The environment a job runs in when
# neither its model nor its instance group names one: "default" (torch, torchvision and the
# data-science set, built by every agent) or "product" (the agent's own interpreter, as
# before; EDT_USER_PYTHON when set). Where agents build them, per host; how long a build may
# take and how much a model's layer may hold; and whether models may bring requirements at all.
EDT_DEFAULT_ENVIRONMENT = os.environ.get("EDT_DEFAULT_ENVIRONMENT", "default")
EDT_ENVIRONMENTS_DIR = Path(os.environ.get("EDT_ENVIRONMENTS_DIR", VAR_DIR / "environments"))
EDT_ENVIRONMENT_BUILD_TIMEOUT_S = env_int("EDT_ENVIRONMENT_BUILD_TIMEOUT_S", 3600)
EDT_LAYER_BUILD_TIMEOUT_S = env_int("EDT_LAYER_BUILD_TIMEOUT_S", 900)
EDT_LAYER_MAX_BYTES = env_int("EDT_LAYER_MAX_BYTES", 4 * 1024**3)
EDT_MODEL_REQUIREMENTS = env_bool("EDT_MODEL_REQUIREMENTS", True)
# A host agent forks its jobs' drivers and workers from a warm process that has imported torch
# already (agent/warm.py): a process starts in milliseconds instead of seconds. Off: each starts
# a new interpreter.
EDT_WARM_PROCESSES = env_bool("EDT_WARM_PROCESSES", True)
# Per-process limits by the kernel (agent/cgroups.py): a root agent puts each driver and worker
# in a control group of its own with these limits (an instance group may set its own), and ends
# the whole group when the process is ended. EDT_CGROUPS=false turns it off; EDT_CGROUP_PARENT
# names the cgroup v2 folder delegated to the agent (default: its own group). Memory per
# process, in bytes (0: nine tenths of the host's memory); processes and threads per process
# (0: none); each job account's processes on the host (RLIMIT_NPROC, a backstop).
# Hyper-parameter search (hpo/): how long after a trial's job ends its objective is read, so
# that its last test metrics, still in the event stream, are counted.
EDT_HPO_SETTLE_S = float(os.environ.get("EDT_HPO_SETTLE_S", "3"))
EDT_CGROUPS = env_bool("EDT_CGROUPS", True)
EDT_CGROUP_PARENT = os.environ.get("EDT_CGROUP_PARENT", "")
EDT_JOB_MEMORY_LIMIT = env_int("EDT_JOB_MEMORY_LIMIT", 0)
EDT_JOB_PIDS_LIMIT = env_int("EDT_JOB_PIDS_LIMIT", 1024)
EDT_JOB_NPROC_LIMIT = env_int("EDT_JOB_NPROC_LIMIT", 8192)
# What one user's jobs may keep in their result folders, in bytes (0: no quota). A job that
# takes its owner past it is stopped (FAILED, saying so); no one file of a job grows past it
# (RLIMIT_FSIZE).
EDT_RESULTS_QUOTA_BYTES = env_int("EDT_RESULTS_QUOTA_BYTES", 100 * 1024**3)
EDT_SCHEDULER_LOCK_TTL_S = env_int("EDT_SCHEDULER_LOCK_TTL_S", 10)
EDT_CPU_ONLY_HIDE_GPUS = env_bool("EDT_CPU_ONLY_HIDE_GPUS", True)
# The address job drivers listen on. Empty: the host's registered address (--address of the
# agent), or 127.0.0.1 when that is empty or loopback; every connection must prove the job's
# secret anyway. Set it (e.g. to this host's cluster-network IP) when other hosts reach this
# one by a name that resolves to loopback here. 0.0.0.0 listens on every interface.
EDT_DRIVER_HOST = os.environ.get("EDT_DRIVER_HOST", "")
EDT_FABRIC_HOME = Path(os.environ.get("EDT_FABRIC_HOME", VAR_DIR / "fabric")).resolve()
# var/ is 0711 and everything in it the service account's alone, but for the folders jobs reach.
service_files.secure_var_dir(VAR_DIR, service_files.job_folders(globals().__getitem__))
EDT_WMLA_TOKEN_TTL_S = env_int("EDT_WMLA_TOKEN_TTL_S", 8 * 3600)  # WMLA's logon tokens: 8 h
# Request bodies (config.body_limit, before the web server reads them): at most this much, but
# on the upload views, which take EDT_MAX_UPLOAD_BYTES more. A body let through is spooled by
# Django: in memory up to FILE_UPLOAD_MAX_MEMORY_SIZE, on disk (TMPDIR) beyond it.
EDT_MAX_REQUEST_BYTES = env_int("EDT_MAX_REQUEST_BYTES", 1024 * 1024)
# The most connections (WebSockets and idle ones included) each of the web server's ports keeps
# open; a request on one more is a 503. Many slow bodies held open at once are what is left to
# an anonymous client: this bounds them (at most about this many EDT_MAX_REQUEST_BYTES).
EDT_WEB_MAX_CONNECTIONS = env_int("EDT_WEB_MAX_CONNECTIONS", 1000)
FILE_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 * 1024 * 1024

# --- REST API -----------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.TokenAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "console.api.pagination.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "rest_framework.filters.OrderingFilter",
        "rest_framework.filters.SearchFilter",
    ],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "console.api.errors.exception_handler",
    # JSON nested past EDT_JSON_MAX_DEPTH is a 400, not a RecursionError (500).
    "DEFAULT_PARSER_CLASSES": [
        "console.api.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
}
EDT_JSON_MAX_DEPTH = env_int("EDT_JSON_MAX_DEPTH", 64)

# /api/schema/ and /api/docs/ are for signed-in users unless this is set.
EDT_PUBLIC_API_DOCS = env_bool("EDT_PUBLIC_API_DOCS", False)
SPECTACULAR_SETTINGS = {
    "TITLE": "Elastic Distributed Training console API",
    "DESCRIPTION": "Datasets, models, training jobs, hosts and instance groups.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
}

# --- Login lockout (django-axes): a real lockout, not a rate limit --------------------------
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = env_int("AXES_COOLOFF_MINUTES", 15) / 60  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_ENABLED = env_bool("AXES_ENABLED", True)
# Not "AXES: BEGIN ..." from each of the product's processes at start, nor a line per login:
# lockouts are still logged (as warnings) and kept in the database.
AXES_VERBOSE = False

# --- Celery ---------------------------------------------------------------------------------
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# Training tasks are long. Ack early and let the database drive recovery: with acks_late, Redis
# would redeliver any task still running after visibility_timeout (celery#3541, #4984).
CELERY_TASK_ACKS_LATE = False
# One message at a time per worker process, so a busy agent never hoards launches.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = "edt"
# How long Redis keeps a delivered, unacknowledged message before it hands it out again. With
# early acks only a message whose ack was lost (the connection dropped between delivery and
# ack) comes back; a launch delivered twice starts one process (see agent/tasks.py).
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("EDT_BROKER_VISIBILITY_TIMEOUT_S", 3600),
}

# --- HTTPS and hardening (production) ------------------------------------------------------
HTTPS = env_bool("HTTPS", False)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", HTTPS)
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", HTTPS)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", HTTPS)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000 if HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", HTTPS)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", HTTPS)
if env_bool("USE_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_HTTPONLY = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "filters": {"client_errors": {"()": "config.log_filters.ClientErrorsWithoutTraceback"}},
    # django-axes says INFO for every login and its clean-ups: only its lockouts (WARNING).
    "loggers": {"uvicorn": {"level": "WARNING"}, "django.channels.server": {"level": "WARNING"},
                "axes": {"level": "WARNING"},
                "django.request": {"filters": ["client_errors"]}},
}
