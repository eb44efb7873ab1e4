"""JSON bodies are taken as their schema types them, not coerced.

DRF turns `{"name": 0}` into "0", `{"is_active": 0}` into False and `{"replicas": "3"}` into
3. The OpenAPI schema says string, boolean, integer: a client that sends another type has a
bug, and accepting it hides the bug (and lets the schema lie). Used by every serializer
that reads a JSON body; not by those that read query strings, where every value is text.
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

# The JSON types each field accepts; checked before DRF's own (coercing) validation.
ACCEPTED: list[tuple[type[serializers.Field], tuple[type, ...], str]] = [
    (serializers.BooleanField, (bool,), "a boolean"),
    (serializers.IntegerField, (int,), "a whole number"),
    (serializers.FloatField, (int, float), "a number"),
    (serializers.DateTimeField, (str,), "a date-time string"),
    (serializers.ChoiceField, (str,), "a string"),
    (serializers.CharField, (str,), "a string"),
    (serializers.RelatedField, (str,), "a string"),
    (serializers.ListField, (list,), "a list"),
    (serializers.DictField, (dict,), "an object"),
]


def unstorable_text(value: Any) -> bool:
    """Text no database here can store: a NUL character (PostgreSQL refuses it in text and
    JSON) or half of a surrogate pair (not UTF-8 at all), anywhere in a value."""
    if isinstance(value, str):
        if "\x00" in value:
            return True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(unstorable_text(key) or unstorable_text(item) for key, item in value.items())
    if isinstance(value, list):
        return any(unstorable_text(item) for item in value)
    return False


def type_error(field: serializers.Field, value: Any) -> str | None:
    if value is None:
        return None  # the field's own allow_null decides
    for kind, types, name in ACCEPTED:
        if isinstance(field, kind):
            if isinstance(value, bool) and bool not in types:
                return f"must be {name}"
            return None if isinstance(value, types) else f"must be {name}"
    return None


# A serializer mixin: refuse values of the wrong JSON type, naming each field. (A comment,
# not a docstring: the schema would take it as the description of every serializer.)
class StrictJSON(serializers.Serializer):
    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": ["the body must be a JSON object"]})
        errors: dict[str, list[str]] = {}
        for name, field in self.fields.items():
            if field.read_only or field.field_name not in data:
                continue
            problem = type_error(field, data[field.field_name])
            if problem is None and unstorable_text(data[field.field_name]):
                problem = "text may not hold NUL characters or unpaired surrogates"
            if problem:
                errors[name] = [problem]
        if errors:
            raise serializers.ValidationError(errors)
        return super().to_internal_value(data)
