"""Wait until every migration of this code is applied to the database.

The init container of the gateway and controller pods (deploy/kubernetes): on an upgrade
the new pods wait here while the migration Job of the same release brings the schema up to
date, so new code never runs on an old schema, whatever order `kubectl apply` created the
objects in. The old pods keep serving meanwhile (a rolling update removes them only once
new ones are ready). This command never migrates anything itself.
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

from controlplane.management.commands.run_controllers import seconds

# How often the waiting is reported in the pod's log.
REPORT_EVERY_SECONDS = 30.0


def pending_migrations() -> list[str]:
    """The migrations of this code not yet applied to the database, in order."""
    from django.db.migrations.executor import MigrationExecutor

    connection = connections[DEFAULT_DB_ALIAS]
    connection.prepare_database()
    executor = MigrationExecutor(connection)
    plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    return [f"{migration.app_label}.{migration.name}" for migration, _ in plan]


class Command(BaseCommand):
    help = ("Wait until the database schema is up to date (every migration of this code "
            "applied, by `manage.py migrate` or the migration Job); exit 1 after --timeout.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--timeout", type=seconds, default=600.0,
                            help="give up after this many seconds (default 600)")
        parser.add_argument("--interval", type=seconds, default=2.0,
                            help="seconds between two looks (default 2)")

    def handle(self, *args: Any, **options: Any) -> None:
        deadline = time.monotonic() + options["timeout"]
        next_report = 0.0
        while True:
            try:
                pending = pending_migrations()
                why = "waiting for the migrations " + ", ".join(pending[:5]) + (
                    f" and {len(pending) - 5} more" if len(pending) > 5 else "")
            except DatabaseError as exc:
                pending, why = ["?"], f"the database does not answer: {exc}".strip()
            finally:
                connection = connections[DEFAULT_DB_ALIAS]
                if not connection.in_atomic_block:  # a fresh connection for the next look
                    connection.close()
            if not pending:
                self.stdout.write("the database schema is up to date")
                return
            now = time.monotonic()
            if now >= deadline:
                raise CommandError(f"the database schema is not up to date after "
                                   f"{options['timeout']:g} s: {why}. Run this release's "
                                   f"migration Job (docs/operations.md).")
            if now >= next_report:
                self.stdout.write(f"{why} (the migration Job of this release applies them)")
                self.stdout.flush()
                next_report = now + REPORT_EVERY_SECONDS
            time.sleep(min(options["interval"], max(0.0, deadline - now)))
