from __future__ import annotations

import asyncio
import signal
from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = ("Run the controllers (reconciler) alone, for a control plane whose gateway and "
            "pages run in other processes (`manage.py serve --no-controllers`).")

    def handle(self, *args: Any, **options: Any) -> None:
        asyncio.run(self.run())

    async def run(self) -> None:
        from controlplane.controllers import run_controllers

        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        self.stdout.write("controllers running; replica processes outlive this command and "
                          "are adopted at its next start")
        self.stdout.flush()
        await run_controllers(stop)
