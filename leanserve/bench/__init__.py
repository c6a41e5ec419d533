"""Serving benchmark (``leanserve bench``): load any OpenAI-compatible server with a production-like workload and
report TTFT, TPOT, ITL, end-to-end latency, throughput and goodput (vLLM ``bench serve`` field names), plus what the
server's Prometheus metrics saw during the run.

Modules: ``corpus`` (offline text), ``workloads`` (the four scenarios), ``datasets`` (ShareGPT / JSONL files),
``arrivals`` (Poisson / gamma arrival times), ``client`` (one streaming request), ``stats`` (the metrics),
``server_metrics`` (/metrics scraping), ``runner`` (one run, a sweep), ``report`` (table, JSON), ``plot`` (PNG),
``command`` (the CLI subcommand).
"""
