"""The Celery application shared by the web process, the scheduler and the host agents."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("edt")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
