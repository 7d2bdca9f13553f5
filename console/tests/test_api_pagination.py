"""Every paginated list of /api/v1 answers a limit or offset it cannot serve with a 400 naming
the parameter, never a 500 (issue 38, finding 7: ``?limit=10**30`` was a 500 on
``/api/v1/models/`` and ``/api/v1/hosts/``, the database refusing a number that large)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from console.api.pagination import MAX_LIMIT, MAX_OFFSET
from console.api.urls import router

pytestmark = pytest.mark.django_db


def _list_routes() -> list[tuple[str, bool]]:
    """(URL name, needs a pk) of every GET route of the router that pages its rows: each
    viewset's list, and its detail actions that page (a job's allocations, metrics, events)."""
    routes = []
    for _prefix, viewset, basename in router.registry:
        if "list" in dir(viewset):
            routes.append((f"{basename}-list", False))
        for action in viewset.get_extra_actions():
            paged = action.kwargs.get("pagination_class", True) is not None
            if action.detail and "get" in action.mapping and paged:
                routes.append((f"{basename}-{action.url_name}", True))
    return routes


ROUTES = _list_routes()
HUGE = ["99999999999999999999", str(10**30)]


def test_the_routes_cover_the_lists_the_issue_names():
    names = {name for name, _ in ROUTES}
    assert {"model-list", "host-list", "job-list", "job-events"} <= names


@pytest.fixture
def url_of(request):
    """The route's URL; a detail route's of a job made for it (only then: it costs a second)."""
    def url(name: str, needs_pk: bool) -> str:
        return reverse(name, args=[request.getfixturevalue("job").pk] if needs_pk else [])

    return url


@pytest.mark.parametrize("name, needs_pk", ROUTES)
@pytest.mark.parametrize("query, param", [
    (f"offset={10**30}", "offset"), (f"offset={MAX_OFFSET + 1}", "offset"),
    ("limit=-1", "limit"), ("limit=ten", "limit"), ("limit=0", "limit"),
    ("offset=%EF%BC%91", "offset"),  # a full-width digit one
])
def test_a_limit_or_offset_it_cannot_serve_is_a_400_naming_it(
    api, admin, url_of, name, needs_pk, query, param
):
    response = api(admin).get(f"{url_of(name, needs_pk)}?{query}")
    assert response.status_code == 400, (name, query, response.status_code,
                                         response.content[:300])
    assert param in response.json(), response.json()
    assert "whole number" in response.json()[param][0]


@pytest.mark.parametrize("name, needs_pk", ROUTES)
@pytest.mark.parametrize("limit", [*HUGE, "0" * 50 + "7" * 40])
def test_a_limit_past_the_page_size_cap_is_served_as_the_cap(
    api, admin, url_of, name, needs_pk, limit
):
    response = api(admin).get(f"{url_of(name, needs_pk)}?limit={limit}&offset=0")
    assert response.status_code == 200, (name, limit, response.status_code,
                                         response.content[:300])
    assert "results" in response.json()
    # The cap, not the number asked for, is what the next page goes on with.
    assert response.json()["next"] is None or f"limit={MAX_LIMIT}" in response.json()["next"]


def test_limit_and_offset_still_page(api, owner, model_def, roots):
    from models.services import model_create

    for name in ("b", "c"):
        model_create(owner=owner, name=name, location=model_def.location,
                     dataset=model_def.dataset)
    page = api(owner).get("/api/v1/models/?limit=1&offset=1").json()
    assert page["count"] == 3
    assert [m["name"] for m in page["results"]] == ["c"]
    assert "limit=1" in page["next"] and "offset=2" in page["next"]


@pytest.mark.django_db
def test_the_api_gives_one_kind_of_metric_when_asked(job, owner):
    from rest_framework.test import APIClient

    from jobs.models import JobMetric

    JobMetric.objects.create(job=job, kind="train", values={"loss": 1.0})
    JobMetric.objects.create(job=job, kind="usage", values={"host": "h1", "cpu_percent": 90.0})
    api = APIClient()
    api.force_authenticate(owner)
    url = f"/api/v1/jobs/{job.pk}/metrics/"
    usage = api.get(url, {"kind": "usage"}).json()
    rows = usage["results"] if isinstance(usage, dict) else usage
    assert [r["kind"] for r in rows] == ["usage"] and rows[0]["values"]["cpu_percent"] == 90.0
    wrong = api.get(url, {"kind": "gpu"})
    assert wrong.status_code == 400 and "train, test, usage" in wrong.json()["kind"][0]
