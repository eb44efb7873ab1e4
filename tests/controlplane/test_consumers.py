"""The WebSocket consumers through Channels' test communicator, against FAKE engines
(fakes/engine.py) behind the gateway's route table: who may connect, what bad frames get
back, the playground's streaming, Stop, and the cleanup when a socket closes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from asgiref.sync import sync_to_async
from asgiref.testing import ApplicationCommunicator
from channels.routing import URLRouter
from django.contrib.auth.models import AnonymousUser, Group, User
from django.db import connection

from controlplane.asgi import websocket_urlpatterns
from serving.models import UsageRecord
from serving.routes import build_table, routes
from tests.engines import FakeEngine, publish

pytestmark = pytest.mark.django_db(transaction=True)

application = URLRouter(websocket_urlpatterns)


class WebsocketCommunicator(ApplicationCommunicator):
    """A WebSocket client speaking ASGI to the application in this process (what
    channels.testing offers, without its dependency on another server)."""

    def __init__(self, app: Any, path: str) -> None:
        super().__init__(app, {"type": "websocket", "path": path,
                               "raw_path": path.encode(), "query_string": b"",
                               "headers": [], "subprotocols": []})

    async def connect(self, timeout: float = 5) -> tuple[bool, int | None]:
        await self.send_input({"type": "websocket.connect"})
        answer = await self.receive_output(timeout)
        if answer["type"] == "websocket.close":
            return False, answer.get("code", 1000)
        return True, None

    async def send_to(self, text_data: str | None = None,
                      bytes_data: bytes | None = None) -> None:
        message: dict[str, Any] = {"type": "websocket.receive"}
        if text_data is not None:
            message["text"] = text_data
        else:
            message["bytes"] = bytes_data
        await self.send_input(message)

    async def receive_from(self, timeout: float = 5) -> str:
        answer = await self.receive_output(timeout)
        assert answer["type"] == "websocket.send", answer
        return str(answer.get("text"))

    async def disconnect(self, code: int = 1000, timeout: float = 5) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": code})
        await self.wait(timeout)


@pytest.fixture(autouse=True)
def empty_route_table() -> Iterator[None]:
    routes.publish(build_table([]))
    yield
    routes.publish(build_table([]))


@pytest.fixture(autouse=True)
def socket_settings(settings: Any) -> None:
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.WEBSOCKET_MESSAGES_PER_SECOND = 50
    settings.USAGE_FLUSH_SECONDS = 0.1


async def make_user(name: str = "ada", *, staff: bool = True,
                    role: str | None = None) -> User:
    def create() -> User:
        user = User.objects.create_user(name, password="pw", is_staff=staff)
        if role:
            # get_or_create: a transactional test's flush empties the migration's groups
            user.groups.add(Group.objects.get_or_create(name=role)[0])
            user = User.objects.get(pk=user.pk)
        return user

    return await sync_to_async(create)()


async def connect(path: str, user: Any) -> tuple[WebsocketCommunicator, bool, int | None]:
    communicator = WebsocketCommunicator(application, path)
    communicator.scope["user"] = user
    connected, code = await communicator.connect()
    return communicator, connected, code


async def send(communicator: WebsocketCommunicator, message: Any) -> None:
    await communicator.send_to(text_data=orjson.dumps(message).decode())


async def receive(communicator: WebsocketCommunicator, timeout: float = 10) -> dict[str, Any]:
    return orjson.loads(await communicator.receive_from(timeout=timeout))


async def receive_until(communicator: WebsocketCommunicator, kind: str,
                        timeout: float = 20) -> list[dict[str, Any]]:
    seen = []
    while True:
        message = await receive(communicator, timeout)
        seen.append(message)
        if message["type"] in (kind, "error"):
            return seen


async def test_each_socket_checks_the_role() -> None:
    _, connected, code = await connect("/ws/playground/", AnonymousUser())
    assert not connected and code == 4401
    _, connected, code = await connect("/ws/dashboard/", await make_user("bo", staff=False))
    assert not connected and code == 4403  # logged in, no role
    viewer = await make_user("cy", staff=False, role="viewer")
    communicator, connected, _ = await connect("/ws/dashboard/", viewer)
    assert connected
    await communicator.disconnect()
    _, connected, code = await connect("/ws/playground/", viewer)
    assert not connected and code == 4403  # the playground runs inference: operator
    operator = await make_user("di", staff=False, role="operator")
    communicator, connected, _ = await connect("/ws/playground/", operator)
    assert connected
    await communicator.disconnect()


async def test_bad_frames_get_an_error_and_the_socket_stays_usable(settings: Any) -> None:
    settings.WEBSOCKET_MAX_MESSAGE_BYTES = 2048
    communicator, connected, _ = await connect("/ws/playground/", await make_user())
    assert connected
    await communicator.send_to(text_data="{not json")
    assert (await receive(communicator))["message"].startswith("not JSON")
    await communicator.send_to(text_data="[1, 2]")
    assert "JSON object" in (await receive(communicator))["message"]
    await communicator.send_to(bytes_data=b"\x00\x01")
    assert "text frames" in (await receive(communicator))["message"]
    await send(communicator, {"type": "generate", "messages": [{"role": "user",
                                                                "content": "x" * 4000}]})
    assert "over the limit of 2048 bytes" in (await receive(communicator))["message"]
    await send(communicator, {"type": "dance"})
    assert "unknown message type" in (await receive(communicator))["message"]
    await send(communicator, {"type": "ping"})
    assert await receive(communicator) == {"type": "pong"}
    await communicator.disconnect()


async def test_frames_sent_too_fast_are_refused_then_allowed_again(settings: Any) -> None:
    settings.WEBSOCKET_MESSAGES_PER_SECOND = 2  # a burst of 4, then 2 per second
    communicator, _, _ = await connect("/ws/playground/", await make_user())
    answers = []
    for _ in range(6):
        await send(communicator, {"type": "ping"})
        answers.append(await receive(communicator))
    assert answers[:4] == [{"type": "pong"}] * 4
    assert all("too many messages" in a["message"] for a in answers[4:])
    await asyncio.sleep(0.6)  # the behaviour under test: the budget refills with time
    await send(communicator, {"type": "ping"})
    assert await receive(communicator) == {"type": "pong"}
    await communicator.disconnect()


async def test_bad_generation_requests_are_named(
        fake_engines: Callable[..., FakeEngine]) -> None:
    publish("demo", [fake_engines("e1")])
    communicator, _, _ = await connect("/ws/playground/", await make_user())
    cases: list[tuple[dict[str, Any], str]] = [
        ({"deployment": "nope", "messages": [{"role": "user", "content": "hi"}]},
         "no deployment named 'nope'"),
        ({"deployment": "demo", "messages": [{"role": "user", "content": "  "}]},
         "the prompt is empty"),
        ({"deployment": "demo", "messages": []}, "`messages` must be a non-empty list"),
        ({"deployment": "demo", "messages": [{"role": "user", "content": "hi"}],
          "max_tokens": 0}, "`max_tokens` must be a number from 1 to 2048"),
        ({"deployment": "demo", "messages": [{"role": "user", "content": "hi"}],
          "temperature": 9}, "`temperature` must be a number from 0 to 2"),
        ({"deployment": "demo", "messages": [{"role": "user", "content": "hi"}],
          "seed": "x"}, "`seed` must be a whole number"),
    ]
    for fields, expected in cases:
        await send(communicator, {"type": "generate", "id": "a", **fields})
        message = await receive(communicator)
        assert message["type"] == "error" and expected in message["message"], message
    await communicator.disconnect()


async def test_an_oversized_prompt_is_refused(settings: Any,
                                              fake_engines: Callable[..., FakeEngine]) -> None:
    settings.PLAYGROUND_MAX_PROMPT_CHARS = 100
    publish("demo", [fake_engines("e1")])
    communicator, _, _ = await connect("/ws/playground/", await make_user())
    await send(communicator, {"type": "generate", "deployment": "demo",
                              "messages": [{"role": "user", "content": "y" * 101}]})
    message = await receive(communicator)
    assert "over the limit of 100" in message["message"]
    await communicator.disconnect()


async def test_an_answer_streams_token_by_token_with_its_figures(
        fake_engines: Callable[..., FakeEngine]) -> None:
    publish("demo", [fake_engines("e1", interval_ms=5)])
    communicator, _, _ = await connect("/ws/playground/", await make_user())
    await send(communicator, {"type": "generate", "id": "a", "deployment": "demo",
                              "system": "Be brief.", "max_tokens": 12, "seed": 3,
                              "messages": [{"role": "user", "content": "Count."}]})
    seen = await receive_until(communicator, "done")
    assert seen[0]["type"] == "started" and seen[0]["replica"] == "e1"
    tokens = [m for m in seen if m["type"] == "token"]
    assert len(tokens) >= 6  # paced tokens arrive as separate messages
    assert "".join(t["text"] for t in tokens) == " tok" * 12
    stats = seen[-1]["stats"]
    assert stats["completion_tokens"] == 12 and stats["prompt_tokens"] == 5
    assert stats["ttft_ms"] > 0 and stats["tokens_per_s"] > 0
    async with asyncio.timeout(10):  # the usage writer's batch, written off the path
        while not await sync_to_async(UsageRecord.objects.exists)():
            await asyncio.sleep(0.05)
    record = await sync_to_async(UsageRecord.objects.get)()
    assert record.username == "ada" and record.key_id is None and record.deployment == "demo"
    assert record.completion_tokens == 12 and record.status == 200
    await communicator.disconnect()


async def test_the_playground_reaches_a_replica_that_demands_its_key(
        fake_engines: Callable[..., FakeEngine]) -> None:
    engine = fake_engines("e1", key="the-engine-key")
    publish("demo", [engine])
    communicator, _, _ = await connect("/ws/playground/", await make_user())
    await send(communicator, {"type": "generate", "id": "a", "deployment": "demo",
                              "max_tokens": 3,
                              "messages": [{"role": "user", "content": "Count."}]})
    seen = await receive_until(communicator, "done")
    assert "".join(m["text"] for m in seen if m["type"] == "token") == " tok" * 3
    await communicator.disconnect()


async def test_side_by_side_runs_two_deployments_at_once(
        fake_engines: Callable[..., FakeEngine]) -> None:
    from serving.routes import DeploymentRoutes, RouteReplica

    left, right = fake_engines("l1", interval_ms=5), fake_engines("r1", model="other",
                                                                  interval_ms=5)
    routes.publish(build_table([
        DeploymentRoutes(deployment="left", served_model_name="fake", policy="least-load",
             max_model_len=2048, replicas=(RouteReplica("l1", left.url),),
             names=("fake", "left")),
        DeploymentRoutes(deployment="right", served_model_name="other", policy="least-load",
             max_model_len=2048, replicas=(RouteReplica("r1", right.url),),
             names=("other", "right"))]))
    communicator, _, _ = await connect("/ws/playground/", await make_user())
    for ident, deployment in (("a", "left"), ("b", "right")):
        await send(communicator, {"type": "generate", "id": ident, "deployment": deployment,
                                  "max_tokens": 20,
                                  "messages": [{"role": "user", "content": "go"}]})
    done: dict[str, str] = {}
    replicas: dict[str, str] = {}
    text = {"a": "", "b": ""}
    while len(done) < 2:
        message = await receive(communicator)
        assert message["type"] != "error", message
        if message["type"] == "started":
            replicas[message["id"]] = message["replica"]
        elif message["type"] == "token":
            assert message["id"] in done or len(done) < 2
            text[message["id"]] += message["text"]
        elif message["type"] == "done":
            done[message["id"]] = message["stats"]["finish_reason"]
    assert replicas == {"a": "l1", "b": "r1"}
    assert text == {"a": " tok" * 20, "b": " tok" * 20}
    await communicator.disconnect()


async def long_generation(fake_engines: Callable[..., FakeEngine]
                          ) -> tuple[FakeEngine, WebsocketCommunicator]:
    """A 500-token answer at 50 ms a token, started."""
    engine = fake_engines("e1", interval_ms=50)
    publish("demo", [engine])
    communicator, _, _ = await connect("/ws/playground/", await make_user())
    await send(communicator, {"type": "generate", "id": "a", "deployment": "demo",
                              "max_tokens": 500,
                              "messages": [{"role": "user", "content": "go on"}]})
    assert (await receive(communicator))["type"] == "started"
    return engine, communicator


async def engine_saw_disconnect(engine: FakeEngine) -> bool:
    """The engine notices a closed connection at its next token."""
    for _ in range(50):
        if await sync_to_async(engine.metric)("fake:client_disconnects_total") == 1:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_stop_cancels_the_generation_and_its_upstream_request(
        fake_engines: Callable[..., FakeEngine]) -> None:
    engine, communicator = await long_generation(fake_engines)
    assert (await receive(communicator))["type"] == "token"
    await send(communicator, {"type": "stop", "id": "a"})
    seen = await receive_until(communicator, "stopped")
    assert seen[-1] == {"type": "stopped", "id": "a"}
    assert await engine_saw_disconnect(engine)
    # The socket goes on working.
    await send(communicator, {"type": "generate", "id": "a", "deployment": "demo",
                              "max_tokens": 2,
                              "messages": [{"role": "user", "content": "again"}]})
    assert (await receive_until(communicator, "done"))[-1]["type"] == "done"
    await communicator.disconnect()


async def test_closing_the_socket_cancels_what_it_started(
        fake_engines: Callable[..., FakeEngine]) -> None:
    engine, communicator = await long_generation(fake_engines)
    await communicator.disconnect()
    assert await engine_saw_disconnect(engine)
    assert await sync_to_async(engine.metric)("vllm:num_requests_running") == 0


async def test_no_ready_replica_is_an_error_message(
        fake_engines: Callable[..., FakeEngine]) -> None:
    publish("demo", [])
    communicator, _, _ = await connect("/ws/playground/", await make_user())
    await send(communicator, {"type": "generate", "id": "a", "deployment": "demo",
                              "messages": [{"role": "user", "content": "hi"}]})
    message = await receive(communicator)
    assert message["type"] == "error" and "no ready replica" in message["message"]
    await communicator.disconnect()


async def test_a_dashboard_socket_only_listens() -> None:
    communicator, connected, _ = await connect("/ws/dashboard/", await make_user())
    assert connected
    await send(communicator, {"type": "generate"})
    message = await receive(communicator)
    assert message["type"] == "error" and "only listens" in message["message"]
    await send(communicator, {"type": "ping"})
    assert await receive(communicator) == {"type": "pong"}
    await communicator.disconnect()


async def test_a_dashboard_for_an_unknown_deployment_says_so_and_closes() -> None:
    communicator, connected, _ = await connect("/ws/dashboard/nope/", await make_user())
    assert connected
    message = await receive(communicator)
    assert message["type"] == "error" and "no deployment named 'nope'" in message["message"]
    assert (await communicator.receive_output(timeout=5))["code"] == 4404


async def closed_with(communicator: WebsocketCommunicator, timeout: float = 5) -> int | None:
    """Read what the socket still sends until it closes; the close code."""
    while True:
        answer = await communicator.receive_output(timeout)
        if answer["type"] == "websocket.close":
            return int(answer.get("code", 1000))


async def test_a_demoted_users_playground_socket_closes_and_its_generation_stops(
        fake_engines: Callable[..., FakeEngine]) -> None:
    from access.roles import set_role

    engine = fake_engines("e1", interval_ms=50)
    publish("demo", [engine])
    operator = await make_user("ed", staff=False, role="operator")
    communicator, connected, _ = await connect("/ws/playground/", operator)
    assert connected
    await send(communicator, {"type": "generate", "id": "a", "deployment": "demo",
                              "max_tokens": 500,
                              "messages": [{"role": "user", "content": "go on"}]})
    assert (await receive(communicator))["type"] == "started"
    await sync_to_async(set_role)(operator, "viewer", actor="admin")
    assert await closed_with(communicator) == 4403
    assert await engine_saw_disconnect(engine)


async def test_a_deactivated_users_dashboard_socket_closes() -> None:
    viewer = await make_user("fay", staff=False, role="viewer")
    communicator, connected, _ = await connect("/ws/dashboard/", viewer)
    assert connected
    viewer.is_active = False
    await sync_to_async(viewer.save)()
    assert await closed_with(communicator) == 4403


async def test_a_socket_keeps_checking_access_after_the_database_failed_once(
        settings: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A change made in another process is seen by the periodic check alone: a database
    error in one check must not end the checks for good."""
    settings.KEY_CACHE_SECONDS = 1
    viewer = await make_user("gus", staff=False, role="viewer")
    communicator, connected, _ = await connect("/ws/dashboard/", viewer)
    assert connected

    def rename(old: str, new: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {old} RENAME TO {new}")

    await sync_to_async(rename)("auth_user_groups", "auth_user_groups_away")
    try:
        async with asyncio.timeout(10):
            while "could not re-check the access" not in caplog.text:
                await asyncio.sleep(0.05)
    finally:
        await sync_to_async(rename)("auth_user_groups_away", "auth_user_groups")
    # As another process would: no signal, no channel message, only the database.
    await sync_to_async(User.objects.filter(pk=viewer.pk).update)(is_active=False)
    assert await closed_with(communicator) == 4403


async def test_a_fleet_socket_gets_the_whole_view_then_only_what_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from controlplane import collector as collector_module
    from controlplane.metrics import publishing

    def summary(name: str, requests: float) -> dict[str, Any]:
        return {"name": name, "ready": 1, "desired": 1, "standby": 0,
                "requests_per_s": requests, "tokens_per_s": 0.0, "waiting": 0, "running": 0}

    fleet = [summary(f"fleet-{i:04d}", float(i % 5)) for i in range(300)]
    monkeypatch.setattr(publishing, "fleet_view", publishing.FleetView())
    # A collector runs in this process: it has published passes before the socket came.
    monkeypatch.setattr(collector_module, "collector", object())
    await publishing.publish({"t": 1.0, "deployments": fleet}, {})
    await publishing.publish({"t": 3.0, "deployments": fleet}, {})
    communicator, connected, _ = await connect("/ws/dashboard/", await make_user())
    assert connected
    first = await receive(communicator)
    assert first["type"] == "fleet" and first["seq"] == 2 and first["total"] == 300
    assert len(first["deployments"]) == publishing.FLEET_ROWS
    fleet[7] = summary("fleet-0007", 9.0)
    await publishing.publish({"t": 5.0, "deployments": fleet}, {})
    delta = await receive(communicator)
    assert delta["type"] == "fleet.delta" and delta["seq"] == 3
    assert [d["name"] for d in delta["changed"]] == ["fleet-0007"]
    # It entered the busiest 50 (all at 4 requests/s before, by name): the last one left.
    assert delta["removed"] == ["fleet-0249"]
    await communicator.disconnect()


async def test_a_fleet_socket_without_a_collector_starts_from_the_view_in_redis(
        monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    """Scale-out: the collector runs in another process; a socket served here is sent
    the whole view the collector last left in Redis at once, not after up to
    SNAPSHOT_EVERY passes."""
    import redis

    from controlplane import collector as collector_module
    from controlplane.metrics import publishing

    settings.REDIS_URL = "redis://127.0.0.1:6379/5"
    redis.Redis.from_url(settings.REDIS_URL).delete(publishing.SNAPSHOT_KEY)
    monkeypatch.setattr(collector_module, "collector", None)
    communicator, connected, _ = await connect("/ws/dashboard/", await make_user())
    assert connected
    assert await communicator.receive_nothing(0.5)  # nothing in Redis yet: nothing sent
    await communicator.disconnect()

    # The collector's process: its passes leave the whole view in Redis.
    monkeypatch.setattr(publishing, "fleet_view", publishing.FleetView())
    fleet = [{"name": f"far-{i:03d}", "ready": 1, "desired": 1, "requests_per_s": float(i)}
             for i in range(80)]
    for t in (1.0, 3.0):
        await publishing.publish({"t": t, "deployments": fleet}, {})
    # This process holds no view of its own: what it sends comes from Redis.
    monkeypatch.setattr(publishing, "fleet_view", publishing.FleetView())
    communicator, connected, _ = await connect("/ws/dashboard/", await make_user("bea"))
    assert connected
    first = await receive(communicator)
    assert first["type"] == "fleet" and first["seq"] == 2 and first["total"] == 80
    assert first["deployments"][0]["name"] == "far-079"
    await communicator.disconnect()

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens: no view, no failure
    communicator, connected, _ = await connect("/ws/dashboard/", await make_user("cy"))
    assert connected
    assert await communicator.receive_nothing(0.5)
    await communicator.disconnect()
