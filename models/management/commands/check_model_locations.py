"""``manage.py check_model_locations``: the model rows whose folder breaks the model rule.

Models are confined per user (``models.locations``): an ordinary user's model folder is only in
their own area of the model roots, a shared model folder, or their own upload. Rows stored before
that rule (or whose folder became a link since) are listed here, one a line with the owner, the
model, its folder and why, and the command exits with status 1 when there is any, so a deploy
script or a cron job can say so. Jobs of such a model are already refused at submit; the admin
moves the code into the owner's area and registers it again, or deletes the row.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from models.locations import location_problem
from models.models import ModelDefinition


class Command(BaseCommand):
    help = "List the models whose folder breaks the per-user model rule; exit 1 if any does."

    def handle(self, *args, **options) -> None:
        bad = 0
        rows = ModelDefinition.objects.select_related("owner", "upload").order_by("owner", "pk")
        for model in rows.iterator():
            problem = location_problem(model)
            if problem:
                bad += 1
                self.stdout.write(
                    f"owner={model.owner.get_username()!r} model={model.pk} "
                    f"name={model.name!r} location={model.location!r}: {problem}"
                )
        if bad:
            raise CommandError(f"{bad} model(s) break the model location rule (listed above).")
        self.stdout.write("Every model's folder keeps the model location rule.")
