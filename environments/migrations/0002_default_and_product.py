"""The two environments every install has: ``default`` (what IBM's samples and ordinary
models import; built by every host agent) and ``product`` (the agent's own interpreter, as
jobs ran before environments existed)."""

from django.db import migrations

from environments.spec import DEFAULT_NAME, DEFAULT_PACKAGES, PRODUCT_NAME


def create(apps, schema_editor):
    Environment = apps.get_model("environments", "Environment")
    Environment.objects.get_or_create(name=DEFAULT_NAME, defaults={
        "description": "PyTorch with torchvision and the common data-science packages.",
        "packages": "\n".join(DEFAULT_PACKAGES)})
    Environment.objects.get_or_create(name=PRODUCT_NAME, defaults={
        "description": "The host agent's own Python (torch, no torchvision): nothing to build."})


class Migration(migrations.Migration):
    dependencies = [("environments", "0001_initial")]
    operations = [migrations.RunPython(create, migrations.RunPython.noop)]
