from django.apps import AppConfig


class DatasetsConfig(AppConfig):
    name = "datasets"

    def ready(self) -> None:
        from datasets import signals  # noqa: F401 - connects the receivers
