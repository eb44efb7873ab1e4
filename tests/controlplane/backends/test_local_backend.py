"""The local backend's replicas as a process sees them: what they inherit of the control
plane's environment, the key they demand, and which interpreters an admin may name. The
replicas are FAKE engines (fakes/engine.py, a real HTTP server) started by the backend
through fakes/vllm_cli.py's stand-in interpreter, as vLLM would be."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rest_framework.test import APIClient

from controlplane.backends.local import LocalBackend, LocalConfig
from controlplane.models import Deployment, Replica
from fakes.vllm_cli import stand_in_python
from tests.factories import make_backend, make_deployment, make_model
from tests.processes import end_replicas

pytestmark = pytest.mark.django_db

SECRETS = {"SECRET_KEY": "control-plane-secret", "DATABASE_URL": "postgres://u:pw@db/x",
           "REDIS_URL": "redis://:pw@redis:6379/0", "AWS_SECRET_ACCESS_KEY": "aws-secret",
           "METRICS_TOKEN": "metrics-secret"}


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def wait_for(what: str, check: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def started(tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[tuple[LocalBackend, Deployment, Replica]]:
    """A replica the local backend started, with control-plane secrets in the environment
    of the process that started it."""
    settings.DATA_DIR = tmp_path / "data"
    python = stand_in_python(tmp_path)
    settings.LOCAL_BACKEND_PYTHONS = [python]
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    weights = tmp_path / "weights"
    weights.mkdir()
    backend = LocalBackend(LocalConfig.from_dict({"python": python}))
    deployment = make_deployment("chat", model=make_model("fake", path=str(weights)),
                                 backend=make_backend("fakes", "local", {"python": python}))
    replica = Replica.objects.create(deployment=deployment, name="chat-1")
    backend.start(deployment, replica)
    try:
        wait_for("the replica's health", lambda: backend.observe(deployment, replica).healthy)
        yield backend, deployment, replica
    finally:
        end_replicas(str(settings.DATA_DIR))


def test_a_replica_inherits_no_control_plane_secret(
        started: tuple[LocalBackend, Deployment, Replica]) -> None:
    _, deployment, replica = started
    assert replica.pid is not None
    seen = environ(replica.pid)
    assert not set(SECRETS) & set(seen)
    assert not any(value in "\n".join(seen.values()) for value in SECRETS.values())
    assert seen["VLLM_API_KEY"] == deployment.engine_key()
    assert "PATH" in seen and seen["HF_HUB_OFFLINE"] == "1"


def test_a_replica_refuses_a_request_without_its_key_and_the_backend_warms_it_up(
        started: tuple[LocalBackend, Deployment, Replica]) -> None:
    backend, deployment, replica = started
    body = {"model": "chat", "prompt": "hi", "max_tokens": 2}
    refused = httpx.post(f"{replica.endpoint}/v1/completions", json=body, timeout=10)
    assert refused.status_code == 401
    assert refused.json() == {"error": "Unauthorized"}
    backend.warm_up(deployment, replica)  # raises unless the replica took the request
    assert backend.in_flight(replica) == 0
    answered = httpx.post(f"{replica.endpoint}/v1/completions", json=body, timeout=10,
                          headers={"Authorization": f"Bearer {deployment.engine_key()}"})
    assert answered.status_code == 200


def test_a_replica_refuses_every_path_but_health_and_metrics_without_its_key(
        started: tuple[LocalBackend, Deployment, Replica]) -> None:
    _, deployment, replica = started
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    for path, body in (("/invocations", chat), ("/tokenize", {"prompt": "hi"})):
        refused = httpx.post(f"{replica.endpoint}{path}", json=body, timeout=10)
        assert (path, refused.status_code) == (path, 401)
        assert refused.json() == {"error": "Unauthorized"}
        answered = httpx.post(f"{replica.endpoint}{path}", json=body, timeout=10,
                              headers={"Authorization": f"Bearer {deployment.engine_key()}"})
        assert (path, answered.status_code) == (path, 200)
    wrong = httpx.post(f"{replica.endpoint}/invocations", json=chat, timeout=10,
                       headers={"Authorization": "Bearer not-the-key"})
    assert wrong.status_code == 401
    assert httpx.get(f"{replica.endpoint}/health", timeout=10).status_code == 200
    assert httpx.get(f"{replica.endpoint}/metrics", timeout=10).status_code == 200


def test_each_deployment_has_its_own_key_and_the_key_is_not_on_the_command_line(
        started: tuple[LocalBackend, Deployment, Replica]) -> None:
    import psutil

    _, deployment, replica = started
    other = make_deployment("other", model=deployment.model, backend=deployment.backend)
    assert deployment.engine_key() != other.engine_key()
    assert len(deployment.engine_key()) >= 43  # 256 bits, URL-safe base64
    assert deployment.engine_key() not in deployment.engine_key_sealed
    assert replica.pid is not None
    assert not any(deployment.engine_key() in part
                   for part in psutil.Process(replica.pid).cmdline())
    assert deployment.engine_key() not in Path(replica.log_path).read_text()


@pytest.mark.parametrize(("config", "field"), [
    ({"python": "/bin/sh"}, "python"),
    ({"python": "/usr/bin/python3"}, "python"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env"),
    ({"env": {"PYTHONPATH": "/tmp/evil"}}, "env"),
    ({"env": {"VLLM_API_KEY": "mine"}}, "env"),
    ({"env": {"VLLM_SERVER_DEV_MODE": "1"}}, "env"),
    ({"env": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}}, "env"),
    ({"env": {"HOME": "/tmp/evil"}}, "env"),
    ({"env": {"VLLM_PLUGINS": "evil"}}, "env"),
    ({"env": {"VLLM_GENERAL_PLUGINS": "evil"}}, "env"),
])
def test_a_local_backend_may_name_only_what_the_install_allows(
        admin_client: APIClient, config: dict[str, Any], field: str) -> None:
    response = admin_client.post("/api/v1/backends/", {
        "name": "mine", "kind": "local", "config": config}, format="json")
    assert response.status_code == 400, response.json()
    assert field in str(response.json())


def test_the_control_planes_own_interpreter_and_listed_ones_are_allowed(
        admin_client: APIClient, settings: Any, tmp_path: Path) -> None:
    import sys

    python = stand_in_python(tmp_path)
    settings.LOCAL_BACKEND_PYTHONS = [python]
    for name, chosen in (("own", sys.executable), ("listed", python), ("default", "")):
        response = admin_client.post("/api/v1/backends/", {
            "name": name, "kind": "local", "config": {"python": chosen}}, format="json")
        assert response.status_code == 201, response.json()


def test_deployments_made_before_keys_get_one_each_and_roll_their_replicas() -> None:
    import importlib

    from django.apps import apps

    migration = importlib.import_module("controlplane.migrations.0006_deployment_engine_key")
    model = make_model("older")
    local = make_deployment("local-one", model=model)
    remote = make_deployment("remote-one", model=model, backend=make_backend(
        "provider", "external", {"url": "http://provider.example", "api_key": "theirs"}))
    Deployment.objects.update(engine_key_sealed="")  # as the rows were before the column
    migration.give_each_a_key(apps, None)
    local.refresh_from_db()
    remote.refresh_from_db()
    assert local.engine_key() and remote.engine_key()
    assert local.engine_key() != remote.engine_key()
    assert local.generation == 2  # its keyless replicas are replaced by a rollout
    assert remote.generation == 1  # nothing of ours runs there
    assert remote.upstream_key() == "theirs"


def test_a_stored_backend_outside_the_allow_lists_fails_its_replicas_not_the_pass(
        tmp_path: Path, settings: Any, emulated: Any) -> None:
    from controlplane.models import AuditEvent
    from controlplane.reconciler import Reconciler
    from tests.k8s_emulator import write_kubeconfig

    settings.DATA_DIR = tmp_path / "data"
    weights = tmp_path / "weights"
    weights.mkdir()
    model = make_model("fake", path=str(weights))
    # As stored before the allow-lists existed (the API would refuse it now).
    make_deployment("old", model=model,
                    backend=make_backend("old", "local", {"python": "/bin/sh"}))
    make_deployment("gpus", model=model, backend=make_backend("gpus", "kubernetes", {
        "namespace": "inference", "image": "attacker/miner", "model_source": "pvc",
        "pvc_name": "models", "kubeconfig": write_kubeconfig(tmp_path / "k", emulated.url)}))
    reconciler = Reconciler()
    for _ in range(2):  # a pass makes the replica record, the next starts it
        reconciler.reconcile_all()  # no exception: the other deployments are reconciled
    [replica] = Replica.objects.filter(deployment__name="old")
    assert replica.phase == Replica.Phase.FAILED and replica.pid is None
    assert "LOCAL_BACKEND_PYTHONS" in replica.last_error
    assert AuditEvent.objects.filter(deployment__name="old", action="replica-failed",
                                     message__contains="LOCAL_BACKEND_PYTHONS").exists()
    assert not Path(tmp_path / "data" / "replicas" / "old-1.log").exists()
    degraded = Deployment.objects.get(name="gpus").condition("Degraded")
    assert degraded is not None and "KUBERNETES_ALLOWED_IMAGES" in degraded["message"]


@pytest.mark.django_db
def test_a_replica_gets_tensor_times_pipeline_parallel_gpus() -> None:
    model = make_model("parallel")
    deployment = make_deployment("parallel", model=model, engine_args={
        "tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    replica = Replica.objects.create(deployment=deployment, name="parallel-1")
    backend = LocalBackend(LocalConfig.from_dict({}))
    backend._gpus = ["0", "1", "2", "3", "4"]
    devices, env = backend._placement(deployment, replica)
    assert devices == "gpu:0,1,2,3"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_replica_started_whose_record_cannot_be_written_is_stopped_not_doubled(
        tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The database goes away between a replica's start and its record: the server is
    stopped, and the pass after the outage starts one server for the replica, not two."""
    from django.db import OperationalError

    from controlplane.backends.local import owned_processes
    from controlplane.reconciler import Reconciler

    settings.DATA_DIR = tmp_path / "data"
    python = stand_in_python(tmp_path)
    settings.LOCAL_BACKEND_PYTHONS = [python]
    weights = tmp_path / "weights"
    weights.mkdir()
    make_deployment("chat", model=make_model("fake", path=str(weights)), replicas=1,
                    backend=make_backend("fakes", "local", {"python": python}))
    reconciler = Reconciler()
    reconciler.reconcile_all()  # the replica's record, pending
    save = Replica.save

    def database_gone(replica: Replica, *args: Any, **kwargs: Any) -> None:
        if replica.phase == Replica.Phase.STARTING:
            raise OperationalError("server closed the connection unexpectedly")
        save(replica, *args, **kwargs)

    def running() -> set[tuple[int, str]]:
        return {(p.pid, name) for p, name in owned_processes(str(settings.DATA_DIR))
                if p.status() != "zombie"}

    try:
        monkeypatch.setattr(Replica, "save", database_gone)
        result = reconciler.reconcile_all()
        assert result.errors, "the pass did not meet the outage"
        wait_for("the unrecorded server stopped", lambda: not running(), 15)
        monkeypatch.undo()
        for _ in range(3):
            reconciler.reconcile_all()
        replica = Replica.objects.get()
        assert running() == {(replica.pid, replica.name)}
    finally:
        end_replicas(str(settings.DATA_DIR))
