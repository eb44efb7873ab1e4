"""The filter and search parameters of the REST API's lists (access/listing.py): applied
to a viewset's `list`, a parameter that cannot be read a 400 naming it, and described in
the schema. (Apart from pagination.py, which settings name: importing DRF's viewsets there
would import the settings' own classes in a circle.)"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter
from rest_framework import serializers, viewsets

from access.listing import SEARCH_MAX_CHARACTERS, FilterError, Filters


class FilteredList(viewsets.GenericViewSet):  # type: ignore[type-arg]
    """For a viewset: its `filters` (access/listing.py) applied to the `list` action's
    queryset; a parameter that cannot be read is a 400 naming it."""

    filters: Filters = Filters()

    def filter_queryset(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        queryset = super().filter_queryset(queryset)
        if getattr(self, "action", None) != "list":
            return queryset
        try:
            given = self.filters.read(self.request.query_params.getlist)
        except FilterError as exc:
            raise serializers.ValidationError({exc.param: [exc.message]}) from None
        return self.filters.apply(queryset, given)


# A filter's text: what access/listing.py reads (no NUL, at most so many characters).
FILTER_TEXT = {"type": "string", "maxLength": SEARCH_MAX_CHARACTERS, "pattern": "^[^\\u0000]*$"}


def filter_parameters(filters: Filters) -> list[OpenApiParameter]:
    """The schema's description of a list's filter parameters."""
    found: list[OpenApiParameter] = []
    if filters.search:
        found.append(OpenApiParameter(
            "search", FILTER_TEXT, description=filters.describe.get(
                "search", "part of " + " or ".join(f.split("__")[0] for f in filters.search))
            + f" (case-insensitive; at most {SEARCH_MAX_CHARACTERS} characters)"))
    for param in filters.exact:
        found.append(OpenApiParameter(param, FILTER_TEXT, description=filters.describe.get(
            param, f"only those of this {param} (its name)")))
    for param, options in filters.choices.items():
        # Empty is any (what a page's "any" choice sends), so the schema lists it.
        found.append(OpenApiParameter(param, str, enum=["", *options],
                                      description=(filters.describe.get(param, "")
                                                   + " (empty: any)").lstrip()))
    return found
