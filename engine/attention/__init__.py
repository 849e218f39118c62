"""Attention and its kernels: the mixed decode/prefill attention over the paged cache
(paged_attention.py), the static-shape decode attention and its backend registry (paged_decode.py), and the
Triton, FlashInfer and FlashAttention backends (triton_paged_decode.py).
"""
