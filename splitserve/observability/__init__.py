"""What operators watch: Prometheus metrics over HTTP (``exporter``), histogram buckets shared by the
router and the workers (``buckets``), and logs, as text or JSON, carrying the request id
(``logs``). Torch-free: the router imports it. The metrics themselves live with what they measure
(``router/metrics.py``, ``worker_common/metrics.py``); docs/metrics.md lists every one.
"""
