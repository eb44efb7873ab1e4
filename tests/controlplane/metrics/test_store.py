"""The metrics store: rates and quantiles derived from counter and bucket deltas in a
replica's series; the autoscaler's decisions joined to a deployment's series."""

from __future__ import annotations

from controlplane.metrics.store import MetricsStore, ReplicaSeries, ScalingDecision
from controlplane.metrics.targets import Target
from serving.engine_metrics import parse_metrics
from tests.controlplane.metrics.exposition import text


def test_a_series_turns_counter_and_bucket_deltas_into_rates_and_quantiles() -> None:
    series = ReplicaSeries(Target("r1", "demo", "http://x", "active", "ready", None, False),
                           2.0)
    first = series.add(100.0, parse_metrics(text()), {})
    assert first["gen_tps"] is None and first["ttft_p50"] is None  # nothing to compare yet
    assert first["running"] == 2 and first["kv_cache"] == 0.25
    # Two seconds later: 200 more tokens, 50 more prefix queries of which 45 hit, and ten
    # more first tokens, all between 0.1 and 1 s.
    second = series.add(102.0, parse_metrics(text(generated=1200, queries=150, hits=85,
                                                  t2=10, t3=20)), {})
    assert second["gen_tps"] == 100.0
    assert second["prefix_hit_rate"] == 0.9
    assert 0.1 < second["ttft_p50"] < 1.0
    # A restarted replica's counters start again: no negative rate.
    third = series.add(104.0, parse_metrics(text(generated=10, t2=1, t3=1)), {})
    assert third["gen_tps"] is None
    assert series.samples.maxlen is not None and series.samples.maxlen >= 450


def test_a_decision_joins_the_deployments_latest_sample_and_becomes_a_message() -> None:
    store = MetricsStore(2.0)
    decision = ScalingDecision(at=102.0004, current=2, desired=3, reason="scaling up",
                               signals={"waiting_per_replica": {
                                   "value": 7.0, "target": 2.0, "proposes": 3, "per": 3.5}})
    assert store.annotate("chat", decision) is None  # no sample yet: nothing to join
    store.gateway_series("chat").append({"t": 100.0, "desired": 2})
    store.gateway_series("chat").append({"t": 102.0, "desired": 2})
    message = store.annotate("chat", decision)
    entry = {"t": 102.0, "current": 2, "desired": 3, "reason": "scaling up",
             "signals": {"waiting_per_replica": {"value": 7.0, "target": 2.0,
                                                 "proposes": 3}}}
    assert message == {"type": "decision", "deployment": "chat", "t": 102.0,
                       "decision": entry}
    history = store.deployment_history("chat")["gateway"]
    assert "decided" not in history[0]
    assert history[-1] == {"t": 102.0, "desired": 2, "decided": 3, "decision": entry}
