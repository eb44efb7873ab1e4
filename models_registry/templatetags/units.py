"""Number formatting for the registry pages."""

from __future__ import annotations

from django import template

register = template.Library()


@register.filter
def bytes_human(value: int | float | None) -> str:
    if value is None:
        return "—"
    number = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(number) < 1024 or unit == "TiB":
            return f"{number:.0f} {unit}" if unit == "B" else f"{number:.1f} {unit}"
        number /= 1024
    return f"{number:.1f} TiB"


@register.filter
def count_human(value: int | None) -> str:
    if value is None:
        return "—"
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return str(value)


@register.filter
def thousands(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"
