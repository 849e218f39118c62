"""The prefill protocol's edge, shared by the prefill worker and the colocated worker, which both speak it
to the router: the job record of a ``Prefill`` call and its first token (``jobs``), the ``PrefillWorker``
gRPC service (``service``) and the prefix-cache event feed the router routes by (``cache_events``). It
sits here, below both role packages, because those may not import each other (docs/architecture.md)."""
