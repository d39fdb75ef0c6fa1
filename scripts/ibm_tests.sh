#!/usr/bin/env bash
# Run IBM's own torch-spyre tests, from the pinned upstream snapshot and
# unchanged, against this checkout's torch_spyre.
#
#   scripts/ibm_tests.sh                 the files IBM's `make tests` YAML names
#                                        (tests/configs/torch_spyre_tests, outside
#                                        tests/inductor), one pytest per file
#   scripts/ibm_tests.sh FILE...         only these (paths inside the snapshot,
#                                        e.g. tests/test_spyre.py)
#   scripts/ibm_tests.sh --report DIR    the counts of an earlier run (its logs in DIR)
#   scripts/ibm_tests.sh --model-ops [-- PYTEST_ARGS]
#                                        tests/models/test_model_ops.py over
#                                        tests/resource/models/*.yaml (long:
#                                        ~4,000 cases; pass e.g. -- -x or -k)
#
# The snapshot's tests, conftest.py and pyproject.toml are copied into a
# temporary directory (IBM's torch_spyre/ is NOT copied: our package is
# what is imported, from this checkout).  Prints pass/fail/error/skip counts
# per file and the totals; the per-file pytest logs stay in $OUT
# (default /tmp/ibm_tests.<pid>; TORCH_SPYRE_IBM_TESTS_OUT overrides).
#
# TORCH_SPYRE_DEVICE_MEMORY defaults to 4GiB here (the simulated card's
# memory is host RAM; IBM's memory-pressure tests fill the card).
#
# The snapshot: torch-spyre-tests-*.tar.gz in ../shared/clients (or
# TORCH_SPYRE_IBM_CLIENTS).  PER_FILE_TIMEOUT (seconds, default 900) bounds
# each file's run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLIENTS="${TORCH_SPYRE_IBM_CLIENTS:-}"
if [[ -z "$CLIENTS" ]]; then
  for c in "$ROOT/../shared/clients" /work/shared/clients; do
    if compgen -G "$c/torch-spyre-tests-*.tar.gz" >/dev/null; then CLIENTS="$c"; break; fi
  done
fi
TARBALL="$(ls "$CLIENTS"/torch-spyre-tests-*.tar.gz 2>/dev/null | sort | tail -1 || true)"
if [[ -z "$TARBALL" ]]; then
  echo "ibm_tests: no torch-spyre-tests-*.tar.gz in ../shared/clients (set TORCH_SPYRE_IBM_CLIENTS)" >&2
  exit 2
fi

MODE=yaml
FILES=()
EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model-ops) MODE=model-ops; shift ;;
    --report) MODE=report; REPORT_DIR="$2"; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) FILES+=("$1"); shift ;;
  esac
done

OUT="${TORCH_SPYRE_IBM_TESTS_OUT:-/tmp/ibm_tests.$$}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ibm_tests_run.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
tar xzf "$TARBALL" -C "$WORK"
SNAP="$(ls -d "$WORK"/torch-spyre-*/)"
SNAP="${SNAP%/}"
# Their torch_spyre/ holds only _C.pyi: remove it so ours is imported.
rm -rf "$SNAP/torch_spyre"

if [[ "$MODE" == yaml && ${#FILES[@]} -eq 0 ]]; then
  mapfile -t FILES < <(
    grep -rh 'path: *\${TORCH_DEVICE_ROOT}/' "$SNAP/tests/configs/torch_spyre_tests" --include='*.yaml' \
      | grep -v '/tests/inductor/' | sed -e 's/.*\${TORCH_DEVICE_ROOT}\///' | sort -u
  )
fi
if [[ "$MODE" == model-ops ]]; then
  FILES=(tests/models/test_model_ops.py)
fi

file_counts() {  # FILE XML: one tab-separated row of counts
  python - "$1" "$2" "$SNAP/$1" <<'EOF'
import re, sys, xml.etree.ElementTree as ET
f, xml, src = sys.argv[1:4]
p = fl = e = s = 0
note = ""
try:
    root = ET.parse(xml).getroot()
    cases = list(root.iter("testcase"))
    if cases and all(
        c.find("error") is not None and "collection" in (c.find("error").get("message") or "")
        for c in cases
    ):
        cases = []  # only the file's collection error
    for tc in cases:
        kinds = {c.tag for c in tc}
        if "failure" in kinds:
            fl += 1
        elif "error" in kinds:
            e += 1
        elif "skipped" in kinds:
            s += 1
        else:
            p += 1
    if p + fl + e + s == 0:
        # the file did not import: count its test functions as errors (a
        # lower bound: parametrised ones count once)
        n = len(re.findall(r"^\s*(?:async )?def test_", open(src).read(), re.M))
        e, note = max(n, 1), "collection error"
except (OSError, ET.ParseError):
    e, note = -1, "no report: crashed or timed out"
print(f"{f}\t{p}\t{fl}\t{e}\t{s}\t{note}")
EOF
}

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The simulated card's memory is host RAM, and IBM's memory-pressure tests
# fill the card until it runs out: a card of 112 GiB would take the machine's
# RAM first.  A smaller card (an environment setting, not a change to the
# tests) unless the caller chose one.
export TORCH_SPYRE_DEVICE_MEMORY="${TORCH_SPYRE_DEVICE_MEMORY:-4GiB}"
PER_FILE_TIMEOUT="${PER_FILE_TIMEOUT:-900}"
echo "ibm_tests: $(basename "$TARBALL") against $ROOT; logs in $OUT"
RESULTS="$OUT/results.tsv"
: >"$RESULTS"
if [[ "$MODE" == report ]]; then  # the counts of an earlier run's reports
  FILES=()
  for xml in "$REPORT_DIR"/*.xml; do
    f="$(basename "$xml" .xml)"
    file_counts "${f//__//}" "$xml" >>"$RESULTS"
  done
fi
for f in "${FILES[@]}"; do
  name="${f//\//__}"
  xml="$OUT/$name.xml"
  rm -f "$xml"
  args=(-q -p no:cacheprovider -o addopts= --junitxml="$xml" "$f")
  if [[ "$MODE" == model-ops ]]; then
    # IBM's model-op settings (their addopts deselect bf16 cases)
    args=(-q -p no:cacheprovider -c pytest_models.ini --junitxml="$xml" "$f")
  fi
  (cd "$SNAP" && timeout "$PER_FILE_TIMEOUT" python -m pytest "${args[@]}" "${EXTRA[@]}" \
    >"$OUT/$name.log" 2>&1) || true
  file_counts "$f" "$xml" >>"$RESULTS"
  tail -1 "$RESULTS"
done

python - "$RESULTS" <<'EOF'
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
print()
print(f"{'file':55s} {'pass':>5s} {'fail':>5s} {'error':>5s} {'skip':>5s} {'total':>6s}")
tp = tf = te = ts = 0
for f, p, fl, e, s, *rest in rows:
    p, fl, e, s = map(int, (p, fl, e, s))
    e = max(e, 0)
    tp, tf, te, ts = tp + p, tf + fl, te + e, ts + s
    note = f"  ({rest[0]})" if rest and rest[0] else ""
    print(f"{f:55s} {p:5d} {fl:5d} {e:5d} {s:5d} {p + fl + e + s:6d}{note}")
tot = tp + tf + te + ts
pct = 100.0 * tp / tot if tot else 0.0
ran = tp + tf + te
pct_ran = 100.0 * tp / ran if ran else 0.0
print(f"{'TOTAL':55s} {tp:5d} {tf:5d} {te:5d} {ts:5d} {tot:6d}")
print(f"passed: {pct:.1f}% of all ({tp}/{tot}); {pct_ran:.1f}% of those not skipped ({tp}/{ran})")
print("(skip counts pytest's skips and IBM's xfails; a file that does not import counts")
print(" each of its test functions as an error)")
EOF
