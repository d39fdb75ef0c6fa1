"""Developer tools of torch-spyre (op coverage, ...); run as ``python -m torch_spyre.tools.X``."""
