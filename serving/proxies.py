"""Who is calling: the client's address, taken from X-Forwarded-For only when the connection
comes from a trusted proxy (TRUSTED_PROXIES).

Without trusted proxies the connection's own address is the client, whatever headers say:
anyone can write X-Forwarded-For. Behind an ingress or load balancer, list its addresses
(or networks): the client is then the right-most address of X-Forwarded-For that is not a
trusted proxy itself, which is the one the nearest trusted hop saw.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any

from serving.hot_settings import hot

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Scope = dict[str, Any]
App = Callable[[Scope, Any, Any], Awaitable[None]]


def parse_networks(values: list[str]) -> tuple[Network, ...]:
    """Addresses or networks (`10.0.0.0/8`, `::1`); a bad entry raises ValueError naming it."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address or network") from None
    return tuple(networks)


@functools.lru_cache(maxsize=4)
def _networks(values: tuple[str, ...]) -> tuple[Network, ...]:
    return parse_networks(list(values))


def _trusted(address: str, networks: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
    return any(ip in network for network in networks)


def client_address(scope: Scope) -> str:
    """The calling client's address as far as it can be trusted."""
    peer = str((scope.get("client") or ("", 0))[0] or "")
    networks = _networks(tuple(hot.TRUSTED_PROXIES))
    if not networks or not _trusted(peer, networks):
        return peer
    hops: list[str] = []
    for name, value in scope.get("headers") or ():
        if name == b"x-forwarded-for":
            hops += [h.strip() for h in value.decode("latin-1").split(",") if h.strip()]
    for hop in reversed(hops):
        try:
            ipaddress.ip_address(hop)
        except ValueError:
            return peer  # not an address: nothing to the left of it can be believed
        if not _trusted(hop, networks):
            return hop
    return hops[0] if hops else peer


def with_client_address(app: App) -> App:
    """An ASGI wrapper that puts the trusted client address into `scope["client"]`, so the
    gateway, Django (REMOTE_ADDR) and the consumers all see the same one."""

    async def wrapped(scope: Scope, receive: Any, send: Any) -> None:
        if scope.get("type") in ("http", "websocket") and hot.TRUSTED_PROXIES:
            address = client_address(scope)
            client = scope.get("client") or ("", 0)
            if address != client[0]:
                scope = {**scope, "client": (address, client[1])}
        await app(scope, receive, send)

    return wrapped
