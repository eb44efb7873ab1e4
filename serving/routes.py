"""The route table: the contract between the controller and the gateway.

The controller publishes, after each reconcile pass, which replicas of which deployment
may take traffic; the gateway reads it and never touches the database for it. In one
process the table is handed over in memory; where the gateway runs in other processes
(REDIS_URL set), the controller also writes it to Redis and gateways poll it.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

REDIS_KEY = "fleetplane:routes"


@dataclass(frozen=True)
class RouteReplica:
    name: str
    url: str  # the OpenAI base URL without /v1


@dataclass(frozen=True)
class Pool:
    deployment: str
    served_model_name: str
    policy: str
    max_model_len: int | None
    replicas: tuple[RouteReplica, ...]
    #: True when the deployment exists but is stopped or has no ready replica.
    names: tuple[str, ...] = ()


@dataclass
class RouteTable:
    version: int = 0
    pools: dict[str, Pool] = field(default_factory=dict)  # by every name a client may use

    def pool_for(self, model: str) -> Pool | None:
        return self.pools.get(model)

    def model_names(self) -> list[str]:
        return sorted({pool.served_model_name for pool in self.pools.values()})

    def to_json(self) -> str:
        pools = {}
        for pool in {p.deployment: p for p in self.pools.values()}.values():
            pools[pool.deployment] = asdict(pool)
        return json.dumps({"version": self.version, "pools": pools}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RouteTable:
        data = json.loads(text)
        table = cls(version=int(data.get("version", 0)))
        for raw in data.get("pools", {}).values():
            pool = pool_from_dict(raw)
            for name in pool.names or (pool.served_model_name,):
                table.pools[name] = pool
        return table


def pool_from_dict(raw: dict[str, Any]) -> Pool:
    return Pool(deployment=raw["deployment"], served_model_name=raw["served_model_name"],
                policy=raw.get("policy", "least-load"), max_model_len=raw.get("max_model_len"),
                replicas=tuple(RouteReplica(**r) for r in raw.get("replicas", [])),
                names=tuple(raw.get("names", ())))


def build_table(pools: list[Pool], version: int) -> RouteTable:
    table = RouteTable(version=version)
    for pool in pools:
        for name in pool.names or (pool.served_model_name,):
            table.pools[name] = pool
    return table


class RouteStore:
    """Holds the current table for this process; publishes to Redis when configured."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table = RouteTable()
        self._published = ""
        #: True once a controller in this process has published a table.
        self.publishes_locally = False

    @property
    def table(self) -> RouteTable:
        return self._table

    def publish(self, table: RouteTable, redis_url: str | None = None) -> bool:
        """Replace the table if it changed; returns whether it did."""
        text = json.dumps({k: asdict(v) for k, v in sorted(table.pools.items())},
                          sort_keys=True)
        with self._lock:
            if text == self._published:
                return False
            table.version = self._table.version + 1
            self._table = table
            self._published = text
            self.publishes_locally = True
        if redis_url:
            try:
                import redis

                redis.Redis.from_url(redis_url).set(REDIS_KEY, table.to_json())
            except Exception:
                logger.exception("could not publish the route table to Redis")
        return True

    def load_json(self, text: str) -> None:
        table = RouteTable.from_json(text)
        with self._lock:
            if table.version != self._table.version:
                self._table = table


routes = RouteStore()
