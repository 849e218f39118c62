"""Tensor parallelism in one place: the head layout of each rank and the KV-transfer rank pairs (layout.py,
torch-free), one rank's shard of the model (shard.py, torch-free), the process groups and rendezvous stores
(distributed.py) and rank 0's step plan for the other ranks (step.py).

No imports here on purpose: layout.py and shard.py are importable without torch.
"""
