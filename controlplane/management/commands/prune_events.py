"""Delete audit events past their retention now (the controllers also do it every
AUDIT_PRUNE_INTERVAL_SECONDS): rows last seen more than AUDIT_RETENTION_DAYS ago, and
security events (controlplane/audit_log.py SECURITY_ACTIONS) more than
AUDIT_SECURITY_RETENTION_DAYS ago. `--dry-run` prints what would go and deletes nothing."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count, Max, Min

from controlplane.audit_log import Cutoffs, expired, prune_events


class Command(BaseCommand):
    help = ("Delete audit events past AUDIT_RETENTION_DAYS (security events past "
            "AUDIT_SECURITY_RETENTION_DAYS); --dry-run only prints what would go.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true",
                            help="print what would be deleted, delete nothing")

    def handle(self, *args: Any, dry_run: bool = False, **options: Any) -> None:
        cutoffs = Cutoffs.from_settings()
        self.stdout.write(f"retention: events last seen before {cutoffs.ordinary:%Y-%m-%d %H:%M}"
                          f" UTC, security events before {cutoffs.security:%Y-%m-%d %H:%M} UTC")
        by_action = (expired(cutoffs).order_by().values("action")
                     .annotate(rows=Count("id"), oldest=Min("last_seen"),
                               newest=Max("last_seen")).order_by("action"))
        total = 0
        for row in by_action:
            total += row["rows"]
            self.stdout.write(f"  {row['action']}: {row['rows']} "
                              f"(last seen {row['oldest']:%Y-%m-%d} to {row['newest']:%Y-%m-%d})")
        if dry_run:
            self.stdout.write(f"dry run: {total} events would be deleted; none were")
            return
        deleted = 0
        while True:
            batch = prune_events(cutoffs)
            deleted += batch
            if not batch:
                break
        self.stdout.write(f"deleted {deleted} events")
