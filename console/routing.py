"""WebSocket routes of the console's live pages (``config/asgi.py`` mounts them behind
``AllowedHostsOriginValidator(AuthMiddlewareStack(...))``)."""

from django.urls import path

from console import consumers

websocket_urlpatterns = [
    path("ws/jobs/<int:job_id>/", consumers.JobConsumer.as_asgi()),
    path("ws/instance-groups/<int:group_id>/", consumers.InstanceGroupConsumer.as_asgi()),
]
