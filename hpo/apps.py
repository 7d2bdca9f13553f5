from django.apps import AppConfig


class HpoConfig(AppConfig):
    name = "hpo"
    verbose_name = "Hyper-parameter search"
