"""vLLM's exposition read in one place (serving/engine_metrics.py): the load the gateway
routes by and the in-flight count a drain waits on, from the same function."""

from __future__ import annotations

from serving.engine_metrics import parse_metrics, requests_in_system

EXPOSITION = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="chat"} 3.0
vllm:num_requests_running{engine="1",model_name="chat"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="chat"} 2.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 40.0
vllm:kv_cache_usage_perc{engine="0",model_name="chat"} 0.25
"""


def test_running_and_waiting_are_summed_over_engines_and_nothing_else() -> None:
    assert requests_in_system(EXPOSITION) == 6.0


def test_a_text_without_the_gauges_says_nothing_rather_than_zero() -> None:
    assert requests_in_system("# nothing here\nprocess_cpu_seconds_total 1.0\n") is None
    assert requests_in_system("") is None


def test_a_broken_value_is_skipped() -> None:
    assert requests_in_system("vllm:num_requests_running 2\n"
                              "vllm:num_requests_waiting NaNx\n") == 2.0


def test_the_dashboard_figures_come_from_the_same_text() -> None:
    scrape = parse_metrics(EXPOSITION)
    assert scrape.gauges == {"running": 4.0, "waiting": 2.0, "kv_cache": 0.25}
