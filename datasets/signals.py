"""An upload's folder leaves the disk with the record that uses it, whichever way it is deleted
(the API, the console, the WMLA API's exec delete, the admin, a user deleted with their data)."""

from __future__ import annotations

from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver

from datasets.models import Dataset, Upload
from datasets.uploads import remove_folder


@receiver(post_delete, sender=Upload)
def on_upload_deleted(sender, instance: Upload, **kwargs) -> None:
    folder, kind = instance.folder, instance.kind
    # After the commit: a rolled-back deletion must find its files still there.
    transaction.on_commit(lambda: remove_folder(folder, kind))


@receiver(post_delete, sender=Dataset)
@receiver(post_delete, sender="models.ModelDefinition")
def on_user_of_upload_deleted(sender, instance, **kwargs) -> None:
    if instance.upload_id is not None:
        Upload.objects.filter(pk=instance.upload_id).delete()
