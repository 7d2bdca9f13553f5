"""The two environments every install has: ``default`` (what IBM's samples and ordinary
models import; built by every host agent) and ``product`` (the agent's own interpreter, as
jobs ran before environments existed)."""

from django.db import migrations

from environments.spec import BUILTIN


def create(apps, schema_editor):
    Environment = apps.get_model("environments", "Environment")
    for name, fields in BUILTIN.items():
        Environment.objects.get_or_create(name=name, defaults=fields)


class Migration(migrations.Migration):
    dependencies = [("environments", "0001_initial")]
    operations = [migrations.RunPython(create, migrations.RunPython.noop)]
