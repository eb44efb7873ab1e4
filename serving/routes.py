"""The route table: the contract between the controller and the gateway.

The controller publishes, after each reconcile pass, which replicas of which deployment
may take traffic; the gateway reads it and never touches the database for it. In one
process the table is handed over in memory; where the gateway runs in other processes
(REDIS_URL set), the controller also writes it to Redis and gateways poll it.

Each replica carries the key the gateway must send it (`Authorization: Bearer`): the
deployment's engine key, or an external endpoint's own api key. In Redis every such key
is sealed (serving/sealing.py, a key derived from SECRET_KEY, which all processes of one
install share): whoever can read Redis learns the topology, not a way past the gateway.
The keys travel with the table rather than being fetched apart because the table is
already the one thing a gateway reads to reach a replica; a second channel would be a
second thing to keep in step on every change.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from serving.sealing import SealError, seal, unseal

logger = logging.getLogger(__name__)

REDIS_KEY = "fleetplane:routes"


@dataclass(frozen=True)
class RouteReplica:
    """One replica a deployment's traffic may go to."""

    name: str
    url: str  # the OpenAI base URL without /v1
    #: Sent as `Authorization: Bearer`; "" sends none. Kept out of repr (logs, tracebacks).
    key: str = field(default="", repr=False)


def replica_auth(replica: RouteReplica) -> tuple[tuple[str, str], ...]:
    """The header a request to this replica carries so the replica takes it."""
    return (("Authorization", f"Bearer {replica.key}"),) if replica.key else ()


@dataclass(frozen=True)
class DeploymentRoutes:
    """A deployment's routes: the replicas that take its traffic and how to choose one."""

    deployment: str
    served_model_name: str
    policy: str
    max_model_len: int | None
    #: The ready, active replicas; empty while the deployment is stopped or starting.
    replicas: tuple[RouteReplica, ...]
    #: Every model name a client may use for this deployment.
    names: tuple[str, ...] = ()
    #: The autoscaler brings a replica up for a request that finds none (scale from zero):
    #: such a request waits at the gateway (serving/demand.py) instead of failing.
    wakes: bool = False
    #: Requests one replica takes at once; more wait in the gateway's priority queue.
    replica_concurrency: int = 256
    #: The engine runs with scheduling_policy=priority: the request's level is passed on.
    priority_scheduling: bool = False
    #: Context pools: prompts of at least this many (estimated) tokens go to the
    #: `long_replicas`, shorter ones to the others.
    long_prompt_tokens: int | None = None
    long_replicas: tuple[str, ...] = ()
    #: What the model does: "generate" (chat and completions) or "embed" (embeddings).
    task: str = "generate"
    #: The replicas are vLLM servers, which report the usage so far on every streamed
    #: chunk when asked (`continuous_usage_stats`): a stream the client leaves is then
    #: recorded with exactly the tokens relayed. Off for external endpoints, which may
    #: refuse the option.
    running_usage: bool = False

    def context_pools(self) -> dict[str, tuple[RouteReplica, ...]]:
        """The replicas of each context pool: "short" and "long", or one "all"."""
        if not self.long_prompt_tokens:
            return {"all": self.replicas}
        long = tuple(r for r in self.replicas if r.name in self.long_replicas)
        short = tuple(r for r in self.replicas if r.name not in self.long_replicas)
        return {"short": short, "long": long}

    def context_pool_for(self, prompt_tokens: int) -> str:
        """Which context pool a prompt of this size goes to (a pool with no replica hands
        its requests to the other)."""
        if not self.long_prompt_tokens:
            return "all"
        pools = self.context_pools()
        wanted = "long" if prompt_tokens >= self.long_prompt_tokens else "short"
        other = "short" if wanted == "long" else "long"
        return wanted if pools[wanted] or not pools[other] else other

    def narrowed_to(self, context_pool: str) -> DeploymentRoutes:
        """The same routes with only the replicas of one context pool."""
        if context_pool == "all":
            return self
        return replace(self, replicas=self.context_pools()[context_pool])


@dataclass
class RouteTable:
    """Every model name a client may use, with the routes of its deployment."""

    #: By every name a client may use (a deployment appears once per name).
    pools: dict[str, DeploymentRoutes] = field(default_factory=dict)

    def routes_for(self, model: str) -> DeploymentRoutes | None:
        """The routes of the deployment this model name means, if any."""
        return self.pools.get(model)

    def deployments(self) -> list[DeploymentRoutes]:
        """Each deployment's routes once, in the table's order."""
        return list({r.deployment: r for r in self.pools.values()}.values())

    def deployment(self, name: str) -> DeploymentRoutes | None:
        """The routes of the deployment named `name` (not a model name), if it serves."""
        return next((r for r in self.pools.values() if r.deployment == name), None)


    def to_json(self, *, sealed: bool = True) -> str:
        """One entry per deployment, in a stable order. Replica keys are sealed (the text
        for Redis: equal tables then give different text, as sealing is randomised);
        `sealed=False` gives the plain text, which never leaves the process's memory."""
        pools = {pool.deployment: asdict(pool) for pool in self.pools.values()}
        if sealed:
            for raw in pools.values():
                for replica in raw["replicas"]:
                    replica["key"] = seal(replica["key"])
        return json.dumps(pools, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RouteTable:
        """A table `to_json()` wrote (keys sealed)."""
        return build_table([pool_from_dict(raw) for raw in json.loads(text).values()])


def pool_from_dict(raw: dict[str, Any]) -> DeploymentRoutes:
    """A deployment's routes as `RouteTable.to_json` wrote them (keys sealed)."""
    return DeploymentRoutes(
        deployment=raw["deployment"], served_model_name=raw["served_model_name"],
        policy=raw.get("policy", "least-load"), max_model_len=raw.get("max_model_len"),
        replicas=tuple(RouteReplica(name=r["name"], url=r["url"],
                                    key=unseal(r.get("key") or ""))
                       for r in raw.get("replicas", [])),
        names=tuple(raw.get("names", ())), wakes=bool(raw.get("wakes", False)),
        replica_concurrency=int(raw.get("replica_concurrency") or 256),
        priority_scheduling=bool(raw.get("priority_scheduling", False)),
        long_prompt_tokens=raw.get("long_prompt_tokens"),
        long_replicas=tuple(raw.get("long_replicas", ())),
        task=str(raw.get("task") or "generate"),
        running_usage=bool(raw.get("running_usage", False)))


def build_table(pools: list[DeploymentRoutes]) -> RouteTable:
    """The table of these deployments, under every name a client may use for each."""
    table = RouteTable()
    for pool in pools:
        for name in pool.names or (pool.served_model_name,):
            table.pools[name] = pool
    return table


class RouteStore:
    """Holds the current table for this process; publishes to Redis when configured."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table = RouteTable()
        self._seen = ""  # the last text taken from another process (sealed)
        #: True once a controller in this process has published a table.
        self.publishes_locally = False
        self._redis_behind = False  # the last write to Redis failed

    @property
    def table(self) -> RouteTable:
        """The current table (replaced whole, never changed in place)."""
        return self._table

    def publish(self, table: RouteTable, redis_url: str | None = None) -> bool:
        """Replace the table if it changed; returns whether it did. With `redis_url`, the
        table is also written to Redis when it changed, when the last write failed, and
        when Redis lost it (a restart without persistence): each call, made after every
        reconcile pass, puts Redis right once it answers."""
        with self._lock:
            self.publishes_locally = True
            # Compared as values (frozen dataclasses): a table of 1,000 deployments
            # written out as JSON to be compared cost more than building it.
            changed = table.pools != self._table.pools
            if changed:
                self._table = table
        if redis_url:
            self._write_to_redis(table, redis_url, changed)
        return changed

    @property
    def redis_behind(self) -> bool:
        """The last write of the table to Redis failed (the next pass tries again)."""
        return self._redis_behind

    def keep_in_redis(self, redis_url: str | None) -> None:
        """Between rebuilds: put the current table back in Redis when it lost it or the
        last write failed (one EXISTS when all is well)."""
        if redis_url and self.publishes_locally:
            self._write_to_redis(self._table, redis_url, False)

    def _write_to_redis(self, table: RouteTable, redis_url: str, changed: bool) -> None:
        from serving.redis_clients import shared

        try:
            client = shared(redis_url)
            if changed or self._redis_behind or not client.exists(REDIS_KEY):
                client.set(REDIS_KEY, table.to_json())
        except Exception as exc:
            if not self._redis_behind:
                logger.warning("could not publish the route table to Redis (%s); gateways "
                               "in other processes keep the last one until it answers", exc)
            self._redis_behind = True
            return
        if self._redis_behind:
            logger.warning("the route table is published to Redis again")
        self._redis_behind = False

    def load_json(self, text: str) -> None:
        """Take a table another process published, when it differs from the current one."""
        if text == self._seen:
            return
        try:
            table = RouteTable.from_json(text)
        except SealError:
            # Another install's table (a different SECRET_KEY) in a shared Redis: keep ours.
            logger.error("the route table in Redis was sealed with another SECRET_KEY; "
                         "ignored")
            self._seen = text
            return
        with self._lock:
            self._table, self._seen = table, text


routes = RouteStore()
