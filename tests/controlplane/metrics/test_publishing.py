"""The fleet socket's messages (controlplane/metrics/publishing.py): the busiest
deployments whole, then what changed, small however large the fleet."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from controlplane.metrics.publishing import FLEET_ROWS, SNAPSHOT_EVERY, FleetView


def summary(name: str, requests: float = 0.0, **figures: Any) -> dict[str, Any]:
    return {"name": name, "ready": 1, "desired": 1, "standby": 0, "window_seconds": 30.0,
            "requests_per_s": requests, "in_flight": 0, "queued": 0, "queue_wait_s": 0,
            "tokens_per_s": 0.0, "waiting": 0, "running": 0, "kv_cache": 0.01,
            "ttft_p50": None, "ttft_p95": None, "error_rate": 0.0, "scrape_failures": 0,
            **figures}


def fleet(summaries: list[dict[str, Any]], t: float = 1.0) -> dict[str, Any]:
    return {"type": "fleet", "t": t, "deployments": summaries}


def size(message: dict[str, Any]) -> int:
    return len(orjson.dumps(message))


THOUSAND = [summary(f"d-{i:04d}", requests=float(i % 7)) for i in range(1000)]


def test_the_first_message_is_the_busiest_deployments_with_totals_of_all() -> None:
    view = FleetView()
    first = view.next_message(fleet(THOUSAND))
    assert first["type"] == "fleet" and first["seq"] == 1
    assert len(first["deployments"]) == FLEET_ROWS and first["total"] == 1000
    assert {d["requests_per_s"] for d in first["deployments"]} == {6.0}
    assert first["totals"]["deployments"] == 1000 and first["totals"]["ready"] == 1000
    assert first["totals"]["requests_per_s"] == sum(i % 7 for i in range(1000))
    assert size(first) < 30_000


def test_a_pass_that_changed_nothing_sends_no_rows() -> None:
    view = FleetView()
    view.next_message(fleet(THOUSAND))
    second = view.next_message(fleet(THOUSAND, t=3.0))
    assert second["type"] == "fleet.delta" and second["seq"] == 2
    assert second["changed"] == [] and second["removed"] == []
    assert size(second) < 1000


def test_a_delta_holds_the_rows_that_changed_and_those_that_left_the_view() -> None:
    view = FleetView(rows=3)
    view.next_message(fleet([summary("a", 3), summary("b", 2), summary("c", 1),
                             summary("d", 0)]))
    delta = view.next_message(fleet([summary("a", 3, waiting=4), summary("b", 2),
                                     summary("d", 5)]))
    assert [d["name"] for d in delta["changed"]] == ["d", "a"]  # d rose into the view
    assert delta["removed"] == ["c"]  # c is gone (and would have left the view anyway)
    assert delta["total"] == 3 and delta["totals"]["requests_per_s"] == 10


def test_the_whole_view_is_sent_again_every_so_many_passes() -> None:
    view = FleetView()
    kinds = [view.next_message(fleet(THOUSAND))["type"] for _ in range(SNAPSHOT_EVERY + 1)]
    assert kinds[0] == kinds[-1] == "fleet"
    assert set(kinds[1:-1]) == {"fleet.delta"}
    assert orjson.loads(view.snapshot_text or "{}")["seq"] == SNAPSHOT_EVERY + 1


def count_group_sends(layer: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The groups `layer` is asked to send to, in order, from now on."""
    sent: list[str] = []
    real_send = layer.group_send

    async def counting(group: str, message: dict[str, Any]) -> None:
        sent.append(group)
        await real_send(group, message)

    monkeypatch.setattr(layer, "group_send", counting)
    return sent


def one_update(name: str) -> dict[str, Any]:
    return {"type": "update", "deployment": name, "summary": summary(name)}


async def test_a_deployment_update_goes_only_to_a_dashboard_that_is_open(
        monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    """A thousand deployments, one dashboard open: that deployment's socket gets its
    update, the other groups are not sent to (the in-process layer)."""
    from channels.layers import InMemoryChannelLayer, get_channel_layer

    from controlplane.metrics import publishing

    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.REDIS_URL = ""
    monkeypatch.setattr(publishing, "fleet_view", FleetView())
    layer = get_channel_layer()
    assert isinstance(layer, InMemoryChannelLayer)
    watcher = await layer.new_channel()
    await layer.group_add(publishing.deployment_group("d-0500"), watcher)
    sent = count_group_sends(layer, monkeypatch)
    await publishing.publish(fleet(THOUSAND), {s["name"]: one_update(s["name"])
                                               for s in THOUSAND})
    assert sent == [publishing.FLEET_GROUP, publishing.deployment_group("d-0500")]
    received = await layer.receive(watcher)
    assert orjson.loads(received["text"])["deployment"] == "d-0500"


@pytest.mark.parametrize("open_names", [["d-0007"], ["d-0007", "d-0993"], []])
async def test_over_redis_only_the_watched_groups_are_sent_their_update(
        monkeypatch: pytest.MonkeyPatch, settings: Any, open_names: list[str]) -> None:
    """The Redis layer, as with scale-out: sockets in other processes, their group
    membership in Redis; one pipelined look-up tells which groups to send to."""
    import redis
    from channels.layers import channel_layers

    from controlplane.metrics import publishing

    url = "redis://127.0.0.1:6379/14"  # a database no other test uses
    redis.Redis.from_url(url).flushdb()
    settings.CHANNEL_LAYERS = {"default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [url]}}}
    settings.REDIS_URL = url
    monkeypatch.setattr(publishing, "fleet_view", FleetView())
    layer = channel_layers["default"]
    channels = {}
    for name in open_names:
        channels[name] = await layer.new_channel()
        await layer.group_add(publishing.deployment_group(name), channels[name])
    sent = count_group_sends(layer, monkeypatch)
    try:
        await publishing.publish(fleet(THOUSAND), {s["name"]: one_update(s["name"])
                                                   for s in THOUSAND})
        assert sorted(sent) == sorted([publishing.FLEET_GROUP,
                                       *(publishing.deployment_group(n) for n in open_names)])
        for name, channel in channels.items():
            received = await layer.receive(channel)
            assert orjson.loads(received["text"])["deployment"] == name
    finally:
        await layer.flush()
        await layer.close_pools()
