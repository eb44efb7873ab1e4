from __future__ import annotations

import json
import shlex
from typing import Any

from django import forms

from controlplane.models import Backend
from models_registry.models import Model
from models_registry.services import NAME_PATTERN


def suggesting(datalist: str, url: str) -> forms.TextInput:
    """A name typed with suggestions (static/js/suggest.js), not a list of every object."""
    return forms.TextInput(attrs={"list": datalist, "autocomplete": "off",
                                  "data-suggest": url})


class DeploymentForm(forms.Form):
    name = forms.RegexField(NAME_PATTERN, max_length=63,
                            help_text="lower-case letters, digits, hyphens")
    model = forms.CharField(max_length=100, help_text="a ready model's name", widget=suggesting(
        "model-names", "/api/v1/models/?status=ready&limit=10&search="))
    backend = forms.CharField(max_length=63, required=False,
                              help_text="empty: local processes", widget=suggesting(
                                  "backend-names", "/api/v1/backends/?limit=10&search="))
    replicas = forms.IntegerField(min_value=0, initial=1)
    max_replicas = forms.IntegerField(min_value=1, initial=4)
    max_model_len = forms.IntegerField(min_value=16, required=False)
    extra_args = forms.CharField(required=False, help_text="e.g. --enforce-eager")
    engine_args = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}),
                                  help_text="more engine args as JSON, e.g. "
                                            '{"max_num_seqs": 64}')

    def clean_model(self) -> Model:
        name = self.cleaned_data["model"].strip()
        model = Model.objects.filter(name=name).first()
        if model is None:
            raise forms.ValidationError(f"no model named {name!r}")
        if model.status != Model.Status.READY:
            raise forms.ValidationError(f"model {name!r} is not ready ({model.status})")
        return model

    def clean_backend(self) -> Backend | None:
        name = (self.cleaned_data.get("backend") or "").strip()
        if not name:
            return None
        backend = Backend.objects.filter(name=name).first()
        if backend is None:
            raise forms.ValidationError(f"no backend named {name!r}")
        return backend

    def clean_engine_args(self) -> dict[str, Any]:
        text = self.cleaned_data.get("engine_args") or ""
        if not text.strip():
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"not valid JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("must be a JSON object")
        return value

    def engine_args_value(self) -> dict[str, Any]:
        args = dict(self.cleaned_data["engine_args"])
        if self.cleaned_data.get("max_model_len"):
            args["max_model_len"] = self.cleaned_data["max_model_len"]
        extra = shlex.split(self.cleaned_data.get("extra_args") or "")
        if extra:
            args["extra_args"] = extra
        return args


class ScaleForm(forms.Form):
    replicas = forms.IntegerField(min_value=0)
