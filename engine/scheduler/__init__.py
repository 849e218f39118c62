"""Scheduling, torch-free: continuous batching with chunked prefill and preemption (scheduler.py) over the
engine's requests (request.py).

No imports here on purpose: the router imports scheduler.py (stop_reason), which must stay torch-free.
"""
