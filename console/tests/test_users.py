"""Users and API tokens in the console: only admins manage users (everyone else gets a 403),
a password or token made there is shown once and works, and every user sees and regenerates
their own token on "My account"."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]

User = get_user_model()
ADMIN_PAGES = [("users", []), ("user-new", [])]
ADMIN_POSTS = ["user-active", "user-admin", "user-password", "user-token"]


def _secret(response, kind: str) -> str:
    match = re.search(rf'data-secret="{kind}">([^<]+)<', response.content.decode())
    assert match, f"no {kind} shown on the page"
    return match.group(1)


def _api_status(key: str) -> int:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    return client.get("/api/v1/jobs/").status_code


def _can_log_in(username: str, password: str) -> bool:
    """Through the login form, as a person would (django-axes wants the request)."""
    from django.test import Client

    response = Client().post(reverse("login"), {"username": username, "password": password})
    return response.status_code == 302


@pytest.mark.parametrize(("name", "args"), ADMIN_PAGES)
def test_a_user_cannot_see_the_user_pages(browser, owner, name, args):
    assert browser(owner).get(reverse(name, args=args)).status_code == 403


@pytest.mark.parametrize("name", ADMIN_POSTS)
def test_a_user_cannot_manage_users(browser, owner, other, name):
    client = browser(owner)
    response = client.post(reverse(name, args=[other.pk]),
                           {"active": "0", "admin": "1", "action": "create", "password": ""})
    assert response.status_code == 403
    other.refresh_from_db()
    assert other.is_active and not other.is_staff
    assert not Token.objects.filter(user=other).exists()


def test_anonymous_visitors_are_sent_to_log_in(client):
    for name in ("users", "my-account"):
        response = client.get(reverse(name))
        assert response.status_code == 302 and reverse("login") in response.url


def test_the_users_page_lists_users_with_only_the_start_of_their_token(browser, admin, owner):
    key = Token.objects.create(user=owner).key
    html = browser(admin).get(reverse("users")).content.decode()
    assert "alice" in html and "root" in html
    assert key[:6] in html and key not in html


def test_an_admin_creates_a_user_with_a_generated_password(browser, admin):
    response = browser(admin).post(reverse("user-new"), {"username": "bob", "email": ""})
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    password = _secret(response, "password")
    assert _can_log_in("bob", password)
    assert not User.objects.get(username="bob").is_staff


def test_an_admin_creates_an_admin_with_a_given_password(browser, admin):
    response = browser(admin).post(reverse("user-new"), {
        "username": "carol", "password": "a-long-given-pass-42", "is_admin": "on"})
    assert response.status_code == 200 and "data-secret" not in response.content.decode()
    assert _can_log_in("carol", "a-long-given-pass-42")
    assert User.objects.get(username="carol").is_staff


@pytest.mark.parametrize(("fields", "field", "problem"), [
    ({"username": "ALICE"}, "username", "exists already"),
    ({"username": "bad name!"}, "username", "Enter a valid username"),
    ({"username": "dave", "password": "short"}, "password", "too short"),
])
def test_a_bad_new_user_is_refused_on_its_field(browser, admin, owner, fields, field, problem):
    response = browser(admin).post(reverse("user-new"), fields)
    assert response.status_code == 400
    assert problem in " ".join(response.context["form"].errors[field])
    assert User.objects.count() == 2


def test_a_deactivated_user_cannot_log_in_nor_use_their_token(browser, admin, owner):
    from django.test import Client

    key = Token.objects.create(user=owner).key
    signed_in = Client()
    signed_in.force_login(owner)
    client = browser(admin)
    assert client.post(reverse("user-active", args=[owner.pk]), {"active": "0"}).status_code == 302
    assert not _can_log_in("alice", "alice-pass-1234")
    assert _api_status(key) in (401, 403)
    assert signed_in.get(reverse("jobs")).status_code == 302, "their session still works"
    client.post(reverse("user-active", args=[owner.pk]), {"active": "1"})
    assert _can_log_in("alice", "alice-pass-1234")
    assert _api_status(key) == 200


def test_an_admin_makes_a_user_admin_and_back(browser, admin, owner):
    client = browser(admin)
    client.post(reverse("user-admin", args=[owner.pk]), {"admin": "1"})
    owner.refresh_from_db()
    assert owner.is_staff
    client.post(reverse("user-admin", args=[owner.pk]), {"admin": "0"})
    owner.refresh_from_db()
    assert not owner.is_staff and not owner.is_superuser


def test_an_admin_cannot_lock_themselves_out(browser, admin):
    client = browser(admin)
    response = client.post(reverse("user-active", args=[admin.pk]), {"active": "0"}, follow=True)
    assert "You cannot deactivate yourself" in response.content.decode()
    response = client.post(reverse("user-admin", args=[admin.pk]), {"admin": "0"}, follow=True)
    assert "You cannot demote yourself" in response.content.decode()
    admin.refresh_from_db()
    assert admin.is_active and admin.is_superuser


def test_an_admin_resets_a_password(browser, admin, owner):
    response = browser(admin).post(reverse("user-password", args=[owner.pk]), {"password": ""})
    password = _secret(response, "password")
    assert not _can_log_in("alice", "alice-pass-1234")
    assert _can_log_in("alice", password)


def test_a_weak_reset_password_is_refused(browser, admin, owner):
    response = browser(admin).post(reverse("user-password", args=[owner.pk]),
                                   {"password": "alice"})
    assert response.status_code == 400
    assert _can_log_in("alice", "alice-pass-1234")


def test_an_admin_creates_and_revokes_a_users_token(browser, admin, owner):
    client = browser(admin)
    response = client.post(reverse("user-token", args=[owner.pk]), {"action": "create"})
    key = _secret(response, "token")
    assert Token.objects.get(user=owner).key == key and _api_status(key) == 200
    renewed = _secret(client.post(reverse("user-token", args=[owner.pk]),
                                  {"action": "create"}), "token")
    assert renewed != key and _api_status(key) in (401, 403)
    client.post(reverse("user-token", args=[owner.pk]), {"action": "revoke"})
    assert not Token.objects.filter(user=owner).exists()
    assert _api_status(renewed) in (401, 403)


def test_my_account_shows_and_regenerates_my_own_token(browser, owner, other):
    theirs = Token.objects.create(user=other).key
    client = browser(owner)
    page = client.get(reverse("my-account"))
    assert "no API token yet" in page.content.decode() and theirs not in page.content.decode()
    client.post(reverse("my-account"))
    first = _secret(client.get(reverse("my-account")), "token")
    assert Token.objects.get(user=owner).key == first
    client.post(reverse("my-account"))
    second = _secret(client.get(reverse("my-account")), "token")
    assert second != first and _api_status(first) in (401, 403) and _api_status(second) == 200
    assert Token.objects.get(user=other).key == theirs


def test_the_nav_links_users_for_admins_only(browser, owner, admin):
    assert reverse("users") not in browser(owner).get(reverse("my-account")).content.decode()
    assert reverse("users") in browser(admin).get(reverse("my-account")).content.decode()


@pytest.mark.parametrize("name", ADMIN_POSTS)
def test_a_staff_admin_cannot_take_over_a_superuser(browser, admin, django_user_model, name):
    staff = django_user_model.objects.create_user("staff", password="staff-pass-1234",
                                                  is_staff=True)
    response = browser(staff).post(reverse(name, args=[admin.pk]),
                                   {"active": "0", "admin": "0", "action": "create",
                                    "password": ""})
    assert response.status_code == 403
    admin.refresh_from_db()
    assert admin.is_active and admin.is_superuser and admin.check_password("root-pass-1234")
    assert not Token.objects.filter(user=admin).exists()


def test_a_staff_admin_sees_no_buttons_for_a_superuser(browser, admin, django_user_model):
    staff = django_user_model.objects.create_user("staff", password="staff-pass-1234",
                                                  is_staff=True)
    html = browser(staff).get(reverse("users")).content.decode()
    assert reverse("user-password", args=[admin.pk]) not in html
    assert "Only a superuser changes a superuser" in html


def test_each_users_results_are_measured_against_their_quota(browser, admin, owner, job,
                                                             settings):
    settings.EDT_RESULTS_QUOTA_BYTES = 4 << 20
    folder = Path(job.result_dir)
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "weights.pth").write_bytes(os.urandom(1 << 20))  # 1 MiB, not sparse
    (folder / "sparse.bin").open("wb").truncate(512 << 20)  # no block held: not counted
    page = browser(admin).get(reverse("users")).content.decode()
    cell = re.search(r'data-results="alice">(.*?)</td>', page, re.S).group(1)
    assert cell.startswith("1.0 MB") and "1 job, 25% of 4.0 MB" in cell
    mine = browser(owner).get(reverse("my-account")).content.decode()
    assert re.search(r"id=\"results-usage\">1\.0 MB in 1 job \(25% of your quota", mine)
