from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from serving.models import ApiKey
from serving.services import create_api_key


class Command(BaseCommand):
    help = "Create an API key; the key is printed once, on the last line, and stored hashed."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True, help="what the key is for")
        parser.add_argument("--scope", required=True, choices=ApiKey.Scope.values)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            record, key = create_api_key(options["name"], options["scope"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stderr.write(f"Created {record.scope} key {record.name!r}. It is shown only "
                          f"now; store it safely.")
        self.stdout.write(key)
