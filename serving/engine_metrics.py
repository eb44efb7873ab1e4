"""vLLM's Prometheus exposition, read in one place: by the gateway (each replica's load),
the backends (a replica's in-flight requests before it is drained) and the collector (the
dashboard figures). Pure functions of the text.

vLLM exposes hundreds of lines per server; each reader keeps only the sample lines it
needs before parsing, which is where the time goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INFINITY = float("inf")
LOAD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")

# vLLM's names; older names in parentheses are read when the new one is absent.
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache",
    "vllm:gpu_cache_usage_perc": "kv_cache",
}
COUNTERS = {
    "vllm:prefix_cache_hits": "prefix_hits",
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:generation_tokens": "generation_tokens",
    "vllm:num_preemptions": "preemptions",
    "vllm:request_success": "finished",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:time_per_output_token_seconds": "itl",
}
WANTED = (*GAUGES, *COUNTERS, *HISTOGRAMS)
# The sample lines read: gauges, counters' _total, histograms' _bucket (not _sum, _count,
# _created).
WANTED_SAMPLES = frozenset((*GAUGES, *(f"{name}_total" for name in COUNTERS),
                            *(f"{name}_bucket" for name in HISTOGRAMS)))
@dataclass
class Scrape:
    """One /metrics text, reduced to what the dashboards use (summed over label sets)."""

    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, dict[float, float]] = field(default_factory=dict)


def reduce_exposition(text: str) -> str:
    """The sample lines the dashboards read, with every label but `le` dropped: a vLLM server
    exposes hundreds of lines, and most of the parser's time goes into labels. Label sets
    that differ only in dropped labels (engines, finish reasons) become repeated samples,
    which are added up."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):  # samples are matched by name: TYPE and HELP are not read
            continue
        if not line.startswith(WANTED):
            continue
        open_at = line.find("{")
        if open_at < 0:
            if line[:line.find(" ")] in WANTED_SAMPLES:
                kept.append(line)
            continue
        if line[:open_at] not in WANTED_SAMPLES:
            continue
        close_at = line.rfind("}")
        labels = line[open_at + 1:close_at]
        le_at = labels.find('le="')
        if le_at < 0:
            kept.append(line[:open_at] + line[close_at + 1:])
        else:
            le_end = labels.find('"', le_at + 4)
            kept.append(f"{line[:open_at]}{{{labels[le_at:le_end + 1]}}}{line[close_at + 1:]}")
    return "\n".join(kept) + "\n"


def parse_metrics(text: str) -> Scrape:
    """A /metrics text reduced to the dashboard figures."""
    return parse_reduced(reduce_exposition(text))


def parse_reduced(kept: str) -> Scrape:
    """Read a reduced exposition (reduce_exposition's lines: `name value` or
    `name{le="bound"} value`, a timestamp after the value ignored), summing repeated
    samples. Read here line by line, not by prometheus-client's general parser (types,
    escapes and label sets a reduced text never holds), which took several times as long;
    tests hold the two to the same reading. A line that is not a sample raises
    ValueError."""
    scrape = Scrape()
    older: dict[str, float] = {}
    gauges, counters, histograms = scrape.gauges, scrape.counters, scrape.histograms
    for line in kept.splitlines():
        if not line:
            continue
        brace = line.find("{")
        if brace < 0:
            name, _, rest = line.partition(" ")
            bound = INFINITY
        else:
            close = line.find("}", brace)
            labels = line[brace + 1:close]
            if close < 0 or (labels and not (labels.startswith('le="')
                                             and labels.endswith('"'))):
                raise ValueError(f"not a reduced sample line: {line[:120]!r}")
            name, rest = line[:brace], line[close + 1:]
            bound = float(labels[4:-1]) if labels else INFINITY
        fields = rest.split()
        if not 1 <= len(fields) <= 2:
            raise ValueError(f"not a reduced sample line: {line[:120]!r}")
        value = float(fields[0])
        if name in GAUGES:
            target = older if name == "vllm:gpu_cache_usage_perc" else gauges
            key = GAUGES[name]
            target[key] = target.get(key, 0.0) + value
        elif name.endswith("_total") and name[:-6] in COUNTERS:
            key = COUNTERS[name[:-6]]
            counters[key] = counters.get(key, 0.0) + value
        elif name.endswith("_bucket") and name[:-7] in HISTOGRAMS:
            base = name[:-7]
            key = "_older_itl" if base == "vllm:time_per_output_token_seconds" else \
                HISTOGRAMS[base]
            buckets = histograms.setdefault(key, {})
            buckets[bound] = buckets.get(bound, 0.0) + value
    for key, value in older.items():
        gauges.setdefault(key, value)
    fallback = histograms.pop("_older_itl", None)
    if fallback is not None:
        histograms.setdefault("itl", fallback)
    return scrape


def requests_in_system(text: str) -> float | None:
    """Running plus waiting requests (summed over every engine's label set), or None when
    the text has neither gauge (not a vLLM server, or not yet started)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(LOAD_GAUGES):
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        if line[:name_end] not in LOAD_GAUGES:
            continue  # a longer name sharing the prefix
        try:
            total += float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        seen = True
    return total if seen else None
