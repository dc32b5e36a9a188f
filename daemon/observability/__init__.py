"""Observability: what the daemon counts and how it is read.

- `stats.py`: the records (log-bucketed `Histogram`, Prometheus-shaped `Buckets`, Triton's `Span`,
  per-model `ModelStats` and per-device `DeviceStats`).
- `telemetry.py`: the controller's recorder, which fills them from requests and actions.
- `trace.py`: the optional JSON-lines trace of every event, written by a thread of its own.
- `metrics.py`: Prometheus's /metrics and Triton's statistics extension over HTTP.
"""
