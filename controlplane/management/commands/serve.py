from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import sys
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import IntegrityError, transaction

from controlplane.envconfig import env_str
from controlplane.services import ensure_local_admin
from controlplane.workers import check_port, follow_supervisor, reuse_port_socket, serve_workers
from models_registry.services import recover_interrupted_imports
from serving.wakeup import until_beat

INITIAL_PASSWORD_FILE = "initial-admin-password"
# The first admin's password, where it is chosen by whoever installs (on Kubernetes: a key
# of the Secret `fleetplane`) instead of generated: used only while no administrator exists.
ADMIN_PASSWORD_VARIABLE = "FLEETPLANE_ADMIN_PASSWORD"
# How long a stopping server waits for the gateway's buffered usage records to be written.
USAGE_FLUSH_ON_STOP_SECONDS = 5.0

logger = logging.getLogger(__name__)

Result = TypeVar("Result")


def write_owner_only(path: Path, text: str) -> Path:
    """Write `text` to a file that only this user may read (mode 0600, also when the file
    was there before)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(descriptor, 0o600)
        os.write(descriptor, (text + "\n").encode())
    finally:
        os.close(descriptor)
    return path


def first_admin() -> tuple[str, str | None, bool]:
    """Make sure someone can log in: (username, the generated password or None, whether
    the password is FLEETPLANE_ADMIN_PASSWORD's). A generated password is returned once,
    for the caller to hand over; one from the environment is never repeated."""
    given = env_str(ADMIN_PASSWORD_VARIABLE)
    try:
        with transaction.atomic():
            username, generated = ensure_local_admin()
            if generated is None or not given:
                return username, generated, False
            user = get_user_model().objects.get(username=username)
            try:
                validate_password(given, user)
            except ValidationError as exc:  # rolls the new account back
                raise CommandError(f"{ADMIN_PASSWORD_VARIABLE}: {' '.join(exc.messages)}"
                                   ) from None
            user.set_password(given)
            user.save(update_fields=["password"])
            return username, None, True
    except IntegrityError:
        # Another server (a second gateway pod) created the account at the same moment.
        username, generated = ensure_local_admin()
        return username, generated, False


def run_event_loop(main: Coroutine[Any, Any, Result]) -> Result:
    """uvloop where it is installed (it is, with uvicorn[standard]): the relay's speed."""
    # Helper threads (usage writer, reconciler queries) hand the interpreter back to the
    # event loop after 1 ms instead of Python's default 5 ms: a stream's next token does not
    # wait behind a batch insert.
    sys.setswitchinterval(0.001)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


class Command(BaseCommand):
    help = ("Run the control plane: the ASGI server (pages, REST API, WebSockets) and the "
            "controllers (reconciler), in one process (or, with --workers N, N server "
            "processes on one port and the controllers in their parent).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=settings.SERVE_HOST)
        parser.add_argument("--port", type=int, default=settings.SERVE_PORT)
        parser.add_argument("--log-level", default=settings.LOG_LEVEL.lower())
        parser.add_argument("--no-controllers", action="store_true",
                            help="serve only; run `manage.py run_controllers` elsewhere")
        parser.add_argument("--graceful-shutdown-seconds", type=int, default=None,
                            help="at SIGTERM, how long requests in flight (streams) may "
                                 "take to finish before they are cut (default: no bound; "
                                 "deploy/kubernetes/gateway.yaml sets 100)")
        parser.add_argument("--workers", type=int, default=settings.GATEWAY_WORKERS,
                            help="server processes on the one port (SO_REUSEPORT), the "
                                 "controllers run once, in their parent; above 1 needs "
                                 "REDIS_URL (default: GATEWAY_WORKERS, 1)")
        # Set by --workers for each process it starts.
        parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)

    def handle(self, *args: Any, **options: Any) -> None:
        grace, workers = options["graceful_shutdown_seconds"], options["workers"]
        if options["worker_index"] is not None:
            follow_supervisor()
            run_event_loop(self.serve(options["host"], options["port"], options["log_level"],
                                      controllers=False, graceful_shutdown=grace,
                                      reuse_port=True))
            return
        if not 1 <= workers <= 256:
            raise CommandError("--workers: a whole number from 1 to 256")
        if workers > 1 and not settings.REDIS_URL:
            raise CommandError("--workers above 1 needs REDIS_URL: the workers share the "
                               "route table, key changes, rate limits and their figures "
                               "through Redis (docs/operations.md, \"Worker processes\")")
        interrupted = recover_interrupted_imports()
        if interrupted:
            self.stderr.write(f"{interrupted} model import(s) were interrupted by a restart "
                              f"and are marked failed")
        if grace is not None and grace < 1:
            raise CommandError("--graceful-shutdown-seconds: a whole number of at least 1")
        username, password, from_environment = first_admin()
        host, port = options["host"], options["port"]
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        url = f"http://{shown_host}:{port}/"
        if workers > 1:
            check_port(host, port)
        self.stdout.write(f"\nFleetplane is starting on {url}"
                          + (f" with {workers} worker processes" if workers > 1 else ""))
        if from_environment:
            self.stdout.write(f"Log in as {username!r} with the password set in "
                              f"{ADMIN_PASSWORD_VARIABLE}. Change it with: python manage.py "
                              f"changepassword {username}")
        elif password and not settings.DEBUG:
            # Production logs are collected and kept: the password goes into a file only
            # this user can read, and the log says where.
            path = write_owner_only(Path(settings.DATA_DIR) / INITIAL_PASSWORD_FILE, password)
            self.stdout.write(f"Log in as {username!r} with the password in {path} (readable "
                              f"by this user only).\nChange it with: python manage.py "
                              f"changepassword {username}, then delete the file.")
        elif password:
            self.stdout.write(f"Log in as {username!r} with password {password!r}.\n"
                              f"This password is shown only now and stored hashed; change it "
                              f"with: python manage.py changepassword {username}")
        else:
            self.stdout.write(f"Log in as {username!r} (the password was printed at first "
                              f"start; reset it with: python manage.py changepassword "
                              f"{username})")
        self.stdout.write("", ending="\n")
        self.stdout.flush()
        if workers > 1:
            self.supervise(workers, options)
            return
        run_event_loop(self.serve(host, port, options["log_level"],
                                  controllers=not options["no_controllers"],
                                  graceful_shutdown=grace))

    def supervise(self, workers: int, options: dict[str, Any]) -> None:
        """Run the workers of --workers (and the controllers) until a signal stops them."""
        arguments = ["--host", options["host"], "--port", str(options["port"]),
                     "--log-level", options["log_level"]]
        if options["graceful_shutdown_seconds"] is not None:
            arguments += ["--graceful-shutdown-seconds",
                          str(options["graceful_shutdown_seconds"])]
        if run_event_loop(serve_workers(arguments, workers,
                                        controllers=not options["no_controllers"])):
            raise CommandError("a gateway worker kept failing: stopped (see above)")

    async def serve(self, host: str, port: int, log_level: str, *, controllers: bool,
                    graceful_shutdown: int | None = None, reuse_port: bool = False) -> None:
        import uvicorn

        from controlplane.controllers import run_controllers
        from controlplane.http_protocol import HttpProtocol

        config = uvicorn.Config("controlplane.asgi:application", host=host, port=port,
                                # uvicorn's httptools protocol, a response's head written
                                # with its first body bytes (controlplane/http_protocol.py)
                                http=HttpProtocol,
                                log_level=log_level, lifespan="off", access_log=False,
                                # X-Forwarded-For is believed only from TRUSTED_PROXIES, in
                                # serving/proxies.py; uvicorn's own default trusts 127.0.0.1.
                                proxy_headers=False,
                                # Frames between WEBSOCKET_MAX_MESSAGE_BYTES and this get an
                                # error message from the consumer; above it the socket closes.
                                ws_max_size=4 * settings.WEBSOCKET_MAX_MESSAGE_BYTES,
                                # Then streams still running are cancelled, and the usage
                                # they recorded is written below, before the kubelet's
                                # SIGKILL at terminationGracePeriodSeconds.
                                timeout_graceful_shutdown=graceful_shutdown)

        class Server(uvicorn.Server):
            # uvicorn re-raises the SIGINT/SIGTERM it caught as soon as serve() returns,
            # which ends the process before anything after it runs: the signals are
            # captured around the whole shutdown below instead.
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

            main_loop = quiet_main_loop
            handle_exit = waking_handle_exit

        server = Server(config)
        stop = asyncio.Event()
        with uvicorn.Server.capture_signals(server):
            # A worker of --workers binds its own socket with SO_REUSEPORT beside the others.
            sockets = [reuse_port_socket(host, port)] if reuse_port else None
            tasks = [asyncio.create_task(server.serve(sockets=sockets))]
            if controllers:
                tasks.append(asyncio.create_task(run_controllers(stop)))
            await tasks[0]
            # uvicorn handled SIGINT/SIGTERM, let the requests in flight finish and
            # returned: write the usage records they left buffered and send the tokens
            # they owe to budgets in Redis (both within one allowance: the manifests'
            # grace period counts on it), then stop the controllers too. Replica
            # processes keep running and are adopted at the next start. Leaving this
            # block re-raises the signal, as uvicorn does.
            await asyncio.gather(settle_gateway(USAGE_FLUSH_ON_STOP_SECONDS),
                                 flush_usage(USAGE_FLUSH_ON_STOP_SECONDS))
            stop.set()
            await asyncio.gather(*tasks[1:], return_exceptions=True)


async def quiet_main_loop(server: Any) -> None:
    """uvicorn's main loop, woken once a second (to renew the Date header) or at once by
    a stopping signal, where uvicorn's own wakes ten times a second to look for one: an
    idle server's event loop stays asleep (uvicorn's were most of an idle gateway's wake-ups)."""
    loop = asyncio.get_running_loop()
    server.fleet_loop = loop
    freeze_startup_objects()
    counter = 0
    should_exit = await server.on_tick(counter)
    while not should_exit:
        server.fleet_wake = wake = loop.create_future()
        timer = loop.call_later(until_beat(1.0), ring, server)
        try:
            await wake
        finally:
            timer.cancel()
        counter = (counter + 10) % 864000  # uvicorn renews the header when % 10 == 0
        should_exit = await server.on_tick(counter)


# The cycle collector's thresholds once serving: the youngest generation is scanned after
# 20,000 new containers rather than Python's 700. A request's objects (its task, scope,
# call, futures, dicts; a few hundred) are freed by reference counting when it ends, none
# left in cycles (controlplane/http_protocol.py). At 700, with each request's objects in
# a cycle as they were, a burst had them scanned, and promoted to be scanned again, while
# still in use: 15 collections per 100 requests at 128 paced streams, against none now
# (bench/gateway_overhead.py --compare-with, which reads python_gc_collections_total). A
# young collection, when one comes, scans at most some 20,000 objects (bench/gc_pause.py).
SERVING_GC_THRESHOLDS = (20_000, 10, 10)


def freeze_startup_objects() -> None:
    """What the server built to start (Django, its apps and settings, the ASGI
    application: about 100,000 objects) is kept for the process's life: taken out of what
    the cycle collector scans, so its full collections, which come now and then as answers
    end, look at what requests left rather than stalling the event loop for some 25 ms
    (bench/gc_pause.py). Garbage is collected first, so none of it is kept. From then on
    the collector runs at SERVING_GC_THRESHOLDS."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


def ring(server: Any) -> None:
    """Wake `quiet_main_loop` now."""
    wake = getattr(server, "fleet_wake", None)
    if wake is not None and not wake.done():
        wake.set_result(None)


def waking_handle_exit(server: Any, sig: int, frame: Any) -> None:
    """uvicorn's signal handler, and the main loop woken to act on it at once."""
    import uvicorn

    uvicorn.Server.handle_exit(server, sig, frame)
    loop = getattr(server, "fleet_loop", None)
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(ring, server)


async def settle_gateway(timeout: float) -> None:
    """Send the tokens the last answers owe their budgets, and wait for the charges
    still under way (serving/gateway/resources.py), giving up after `timeout` seconds."""
    from serving.gateway import gateway

    resources = gateway.current_resources
    if resources is not None and resources.loop is asyncio.get_running_loop():
        await resources.settle(timeout)


async def flush_usage(timeout: float) -> None:
    """Write the gateway's buffered usage records (lifespan is off, so nothing else does
    at shutdown), in this event loop, giving up after `timeout` seconds."""
    from serving.gateway import gateway

    writer = gateway.usage
    if writer is None:
        return
    try:
        written = await asyncio.wait_for(writer.flush(), timeout)
    except TimeoutError:
        logger.warning("buffered usage records were not written within %.0f s of "
                       "stopping and are lost", timeout)
        return
    if writer.buffer:  # the database was out of reach: flush() kept them
        logger.warning("could not write %d usage records before stopping",
                       len(writer.buffer))
    elif written:
        logger.info("wrote %d buffered usage records before stopping", written)
