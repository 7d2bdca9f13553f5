from django.apps import AppConfig


class ModelsConfig(AppConfig):
    name = "models"
    verbose_name = "Model definitions"
