"""Filtering, search and paging shared by the REST API's lists and the pages.

A `Filters` names the query parameters a list takes: `search` (a case-insensitive match
on a few fields), exact names (`model=`, `backend=`, `deployment=`) and choices (`state=`,
`phase=`, `status=`). Each is given at most once; a choice outside its values, a search
over SEARCH_MAX_CHARACTERS or a NUL character is refused with the parameter named (a 400
in the API, a message on a page). Pages show PAGE_SIZE rows a page; a page number that is
not a number, below 1 or past the end is clamped and said so, never an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.paginator import Paginator
from django.db.models import Q, QuerySet
from django.http import HttpRequest, QueryDict

SEARCH_MAX_CHARACTERS = 100
PAGE_SIZE = 50  # rows on a page of the console


class FilterError(ValueError):
    """A filter parameter that cannot be read: `param` and why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


def choices_of(field_name: str, values: list[str]) -> dict[str, Q]:
    """A choice parameter whose values are the field's own."""
    return {value: Q(**{field_name: value}) for value in values}


@dataclass(frozen=True)
class Filters:
    """The filter parameters of one list."""

    search: tuple[str, ...] = ()  # fields `search` matches (icontains), any of them
    exact: Mapping[str, str] = field(default_factory=dict)  # parameter: field
    # parameter: {value: its condition, or a callable that makes it when the list is read}
    choices: Mapping[str, Mapping[str, Q | Callable[[], Q]]] = field(default_factory=dict)
    describe: Mapping[str, str] = field(default_factory=dict)  # parameter: what it does

    @property
    def params(self) -> list[str]:
        return [*(["search"] if self.search else []), *self.exact, *self.choices]

    def read(self, values: Callable[[str], list[str]]) -> dict[str, str]:
        """The parameters given (text stripped, a choice as written, empty ones left out),
        checked."""
        given: dict[str, str] = {}
        for param in self.params:
            found = values(param)
            if len(found) > 1:
                raise FilterError(param, "give it once")
            value = found[0] if found else ""
            if param not in self.choices:  # a choice is taken as written: "running " is not one
                value = value.strip()
            if not value:
                continue
            if "\x00" in value:
                raise FilterError(param, "may not hold NUL characters")
            if len(value) > SEARCH_MAX_CHARACTERS:
                raise FilterError(param, f"at most {SEARCH_MAX_CHARACTERS} characters")
            if param in self.choices and value not in self.choices[param]:
                raise FilterError(param, "must be one of " + ", ".join(self.choices[param]))
            given[param] = value
        return given

    def apply(self, queryset: QuerySet[Any], given: Mapping[str, str]) -> QuerySet[Any]:
        if given.get("search"):
            match = Q()
            for name in self.search:
                match |= Q(**{f"{name}__icontains": given["search"]})
            queryset = queryset.filter(match)
        for param, name in self.exact.items():
            if param in given:
                queryset = queryset.filter(**{name: given[param]})
        for param, options in self.choices.items():
            if param in given:
                condition = options[given[param]]
                queryset = queryset.filter(condition if isinstance(condition, Q)
                                           else condition())
        return queryset


@dataclass
class PageView:
    """One page of a list for a template: its rows, where it is, and the links."""

    rows: list[Any]
    number: int
    pages: int
    count: int
    first_row: int
    query: QueryDict  # the filters (no page): kept by every link
    param: str = "page"  # the query parameter of this list's page number
    notice: str = ""  # set when the page asked for was clamped

    def link(self, number: int) -> str:
        query = self.query.copy()
        if number > 1:
            query[self.param] = str(number)
        text = query.urlencode()
        return f"?{text}" if text else "?"

    @property
    def previous_link(self) -> str | None:
        return self.link(self.number - 1) if self.number > 1 else None

    @property
    def next_link(self) -> str | None:
        return self.link(self.number + 1) if self.number < self.pages else None

    @property
    def last_row(self) -> int:
        return self.first_row + len(self.rows) - 1 if self.rows else 0


def requested_page(raw: str | None) -> tuple[int, bool]:
    """The page number asked for, and whether it was readable: anything but a whole
    number from 1 is page 1 (a number too long to mean a page is clamped later)."""
    if raw is None or raw == "":
        return 1, True
    text = raw.strip()
    if not text.isdigit() or not text.isascii():
        return 1, False
    if len(text) > 9:
        return 10**9, True
    number = int(text)
    return (number, True) if number >= 1 else (1, False)


def page_of(request: HttpRequest, queryset: QuerySet[Any], param: str = "page",
            size: int = PAGE_SIZE) -> PageView:
    """The page of `queryset` named by `?<param>=` (clamped to the pages there are)."""
    number, readable = requested_page(request.GET.get(param))
    paginator = Paginator(queryset, size, allow_empty_first_page=True)
    pages = paginator.num_pages
    notice = "" if readable else f"{param} must be a whole number from 1: showing page 1"
    if number > pages:
        notice = f"there are {pages} page{'s' if pages != 1 else ''}: showing the last"
        number = pages
    page = paginator.page(number)
    query = request.GET.copy()
    query.pop(param, None)
    return PageView(rows=list(page.object_list), number=number, pages=pages,
                    count=paginator.count, first_row=page.start_index(), query=query,
                    param=param, notice=notice)


def filtered_page(request: HttpRequest, queryset: QuerySet[Any], filters: Filters,
                  param: str = "page", size: int = PAGE_SIZE
                  ) -> tuple[PageView, dict[str, str], str]:
    """For a page: the filtered page, the filters given, and the error of a filter that
    could not be read (then the list is empty and the page says why)."""
    try:
        given = filters.read(request.GET.getlist)
    except FilterError as exc:
        return page_of(request, queryset.none(), param, size), {}, str(exc)
    return page_of(request, filters.apply(queryset, given), param, size), given, ""
