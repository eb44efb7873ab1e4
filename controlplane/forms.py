from __future__ import annotations

import json
import shlex
from typing import Any

from django import forms

from controlplane.models import Backend
from models_registry.models import Model
from models_registry.services import NAME_PATTERN


class DeploymentForm(forms.Form):
    name = forms.RegexField(NAME_PATTERN, max_length=63,
                            help_text="lower-case letters, digits, hyphens")
    model = forms.ModelChoiceField(queryset=Model.objects.filter(status=Model.Status.READY),
                                   to_field_name="name")
    backend = forms.ModelChoiceField(queryset=Backend.objects.all(), to_field_name="name",
                                     required=False, help_text="empty: local processes")
    replicas = forms.IntegerField(min_value=0, initial=1)
    max_replicas = forms.IntegerField(min_value=1, initial=4)
    max_model_len = forms.IntegerField(min_value=16, required=False)
    extra_args = forms.CharField(required=False, help_text="e.g. --enforce-eager")
    engine_args = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}),
                                  help_text="more engine args as JSON, e.g. "
                                            '{"max_num_seqs": 64}')

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
