"""Bounded paging for every list of the REST API.

DRF's LimitOffsetPagination quietly ignores a `limit` it cannot read and has no cap unless
told; here a limit above API_MAX_PAGE_SIZE is cut to it, and a limit or offset that is not
a whole number in range is a 400 naming the parameter, as the schema says.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from rest_framework import serializers
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.utils.urls import replace_query_param

from access.strict_json import unstorable_text

# Past this an offset is no page anyone reads, and SQLite cannot hold it (a 500 otherwise).
MAX_OFFSET = 2**31 - 1


def max_page_size() -> int:
    return int(settings.API_MAX_PAGE_SIZE)


def single_param(request: Request, name: str) -> str | None:
    """A query parameter given at most once (a repeated one is a 400: which would count?)."""
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise serializers.ValidationError({name: ["give it once"]})
    if values and unstorable_text(values[0]):
        raise serializers.ValidationError({name: ["may not hold NUL characters"]})
    return values[0] if values else None


def count_param(request: Request, name: str, default: int, *, minimum: int,
                maximum: int, clamp: bool = False) -> int:
    """A whole-number query parameter: `default` when absent, a 400 naming it when it is not
    a whole number from `minimum` (and up to `maximum` unless `clamp` cuts it there)."""
    raw = single_param(request, name)
    if raw is None:
        return default
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise serializers.ValidationError({name: ["must be a whole number"]}) from None
    if value < minimum or (value > maximum and not clamp):
        raise serializers.ValidationError({name: [f"must be from {minimum} to {maximum}"]})
    return min(value, maximum)


class Page(LimitOffsetPagination):
    def get_limit(self, request: Request) -> int:
        cap = max_page_size()
        return count_param(request, self.limit_query_param, min(self.default_limit or cap, cap),
                           minimum=1, maximum=cap, clamp=True)

    def get_offset(self, request: Request) -> int:
        return count_param(request, self.offset_query_param, 0, minimum=0, maximum=MAX_OFFSET)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        cap = max_page_size()
        return [
            {"name": self.limit_query_param, "required": False, "in": "query",
             "description": f"rows per page (default {self.default_limit}; above {cap} "
                            f"is cut to {cap})",
             "schema": {"type": "integer", "minimum": 1}},
            {"name": self.offset_query_param, "required": False, "in": "query",
             "description": "rows to skip", "schema": {"type": "integer", "minimum": 0,
                                                       "maximum": MAX_OFFSET}},
        ]


class BoundedCountPage(Page):
    """For tables that grow without bound (the audit log): the page is read with one row
    more to know whether another follows, and `count` is counted up to EVENTS_COUNT_LIMIT
    only (a COUNT over a LIMIT subquery); past it, `count` is the limit and `count_capped`
    is true. A first page that holds every row needs no count query at all."""

    count_capped = False

    def paginate_queryset(self, queryset: QuerySet[Any], request: Request,
                          view: Any = None) -> list[Any]:
        self.request = request
        self.limit = self.get_limit(request)
        self.offset = self.get_offset(request)
        rows = list(queryset[self.offset:self.offset + self.limit + 1])
        self.more = len(rows) > self.limit
        rows = rows[:self.limit]
        if self.offset == 0 and not self.more:
            self.count = len(rows)
        else:
            cap = int(settings.EVENTS_COUNT_LIMIT)
            counted = queryset.order_by()[:cap + 1].count()
            self.count_capped = counted > cap
            self.count = min(counted, cap)
        self.display_page_controls = self.offset > 0 or self.more
        return rows

    def get_next_link(self) -> str | None:
        if not self.more or self.request is None or self.limit is None:
            return None
        url = self.request.build_absolute_uri()
        url = replace_query_param(url, self.limit_query_param, self.limit)
        return replace_query_param(url, self.offset_query_param, (self.offset or 0) + self.limit)

    def get_paginated_response(self, data: Any) -> Response:
        return Response({"count": self.count, "count_capped": self.count_capped,
                         "next": self.get_next_link(), "previous": self.get_previous_link(),
                         "results": data})

    def get_paginated_response_schema(self, schema: dict[str, Any]) -> dict[str, Any]:
        paged = super().get_paginated_response_schema(schema)
        paged["properties"]["count"]["description"] = (
            f"rows in all, counted up to EVENTS_COUNT_LIMIT "
            f"({settings.EVENTS_COUNT_LIMIT})")
        paged["properties"]["count_capped"] = {
            "type": "boolean", "description": "true: there are more rows than `count`"}
        return paged

