"""``job_submit_once``: a submission key names one job per user, even when two requests with the
same key race, and only for ``SUBMIT_KEY_WINDOW``."""

from __future__ import annotations

import pytest
from django.utils import timezone

from jobs import services
from jobs.models import TrainingJob

pytestmark = pytest.mark.django_db


@pytest.fixture
def submit(owner, model_def, cluster):
    def submit_once(key: str, user=owner, fingerprint: str = "", **fields):
        return services.job_submit_once(
            user=user, model=model_def, instance_group=cluster["instance_group"],
            max_workers=fields.pop("max_workers", 2), submit_key=key,
            submit_fingerprint=fingerprint, **fields,
        )

    return submit_once


def test_it_submits_a_key_once(submit):
    first, created = submit("api:k1")
    again, created_again = submit("api:k1")
    assert (created, created_again) == (True, False)
    assert again.pk == first.pk
    assert TrainingJob.objects.count() == 1


def test_a_new_key_submits_a_new_job(submit):
    assert submit("api:k1")[0].pk != submit("api:k2")[0].pk


def test_it_returns_the_job_a_concurrent_request_committed_first(submit, monkeypatch):
    """The race, made deterministic: the look-up sees no job (the other request has not yet
    committed), then the insert hits the row it committed meanwhile. The unique constraint
    refuses it and the caller gets the other request's job."""
    winner, _ = submit("api:k1")
    look_up = services._submitted_with_key
    calls = []

    def too_early(**kwargs):
        calls.append(kwargs)
        return None if len(calls) == 1 else look_up(**kwargs)

    monkeypatch.setattr(services, "_submitted_with_key", too_early)
    job, created = submit("api:k1")
    assert (job.pk, created, len(calls)) == (winner.pk, False, 2)
    assert TrainingJob.objects.count() == 1


def test_the_same_key_with_another_request_is_refused(submit):
    first, _ = submit("api:k1", fingerprint="a" * 64)
    with pytest.raises(services.SubmitKeyReused) as refused:
        submit("api:k1", fingerprint="b" * 64, max_workers=3)
    assert refused.value.job.pk == first.pk
    assert "different request body" in str(refused.value)
    assert TrainingJob.objects.count() == 1


def test_keys_are_per_user(submit, other, owner, roots, cluster):
    from models.services import model_create

    theirs = model_create(
        owner=other, name="theirs", location=str(roots["models"] / "resnet"), dataset=None
    )
    mine, _ = submit("api:k1")
    job, created = services.job_submit_once(
        user=other, model=theirs, instance_group=cluster["instance_group"], max_workers=1,
        submit_key="api:k1",
    )
    assert created and job.pk != mine.pk and job.owner == other


def test_a_key_older_than_the_window_submits_a_new_job(submit):
    old, _ = submit("api:k1")
    TrainingJob.objects.filter(pk=old.pk).update(
        created=timezone.now() - services.SUBMIT_KEY_WINDOW - timezone.timedelta(minutes=1)
    )
    new, created = submit("api:k1")
    assert created and new.pk != old.pk
    old.refresh_from_db()
    assert old.submit_key == ""


def test_jobs_without_a_key_do_not_collide(owner, model_def, cluster):
    for _ in range(2):
        services.job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"])
    assert TrainingJob.objects.filter(submit_key="").count() == 2
