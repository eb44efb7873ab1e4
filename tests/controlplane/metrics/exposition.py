"""vLLM's exposition as the collector's tests scrape and parse it."""

from __future__ import annotations

# The shape of vLLM's own /metrics (names, labels, _total and _created lines, histograms),
# cut down to a few families and with other families around them.
VLLM_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 1234.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="smollm2"}} {running}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",model_name="smollm2"}} {waiting}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="smollm2"}} 0.25
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="smollm2"}} {queries}
vllm:prefix_cache_queries_created{{engine="0",model_name="smollm2"}} 1.7e9
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="smollm2"}} {hits}
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="smollm2"}} {generated}
# TYPE vllm:request_success counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="smollm2"}} 3.0
vllm:request_success_total{{engine="0",finished_reason="length",model_name="smollm2"}} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.01",model_name="smollm2"}} {t1}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",model_name="smollm2"}} {t2}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="1.0",model_name="smollm2"}} {t3}
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="smollm2"}} {t3}
vllm:time_to_first_token_seconds_count{{engine="0",model_name="smollm2"}} {t3}
vllm:time_to_first_token_seconds_sum{{engine="0",model_name="smollm2"}} 1.5
"""


def text(**values: float) -> str:
    defaults = {"running": 2, "waiting": 1, "queries": 100, "hits": 40, "generated": 1000,
                "t1": 0, "t2": 10, "t3": 10}
    return VLLM_TEXT.format(**{**defaults, **values})
