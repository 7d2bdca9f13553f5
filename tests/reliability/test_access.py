"""Who may see and change what, over /api/v1.

Every operation of the project's OpenAPI schema is tried as anonymous, as another user and as
an admin, so an endpoint added later is covered without editing this file. Another user's
object is a 404 (not a 403: its existence is not disclosed) and their lists are empty; a token
reaches no more than the session of the same user; session writes need the CSRF token; login
attempts lock out after AXES_FAILURE_LIMIT failures; the production settings pass Django's
deployment checks.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.test import Client
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from datasets import services as dataset_services
from datasets.models import Dataset
from environments.models import Environment, EnvironmentBuild
from hpo import services as hpo_services
from hpo.models import HpoTask, HpoTrial
from hpo.space import parse_search
from jobs import services as job_services
from jobs.models import JobEvent, JobMetric, SlotAllocation, TrainingJob
from models import services as model_services
from models.models import ModelDefinition
from resources.models import Host, InstanceGroup, ResourceGroup

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "a-long-enough-password-1"
OWNED = ("/api/v1/datasets/", "/api/v1/models/", "/api/v1/jobs/")
CLUSTER = ("/api/v1/hosts/", "/api/v1/resource-groups/", "/api/v1/instance-groups/",
           "/api/v1/environments/")
PUBLIC = {("POST", "/api/v1/auth/token/")}


def _operations() -> list[tuple[str, str]]:
    spec = json.loads(
        OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True))
    )
    return [
        (method.upper(), path)
        for path, item in spec["paths"].items()
        if path.startswith("/api/v1/")
        for method in item
        if method in {"get", "post", "put", "patch", "delete"}
    ]


OPERATIONS = _operations()


@dataclass
class Owned:
    dataset: Dataset
    model: ModelDefinition
    job: TrainingJob
    search: HpoTask

    def ids(self) -> dict[str, int]:
        return {"/api/v1/datasets/": self.dataset.pk, "/api/v1/models/": self.model.pk,
                "/api/v1/jobs/": self.job.pk, "/api/v1/hpo/": self.search.pk}


@dataclass
class World:
    alice: object
    bob: object
    carol: object  # signed in, owns nothing
    admin: object
    alice_owns: Owned
    bob_owns: Owned
    cluster_ids: dict[str, int]

    def url(self, path: str, owner: Owned | None = None) -> str:
        """``path`` with ``{id}`` filled in with ``owner``'s object (alice's by default)."""
        if "{id}" not in path:
            return path
        ids = {**self.cluster_ids, **(owner or self.alice_owns).ids()}
        pk = next(v for k, v in ids.items() if path.startswith(k))
        return path.replace("{id}", str(pk))


def _own(user, name: str, tmp: Path, ig: InstanceGroup, host: Host, slot: int) -> Owned:
    data = tmp / "data" / name
    for part in ("train", "test"):
        (data / part).mkdir(parents=True)
    code = tmp / "models" / name
    code.mkdir(parents=True)
    (code / "main.py").write_text("print('hi')\n")
    dataset = dataset_services.dataset_create(
        owner=user, name=f"ds-{name}", train_path=str(data / "train"),
        test_path=str(data / "test"),
    )
    model = model_services.model_create(
        owner=user, name=f"m-{name}", location=str(code), dataset=dataset
    )
    job = job_services.job_submit(user=user, model=model, instance_group=ig, max_workers=2)
    SlotAllocation.objects.create(job=job, host=host, slot=slot, worker_id=f"{name}-w0")
    JobMetric.objects.create(job=job, kind="train", epoch=1, values={"loss": 0.5})
    job_services.record_event(job, "worker.joined", f"{name}-w0 joined")
    search = hpo_services.hpo_create(
        user=user, model=model, instance_group=ig, trial_job={"max_workers": 1},
        search=parse_search({"algorithm": "Random", "maxJobNum": 2, "objectiveMetric": "loss"},
                            [{"name": "lr", "type": "Discrete", "dataType": "DOUBLE",
                              "discreteDbVal": [0.1, 0.01]}]))
    return Owned(dataset=dataset, model=model, job=job, search=search)


@pytest.fixture
def world(db, tmp_path, settings) -> World:
    # Real password checks, fast: the lockout tests log in many times.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.EDT_DATA_ROOTS = [(tmp_path / "data").resolve()]
    settings.EDT_MODEL_ROOTS = [(tmp_path / "models").resolve()]
    settings.EDT_UPLOAD_ROOT = (tmp_path / "uploads").resolve()
    settings.EDT_RESULT_ROOT = (tmp_path / "results").resolve()
    users = get_user_model().objects
    alice, bob, carol = (users.create_user(n, password=PASSWORD) for n in ("alice", "bob", "carol"))
    admin = users.create_superuser("root", password=PASSWORD)
    host = Host.objects.create(name="cpu-host-1", cpu_slots=4)
    rg = ResourceGroup.objects.create(name="rg", slots_mode="static", static_slots=4)
    ig = InstanceGroup.objects.create(name="ig", resource_group=rg)
    team = Environment.objects.create(name="team", packages="numpy==2.4.6")
    Environment.objects.create(name="alice-layer", base=team, owner=alice, key="k" * 64,
                               packages="termcolor")
    return World(
        alice=alice, bob=bob, carol=carol, admin=admin,
        alice_owns=_own(alice, "alice", tmp_path, ig, host, 0),
        bob_owns=_own(bob, "bob", tmp_path, ig, host, 1),
        cluster_ids={"/api/v1/hosts/": host.pk, "/api/v1/resource-groups/": rg.pk,
                     "/api/v1/instance-groups/": ig.pk, "/api/v1/environments/": team.pk},
    )


def _snapshot() -> dict:
    """Every row a request could change, to prove a refused request changed nothing."""
    return {
        model.__name__: sorted(map(repr, model.objects.values()))
        for model in (Dataset, ModelDefinition, TrainingJob, SlotAllocation, JobEvent, JobMetric,
                      Host, ResourceGroup, InstanceGroup, Token, Environment, EnvironmentBuild,
                      HpoTask, HpoTrial)
    }


def _client(user=None, *, auth: str = "session", csrf: bool = False) -> APIClient:
    client = APIClient(enforce_csrf_checks=csrf)
    if user is not None and auth == "session":
        client.force_login(user, backend="django.contrib.auth.backends.ModelBackend")
    elif user is not None:
        key = Token.objects.get_or_create(user=user)[0].key
        client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client


def _send(client: APIClient, method: str, url: str, data: dict | None = None):
    return client.generic(method, url, json.dumps(data or {}), content_type="application/json")


def test_the_schema_lists_the_endpoints_this_suite_walks() -> None:
    assert len(OPERATIONS) >= 20
    assert ("GET", "/api/v1/jobs/{id}/") in OPERATIONS


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=lambda v: v)
def test_anonymous_reaches_nothing(world: World, method: str, path: str) -> None:
    before = _snapshot()
    response = _send(_client(), method, world.url(path))
    if (method, path) in PUBLIC:
        assert response.status_code == 400  # the token endpoint asks for credentials
    else:
        assert response.status_code in (401, 403), (method, path, response.status_code)
    assert _snapshot() == before


@pytest.mark.parametrize("auth", ["session", "token"])
@pytest.mark.parametrize(
    ("method", "path"), [op for op in OPERATIONS if op[1].startswith(OWNED) and "{id}" in op[1]],
    ids=lambda v: v,
)
def test_another_users_object_is_a_404_and_stays_unchanged(
    world: World, method: str, path: str, auth: str
) -> None:
    client = _client(world.bob, auth=auth)
    before = _snapshot()
    body = {"priority": 1, "description": "bob was here", "hyper_parameters": {"epochs": 1}}
    response = _send(client, method, world.url(path), body)
    assert response.status_code == 404, (method, path, response.status_code, response.content)
    assert _snapshot() == before


@pytest.mark.parametrize("auth", ["session", "token"])
@pytest.mark.parametrize(
    "path", [p for m, p in OPERATIONS if m == "GET" and p.startswith(OWNED) and "{id}" in p]
)
def test_the_owner_and_an_admin_reach_the_same_object(world: World, path: str, auth: str) -> None:
    for user in (world.alice, world.admin):
        response = _client(user, auth=auth).get(world.url(path))
        assert response.status_code == 200, (user, path, response.status_code)


@pytest.mark.parametrize("path", [p for m, p in OPERATIONS if m == "GET"])
def test_an_admin_reads_every_endpoint(world: World, path: str) -> None:
    response = _client(world.admin).get(world.url(path))
    assert response.status_code == 200, (path, response.status_code)


@pytest.mark.parametrize("auth", ["session", "token"])
@pytest.mark.parametrize("path", OWNED)
def test_lists_hold_only_the_users_own_objects(world: World, path: str, auth: str) -> None:
    def names(user) -> set[int]:
        body = _client(user, auth=auth).get(path).json()
        return {row["id"] for row in body["results"]}

    alice_id, bob_id = world.alice_owns.ids()[path], world.bob_owns.ids()[path]
    assert names(world.alice) == {alice_id}
    assert names(world.bob) == {bob_id}
    assert names(world.carol) == set()
    assert names(world.admin) >= {alice_id, bob_id}


@pytest.mark.parametrize("sub", ["allocations", "metrics", "events"])
def test_a_jobs_history_is_visible_to_its_owner_only(world: World, sub: str) -> None:
    url = f"/api/v1/jobs/{world.alice_owns.job.pk}/{sub}/"
    assert _client(world.alice).get(url).json()["count"] >= 1
    assert _client(world.bob).get(url).status_code == 404
    assert _client(world.carol).get(url).status_code == 404


@pytest.mark.parametrize(
    ("method", "path"),
    [op for op in OPERATIONS if op[1].startswith(CLUSTER) and op[0] != "GET"],
    ids=lambda v: v,
)
def test_only_an_admin_changes_hosts_and_groups(world: World, method: str, path: str) -> None:
    before = _snapshot()
    response = _send(_client(world.alice), method, world.url(path), {"name": "mine"})
    assert response.status_code == 403, (method, path, response.status_code)
    assert _snapshot() == before


def test_a_users_layer_is_theirs_alone(world: World) -> None:
    layer = Environment.objects.get(name="alice-layer")
    assert _client(world.alice).get(f"/api/v1/environments/{layer.pk}/").status_code == 200
    assert _client(world.bob).get(f"/api/v1/environments/{layer.pk}/").status_code == 404
    listed = _client(world.bob).get("/api/v1/environments/").json()["results"]
    names = {row["name"] for row in listed}
    assert "team" in names and "alice-layer" not in names


def test_a_user_cannot_train_another_users_model_or_use_their_dataset(world: World) -> None:
    bob = _client(world.bob, auth="token")
    before = _snapshot()
    ig = world.cluster_ids["/api/v1/instance-groups/"]
    response = bob.post("/api/v1/jobs/", {"model": world.alice_owns.model.pk,
                                          "instance_group": ig, "max_workers": 1}, format="json")
    assert response.status_code == 400 and "model" in response.json()
    response = bob.post("/api/v1/jobs/", {"model": world.bob_owns.model.pk, "instance_group": ig,
                                          "max_workers": 1, "dataset": world.alice_owns.dataset.pk},
                        format="json")
    assert response.status_code == 400 and "dataset" in response.json()
    response = bob.patch(f"/api/v1/models/{world.bob_owns.model.pk}/",
                         {"dataset": world.alice_owns.dataset.pk}, format="json")
    assert response.status_code == 400 and "dataset" in response.json()
    response = bob.post("/api/v1/models/", {
        "name": "steal", "location": str(Path(world.bob_owns.model.location)),
        "dataset": world.alice_owns.dataset.pk}, format="json")
    assert response.status_code == 400 and "dataset" in response.json()
    response = bob.post("/api/v1/jobs/reorder/", {"order": [world.alice_owns.job.pk,
                                                            world.bob_owns.job.pk]}, format="json")
    assert response.status_code == 400 and "order" in response.json()
    assert _snapshot() == before


def test_me_is_the_caller(world: World) -> None:
    body = _client(world.bob, auth="token").get("/api/v1/me/").json()
    assert body["username"] == "bob" and body["is_staff"] is False


# --- CSRF ------------------------------------------------------------------------------------

CSRF_WRITES = [
    ("POST", "/api/v1/jobs/{id}/kill/"),
    ("PATCH", "/api/v1/jobs/{id}/"),
    ("PATCH", "/api/v1/datasets/{id}/"),
    ("DELETE", "/api/v1/models/{id}/"),
    ("POST", "/api/v1/jobs/reorder/"),
    ("POST", "/api/v1/datasets/"),
]


@pytest.mark.parametrize(("method", "path"), CSRF_WRITES, ids=lambda v: v)
def test_a_session_write_without_the_csrf_token_is_refused(
    world: World, method: str, path: str
) -> None:
    client = _client(world.alice, csrf=True)
    before = _snapshot()
    body = {"priority": 9000, "description": "x", "order": [world.alice_owns.job.pk]}
    response = _send(client, method, world.url(path), body)
    assert response.status_code == 403, (method, path, response.status_code)
    assert "CSRF" in response.json()["detail"]
    assert _snapshot() == before


def test_a_session_write_with_the_csrf_token_goes_through(world: World) -> None:
    client = _client(world.alice, csrf=True)
    secret = secrets.token_hex(16)  # 32 characters: a valid unmasked CSRF secret
    client.cookies[django_settings.CSRF_COOKIE_NAME] = secret
    url = f"/api/v1/jobs/{world.alice_owns.job.pk}/"
    response = client.patch(url, {"priority": 9000}, format="json", HTTP_X_CSRFTOKEN=secret)
    assert response.status_code == 200, response.content
    assert TrainingJob.objects.get(pk=world.alice_owns.job.pk).priority == 9000


def test_a_token_write_needs_no_csrf_token(world: World) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=world.alice).key}")
    response = client.patch(f"/api/v1/jobs/{world.alice_owns.job.pk}/", {"priority": 42},
                            format="json")
    assert response.status_code == 200, response.content


# --- Login lockout (django-axes) -------------------------------------------------------------


def _admin_login(client: Client, username: str, password: str) -> bool:
    client.post("/admin/login/?next=/admin/", {"username": username, "password": password})
    return client.get("/admin/").status_code == 200


def _api_login(username: str, password: str):
    return APIClient().post("/api/v1/auth/token/", {"username": username, "password": password},
                            format="json")


def test_the_admin_login_locks_out_after_the_failure_limit(world: World, settings) -> None:
    assert settings.AXES_ENABLED and settings.AXES_FAILURE_LIMIT == 5
    assert _admin_login(Client(), "root", PASSWORD)  # the right password works at first
    for _ in range(settings.AXES_FAILURE_LIMIT):
        assert not _admin_login(Client(), "root", "wrong-password")
    assert not _admin_login(Client(), "root", PASSWORD), "locked out, even with the password"


def test_the_api_token_endpoint_locks_out_after_the_failure_limit(world: World, settings) -> None:
    assert _api_login("bob", PASSWORD).status_code == 200
    for _ in range(settings.AXES_FAILURE_LIMIT):
        # The attempt that reaches the limit is already answered with the lockout (429).
        assert _api_login("bob", "wrong-password").status_code in (401, 403, 429)
    tokens = Token.objects.count()
    response = _api_login("bob", PASSWORD)
    assert response.status_code in (401, 403, 429), response.status_code
    assert b'"token"' not in response.content  # axes answers the lockout itself, in HTML
    assert Token.objects.count() == tokens
    # The lockout is per user and address: another user is not locked out by bob's attacker.
    assert _api_login("carol", PASSWORD).status_code == 200


def test_failures_on_the_api_and_the_admin_count_together(world: World, settings) -> None:
    for i in range(settings.AXES_FAILURE_LIMIT):
        if i % 2:
            _api_login("carol", "wrong-password")
        else:
            _admin_login(Client(), "carol", "wrong-password")
    assert _api_login("carol", PASSWORD).status_code in (401, 403, 429)


# --- Deployment checks -------------------------------------------------------------------------


def test_the_production_settings_pass_the_deployment_checks(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DEBUG": "false",
        "SECRET_KEY": secrets.token_urlsafe(64),
        "ALLOWED_HOSTS": "example.com",
        "HTTPS": "true",
        "EDT_VAR_DIR": str(tmp_path),  # nothing is written into the checkout
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    # The browser tests' session fixture sets this for Playwright's sync API; no deployment does.
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_the_deployment_checks_catch_a_debug_deployment(tmp_path: Path) -> None:
    """The check above can fail: the same run with DEBUG on is refused."""
    env = {**os.environ, "DEBUG": "true", "SECRET_KEY": secrets.token_urlsafe(64),
           "ALLOWED_HOSTS": "example.com", "HTTPS": "true", "EDT_VAR_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0 and "DEBUG" in result.stderr + result.stdout
