"""Users and their API tokens in the console: admins list and create users, deactivate and
reactivate them, make them admins or not, reset their passwords and give or revoke their API
tokens (``rest_framework.authtoken``, what ``/api/v1/auth/token/`` hands out). Everyone else
gets a 403 there, and sees and regenerates only their own token on "My account".

A password or token made here is shown once, on the page that answers the POST (never carried
in a redirect's message, which the session or a cookie would keep), and the page is not cached.
"""

from __future__ import annotations

import secrets

from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_POST
from rest_framework.authtoken.models import Token

from console import selectors
from console.manage_forms import PasswordResetForm, UserCreateForm
from console.views import admin_required

User = get_user_model()


def generated_password() -> str:
    """A password to hand over once: 16 URL-safe characters (96 random bits)."""
    return secrets.token_urlsafe(12)


def _secret_page(request: HttpRequest, context: dict) -> HttpResponse:
    """The page that shows a new password or token once."""
    response = render(request, "console/user_secret.html", context)
    add_never_cache_headers(response)
    return response


def _renew_token(user) -> Token:
    """A new key for ``user``; the old one stops working at once."""
    with transaction.atomic():
        Token.objects.filter(user=user).delete()
        return Token.objects.create(user=user)


@admin_required
def users(request: HttpRequest) -> HttpResponse:
    rows = list(User.objects.order_by("username").select_related("auth_token"))
    for row in rows:  # what each user's results take, as the quota counts it
        row.results = selectors.results_usage(user=row)
    return render(request, "console/users.html", {"users": rows})


@admin_required
def user_new(request: HttpRequest) -> HttpResponse:
    form = UserCreateForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        password = data["password"] or generated_password()
        user = User.objects.create_user(data["username"], email=data["email"] or "",
                                        password=password, is_staff=data["is_admin"])
        return _secret_page(request, {
            "subject": user, "title": f"User {user.username} created",
            "password": password if not data["password"] else "",
        })
    status = 400 if form.errors else 200
    return render(request, "console/user_new.html", {"form": form}, status=status)


def _managed_user(request: HttpRequest, pk: int) -> User:
    """The user an admin acts on. A superuser is changed only by a superuser: an admin who is
    staff alone must not take over a superuser's account by resetting its password or
    token (Django's own admin draws the same line)."""
    user = get_object_or_404(User, pk=pk)
    if user.is_superuser and not request.user.is_superuser:
        raise PermissionDenied("Only a superuser can change a superuser's account.")
    return user


def _refuse_self(request: HttpRequest, user, what: str) -> HttpResponse | None:
    """An admin cannot lock themselves out: another admin must do it."""
    if user.pk == request.user.pk:
        messages.error(request, f"You cannot {what} yourself; ask another administrator.")
        return redirect("users")
    return None


@require_POST
@admin_required
def user_active(request: HttpRequest, pk: int) -> HttpResponse:
    """Deactivate (``active=0``) or reactivate a user. A deactivated user's sessions, API
    token and WMLA tokens stop working at once (every authentication checks ``is_active``);
    their objects stay."""
    user = _managed_user(request, pk)
    active = request.POST.get("active") == "1"
    if not active and (refused := _refuse_self(request, user, "deactivate")):
        return refused
    user.is_active = active
    user.save(update_fields=["is_active"])
    messages.success(request, f"User {user.username} {'reactivated' if active else 'deactivated'}.")
    return redirect("users")


@require_POST
@admin_required
def user_admin(request: HttpRequest, pk: int) -> HttpResponse:
    """Make a user an administrator (staff) or not (neither staff nor superuser)."""
    user = _managed_user(request, pk)
    admin = request.POST.get("admin") == "1"
    if not admin and (refused := _refuse_self(request, user, "demote")):
        return refused
    user.is_staff = admin
    if not admin:
        user.is_superuser = False
    user.save(update_fields=["is_staff", "is_superuser"])
    state = "is now an administrator" if admin else "is no longer an administrator"
    messages.success(request, f"User {user.username} {state}.")
    return redirect("users")


@admin_required
def user_password(request: HttpRequest, pk: int) -> HttpResponse:
    """GET: the reset form; POST: set the given password, or a generated one shown once."""
    user = _managed_user(request, pk)
    form = PasswordResetForm(request.POST or None, user=user)
    if request.method == "POST" and form.is_valid():
        password = form.cleaned_data["password"] or generated_password()
        user.set_password(password)
        user.save(update_fields=["password"])
        return _secret_page(request, {
            "subject": user, "title": f"Password of {user.username} reset",
            "password": password if not form.cleaned_data["password"] else "",
        })
    status = 400 if form.errors else 200
    return render(request, "console/user_password.html", {"form": form, "subject": user},
                  status=status)


@require_POST
@admin_required
def user_token(request: HttpRequest, pk: int) -> HttpResponse:
    """``action=create``: a new API token for the user (replacing any), shown once;
    ``action=revoke``: delete it, so scripts using it are refused from now on."""
    user = _managed_user(request, pk)
    if request.POST.get("action") == "revoke":
        deleted, _ = Token.objects.filter(user=user).delete()
        if deleted:
            messages.success(request, f"The API token of {user.username} was revoked.")
        else:
            messages.info(request, f"{user.username} had no API token.")
        return redirect("users")
    token = _renew_token(user)
    return _secret_page(request, {
        "subject": user, "title": f"API token of {user.username}", "token": token.key,
    })


@login_required
def my_account(request: HttpRequest) -> HttpResponse:
    """The user's own API token: shown, created or regenerated (POST)."""
    if request.method == "POST":
        _renew_token(request.user)
        messages.success(request, "A new API token was made; the old one no longer works.")
        return redirect("my-account")
    token = Token.objects.filter(user=request.user).first()
    response = render(request, "console/my_account.html",
                      {"token": token, "results": selectors.results_usage(user=request.user)})
    add_never_cache_headers(response)
    return response
