from __future__ import annotations

from django import forms

from models_registry.capacity import (
    DEFAULT_OVERHEAD_GIB,
    DEFAULT_SEQUENCE_LENGTH,
    DEFAULT_UTILIZATION,
    KV_CACHE_DTYPES,
)
from models_registry.models import Model


class RegisterModelForm(forms.Form):
    name = forms.SlugField(max_length=100, help_text="lower-case letters, digits, hyphens")
    source = forms.ChoiceField(choices=Model.Source.choices)
    location = forms.CharField(max_length=1000, help_text="folder, GGUF file, owner/name, "
                               "or an installed package's name")
    display_name = forms.CharField(max_length=200, required=False)


class CapacityForm(forms.Form):
    memory_gib = forms.FloatField(min_value=0.01, max_value=100_000, required=False,
                                  label="Memory (GiB)")
    utilization = forms.FloatField(min_value=0.01, max_value=1.0, initial=DEFAULT_UTILIZATION,
                                   required=False, label="Memory utilisation")
    overhead_gib = forms.FloatField(min_value=0, max_value=10_000, initial=DEFAULT_OVERHEAD_GIB,
                                    required=False, label="Overhead (GiB)")
    sequence_length = forms.IntegerField(min_value=1, max_value=10_000_000,
                                         initial=DEFAULT_SEQUENCE_LENGTH, required=False,
                                         label="Sequence length")
    kv_cache_dtype = forms.ChoiceField(choices=[(d, d) for d in KV_CACHE_DTYPES],
                                       initial="auto", required=False, label="KV cache dtype")

    def estimate_arguments(self) -> dict[str, object]:
        data = self.cleaned_data
        return {
            "memory_gib": data.get("memory_gib"),
            "utilization": data.get("utilization") or DEFAULT_UTILIZATION,
            "overhead_gib": DEFAULT_OVERHEAD_GIB if data.get("overhead_gib") is None
            else data["overhead_gib"],
            "sequence_length": data.get("sequence_length") or DEFAULT_SEQUENCE_LENGTH,
            "kv_cache_dtype": data.get("kv_cache_dtype") or "auto",
        }
