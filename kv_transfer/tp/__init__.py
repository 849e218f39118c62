"""The KV hand-off between tensor-parallel workers: which transfers it is made of (``parts``), packing and
landing part of a rank's KV heads (``heads``), and the hand-off of several parts as one handle
(``handoff``). The rest of a tensor-parallel worker (its rank link, its followers) is in
``splitserve.worker_common.tp``."""
