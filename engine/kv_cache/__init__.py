"""The KV cache and its bookkeeping: the paged cache tensor, ref-counted blocks and the prefix cache, block hashes.

No imports here on purpose: the router imports the torch-free modules of this package (block_hash,
block_manager), and an import in this file would run first for every one of them.
"""
