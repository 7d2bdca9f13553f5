"""The one permission rule every list applies: users see their own objects, admins see all.

Models with an ``owner`` use ``OwnedQuerySet`` as their manager, and every view, API endpoint and
WebSocket consumer starts from ``Model.objects.visible_to(user)``, so none can forget the rule.
"""

from __future__ import annotations

from django.db import models


def is_admin(user) -> bool:
    return bool(user and user.is_authenticated and (user.is_staff or user.is_superuser))


class OwnedQuerySet(models.QuerySet):
    def visible_to(self, user) -> OwnedQuerySet:
        if not (user and user.is_authenticated):
            return self.none()
        if is_admin(user):
            return self
        return self.filter(owner=user)


class RetirableQuerySet(OwnedQuerySet):
    """Rows a user deleted while keeping the runs that used them (``deleted`` set): gone from
    every list, form and page of their own, still shown by name on those runs' pages (a job
    reaches its model through its foreign key, which does not filter)."""

    def visible_to(self, user) -> RetirableQuerySet:
        return super().visible_to(user).filter(deleted__isnull=True)

    def live(self) -> RetirableQuerySet:
        return self.filter(deleted__isnull=True)
