"""Fixtures for the end-to-end tests: a real cluster (``harness.Cluster``) and the records a
data scientist would have created (dataset, model, instance group of all hosts)."""

from __future__ import annotations

import pytest
from django.db import connection

from tests.e2e.harness import Cluster


def _shared_database() -> bool:
    """Can processes other than this one open the test database?"""
    name = str(connection.settings_dict["NAME"])
    return connection.vendor != "sqlite" or not ("memory" in name or name == "")


@pytest.fixture
def e2e(transactional_db, tmp_path, settings):
    if not _shared_database():
        pytest.skip(
            "the scheduler and host agent subprocesses cannot open an in-memory SQLite test "
            "database: run with DATABASE_URL=postgres://... (as CI does)"
        )
    cluster = Cluster(tmp_path, settings)
    yield cluster
    cluster.stop_all()
    cluster.cleanup_redis()


@pytest.fixture
def e2e_records(e2e, django_user_model):
    from datasets.models import Dataset
    from models.models import ModelDefinition
    from resources.models import InstanceGroup, ResourceGroup

    owner = django_user_model.objects.create_user("e2e", password="e2e-pass-1234")
    data = e2e.tmp / "data"
    for sub in ("train", "test"):
        (data / sub).mkdir(parents=True)
    dataset = Dataset.objects.create(
        owner=owner, name=f"points-{e2e.run_id}", train_path=str(data / "train"),
        test_path=str(data / "test"),
    )
    model = ModelDefinition.objects.create(
        owner=owner, name="points", location=str(e2e.model_dir()), main_file="main.py",
        dataset=dataset,
    )
    rg = ResourceGroup.objects.create(name=f"rg-{e2e.run_id}")
    ig = InstanceGroup.objects.create(name=f"ig-{e2e.run_id}", resource_group=rg,
                                      reclaim_grace_s=60)
    return {"owner": owner, "model": model, "instance_group": ig}
