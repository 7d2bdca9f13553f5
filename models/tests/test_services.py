import pytest
from django.core.exceptions import ValidationError

from models.models import ModelDefinition
from models.services import model_create

pytestmark = pytest.mark.django_db


def test_it_registers_a_model_folder(model_def, roots):
    assert model_def.location == str(roots["models"] / "resnet")
    assert model_def.framework == "PyTorch"
    assert model_def.get_engine_display() == "Elastic Distributed Training"


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"location": "../../etc"}, "location"),
        ({"main_file": "missing.py"}, "main_file"),
        ({"main_file": "../../../etc/passwd"}, "main_file"),
        ({"framework": "Caffe"}, "framework"),
        ({"hyper_parameters": {"epochs": "ten"}}, "hyper_parameters"),
        ({"hyper_parameters": {"optimizer": "Magic"}}, "hyper_parameters"),
        ({"name": " "}, "name"),
    ],
)
def test_bad_input_names_the_field_and_stores_nothing(owner, dataset, roots, fields, field):
    args = {
        "owner": owner,
        "name": "m",
        "location": str(roots["models"] / "resnet"),
        "dataset": dataset,
        **fields,
    }
    with pytest.raises(ValidationError) as err:
        model_create(**args)
    assert field in err.value.message_dict
    assert ModelDefinition.objects.count() == 0


def test_another_users_dataset_cannot_be_used(other, dataset, roots):
    with pytest.raises(ValidationError, match="your own datasets"):
        model_create(
            owner=other, name="m", location=str(roots["models"] / "resnet"), dataset=dataset
        )
