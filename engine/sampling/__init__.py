"""Sampling: what a request asks for (params.py, torch-free; the router validates with it), the
(seed, position)-keyed draws (rng.py, torch-free) and logits -> tokens (sampler.py).

No imports here on purpose: the router imports params.py, and rng.py through wire.py, without torch.
"""
