"""Shared fixtures: an owner, another user and an admin; a cluster of two hosts with four CPU
slots each; data and model roots in a temporary folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from rest_framework.test import APIClient


@pytest.fixture
def roots(tmp_path: Path, settings) -> dict[str, Path]:
    """Users register datasets from their own area of a data root, ``<root>/<username>/``:
    alice's (the owner's) and mallory's (the other user's) hold a cifar dataset each."""
    data = tmp_path / "data"
    models = tmp_path / "models"
    for user in ("alice", "mallory"):
        for part in ("train_db", "test_db"):
            (data / user / "cifar" / part).mkdir(parents=True)
    (models / "resnet").mkdir(parents=True)
    (models / "resnet" / "main.py").write_text("print('hello')\n")
    settings.EDT_DATA_ROOTS = [data.resolve()]
    settings.EDT_SHARED_DATA_DIRS = []
    settings.EDT_MODEL_ROOTS = [models.resolve()]
    settings.EDT_RESULT_ROOT = (tmp_path / "results").resolve()
    settings.EDT_UPLOAD_ROOT = (tmp_path / "uploads").resolve()
    return {"data": data.resolve(), "alice": (data / "alice").resolve(),
            "mallory": (data / "mallory").resolve(), "models": models.resolve(), "tmp": tmp_path}


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
        train_path=str(roots["alice"] / "cifar" / "train_db"),
        test_path=str(roots["alice"] / "cifar" / "test_db"),
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


@pytest.fixture
def own_events_stream(settings):
    """Events published by a test go to a stream of its own, never the real one."""
    import uuid

    import redis

    settings.EDT_EVENTS_STREAM = f"edt-test-{uuid.uuid4().hex[:10]}:events"
    yield settings.EDT_EVENTS_STREAM
    redis.Redis.from_url(settings.REDIS_URL).delete(settings.EDT_EVENTS_STREAM)


@pytest.fixture(params=["cold", "warm"])
def process_start(request):
    """How the agent starts a job's processes in this test: a new interpreter each (``None``),
    or forked from a warm process (``agent.warm``), which is then the pool yielded."""
    if request.param == "cold":
        yield None
        return
    from agent import processes, warm

    pool = warm.WarmPool()
    pool.start(processes.user_python())
    assert pool.ready(120), "the warm process did not get ready within 120 s"
    original, warm.pool = warm.pool, pool
    try:
        yield pool
    finally:
        warm.pool = original
        pool.stop()
