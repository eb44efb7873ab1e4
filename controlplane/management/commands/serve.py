from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from controlplane.services import ensure_local_admin
from models_registry.services import recover_interrupted_imports


class Command(BaseCommand):
    help = "Run the control plane: the ASGI server (pages, REST API, WebSockets)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=settings.SERVE_HOST)
        parser.add_argument("--port", type=int, default=settings.SERVE_PORT)
        parser.add_argument("--log-level", default=settings.LOG_LEVEL.lower())

    def handle(self, *args: Any, **options: Any) -> None:
        import uvicorn

        interrupted = recover_interrupted_imports()
        if interrupted:
            self.stderr.write(f"{interrupted} model import(s) were interrupted by a restart "
                              f"and are marked failed")
        username, password = ensure_local_admin()
        host, port = options["host"], options["port"]
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        url = f"http://{shown_host}:{port}/"
        self.stdout.write(f"\nFleetplane is starting on {url}")
        if password:
            self.stdout.write(f"Log in as {username!r} with password {password!r}.\n"
                              f"This password is shown only now and stored hashed; change it "
                              f"with: python manage.py changepassword {username}")
        else:
            self.stdout.write(f"Log in as {username!r} (the password was printed at first "
                              f"start; reset it with: python manage.py changepassword "
                              f"{username})")
        self.stdout.write("", ending="\n")
        self.stdout.flush()
        uvicorn.run("controlplane.asgi:application", host=host, port=port,
                    log_level=options["log_level"], lifespan="off", access_log=False)
