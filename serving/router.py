"""Router policies: which ready replica of a deployment takes a request.

- least-load (default): fewest outstanding requests: the gateway's own in-flight requests
  to the replica plus the rest of its scraped vllm:num_requests_running and
  num_requests_waiting (the engine's count less this process's own requests);
- round-robin: the baseline;
- session: the same `user` field or X-Session-Id goes to the same replica (rendezvous
  hashing) while it is healthy and not overloaded;
- prefix: requests that share a prompt prefix go to the replica that likely has it cached,
  by consistent hashing with bounded load, so a hot prefix cannot overload one replica.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from serving.routes import DeploymentRoutes, RouteReplica

POLICIES = ("least-load", "round-robin", "session", "prefix")
# A replica takes an affinity request only while its load stays within this factor of the
# pool's average (plus one): the "bounded load" of consistent hashing.
LOAD_BOUND = 1.25
VIRTUAL_NODES = 64
PREFIX_CHARS = 256
UNHEALTHY_SECONDS = 5.0


def stable_hash(text: str) -> int:
    """A hash that is the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@dataclass
class ReplicaState:
    """One replica's load and health as this process sees them."""

    in_flight: int = 0
    scraped: int = 0  # vLLM's running + waiting, from its /metrics, less our own in_flight
    unhealthy_until: float = 0.0
    failures: int = 0


@dataclass
class Router:
    """Each replica's load and health in this process, and the policies that use them."""

    states: dict[str, ReplicaState] = field(default_factory=dict)
    round_robin: dict[str, int] = field(default_factory=dict)
    rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = field(default_factory=dict)

    def state(self, replica: str) -> ReplicaState:
        """The replica's state, made on first use."""
        state = self.states.get(replica)
        if state is None:
            state = self.states[replica] = ReplicaState()
        return state

    def load(self, replica: str) -> int:
        """Outstanding requests: the gateway's own in flight plus the engine's queue."""
        state = self.state(replica)
        return state.in_flight + state.scraped

    def healthy(self, routes: DeploymentRoutes,
                exclude: Sequence[str] = ()) -> list[RouteReplica]:
        """The replicas not sitting out after a failure, less `exclude`."""
        now = time.monotonic()
        return [r for r in routes.replicas
                if r.name not in exclude and self.state(r.name).unhealthy_until <= now]

    def choose(self, routes: DeploymentRoutes, *, session: str | None = None,
               prefix: str | None = None, exclude: Sequence[str] = ()
               ) -> RouteReplica | None:
        """The replica the deployment's policy picks, or None when none is healthy."""
        candidates = self.healthy(routes, exclude)
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0]
        if routes.policy == "round-robin":
            index = self.round_robin.get(routes.deployment, 0)
            self.round_robin[routes.deployment] = index + 1
            return candidates[index % len(candidates)]
        if routes.policy == "session" and session:
            return self.bounded(candidates, self.rendezvous(candidates, session))
        if routes.policy == "prefix" and prefix:
            return self.bounded(candidates, self.ring_order(candidates, prefix[:PREFIX_CHARS]))
        return self.least_loaded(candidates)

    def least_loaded(self, candidates: list[RouteReplica]) -> RouteReplica:
        # Ties go round the pool so equal replicas share the load.
        """The replica with the fewest outstanding requests."""
        best = min(self.load(r.name) for r in candidates)
        tied = [r for r in candidates if self.load(r.name) == best]
        key = ",".join(r.name for r in tied)
        index = self.round_robin.get(key, 0)
        self.round_robin[key] = index + 1
        return tied[index % len(tied)]

    def bounded(self, candidates: list[RouteReplica],
                preference: list[RouteReplica]) -> RouteReplica:
        """The first preferred replica within the load bound, else the least loaded."""
        total = sum(self.load(r.name) for r in candidates) + 1  # this request included
        bound = math.ceil(LOAD_BOUND * total / len(candidates))
        for replica in preference:
            if self.load(replica.name) + 1 <= bound:
                return replica
        return self.least_loaded(candidates)

    @staticmethod
    def rendezvous(candidates: list[RouteReplica], key: str) -> list[RouteReplica]:
        """The replicas in the rendezvous-hashing order of `key`."""
        return sorted(candidates, key=lambda r: stable_hash(f"{r.name}|{key}"), reverse=True)

    def ring_order(self, candidates: list[RouteReplica], key: str) -> list[RouteReplica]:
        """The replicas in consistent-hash ring order from `key`."""
        names = tuple(sorted(r.name for r in candidates))
        ring = self.rings.get(names)
        if ring is None:
            points = sorted((stable_hash(f"{name}#{v}"), name) for name in names
                            for v in range(VIRTUAL_NODES))
            ring = ([p for p, _ in points], [n for _, n in points])
            self.rings = {names: ring}  # only the current membership is worth keeping
        hashes, owners = ring
        start = bisect.bisect(hashes, stable_hash(key)) % len(hashes)
        order: list[str] = []
        for step in range(len(hashes)):
            owner = owners[(start + step) % len(hashes)]
            if owner not in order:
                order.append(owner)
                if len(order) == len(names):
                    break
        by_name = {r.name: r for r in candidates}
        return [by_name[name] for name in order]

    # --- health ----------------------------------------------------------------------

    def failed(self, replica: str) -> None:
        """Passive health: a replica that failed a request sits out, longer each time."""
        state = self.state(replica)
        state.failures += 1
        state.unhealthy_until = time.monotonic() + UNHEALTHY_SECONDS * min(
            2 ** (state.failures - 1), 12)

    def succeeded(self, replica: str) -> None:
        """A replica that answered is taken back in at once."""
        state = self.state(replica)
        if state.failures:
            state.failures = 0
            state.unhealthy_until = 0.0

    def forget_missing(self, present: set[str]) -> None:
        """Drop the state of replicas no longer in the route table."""
        for name in list(self.states):
            if name not in present:
                del self.states[name]
