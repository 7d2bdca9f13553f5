"""The console app's models live with the feature that owns them; importing them here registers
them with the ``console`` app so migrations and the admin see them."""

from console.wmla.models import AccessToken, WmlaExec  # noqa: F401
