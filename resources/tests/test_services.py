"""Writes on hosts: a host agent leaving."""

from __future__ import annotations

import pytest

from resources.models import Host
from resources.services import host_leave, host_register


@pytest.mark.django_db
def test_a_host_that_leaves_is_unavailable_at_once():
    host_register(name="cpu1", cpu_slots=2)
    assert host_leave(name="cpu1")
    assert Host.objects.get(name="cpu1").state == Host.State.UNAVAILABLE
    assert not host_leave(name="cpu1")  # it left already
