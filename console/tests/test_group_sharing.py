"""Instance groups that share hosts, as the console shows them: the share weight in the form and
the API (with a clear error out of bounds), the dashboard's slots held by other groups, and
why a waiting job waits when another group holds the shared slots."""

from __future__ import annotations

import html

import pytest
from django.urls import reverse

from events.fanout import cluster_usage
from jobs.models import SlotAllocation
from jobs.services import job_submit
from resources.models import InstanceGroup, ResourceGroup


@pytest.fixture
def two_groups(cluster):
    """prod (the cluster's instance group) and research, both over all hosts: 8 slots."""
    prod = cluster["instance_group"]
    prod.name = "prod"
    prod.save(update_fields=["name"])
    research = InstanceGroup.objects.create(
        name="research", resource_group=ResourceGroup.objects.create(name="everything"))
    return prod, research


def hold(job, hosts, per_host: int) -> None:
    for host in hosts:
        for slot in range(per_host):
            SlotAllocation.objects.create(job=job, host=host, slot=slot)


@pytest.mark.parametrize(("value", "status"), [(1, 200), (10000, 200), (0, 400), (10001, 400),
                                               ("heavy", 400)])
def test_the_api_sets_a_share_weight_within_bounds(api, admin, cluster, value, status):
    group = cluster["instance_group"]
    response = api(admin).patch(f"/api/v1/instance-groups/{group.pk}/",
                                {"share_weight": value}, format="json")
    assert response.status_code == status, response.json()
    group.refresh_from_db()
    assert group.share_weight == (value if status == 200 else 1)
    if status == 400:
        assert response.json()["share_weight"] == [
            "Share weight must be a whole number from 1 to 10000 (1: an equal share with the "
            "other instance groups on the same hosts)."]
    else:
        assert response.json()["share_weight"] == value


def test_the_api_takes_the_throughput_aware_policy(api, admin, cluster):
    body = {"name": "fast", "resource_group": cluster["resource_group"].pk, "policy": "goodput",
            "share_weight": 3}
    response = api(admin).post("/api/v1/instance-groups/", body, format="json")
    assert response.status_code == 201, response.json()
    assert (response.json()["policy"], response.json()["share_weight"]) == ("goodput", 3)


def test_the_form_sets_a_share_weight_and_refuses_one_out_of_bounds(browser, admin, cluster):
    group = cluster["instance_group"]
    url = reverse("instance-group-edit", args=[group.pk])
    page = browser(admin).get(url).content.decode()
    assert "Share weight on shared hosts" in page
    assert 'value="goodput"' in page and "Throughput-aware fair share" in page
    body = {"name": group.name, "resource_group": cluster["resource_group"].pk,
            "policy": "fairshare", "reclaim_grace_s": 120, "preemption": "on"}
    refused = browser(admin).post(url, body | {"share_weight": 0})
    assert refused.status_code == 200
    assert "Share weight must be a whole number from 1 to 10000" in refused.content.decode()
    group.refresh_from_db()
    assert group.share_weight == 1
    assert browser(admin).post(url, body | {"share_weight": 7}).status_code == 302
    group.refresh_from_db()
    assert group.share_weight == 7


def test_the_dashboard_counts_slots_held_by_other_groups_apart_from_free_ones(
    browser, owner, model_def, cluster, two_groups
):
    prod, research = two_groups
    a = job_submit(user=owner, model=model_def, instance_group=prod, max_workers=8)
    hold(a, cluster["hosts"][:1], 4)
    assert cluster_usage(research.pk) == {"total": 8, "used": 0, "other": 4, "free": 4}
    assert cluster_usage(prod.pk) == {"total": 8, "used": 4, "other": 0, "free": 4}
    page = browser(owner).get(reverse("instance-group", args=[research.pk])).content.decode()
    assert "Held by other groups" in page and "data-other>4<" in page
    assert "data-free>4<" in page
    # A group with its hosts to itself shows no such line.
    page = browser(owner).get(reverse("instance-group", args=[prod.pk])).content.decode()
    assert "Held by other groups" not in page


def test_a_waiting_jobs_page_says_which_group_holds_the_shared_slots(
    browser, owner, model_def, cluster, two_groups
):
    prod, research = two_groups
    a = job_submit(user=owner, model=model_def, instance_group=prod, max_workers=8)
    hold(a, cluster["hosts"], 4)
    b = job_submit(user=owner, model=model_def, instance_group=research, max_workers=8)
    page = html.unescape(browser(owner).get(reverse("job", args=[b.pk])).content.decode())
    assert ("waiting: instance group 'prod' holds 8 of the 8 shared slots; this group's share "
            "is 4, being reclaimed") in page
    history = browser(owner).get(reverse("job-history", args=[b.pk])).json()
    assert history["job"]["waiting"].startswith("waiting: instance group 'prod' holds 8")

    # With preemption off, prod's jobs keep their slots: the page says so.
    prod.preemption = False
    prod.save(update_fields=["preemption"])
    page = html.unescape(browser(owner).get(reverse("job", args=[b.pk])).content.decode())
    assert ("waiting: instance group 'prod' holds 8 of the 8 shared slots; their jobs keep "
            "their slots until they end (preemption off)") in page


def test_a_job_of_a_group_alone_on_its_hosts_has_no_such_reason(
    browser, owner, model_def, cluster
):
    job = job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"],
                     max_workers=8)
    page = html.unescape(browser(owner).get(reverse("job", args=[job.pk])).content.decode())
    assert "shared slots" not in page
