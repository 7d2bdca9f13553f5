from django.apps import AppConfig


class EnvironmentsConfig(AppConfig):
    name = "environments"
    verbose_name = "Job environments"
