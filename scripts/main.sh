#!/usr/bin/env bash
# The main job: chat with a real model (SmolLM2-135M-Instruct) on the simulated
# spyre card, compiled, checked against the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh models
exec python examples/chat.py "$@"
