from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane import liveness

# How long the controllers have to end once stopped (a signal, or the Lease lost) before
# the process exits anyway: a pass hung in a worker thread would otherwise keep it alive.
STOP_WAIT_SECONDS = 20.0

logger = logging.getLogger(__name__)


def port_number(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise CommandError(f"--health-port {text!r}: a port number from 1 to 65535")
    return int(text)


def seconds(text: str) -> float:
    """A command's seconds option: a number above 0 (--stall-seconds, --timeout ...)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise CommandError(f"{text!r}: a number of seconds above 0")
    return value


class Command(BaseCommand):
    help = ("Run the controllers (reconciler) alone, for a control plane whose gateway and "
            "pages run in other processes (`manage.py serve --no-controllers`).")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--health-port", type=port_number, default=None,
                            help="serve /livez and /readyz on this port (off when not "
                                 "given; deploy/kubernetes uses 8081)")
        parser.add_argument("--health-host", default="0.0.0.0",
                            help="the address of the health checks (default: all, so the "
                                 "kubelet reaches them)")
        parser.add_argument("--stall-seconds", type=seconds,
                            default=liveness.default_stall_seconds(
                                settings.RECONCILE_INTERVAL_SECONDS),
                            help="/livez fails when no reconcile pass (or, waiting for the "
                                 "Lease, no election attempt) has completed for this long "
                                 "(default: 3 x RECONCILE_INTERVAL_SECONDS + 15)")

    def handle(self, *args: Any, **options: Any) -> None:
        stuck = asyncio.run(self.run(options["health_port"], options["health_host"],
                                     options["stall_seconds"]))
        if stuck:
            # The hung thread would keep the interpreter from exiting: leave now, and let
            # Kubernetes start a fresh process.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    async def run(self, health_port: int | None, health_host: str,
                  stall_seconds: float, stop: asyncio.Event | None = None) -> bool:
        """Run until stopped; True when the controllers did not end within
        STOP_WAIT_SECONDS of the stop (a pass is stuck)."""
        from controlplane.controllers import run_controllers

        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        beat = liveness.heartbeat
        beat.restart()
        beat.stall_seconds = stall_seconds
        closed = asyncio.Event()
        health = None
        if health_port is not None:
            health = loop.create_task(liveness.serve_health(beat, health_host, health_port,
                                                            closed))
        self.stdout.write("controllers running; replica processes outlive this command and "
                          "are adopted at its next start")
        self.stdout.flush()
        controllers = loop.create_task(run_controllers(stop))
        stopping = loop.create_task(stop.wait())
        try:
            await asyncio.wait({controllers, stopping}, return_when=asyncio.FIRST_COMPLETED)
            try:
                await asyncio.wait_for(asyncio.shield(controllers), STOP_WAIT_SECONDS)
            except TimeoutError:
                logger.error("the controllers did not stop within %.0f s (a reconcile pass "
                             "is stuck: %.0f s since the last one ended): exiting",
                             STOP_WAIT_SECONDS, beat.age())
                return True
            return False
        finally:
            stopping.cancel()
            closed.set()
            if health is not None:
                await health
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
