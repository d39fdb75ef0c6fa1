#!/usr/bin/env bash
# The test suite: lint, then every test (slow whole-model tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,models,vllm
python -m ruff check .
python -m ruff format --check .
exec python -m pytest -q "$@"
