"""Tools that make what a deployment serves: random-weight Hugging Face checkpoints with real
architectures (``make_model``, ``random_weights``), a byte-level BPE tokenizer trained for them
(``bpe_tokenizer``) and TLS certificates for the cluster (``certs``)."""
