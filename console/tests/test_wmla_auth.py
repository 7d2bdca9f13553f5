"""WMLA logon: Basic credentials -> an expiring bearer token, accepted as ``Authorization:
Bearer`` or ``X-Auth-Token``; logoff ends one token; Basic works on every endpoint."""

import base64
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from console.wmla.models import AccessToken

pytestmark = pytest.mark.django_db

EXECS = "/platform/rest/deeplearning/v1/execs"


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """PBKDF2's deliberate slowness costs a second per test user on CI's two cores."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


def logon(client: APIClient, path: str = "/auth/v1/logon") -> str:
    response = client.get(path, HTTP_AUTHORIZATION=basic("alice", "alice-pass-1234"))
    assert response.status_code == 200, response.content
    return response.json()["accessToken"]


@pytest.mark.parametrize("path", ["/auth/v1/logon", "/platform/rest/conductor/v1/auth/logon"])
def test_it_logs_on_with_basic_credentials(owner, path):
    client = APIClient()
    response = client.get(path, HTTP_AUTHORIZATION=basic("alice", "alice-pass-1234"))
    assert response.status_code == 200
    body = response.json()
    assert body["accessToken"] and body["userName"] == "alice"
    assert body["expiresIn"] == 8 * 3600
    row = AccessToken.objects.get(user=owner)
    assert row.expires - row.created == timedelta(hours=8)
    # Only a digest is stored.
    assert body["accessToken"] not in row.key_hash


def test_it_refuses_a_wrong_password_with_401(owner):
    response = APIClient().get("/auth/v1/logon", HTTP_AUTHORIZATION=basic("alice", "nope"))
    assert response.status_code == 401
    assert "Wrong username or password" in response.json()["detail"]
    assert not AccessToken.objects.exists()


def test_logon_without_credentials_asks_for_basic(owner):
    response = APIClient().get("/auth/v1/logon")
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Basic")


@pytest.mark.parametrize("header", ["HTTP_AUTHORIZATION", "HTTP_X_AUTH_TOKEN"])
def test_the_token_authenticates_as_bearer_or_x_auth_token(owner, header):
    token = logon(APIClient())
    value = f"Bearer {token}" if header == "HTTP_AUTHORIZATION" else token
    response = APIClient().get(EXECS, **{header: value})
    assert response.status_code == 200
    assert response.json() == []
    assert AccessToken.objects.get().last_used is not None


def test_basic_credentials_work_on_every_endpoint_as_in_wmla_notebooks(owner):
    response = APIClient().get(EXECS, HTTP_AUTHORIZATION=basic("alice", "alice-pass-1234"))
    assert response.status_code == 200


def test_an_expired_token_is_refused_with_a_clear_401(owner):
    token = logon(APIClient())
    AccessToken.objects.update(expires=timezone.now() - timedelta(seconds=1))
    response = APIClient().get(EXECS, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 401
    assert "expired" in response.json()["detail"]


def test_an_unknown_token_is_refused(owner):
    response = APIClient().get(EXECS, HTTP_AUTHORIZATION="Bearer edt_not-a-token")
    assert response.status_code == 401
    assert "Log on again" in response.json()["detail"]


def test_anonymous_requests_get_401_not_403(db):
    response = APIClient().get(EXECS)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_logoff_ends_only_that_token(owner):
    first, second = logon(APIClient()), logon(APIClient())
    response = APIClient().post("/auth/v1/logoff", HTTP_AUTHORIZATION=f"Bearer {first}")
    assert response.status_code == 200
    assert APIClient().get(EXECS, HTTP_AUTHORIZATION=f"Bearer {first}").status_code == 401
    assert APIClient().get(EXECS, HTTP_AUTHORIZATION=f"Bearer {second}").status_code == 200


def test_logoff_without_a_token_is_a_clear_400(owner):
    response = APIClient().post(
        "/auth/v1/logoff", HTTP_AUTHORIZATION=basic("alice", "alice-pass-1234")
    )
    assert response.status_code == 400
    assert "Bearer" in response.json()["detail"]


def test_a_disabled_users_token_stops_working(owner):
    token = logon(APIClient())
    owner.is_active = False
    owner.save()
    assert APIClient().get(EXECS, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 401


def test_the_token_lifetime_follows_the_setting(owner, settings):
    settings.EDT_WMLA_TOKEN_TTL_S = 60
    body = APIClient().get(
        "/auth/v1/logon", HTTP_AUTHORIZATION=basic("alice", "alice-pass-1234")
    ).json()
    assert body["expiresIn"] == 60
