"""The OpenAPI schema declares the errors every operation can answer, in the API's shape.

A client generated from the schema must know every status it may get: DRF answers 400 for
bad input (`{"field": ["message"]}`, nested for objects), 401/403 for a missing or weak
credential, 404 for an unknown name, 409 for a conflict (controlplane/api/errors.py) and 415
for a body that is not JSON, all as `{"detail": "..."}` except 400.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.plumbing import ResolvedComponent
from rest_framework import serializers

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "what went wrong, in a sentence",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}
VALIDATION_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "each field at fault (dotted for nested settings, `non_field_errors` for "
                   "the body as a whole) with its messages",
    "additionalProperties": {},
}
DESCRIPTIONS = {
    "400": "bad input: the fields at fault, each with its reasons",
    "401": "no credential, or one that is not valid",
    "403": "the credential's role may not do this",
    "404": "nothing of that name",
    "409": "conflicts with the current state (in use, already being changed, unknown size)",
    "413": "the request body is too large",
    "415": "the body is not JSON",
}
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# DRF refuses NUL characters in every text field; the schema says so.
NO_NUL = "^[^\\u0000]*$"


class ApiSchema(AutoSchema):
    def _error_ref(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        component = ResolvedComponent(name=name, type=ResolvedComponent.SCHEMA,
                                      schema=schema, object=name)
        self.registry.register_on_missing(component)
        return component.ref

    def error_codes(self) -> list[str]:
        codes = ["400", "401", "403"]
        if "{" in self.path:
            codes.append("404")
        if self.method in WRITE_METHODS:
            codes += ["409", "413", "415"]
        return codes

    def _map_serializer_field(self, field: Any, direction: Any,
                              bypass_extensions: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = super()._map_serializer_field(field, direction,
                                                               bypass_extensions)
        if (isinstance(field, serializers.CharField) and result.get("type") == "string"
                and not field.read_only):
            if not field.allow_blank:
                result.setdefault("minLength", 1)
            if not isinstance(field, serializers.RegexField) and not (
                    {"pattern", "format", "enum"} & result.keys()):
                result["pattern"] = NO_NUL
        return result

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        for code in self.error_codes():
            if code in responses:
                continue
            name, schema = (("ValidationError", VALIDATION_ERROR_SCHEMA) if code == "400"
                            else ("Error", ERROR_SCHEMA))
            responses[code] = {
                "description": DESCRIPTIONS[code],
                "content": {"application/json": {"schema": self._error_ref(name, schema)}},
            }
        return responses
