"""Histogram buckets, chosen to resolve both CPU serving (tens to hundreds of ms per token, seconds to
first token) and GPU serving (a few ms per token, tens of ms to first token). Upper bounds in seconds,
bytes or tokens; every histogram also has +Inf."""

from __future__ import annotations

# Queue, TTFT, prefill: 1 ms to 10 min (vLLM's TTFT buckets, with finer steps under 100 ms).
LATENCY_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
             1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)  # fmt: skip
# Inter-token latency and model steps: 0.5 ms to 80 s.
STEP_S = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
          0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
# Whole requests and decode phases: 10 ms to 2 h.
E2E_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
         40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 3840.0, 7680.0)  # fmt: skip
# One KV transfer: 50 us (a small request over NVLink) to 60 s (the default transfer deadline).
TRANSFER_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
              0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # fmt: skip
# One KV transfer's size: 4 KiB to 16 GiB, by factors of 4.
TRANSFER_BYTES = tuple(float(4**k) for k in range(6, 18))
# Tokens per request or per step: 1 to 128k, 1-2-5 steps.
TOKENS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5) if m * 10**e <= 200_000)
# Requests per step (batch size): 1 to 1024.
BATCH = tuple(float(2**k) for k in range(11))
