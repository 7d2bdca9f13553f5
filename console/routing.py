"""WebSocket routes (the console's live consumers are added here)."""

websocket_urlpatterns: list = []
