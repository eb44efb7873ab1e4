"""What the model list may be filtered and searched by, in the REST API and on the page
(access/listing.py reads and applies it)."""

from __future__ import annotations

from access.listing import Filters, choices_of
from models_registry.models import Model

MODEL_FILTERS = Filters(
    search=("name", "display_name", "architecture"),
    choices={"status": choices_of("status", Model.Status.values),
             "task": choices_of("task", Model.Task.values),
             "source": choices_of("source", Model.Source.values)})
