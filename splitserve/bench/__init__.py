"""``splitserve bench``: a gRPC load generator measured the way vLLM's ``benchmark_serving`` measures.

- ``datasets``: the requests (prompt token ids, output length, optional arrival time);
- ``arrivals``: when each request is due (gamma-distributed gaps, or a trace's timestamps);
- ``runner``: sends them over ``grpc.aio`` and times every streamed message;
- ``metrics``: TTFT, TPOT, ITL, E2EL, throughputs and goodput from the per-request records;
- ``sweep`` and ``plots``: one run per request rate, SLO attainment, goodput, and its plots;
- ``ray_clients``: one run's load sent by client actors spread over a Ray cluster, merged into one result;
- ``timeline``: where the served time went, from the router's and the workers' metrics around a run.
"""

DATASETS = ("random", "chat", "code", "summarize", "shared-prefix", "mooncake")
