from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _make_builtins(sender, using: str = "default", **kwargs) -> None:
    """The built-in environments exist after every migrate, and after a flush (which sends
    post_migrate too, as it does for content types): a job can always name them."""
    from environments.models import Environment
    from environments.spec import BUILTIN

    for name, defaults in BUILTIN.items():
        Environment.objects.using(using).get_or_create(name=name, defaults=defaults)


class EnvironmentsConfig(AppConfig):
    name = "environments"
    verbose_name = "Job environments"

    def ready(self) -> None:
        post_migrate.connect(_make_builtins, sender=self,
                             dispatch_uid="environments.make_builtins")
