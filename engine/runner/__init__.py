"""Running a scheduled step on the device: the flattened batch, the model and the sampler (model_runner.py),
and the static decode path: its buckets and persistent buffers (static_decode.py) and their CUDA graphs
(cuda_graphs.py).
"""
