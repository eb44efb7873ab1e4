"""The metrics collector's parts (controlplane/collector.py runs the pass): which replicas
to scrape and how (`targets`, `scraping`), the figures derived from counters and
histograms (`rates`), the per-replica ring buffers and the summaries (`store`), the
accelerators' readings (`accelerators`), the gateway's figures (`gateway_figures`) and the
dashboards' Channels groups (`publishing`)."""
