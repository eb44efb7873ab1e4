"""ASGI entry point: HTTP to Django, WebSockets to the consumers."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_application = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
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
    """/v1/* goes to the gateway, which needs none of Django's middleware (and caps its
    bodies at GATEWAY_MAX_BODY_BYTES itself); /metrics to the Prometheus exposition;
    everything else to Django, its body capped first."""
    path = scope["path"]
    if path.startswith("/v1/"):
        await gateway(scope, receive, send)  # type: ignore[arg-type]
    elif path == "/metrics":
        await metrics_application(scope, receive, send)  # type: ignore[arg-type]
    else:
        await capped_body(django_application, scope, receive, send)  # type: ignore[arg-type]


async def capped_body(app: Any, scope: dict[str, Any],
                      receive: Callable[[], Awaitable[dict[str, Any]]],
                      send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
    """Refuse a body over HTTP_MAX_BODY_BYTES with 413 before the application reads any of
    it: a declared length is checked at once, a chunked body as it arrives (it is held
    here, as Django would hold it, and handed on once complete)."""
    limit = settings.HTTP_MAX_BODY_BYTES
    declared = next((v for k, v in scope.get("headers") or () if k == b"content-length"),
                    None)
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        await too_large(send, limit)
        return
    messages: list[dict[str, Any]] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if size > limit:
            await too_large(send, limit)
            return
        if not message.get("more_body"):
            break

    async def replay() -> dict[str, Any]:
        return messages.pop(0) if messages else await receive()

    await app(scope, replay, send)


async def too_large(send: Callable[[dict[str, Any]], Awaitable[None]], limit: int) -> None:
    body = orjson.dumps({"detail": f"request body over the limit of {limit} bytes "
                                   f"(HTTP_MAX_BODY_BYTES)", "code": "request_too_large"})
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


application = ProtocolTypeRouter(
    {
        "http": with_client_address(http_application),
        "websocket": with_client_address(AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
        )),
    }
)
