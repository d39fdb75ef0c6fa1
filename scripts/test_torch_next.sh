#!/usr/bin/env bash
# The newer torch in the tested range (pyproject.toml: torch>=2.13,<2.15): a
# sample of the suite on torch 2.14.1, in its own virtual environment.
#
# * The venv is cached on the machine (~/.cache/torch_spyre/venv-torch-2.14.1,
#   or TORCH_SPYRE_NEXT_VENV) and reused when complete: a marker file is written
#   at the end of a successful install (the first install takes ~6 minutes).
# * torch and the test dependencies come through pip and the index it is
#   configured with, via scripts/install.sh (extras test,models; vLLM is pinned
#   to torch 2.13.0 and is left out, so tests/vllm is not in the sample).
# * The checkout is copied to a directory of the venv and built there, so the
#   in-place 2.13 build of the checkout is never touched; setup.py's build cache
#   is keyed by the torch version, so 2.13 and 2.14 libraries never mix.
# * The sample: every fast test (-m "not slow") plus a few slow ones; not the
#   tests that serve through vLLM (tests/vllm and the serve plans, which
#   run vLLM's scheduler), as vLLM 0.32.0 cannot be installed next to torch 2.14.
# Usage: scripts/test_torch_next.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
version="${TORCH_SPYRE_NEXT_TORCH:-2.14.1}"
venv="${TORCH_SPYRE_NEXT_VENV:-$HOME/.cache/torch_spyre/venv-torch-$version}"
marker="$venv/.torch-spyre-install-complete"
src="$venv/src"
start=$(date +%s)

# a fresh copy of the checkout's files (tracked and new, not its builds); the
# copy's C++ build comes back from setup.py's build cache in a second
sync_src() {
  rm -rf "$src"
  mkdir -p "$src"
  git ls-files -z --cached --others --exclude-standard |
    python -c "
import shutil, sys
from pathlib import Path
for name in sys.stdin.read().split('\0'):
    p = Path(name)
    if name and p.is_file() and p.suffix != '.so':
        (Path(sys.argv[1]) / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, Path(sys.argv[1]) / p)
" "$src"
}

if [ ! -f "$marker" ]; then
  echo "test_torch_next: installing torch==$version into $venv (once)" >&2
  rm -rf "$venv"
  python -m venv "$venv"
  sync_src
  (cd "$src" && PATH="$venv/bin:$PATH" TORCH_SPYRE_TORCH="torch==$version" \
    bash scripts/install.sh test,models)
  TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')"
  date -u +%FT%TZ >"$marker"
  echo "test_torch_next: installed in $(($(date +%s) - start)) s" >&2
else
  sync_src
fi

cd "$src"
export PATH="$venv/bin:$PATH"
# no autoload until the copy's C++ part is built (sync_src starts it afresh)
TORCH_DEVICE_BACKEND_AUTOLOAD=0 python -c \
  "import torch; assert torch.__version__.split('+')[0] == '$version', torch.__version__"
TORCH_DEVICE_BACKEND_AUTOLOAD=0 python setup.py -q build_ext --inplace >/dev/null
python -c "from torch_spyre.models import offline; [offline.folder(n) for n in offline.OFFLINE_MODELS]"
# a few slow tests: a real model eager and compiled, a compiled whole-model check
slow=(
  "tests/compiler/test_compile.py::test_rope_is_a_permutation_matmul_with_a_fused_epilogue"
)
mapfile -t extra_slow < <(python - <<'EOF'
import subprocess, sys
out = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "slow",
     "-p", "no:cacheprovider", "tests/models", "tests/compiler"],
    capture_output=True, text=True,
).stdout
ids = [line for line in out.splitlines() if "::" in line]
print("\n".join(ids[:3]))
EOF
)
echo "test_torch_next: torch $(python -c 'import torch; print(torch.__version__)'), sample from $src" >&2
rc=0
# two workers, a test file each at a time, as scripts/test.sh
OMP_NUM_THREADS=1 python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider -m "not slow" \
  --ignore=tests/vllm --deselect tests/models/test_estimate_plan.py::test_serve_plan_cli \
  --deselect tests/models/test_spec_estimate.py::test_serve_plan_with_speculation \
  "$@" tests || rc=$?
OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider "${slow[@]}" "${extra_slow[@]}" || rc=$?
echo "test_torch_next: $(($(date +%s) - start)) s in all (rc $rc)" >&2
cd "$root"
exit $rc
