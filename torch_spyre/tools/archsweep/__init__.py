"""A sweep of every model type the installed transformers ships: tiny random
configs (configs.py), each run on the card eagerly and compiled against the
CPU (run.py) in restartable worker processes (sweep.py), written as
docs/models.md's table (table.py)."""
