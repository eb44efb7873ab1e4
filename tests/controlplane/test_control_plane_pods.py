"""The control plane's own pods (deploy/kubernetes): the controllers' liveness follows their
loop, the gateway's liveness does not need the database, pods stop without cutting
streams, a release migrates before its pods start, the first admin password stays out of
the logs, and clusters older than the minimum Kubernetes version are refused."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from django.contrib.auth import authenticate, get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.test import Client

from controlplane import controllers, liveness
from controlplane.backends.k8s_version import (
    UnsupportedKubernetesVersion,
    check_server_version,
)
from controlplane.management.commands import run_controllers, serve
from controlplane.management.commands.wait_for_migrations import pending_migrations
from tests.processes import free_port, manage, server_env, start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
OPERATIONS = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
PRODUCTION_KEY = "p" * 20 + "-production-secret-key-for-the-pods-tests-0123456789"


def documents(name: str) -> list[dict[str, Any]]:
    with (DEPLOY / name).open(encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc]


def workload(name: str, kind: str = "Deployment") -> dict[str, Any]:
    [found] = [d for d in documents(name) if d["kind"] == kind]
    return found


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in pod["containers"] if c["name"] == name]
    return found


def option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# --- the controllers' liveness ------------------------------------------------------------

def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=5)


def test_the_controllers_liveness_fails_while_a_pass_hangs_and_recovers_when_it_ends(
        monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    settings.RECONCILE_INTERVAL_SECONDS = 0.05
    settings.LEADER_ELECTION = "none"
    monkeypatch.setattr(liveness, "heartbeat", liveness.Heartbeat())
    hung, unblock = threading.Event(), threading.Event()
    passes: list[float] = []

    def one_pass(reconciler: object, requested: bool = False) -> None:
        passes.append(time.monotonic())
        if len(passes) == 5:
            hung.set()
            unblock.wait(timeout=60)

    async def idle(stop: asyncio.Event) -> None:
        await stop.wait()

    monkeypatch.setattr(controllers, "_one_pass", one_pass)
    monkeypatch.setattr(controllers, "run_autoscaler", idle)
    monkeypatch.setattr("controlplane.collector.run_collector", idle)
    port, bound = free_port(), 1.0
    base = f"http://127.0.0.1:{port}"

    async def until(path: str, status: int, within: float) -> float:
        started = time.monotonic()
        while True:
            try:
                if (await asyncio.to_thread(get, base + path)).status_code == status:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            assert time.monotonic() - started < within, f"{path} never answered {status}"
            await asyncio.sleep(0.05)

    async def scenario() -> dict[str, Any]:
        stop = asyncio.Event()
        run = asyncio.create_task(run_controllers.Command().run(port, "127.0.0.1", bound,
                                                                stop))
        seen: dict[str, Any] = {"ready": await until("/readyz", 200, 10)}
        seen["live"] = (await asyncio.to_thread(get, base + "/livez")).json()
        assert await asyncio.to_thread(hung.wait, 10)
        seen["failed_after"] = await until("/livez", 503, 10)
        seen["stalled"] = (await asyncio.to_thread(get, base + "/livez")).json()
        seen["not_ready"] = (await asyncio.to_thread(get, base + "/readyz")).status_code
        unblock.set()  # the pass ends
        seen["recovered_after"] = await until("/livez", 200, 5)
        stop.set()
        seen["stuck"] = await asyncio.wait_for(run, timeout=10)
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        unblock.set()
    assert seen["live"]["status"] == "ok" and seen["live"]["last"] == "reconcile pass"
    assert seen["failed_after"] <= bound + 1.0  # within the bound, give or take a probe
    assert seen["stalled"]["status"] == "stalled"
    assert "no reconcile pass or election attempt completed for" in seen["stalled"]["detail"]
    assert seen["not_ready"] == 503
    assert seen["recovered_after"] < 2
    assert seen["stuck"] is False  # stopped cleanly once nothing hung


def test_run_controllers_refuses_a_bad_health_port() -> None:
    with pytest.raises(CommandError, match="--health-port 'http'"):
        call_command("run_controllers", "--health-port", "http")


# --- the gateway's probes -------------------------------------------------------------------

def unreachable_database(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: BaseDatabaseWrapper) -> None:
        raise OperationalError('connection to server at "postgres" failed: Connection refused')

    monkeypatch.setattr(BaseDatabaseWrapper, "ensure_connection", refuse)


@pytest.mark.django_db
def test_the_gateway_is_ready_and_live_with_its_database() -> None:
    client = Client()
    assert client.get("/livez").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok"}
    assert client.get("/healthz").status_code == 200


def test_without_its_database_a_gateway_holding_nothing_is_live_but_not_ready(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from serving import keys
    from serving.routes import RouteTable, routes

    monkeypatch.setattr(keys, "_cache", {})
    monkeypatch.setattr(routes, "_table", RouteTable())
    unreachable_database(monkeypatch)
    client = Client(raise_request_exception=False)
    live = client.get("/livez")
    assert live.status_code == 200 and live.json() == {"status": "ok"}
    for path in ("/readyz", "/healthz"):
        answer = client.get(path)
        assert answer.status_code == 503, path
        assert answer["Content-Type"] == "application/json"
        assert answer.json() == {"status": "unavailable", "detail": "the database does not "
                                 "answer (the server's log says why)"}
        assert "postgres" not in answer.content.decode()  # no details for anonymous callers


def test_without_its_database_a_gateway_holding_keys_and_routes_stays_ready_degraded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # It serves those from memory: the whole fleet must not leave the Service at once.
    from serving import keys
    from serving.routes import DeploymentRoutes, RouteReplica, RouteTable, build_table, routes

    known = keys.KeyInfo(1, "app", "inference", ())
    monkeypatch.setattr(keys, "_cache", {"hash": (known, time.monotonic())})
    monkeypatch.setattr(routes, "_table", build_table([DeploymentRoutes(
        deployment="chat", served_model_name="chat", policy="least-load",
        max_model_len=2048, replicas=(RouteReplica("chat-1", "http://127.0.0.1:9"),),
        names=("chat",))]))
    unreachable_database(monkeypatch)
    answer = Client(raise_request_exception=False).get("/readyz")
    assert answer.status_code == 200
    assert answer.json() == {"status": "degraded", "detail": "the database does not answer "
                             "(the server's log says why); serving the keys and routes "
                             "known"}
    monkeypatch.setattr(routes, "_table", RouteTable())  # nothing to route: not ready
    assert Client(raise_request_exception=False).get("/readyz").status_code == 503


def test_a_hung_database_does_not_hold_up_the_gateways_liveness(
        gateway_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    released = threading.Event()
    entered = threading.Event()

    def hang(self: BaseDatabaseWrapper) -> None:
        entered.set()
        released.wait(timeout=30)
        raise OperationalError("timed out")

    monkeypatch.setattr(BaseDatabaseWrapper, "ensure_connection", hang)
    answers: list[int] = []
    waiting = threading.Thread(target=lambda: answers.append(
        httpx.get(f"{gateway_url}/readyz", timeout=40).status_code))
    waiting.start()
    try:
        assert entered.wait(timeout=10)
        started = time.monotonic()
        live = httpx.get(f"{gateway_url}/livez", timeout=5)
        took = time.monotonic() - started
    finally:
        released.set()
        waiting.join(timeout=40)
    assert live.status_code == 200
    assert took < 2
    assert answers == [503]


# --- the manifests --------------------------------------------------------------------------

def test_the_gateway_probes_liveness_without_the_database_and_readiness_with_it() -> None:
    pod = workload("gateway.yaml")["spec"]["template"]["spec"]
    gateway = container(pod, "gateway")
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_the_gateway_finishes_its_streams_before_it_is_killed() -> None:
    pod = workload("gateway.yaml")["spec"]["template"]["spec"]
    gateway = container(pod, "gateway")
    pause = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    streams = int(option(gateway["args"], "--graceful-shutdown-seconds"))
    # The pause, the streams' time, the usage flush: all before the SIGKILL.
    assert pause >= 5 and streams >= 60
    assert pause + streams + serve.USAGE_FLUSH_ON_STOP_SECONDS < pod[
        "terminationGracePeriodSeconds"]
    assert pod["terminationGracePeriodSeconds"] == 120
    assert "terminationGracePeriodSeconds` 120" in OPERATIONS


def test_the_controller_probes_the_health_server_it_starts() -> None:
    pod = workload("controller.yaml")["spec"]["template"]["spec"]
    controller = container(pod, "controller")
    [port] = controller["ports"]
    assert option(controller["args"], "--health-port") == str(port["containerPort"])
    assert controller["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port["name"]}
    assert controller["readinessProbe"]["httpGet"] == {"path": "/readyz",
                                                       "port": port["name"]}
    # A stuck controller exits by itself before the kubelet's SIGKILL.
    assert run_controllers.STOP_WAIT_SECONDS < pod["terminationGracePeriodSeconds"]


def test_a_release_migrates_before_its_pods_start() -> None:
    [kustomization] = documents("kustomization.yaml")
    [image] = kustomization["images"]
    job = workload("migrate-job.yaml", "Job")
    # A new release is a new Job (a Job's template cannot change in place).
    assert job["metadata"]["name"] == f"fleetplane-migrate-{image['newTag']}"
    assert container(job["spec"]["template"]["spec"], "migrate")["args"] == [
        "python", "manage.py", "migrate", "--noinput"]
    for name in ("gateway.yaml", "controller.yaml"):
        pod = workload(name)["spec"]["template"]["spec"]
        [wait] = pod["initContainers"]
        assert wait["image"] == "fleetplane"  # the release's own image, set by kustomize
        assert wait["args"][:3] == ["python", "manage.py", "wait_for_migrations"]
    assert "manage.py wait_for_migrations" in OPERATIONS
    assert f"fleetplane-migrate-{image['newTag']}" in OPERATIONS


def test_disruptions_leave_a_gateway_and_a_controller() -> None:
    budgets = {d["metadata"]["name"]: d for d in documents("pdb.yaml")}
    for name in ("gateway", "controller"):
        deployment = workload(f"{name}.yaml")
        budget = budgets[f"fleetplane-{name}"]
        assert budget["spec"]["minAvailable"] == 1
        assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"][
            "metadata"]["labels"]
        assert deployment["spec"]["replicas"] >= 2
    [kustomization] = documents("kustomization.yaml")
    assert "pdb.yaml" in kustomization["resources"]


def test_the_gateway_autoscaler_is_optional_and_targets_the_gateway() -> None:
    hpa = workload("gateway-hpa.yaml", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == workload("gateway.yaml")["metadata"][
        "name"]
    assert hpa["spec"]["minReplicas"] >= 2
    [kustomization] = documents("kustomization.yaml")
    assert "gateway-hpa.yaml" not in kustomization["resources"]


@pytest.mark.parametrize("name", ["gateway.yaml", "controller.yaml", "migrate-job.yaml"])
def test_every_control_plane_container_meets_pod_security_restricted(name: str) -> None:
    [found] = [d for d in documents(name) if d["kind"] in ("Deployment", "Job")]
    pod = found["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for each in pod["containers"] + pod.get("initContainers", []):
        assert each["securityContext"] == {"allowPrivilegeEscalation": False,
                                           "readOnlyRootFilesystem": True,
                                           "capabilities": {"drop": ["ALL"]}}, each["name"]
        assert each["resources"]["requests"] and each["resources"]["limits"], each["name"]


# --- migrations -----------------------------------------------------------------------------

@pytest.mark.django_db
def test_waiting_for_migrations_ends_at_once_on_an_up_to_date_schema(
        capsys: pytest.CaptureFixture[str]) -> None:
    call_command("wait_for_migrations", "--timeout", "5")
    assert "the database schema is up to date" in capsys.readouterr().out


@pytest.mark.django_db
def test_waiting_for_migrations_names_the_missing_ones_and_gives_up() -> None:
    from django.db.migrations.recorder import MigrationRecorder

    latest = MigrationRecorder.Migration.objects.filter(app="controlplane").order_by(
        "-applied").first()
    assert latest is not None
    latest.delete()  # as if this release brought a migration the database lacks
    assert pending_migrations() == [f"controlplane.{latest.name}"]
    started = time.monotonic()
    with pytest.raises(CommandError, match=(
            rf"not up to date after 0.5 s: waiting for the migrations "
            rf"controlplane\.{re.escape(latest.name)}\. Run this release's migration Job")):
        call_command("wait_for_migrations", "--timeout", "0.5", "--interval", "0.1")
    assert time.monotonic() - started < 3


# --- the first admin ------------------------------------------------------------------------

def test_the_first_admin_takes_its_password_from_the_environment_and_logs_none(
        tmp_path: Path) -> None:
    data = tmp_path / "data"
    password = "walkthrough-Admin-7f3b9c2e41"
    env = server_env(data, DEBUG="false", SECRET_KEY=PRODUCTION_KEY,
                      ALLOWED_HOSTS="127.0.0.1", ALLOW_SQLITE_IN_PRODUCTION="true",
                      SECURE_SSL_REDIRECT="false", FLEETPLANE_ADMIN_PASSWORD=password)
    manage(env, "migrate", "--noinput", "-v0")
    process, output = start_server(env, free_port(), "--no-controllers")
    stop_server(process)
    assert password not in output
    assert "Log in as 'admin' with the password set in FLEETPLANE_ADMIN_PASSWORD" in output
    assert not (data / serve.INITIAL_PASSWORD_FILE).exists()
    check = ("from django.contrib.auth import authenticate; "
             f"print(authenticate(username='admin', password={password!r}) is not None)")
    assert manage(env, "shell", "-c", check).stdout.splitlines()[-1] == "True"


@pytest.mark.django_db
def test_a_weak_first_admin_password_is_refused_and_no_admin_is_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETPLANE_ADMIN_PASSWORD", "admin")
    with pytest.raises(CommandError, match=r"^FLEETPLANE_ADMIN_PASSWORD: This password is "
                                           r"too short"):
        serve.first_admin()
    assert not get_user_model().objects.filter(is_superuser=True).exists()


@pytest.mark.django_db
def test_the_environment_password_is_only_for_the_first_admin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve.first_admin()[2] is False  # none set: a generated password
    monkeypatch.setenv("FLEETPLANE_ADMIN_PASSWORD", "a-later-Password-8c1d")
    username, generated, from_environment = serve.first_admin()
    assert (generated, from_environment) == (None, False)
    assert authenticate(username=username, password="a-later-Password-8c1d") is None


# --- the minimum Kubernetes version ---------------------------------------------------------

@pytest.mark.parametrize("version", [
    {"major": "1", "minor": "30"},
    {"major": "1", "minor": "31+", "gitVersion": "v1.31.4-eks-2d5f260"},
    {"major": "1", "minor": "37"},
    {"git_version": "v1.30.0"},  # the official client's to_dict() spelling
    {"major": "", "minor": "", "gitVersion": "v1.32.1+k3s1"},
])
def test_clusters_from_kubernetes_1_30_are_accepted(version: dict[str, str]) -> None:
    check_server_version(version)


@pytest.mark.parametrize(("version", "says"), [
    ({"major": "1", "minor": "29"}, "runs Kubernetes 1.29"),
    ({"major": "1", "minor": "28+", "gitVersion": "v1.28.9-gke.100"}, "runs Kubernetes 1.28"),
    ({"gitVersion": "v1.27.3"}, "runs Kubernetes 1.27"),
    ({"platform": "linux/amd64"}, "did not say its version"),
])
def test_older_clusters_are_refused_with_both_versions_named(
        version: dict[str, str], says: str) -> None:
    with pytest.raises(UnsupportedKubernetesVersion, match=says) as refused:
        check_server_version(version)
    assert "Fleetplane needs Kubernetes 1.30 or later" in str(refused.value)


def test_the_operations_guide_states_the_minimum_version() -> None:
    assert "Kubernetes 1.30 or later" in OPERATIONS


def test_the_walkthroughs_database_and_redis_validate() -> None:
    import kubernetes_validate

    path = ROOT / "deploy" / "kind" / "postgres-redis.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    assert {d["metadata"]["name"] for d in docs} == {"postgres", "redis"}
    for version in ("1.36.0", "1.37.0"):
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)
    secret = yaml.safe_load((DEPLOY / "secret.example.yaml").read_text(encoding="utf-8"))
    # The walkthrough's hosts are the ones the example Secret names.
    assert "@postgres.fleetplane:5432/" in secret["stringData"]["DATABASE_URL"]
    assert "redis.fleetplane:6379" in secret["stringData"]["REDIS_URL"]
    assert "@postgres.fleetplane:5432/fleetplane" in OPERATIONS
