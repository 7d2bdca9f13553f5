"""models.locations: the per-user rule for model folders, on its own."""

import io
import tarfile

import pytest
from django.core.exceptions import ValidationError

from datasets.models import Upload
from datasets.uploads import unpacked
from models.locations import location_problem, model_folder
from models.models import ModelDefinition

pytestmark = pytest.mark.django_db


def _archive() -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("m/main.py")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"1\n"))
    buffer.seek(0)
    return buffer


def test_an_upload_counts_only_for_its_own_owner(roots, owner, other):
    with unpacked(owner=other, kind=Upload.Kind.MODEL, archive=_archive()) as upload:
        assert model_folder(upload.folder, owner=other, upload=upload)
        with pytest.raises(ValidationError, match="not inside the model's own uploaded folder"):
            model_folder(upload.folder, owner=owner, upload=upload)


def test_a_relative_name_is_looked_up_in_the_owners_area_first(roots, owner):
    (roots["models"] / "alice" / "resnet").mkdir(parents=True)
    assert model_folder("resnet", owner=owner) == roots["models"] / "alice" / "resnet"


def test_a_shared_folder_stops_being_allowed_when_the_admin_unshares_it(roots, owner, settings):
    model = ModelDefinition.objects.create(owner=owner, name="m",
                                           location=str(roots["models"] / "resnet"))
    assert location_problem(model) == ""  # conftest shares models/resnet
    settings.EDT_SHARED_MODEL_DIRS = []
    assert "must be under" in location_problem(model)
    assert f"{roots['models']}/alice/" in location_problem(model)


def test_a_shared_folder_outside_the_roots_is_ignored(roots, owner, settings, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    settings.EDT_SHARED_MODEL_DIRS = [str(outside), str(roots["models"])]
    with pytest.raises(ValidationError, match="outside the allowed model roots"):
        model_folder(str(outside), owner=owner)
    with pytest.raises(ValidationError, match="root itself cannot be a model folder"):
        model_folder(str(roots["models"]), owner=owner)
