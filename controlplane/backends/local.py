"""The local backend: each replica is `python -m vllm.entrypoints.openai.api_server` in its
own process group, on a free port, logging to its own file.

The processes outlive the control plane: after a restart the reconciler finds them by pid
and start time and adopts them. Every child carries FLEETPLANE_REPLICA=<name> in its
environment, so servers no record knows can be found and stopped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import psutil
from django.conf import settings

from controlplane.backends import vllm_http
from controlplane.backends.base import BackendConfigError, BackendError, Observation

if TYPE_CHECKING:
    from controlplane.models import Deployment, Replica

REPLICA_ENV_MARKER = "FLEETPLANE_REPLICA"
# Which control plane (by its data folder) started the process: two control planes on one
# machine never touch each other's replicas.
REPLICA_OWNER_ENV = "FLEETPLANE_DATA_DIR"
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM's own variable for --api-key: its server then refuses /v1/* without the key.
ENGINE_KEY_ENV = "VLLM_API_KEY"
# vLLM guards only /v1, /v2, /inference and /cohere with the key; this middleware, loaded
# into each replica, refuses every other path but /health and /metrics without it
# (SageMaker's /invocations, /tokenize, /pooling, /score...).
ENGINE_GUARD = "serving.engine_guard.EngineGuard"
# The folder that holds the project's packages: on the replica's PYTHONPATH, so any
# allowed interpreter with vLLM can import ENGINE_GUARD.
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
# What a replica may inherit from the control plane's environment (replica_environment).
INHERITED_ENV = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "TRANSFORMERS_CACHE", "TORCH_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
    "XDG_CACHE_HOME", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
})
# VLLM_API_KEY is not among them: it is the deployment's own (set below), never the
# control plane's.
# What a backend's `env` may not set: names that load other code into the interpreter
# (an allow-listed python is no bound if PYTHONPATH or LD_PRELOAD can be set beside it;
# HOME moves where site-packages, .pth files and caches are read from; any *PLUGIN*
# name selects vLLM or library plugins), names that open vLLM's unguarded development
# routes (/collective_rpc, /sleep...) or unpickling of what clients send, and the ones the
# control plane sets itself.
RESERVED_ENV = frozenset({ENGINE_KEY_ENV, REPLICA_ENV_MARKER, REPLICA_OWNER_ENV, "PATH",
                          "BASH_ENV", "ENV", "HOME", "VLLM_SERVER_DEV_MODE",
                          "VLLM_ALLOW_INSECURE_SERIALIZATION"})
RESERVED_ENV_PREFIXES = ("LD_", "PYTHON", "FLEETPLANE_")
RESERVED_ENV_PARTS = ("PLUGIN",)
INHERITED_ENV_PREFIXES = ("LC_", "VLLM_", "HF_", "CUDA_", "NVIDIA_", "NCCL_", "ROCM_", "HIP_")


@dataclass(frozen=True)
class LocalConfig:
    #: Whole GiB of KV cache per replica on CPU builds (VLLM_CPU_KVCACHE_SPACE).
    kv_cache_gib: int = 1
    #: Cores given to each replica on CPU builds (VLLM_CPU_OMP_THREADS_BIND); 0 lets vLLM
    #: choose. Cores are only bound when enough are free for every replica.
    cpu_cores_per_replica: int = 0
    host: str = "127.0.0.1"
    #: The interpreter that runs vLLM (default: the control plane's own).
    python: str = ""
    #: Extra environment variables for every replica.
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, allow_lists: bool = True) -> LocalConfig:
        """Check a config. `allow_lists=False` (a config already stored, read to run it)
        leaves the install's allow-lists to `start`, which refuses a replica with a
        message instead of failing every reconcile pass."""
        known = {"kv_cache_gib", "cpu_cores_per_replica", "host", "python", "env"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise BackendConfigError(unknown[0], f"unknown local backend setting {unknown[0]!r}")
        kv = data.get("kv_cache_gib", 1)
        if isinstance(kv, float) and kv.is_integer():
            kv = int(kv)
        if isinstance(kv, bool) or not isinstance(kv, int) or not 1 <= kv <= 4096:
            raise BackendConfigError("kv_cache_gib", "must be a whole number of GiB, 1 or more "
                                                     "(vLLM's CPU build takes whole GiB)")
        cores = data.get("cpu_cores_per_replica", 0)
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 0:
            raise BackendConfigError("cpu_cores_per_replica", "must be a whole number >= 0")
        host = data.get("host", "127.0.0.1")
        if not isinstance(host, str) or not host:
            raise BackendConfigError("host", "must be an address to listen on")
        python = data.get("python", "")
        if not isinstance(python, str):
            raise BackendConfigError("python", "must be a path to a Python interpreter")
        refusal = refused_setting(python, {}) if allow_lists else None
        if refusal and refusal[0] == "python":
            raise BackendConfigError(*refusal)
        env = data.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise BackendConfigError("env", "must map names to string values")
        refusal = refused_setting("", env) if allow_lists else None
        if refusal:
            raise BackendConfigError(*refusal)
        return cls(kv_cache_gib=kv, cpu_cores_per_replica=cores, host=host,
                   python=python, env=dict(env))

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def refused_setting(python: str, env: dict[str, str]) -> tuple[str, str] | None:
    """(field, why) when the install does not allow this python or environment."""
    if python and os.path.normpath(python) not in allowed_pythons():
        return "python", (f"{python!r} is not an interpreter this install allows "
                          f"(LOCAL_BACKEND_PYTHONS)")
    refused = sorted(name for name in env if name.upper() in RESERVED_ENV
                     or name.upper().startswith(RESERVED_ENV_PREFIXES)
                     or any(part in name.upper() for part in RESERVED_ENV_PARTS))
    if refused:
        return "env", (f"{refused[0]} may not be set: it would change which code runs, "
                       f"or is the control plane's")
    return None


def allowed_pythons() -> set[str]:
    """The interpreters a local backend may name: the control plane's own, and those the
    install lists in LOCAL_BACKEND_PYTHONS."""
    return {os.path.normpath(sys.executable),
            *(os.path.normpath(p) for p in settings.LOCAL_BACKEND_PYTHONS)}


def replica_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """What a replica inherits of the control plane's environment: an allow-list, so
    SECRET_KEY, DATABASE_URL, REDIS_URL, cloud credentials and whatever else the control
    plane was given never reach a process that runs model code."""
    return {name: value for name, value in parent.items()
            if name in INHERITED_ENV or name.startswith(INHERITED_ENV_PREFIXES)}


def free_port(host: str, avoid: set[int]) -> int:
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port
    raise BackendError("no free port found")


def tail_lines(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a file, read from its end."""
    if lines <= 0 or not path.is_file():
        return []
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        end = handle.tell()
        block, data = 64 * 1024, b""
        position = end
        while position > 0 and data.count(b"\n") <= lines:
            step = min(block, position)
            position -= step
            handle.seek(position)
            data = handle.read(step) + data
    return data.decode("utf-8", errors="replace").splitlines()[-lines:]


def detect_gpus() -> list[str]:
    """GPU indices NVML knows (through nvidia-smi), or none."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


class LocalBackend:
    creates_replicas = True
    owns_pods = False

    def __init__(self, config: LocalConfig) -> None:
        self.config = config
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._gpus: list[str] | None = None
        # Every backend shares one pooled client (one TLS context for the process).
        self.http = vllm_http.shared_client()

    # --- placement -------------------------------------------------------------------

    def gpus(self) -> list[str]:
        if self._gpus is None:
            self._gpus = detect_gpus()
        return self._gpus

    def _taken_devices(self, exclude: Replica) -> set[str]:
        from controlplane.models import Replica

        taken: set[str] = set()
        rows = Replica.objects.filter(phase__in=[*Replica.LIVE_PHASES, Replica.Phase.DRAINING],
                                      deployment__backend__kind="local").exclude(pk=exclude.pk)
        for devices in rows.values_list("devices", flat=True):
            taken.update(d for d in devices.removeprefix("gpu:").removeprefix("cpu:")
                         .split(",") if d)
        return taken

    def _placement(self, deployment: Deployment, replica: Replica) -> tuple[str, dict[str, str]]:
        gpus = self.gpus()
        if gpus:
            from controlplane.engine_args import gpu_count

            needed = gpu_count(deployment.engine_args or {})  # tensor x pipeline parallel
            free = [g for g in gpus if g not in self._taken_devices(replica)]
            if len(free) < needed:
                raise BackendError(f"needs {needed} free GPU(s), {len(free)} of "
                                   f"{len(gpus)} are free")
            chosen = free[:needed]
            return "gpu:" + ",".join(chosen), {"CUDA_VISIBLE_DEVICES": ",".join(chosen)}
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_gib)}
        per_replica = self.config.cpu_cores_per_replica
        if per_replica:
            cores = [str(c) for c in range(os.cpu_count() or 1)]
            free = [c for c in cores if c not in self._taken_devices(replica)]
            if len(free) >= per_replica:
                chosen = free[:per_replica]
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(chosen)
                return "cpu:" + ",".join(chosen), env
        return "", env

    # --- the protocol ----------------------------------------------------------------

    def start(self, deployment: Deployment, replica: Replica) -> None:
        from controlplane.engine_args import engine_command_line
        from controlplane.models import Replica

        refusal = refused_setting(self.config.python, self.config.env)
        if refusal:  # stored before the allow-lists, or a setting narrowed since
            raise BackendError(f"the backend's {refusal[0]}: {refusal[1]}")
        model = deployment.model
        if not model.path or not Path(model.path).is_dir():
            raise BackendError(f"model {model.name} has no local folder to serve")
        devices, placement_env = self._placement(deployment, replica)
        avoid = {port for port in Replica.objects.values_list("port", flat=True) if port}
        port = free_port(self.config.host, avoid)
        log_dir = Path(settings.DATA_DIR) / "replicas"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{replica.name}.log"
        command = [self.config.python or sys.executable, "-m", VLLM_MODULE,
                   *engine_command_line(deployment.engine_args, model_path=model.path,
                                        served_name=deployment.served_model_name(),
                                        port=port, host=self.config.host,
                                        task=model.task),
                   # Health probes would otherwise fill the log a person reads.
                   "--disable-uvicorn-access-log", "--middleware", ENGINE_GUARD]
        # The key goes in the environment, not on the command line: a command line is
        # readable by every local user (ps) and is written to the log below.
        env = {**replica_environment(os.environ), "HF_HUB_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **placement_env,
               **self.config.env, REPLICA_ENV_MARKER: replica.name,
               REPLICA_OWNER_ENV: str(settings.DATA_DIR),
               ENGINE_KEY_ENV: deployment.engine_key(), "PYTHONPATH": PROJECT_ROOT}
        with log_path.open("ab") as log:
            log.write(f"--- fleetplane: starting {replica.name}: {' '.join(command)}\n".encode())
            log.flush()
            try:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=env,
                                           start_new_session=True, cwd=log_dir)
            except OSError as exc:
                raise BackendError(f"could not start vLLM: {exc}") from None
        self._children[process.pid] = process
        replica.pid = process.pid
        try:
            replica.process_started = psutil.Process(process.pid).create_time()
        except psutil.NoSuchProcess:
            replica.process_started = None
        replica.port = port
        replica.endpoint = f"http://{self.config.host}:{port}"
        replica.log_path = str(log_path)
        replica.devices = devices

    def _process(self, replica: Replica) -> psutil.Process | None:
        if not replica.pid:
            return None
        child = self._children.get(replica.pid)
        if child is not None and child.poll() is not None:
            self._children.pop(replica.pid, None)
            return None
        try:
            process = psutil.Process(replica.pid)
            if replica.process_started and abs(process.create_time()
                                               - replica.process_started) > 1.0:
                return None  # the pid was recycled by another process
            if process.status() == psutil.STATUS_ZOMBIE:
                return None
            return process
        except psutil.NoSuchProcess:
            return None

    def observe(self, deployment: Deployment, replica: Replica, *,
                probe_health: bool = True) -> Observation:
        if self._process(replica) is None:
            return Observation(alive=False, healthy=False, message="the process has exited")
        if not probe_health:
            return Observation(alive=True, healthy=True, message="process alive")
        try:
            response = self.http.get(f"{replica.endpoint}/health", timeout=5.0,
                                     headers=vllm_http.auth(deployment.engine_key()))
        except httpx.HTTPError as exc:
            return Observation(alive=True, healthy=False, message=exc.__class__.__name__)
        return Observation(alive=True, healthy=response.status_code == 200,
                           message=f"/health answered {response.status_code}")

    def warm_up(self, deployment: Deployment, replica: Replica) -> None:
        vllm_http.warm_up(self.http, deployment, replica.endpoint)

    def in_flight(self, replica: Replica) -> int | None:
        return vllm_http.in_flight(self.http, replica.endpoint,
                                   replica.deployment.engine_key())

    def stop(self, replica: Replica, *, force: bool) -> None:
        # The whole process group: vLLM's engine core runs in a child process.
        if not replica.pid or self.is_gone(replica):
            return
        try:
            os.killpg(replica.pid, signal.SIGKILL if force else signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass

    def is_gone(self, replica: Replica) -> bool:
        if not replica.pid:
            return True
        child = self._children.get(replica.pid)
        if child is not None and child.poll() is not None:
            self._children.pop(replica.pid, None)
        try:
            os.killpg(replica.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        # Only a zombie leader left (reaped by its parent later) counts as gone.
        try:
            group = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == replica.pid]
        except psutil.Error:
            return False
        return all(_is_zombie(p) for p in group)

    def logs(self, replica: Replica, lines: int) -> list[str]:
        return tail_lines(Path(replica.log_path), lines) if replica.log_path else []

    def cleanup_orphans(self, known: set[str]) -> list[str]:
        stopped: set[str] = set()
        for process, name in owned_processes():
            if name in known:
                continue
            # Every process of the replica, not only its group leader: an engine process
            # whose API server died is an orphan too.
            try:
                process.kill()
                stopped.add(name)
            except psutil.Error:
                continue
        return sorted(stopped)


def owned_processes(data_dir: str | None = None) -> list[tuple[psutil.Process, str]]:
    """Processes of replicas started by the control plane of this data folder."""
    owner = data_dir or str(settings.DATA_DIR)
    found = []
    for process in psutil.process_iter(["pid"]):
        try:
            environ = process.environ()
        except (psutil.Error, OSError):
            continue
        name = environ.get(REPLICA_ENV_MARKER)
        if name and environ.get(REPLICA_OWNER_ENV) == owner:
            found.append((process, name))
    return found


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _is_zombie(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
