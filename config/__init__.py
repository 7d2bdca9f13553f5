"""Django project configuration: settings, URLs, ASGI application and the Celery app."""

from config.celery import app as celery_app

__all__ = ["celery_app"]
