#!/usr/bin/env bash
# The main job: a real model on the simulated spyre card, checked against the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh models
exec python examples/sentence_similarity.py "$@"
