"""ASGI entry point: HTTP to Django, WebSockets to the consumers."""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_application = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import path, re_path  # noqa: E402

from controlplane.consumers import DashboardConsumer, PlaygroundConsumer  # noqa: E402
from serving.gateway import gateway  # noqa: E402
from serving.metrics_endpoint import metrics_application  # noqa: E402
from serving.proxies import with_client_address  # noqa: E402

websocket_urlpatterns: list[object] = [
    path("ws/dashboard/", DashboardConsumer.as_asgi()),
    re_path(r"^ws/dashboard/(?P<deployment>[a-z0-9-]{1,63})/$", DashboardConsumer.as_asgi()),
    path("ws/playground/", PlaygroundConsumer.as_asgi()),
]


async def http_application(scope: dict, receive: object, send: object) -> None:
    """/v1/* goes to the gateway, which needs none of Django's middleware; /metrics to the
    Prometheus exposition; everything else to Django."""
    path = scope["path"]
    if path.startswith("/v1/"):
        await gateway(scope, receive, send)  # type: ignore[arg-type]
    elif path == "/metrics":
        await metrics_application(scope, receive, send)  # type: ignore[arg-type]
    else:
        await django_application(scope, receive, send)  # type: ignore[arg-type]


application = ProtocolTypeRouter(
    {
        "http": with_client_address(http_application),
        "websocket": with_client_address(AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        )),
    }
)
