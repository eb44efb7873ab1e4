from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from serving.models import ApiKey
from serving.services import KeyRequestError, create_api_key


def expiry(text: str) -> datetime:
    """`30d`, `12h` or an ISO date/time (UTC unless it says otherwise)."""
    units = {"d": "days", "h": "hours", "m": "minutes"}
    if text[-1:] in units and text[:-1].isdigit():
        return timezone.now() + timedelta(**{units[text[-1]]: int(text[:-1])})
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(f"--expires {text!r}: use 30d, 12h, 45m or an ISO date") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise CommandError(f"{text!r} is not a whole number of at least 1")
    return int(text)


class Command(BaseCommand):
    help = "Create an API key; the key is printed once, on the last line, and stored hashed."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True, help="what the key is for")
        parser.add_argument("--scope", default=ApiKey.Scope.INFERENCE,
                            choices=ApiKey.Scope.values)
        parser.add_argument("--team", help="the team the key belongs to (shares its budget)")
        parser.add_argument("--user", help="the user the key belongs to")
        parser.add_argument("--models", default="",
                            help="comma-separated model or deployment names (default: all)")
        parser.add_argument("--priority", help="the highest priority class the key may use "
                                               "(default: standard)")
        parser.add_argument("--rpm", type=positive, help="requests per minute")
        parser.add_argument("--tpm", type=positive, help="tokens per minute")
        parser.add_argument("--expires", type=expiry, help="30d, 12h, 45m or an ISO date")

    def handle(self, *args: Any, **options: Any) -> None:
        models = [m for m in options["models"].split(",") if m.strip()]
        try:
            record, key = create_api_key(
                options["name"], options["scope"], team=options["team"],
                user=options["user"], models=models, priority=options["priority"],
                rpm=options["rpm"], tpm=options["tpm"], expires_at=options["expires"],
                actor="manage.py create_api_key")
        except KeyRequestError as exc:
            raise CommandError(f"--{exc.field.replace('_at', '')}: {exc}") from None
        self.stderr.write(f"Created {record.scope} key {record.name!r}. It is shown only "
                          f"now; store it safely.")
        self.stdout.write(key)
