from __future__ import annotations

from collections import Counter

from serving.router import Router
from serving.routes import DeploymentRoutes, RouteReplica


def pool(policy: str, count: int = 3) -> DeploymentRoutes:
    return DeploymentRoutes(deployment="demo", served_model_name="demo", policy=policy,
                max_model_len=2048,
                replicas=tuple(RouteReplica(f"demo-{i}", f"http://127.0.0.1:{9000 + i}")
                               for i in range(1, count + 1)))


def test_least_load_picks_the_replica_with_the_fewest_outstanding_requests() -> None:
    router = Router()
    router.state("demo-1").in_flight = 3
    router.state("demo-2").scraped = 1
    router.state("demo-3").in_flight = 1
    router.state("demo-3").scraped = 2
    chosen = router.choose(pool("least-load"))
    assert chosen is not None and chosen.name == "demo-2"


def test_least_load_shares_ties_round_the_pool() -> None:
    router = Router()
    names = [router.choose(pool("least-load")).name for _ in range(6)]  # type: ignore[union-attr]
    assert Counter(names) == {"demo-1": 2, "demo-2": 2, "demo-3": 2}


def test_round_robin_cycles() -> None:
    router = Router()
    names = [router.choose(pool("round-robin")).name for _ in range(4)]  # type: ignore[union-attr]
    assert names == ["demo-1", "demo-2", "demo-3", "demo-1"]


def test_a_session_sticks_to_one_replica() -> None:
    router = Router()
    first = router.choose(pool("session"), session="alice")
    assert all(router.choose(pool("session"), session="alice") == first for _ in range(10))


def test_sessions_spread_over_the_replicas() -> None:
    router = Router()
    owners = {router.choose(pool("session"), session=f"user-{n}").name  # type: ignore[union-attr]
              for n in range(50)}
    assert owners == {"demo-1", "demo-2", "demo-3"}


def test_a_session_leaves_an_overloaded_replica() -> None:
    router = Router()
    home = router.choose(pool("session"), session="alice")
    assert home is not None
    router.state(home.name).in_flight = 20
    moved = router.choose(pool("session"), session="alice")
    assert moved is not None and moved.name != home.name


def test_a_shared_prefix_goes_to_the_same_replica() -> None:
    router = Router()
    prompt = "You are a helpful assistant. " * 20
    first = router.choose(pool("prefix"), prefix=prompt + "question one")
    assert router.choose(pool("prefix"), prefix=prompt + "question two") == first


def test_a_hot_prefix_spills_over_within_the_load_bound() -> None:
    router = Router()
    prompt = "system prompt " * 40
    chosen = []
    for _ in range(30):
        replica = router.choose(pool("prefix"), prefix=prompt)
        assert replica is not None
        router.state(replica.name).in_flight += 1
        chosen.append(replica.name)
    loads = Counter(chosen)
    assert len(loads) == 3
    assert max(loads.values()) <= 13  # ceil(1.25 x 30 / 3) + 1


def test_a_failed_replica_sits_out_and_comes_back_after_success() -> None:
    router = Router()
    router.failed("demo-1")
    names = {router.choose(pool("round-robin")).name for _ in range(6)}  # type: ignore[union-attr]
    assert names == {"demo-2", "demo-3"}
    router.succeeded("demo-1")
    names = {router.choose(pool("round-robin")).name for _ in range(6)}  # type: ignore[union-attr]
    assert "demo-1" in names


def test_no_healthy_replica_means_no_choice() -> None:
    router = Router()
    single = pool("least-load", count=1)
    router.failed("demo-1")
    assert router.choose(single) is None
