"""The model and its loading: config.json (torch-free config.py), the decoder (transformer.py), rotary
embeddings, the safetensors loader and the choice of linear kernels made at load.

No imports here on purpose: the router imports config.py, which must not load torch through this file.
"""
