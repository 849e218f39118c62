"""Text, torch-free: text <-> token ids for one model folder (tokenizer.py), streamed detokenization that never
emits half a character (detokenizer.py) and stop strings over streamed text (stop_strings.py).

No imports here on purpose: the router imports all three, and must not load torch.
"""
