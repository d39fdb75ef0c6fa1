"""A differential fuzzer for the spyre compiler (NNSmith-style)."""
