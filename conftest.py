"""Shared fixtures: an owner, another user and an admin; a cluster of two hosts with four CPU
slots each; data and model roots in a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from rest_framework.test import APIClient


@pytest.fixture
def roots(tmp_path: Path, settings) -> dict[str, Path]:
    data = tmp_path / "data"
    models = tmp_path / "models"
    for folder in (data / "cifar" / "train_db", data / "cifar" / "test_db", models / "resnet"):
        folder.mkdir(parents=True)
    (models / "resnet" / "main.py").write_text("print('hello')\n")
    settings.EDT_DATA_ROOTS = [data.resolve()]
    settings.EDT_MODEL_ROOTS = [models.resolve()]
    settings.EDT_RESULT_ROOT = (tmp_path / "results").resolve()
    settings.EDT_UPLOAD_ROOT = (tmp_path / "uploads").resolve()
    return {"data": data.resolve(), "models": models.resolve(), "tmp": tmp_path}


@pytest.fixture
def owner(django_user_model):
    return django_user_model.objects.create_user("alice", password="alice-pass-1234")


@pytest.fixture
def other(django_user_model):
    return django_user_model.objects.create_user("mallory", password="mallory-pass-1234")


@pytest.fixture
def admin(django_user_model):
    return django_user_model.objects.create_superuser("root", password="root-pass-1234")


def _client(user) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_authenticate(user)
    return client


@pytest.fixture
def api():
    """``api(user)`` returns an API client authenticated as that user (None: anonymous)."""
    return _client


@pytest.fixture
def cluster(db):
    from resources.models import Host, InstanceGroup, ResourceGroup

    hosts = [Host.objects.create(name=f"host{i}", address="127.0.0.1", cpu_slots=4) for i in (1, 2)]
    rg = ResourceGroup.objects.create(name="ComputeHostsGPU")
    ig = InstanceGroup.objects.create(name="sig-elastic", resource_group=rg)
    return {"hosts": hosts, "resource_group": rg, "instance_group": ig}


@pytest.fixture
def dataset(roots, owner):
    from datasets.services import dataset_create

    return dataset_create(
        owner=owner,
        name="cifar10EDTpytorch",
        train_path=str(roots["data"] / "cifar" / "train_db"),
        test_path=str(roots["data"] / "cifar" / "test_db"),
    )


@pytest.fixture
def model_def(roots, owner, dataset):
    from models.services import model_create

    return model_create(
        owner=owner,
        name="resnet-edt",
        location=str(roots["models"] / "resnet"),
        dataset=dataset,
        hyper_parameters={"epochs": 2, "batch_size": 16},
    )


@pytest.fixture
def job(owner, model_def, cluster):
    from jobs.services import job_submit

    return job_submit(
        user=owner, model=model_def, instance_group=cluster["instance_group"], max_workers=8
    )
