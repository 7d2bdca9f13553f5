"""Fixtures shared by the console's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def quiet_channels(settings):
    """For tests of pages and views, not of the live path: events stay off the shared Redis,
    and a fast hasher keeps modules that create many users quick."""
    from events.ingest import clear_caches

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    clear_caches()
    yield
    clear_caches()


@pytest.fixture
def browser(client):
    """``browser(user)``: the test client signed in as that user."""

    def sign_in(user):
        client.force_login(user)
        return client

    return sign_in
