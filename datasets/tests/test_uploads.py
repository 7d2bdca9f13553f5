"""Upload folders: removed link-safely, and only those the product created."""

from __future__ import annotations

import io
import uuid
import zipfile

import pytest
from django.core.exceptions import ValidationError

from datasets.models import Upload
from datasets.uploads import QuotaExceeded, remove_folder, root_for, unpacked

pytestmark = pytest.mark.django_db


def _zip(size: int) -> io.BytesIO:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("train/a.bin", b"a" * size)
        archive.writestr("test/b.bin", b"b")
    buffer.seek(0)
    return buffer


def test_it_removes_an_upload_folder_without_following_links(roots, tmp_path):
    folder = root_for(Upload.Kind.DATASET) / uuid.uuid4().hex
    (folder / "train").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    (folder / "train" / "link").symlink_to(outside, target_is_directory=True)
    remove_folder(folder, Upload.Kind.DATASET)
    assert not folder.exists()
    assert (outside / "keep").read_text() == "keep"


def test_it_never_removes_a_folder_it_did_not_create(roots, tmp_path):
    uploads = root_for(Upload.Kind.DATASET)
    uploads.mkdir(parents=True)
    typed = roots["alice"] / "cifar"
    named = uploads / "not-an-upload"
    named.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    link = uploads / uuid.uuid4().hex
    link.symlink_to(target, target_is_directory=True)
    for folder in (typed, named, link, uploads / uuid.uuid4().hex / ".." / "x"):
        remove_folder(folder, Upload.Kind.DATASET)
    assert typed.is_dir() and named.is_dir() and target.is_dir()


def test_a_refused_upload_leaves_neither_folder_nor_row(roots, owner, settings):
    settings.EDT_UPLOAD_QUOTA_BYTES = 1000
    with pytest.raises(QuotaExceeded) as err:
        with unpacked(owner=owner, kind=Upload.Kind.DATASET, archive=_zip(5000)):
            pass
    assert err.value.status_code == 413
    assert "quota" in err.value.message_dict["archive"][0]
    with pytest.raises(ValidationError):
        with unpacked(owner=owner, kind=Upload.Kind.DATASET, archive=_zip(10)):
            raise ValidationError({"archive": "the caller refused it"})
    assert not Upload.objects.exists()
    assert list(root_for(Upload.Kind.DATASET).iterdir()) == []


def test_an_upload_is_charged_its_unpacked_size(roots, owner, settings):
    settings.EDT_UPLOAD_QUOTA_BYTES = 0
    with unpacked(owner=owner, kind=Upload.Kind.DATASET, archive=_zip(3000)) as upload:
        assert upload.size == 3001
    assert Upload.objects.get().size == 3001
