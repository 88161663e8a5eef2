#!/usr/bin/env bash
# GPU validation kit for ooo_wrap: one command on a machine with one CUDA GPU, <= 8 minutes.
#
#   bash scripts/gpu_check.sh
#
# Logs, the benchmark JSON and plot, and summary.md go to $OUT when it is set, else to
# gpu_check_out/<UTC time>/ in the checkout. Steps, each logged; a failing check does not
# stop the later ones:
#   0. preflight: torch importable, torch>=2.6, a CUDA GPU visible (stops here otherwise,
#      before installing anything)
#   1. install: pip install -e ".[test,bench]" (torch with CUDA must already be installed;
#      offline, it falls back to the checkout on PYTHONPATH)
#   a. pytest -m cuda: parity, stream placement, fallbacks; fails if they were skipped
#   b. CUDA Stream Sanitizer: training steps of every benchmark model, wrapped, must give
#      zero reports, and a deliberately broken program must be flagged
#   c. the benchmark suite, full default sweep (it starts at the target point towers K=8,
#      width 2048, depth 4, batch 16, float32), cut to the time left
#   d. one summary: the checks, then the benchmark table against its targets
# Exit status 0 if every check passed. The benchmark targets are reported, not enforced.
# Environment: OUT, PYTHON (default: python), GPU_CHECK_BUDGET_S (default 470 seconds in
# all), GPU_CHECK_SKIP_INSTALL=1 (use what is installed).

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-470}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT_DIR="${OUT:-$ROOT/gpu_check_out/$STAMP}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu_check.log"
export PYTHONUNBUFFERED=1
CSAN_REPORT="CSAN detected a possible data race"

START=$SECONDS
CHECKS=()
FAILED=0

say() { printf '\n[gpu_check +%ss] %s\n' "$((SECONDS - START))" "$*"; }

record() { # check name, PASS|FAIL|WARN, detail
  CHECKS+=("| $1 | $2 | $3 |")
  if [[ "$2" == FAIL ]]; then FAILED=1; fi
  printf '[gpu_check] %s: %s (%s)\n' "$1" "$2" "$3"
}

seconds_for() { # a step's timeout: what it asks for, within the time left, at least 20 s
  local want=$1 left=$((BUDGET_S - (SECONDS - START)))
  if ((left < want)); then want=$left; fi
  if ((want < 20)); then want=20; fi
  echo "$want"
}

if ! command -v timeout >/dev/null 2>&1; then
  timeout() { shift; "$@"; } # no coreutils timeout: run without a limit
fi
# The steps. Not indented, so that the Python heredocs keep their terminators in column 0.
main() {
trap 'echo "[gpu_check] unexpected error at line $LINENO; logs in $OUT_DIR" >&2' ERR

say "ooo_wrap GPU check in $ROOT (git $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)); output in $OUT_DIR"

# --- 0. preflight -----------------------------------------------------------------------
say "preflight: torch with CUDA and a visible GPU"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "[gpu_check] error: no '$PYTHON' on PATH (set PYTHON=...)"
  exit 1
fi
if ! "$PYTHON" - <<'PY'; then
import sys

try:
    import torch
except ImportError:
    sys.exit("error: torch is not installed; install a CUDA build of PyTorch first")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit(
        "error: no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False); "
        "this script needs one"
    )
version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if version < (2, 6):
    sys.exit(f"error: ooo_wrap needs torch>=2.6, found {torch.__version__}")
count = torch.cuda.device_count()
print(f"{count} CUDA device(s); using cuda:{torch.cuda.current_device()}: "
      f"{torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
PY
  echo "[gpu_check] stopped before installing or running anything"
  exit 1
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
fi

# --- 1. install ---------------------------------------------------------------------------
if [[ "${GPU_CHECK_SKIP_INSTALL:-0}" == 1 ]]; then
  record "install" WARN "skipped (GPU_CHECK_SKIP_INSTALL=1)"
else
  say "install: pip install -e .[test,bench] (log: pip.log)"
  # Few retries: on a machine without network, fail fast and fall back.
  if timeout "$(seconds_for 150)" "$PYTHON" -m pip install --disable-pip-version-check \
    --retries 2 --timeout 20 -e ".[test,bench]" >"$OUT_DIR/pip.log" 2>&1; then
    record "install" PASS "pip install -e .[test,bench]"
  elif timeout "$(seconds_for 60)" "$PYTHON" -m pip install --disable-pip-version-check \
    --no-build-isolation --no-deps -e . >>"$OUT_DIR/pip.log" 2>&1; then
    record "install" WARN "extras not installed (offline?), project installed; see pip.log"
  else
    record "install" WARN "pip failed (see pip.log); using the checkout on PYTHONPATH"
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # this checkout, whatever is installed

# --- a. cuda tests ------------------------------------------------------------------------
say "(a) pytest -m cuda (log: pytest-cuda.log)"
if ! "$PYTHON" -c "import pytest" >/dev/null 2>&1; then
  record "(a) cuda tests" FAIL "pytest is not installed (pip install pytest)"
else
  rc=0
  timeout "$(seconds_for 180)" "$PYTHON" -m pytest -m cuda -v -rs -p no:cacheprovider \
    --junitxml="$OUT_DIR/pytest-cuda.xml" tests 2>&1 | tee "$OUT_DIR/pytest-cuda.log" || rc=$?
  counts="no junit report"
  ok=0
  if [[ -f "$OUT_DIR/pytest-cuda.xml" ]]; then
    counts=$("$PYTHON" - "$OUT_DIR/pytest-cuda.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
total = sum(int(s.get("tests", 0)) for s in suites)
failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skips = list(root.iter("skipped"))
no_cuda = [s for s in skips if "no cuda" in (s.get("message") or "").lower()]
passed = total - failed - len(skips)
print(f"{passed} passed, {failed} failed, {len(skips)} skipped "
      f"({len(no_cuda)} for lack of CUDA) of {total}")
sys.exit(0 if total and passed and not failed and not no_cuda else 1)
PY
    ) && ok=1
  fi
  if [[ $rc -eq 0 && $ok -eq 1 ]]; then
    record "(a) cuda tests" PASS "$counts"
  else
    record "(a) cuda tests" FAIL "pytest exit $rc; $counts; see pytest-cuda.log"
  fi
fi

# --- b. CUDA Stream Sanitizer -------------------------------------------------------------
say "(b) CUDA Stream Sanitizer on every benchmark model, wrapped (log: sanitizer-clean.log)"
rc=0
TORCH_CUDA_SANITIZER=1 timeout "$(seconds_for 150)" "$PYTHON" scripts/sanitizer_check.py \
  --steps 3 2>&1 | tee "$OUT_DIR/sanitizer-clean.log" || rc=$?
reports=$(grep -c "$CSAN_REPORT" "$OUT_DIR/sanitizer-clean.log" || true)
runs=$(grep -c '^ok: ' "$OUT_DIR/sanitizer-clean.log" || true)
if [[ $rc -eq 0 && $reports -eq 0 && $runs -gt 0 ]]; then
  record "(b) sanitizer, wrapped models" PASS "0 reports in $runs runs of 3 training steps"
else
  record "(b) sanitizer, wrapped models" FAIL \
    "exit $rc, $reports reports, $runs runs finished; see sanitizer-clean.log"
fi

say "(b) CUDA Stream Sanitizer on a deliberately broken program (log: sanitizer-broken.log)"
rc=0
TORCH_CUDA_SANITIZER=1 timeout "$(seconds_for 60)" "$PYTHON" scripts/sanitizer_check.py \
  --broken 2>&1 | tee "$OUT_DIR/sanitizer-broken.log" || rc=$?
flagged=$(grep -c "$CSAN_REPORT" "$OUT_DIR/sanitizer-broken.log" || true)
if [[ $rc -eq 0 && $flagged -gt 0 ]]; then
  record "(b) sanitizer flags a real race" PASS "the broken program was flagged"
else
  record "(b) sanitizer flags a real race" FAIL \
    "exit $rc, $flagged reports: a silent sanitizer cannot vouch for (b); see sanitizer-broken.log"
fi

# --- c. benchmark suite -------------------------------------------------------------------
left=$((BUDGET_S - (SECONDS - START)))
suite_budget=$((left - 75)) # room for the point in flight, the overhead probe and the plot
if ((suite_budget < 30)); then suite_budget=30; fi
say "(c) benchmark suite, ${suite_budget}s for new points (log: suite.log)"
rc=0
timeout "$(seconds_for $((left - 10)))" "$PYTHON" benchmarks/suite.py --require-gpu \
  --out-dir "$OUT_DIR" --budget-s "$suite_budget" --warmup 5 --steps 30 \
  2>&1 | tee "$OUT_DIR/suite.log" || rc=$?
json=$(sed -n 's/^JSON: //p' "$OUT_DIR/suite.log" | tail -n 1)
if [[ $rc -eq 0 && -n "$json" && -f "$json" ]]; then
  points=$("$PYTHON" - "$json" <<'PY'
import json
import sys

with open(sys.argv[1], encoding="utf-8") as f:
    report = json.load(f)
print(f"{len(report['results'])} points measured, {len(report['skipped'])} left out for time")
PY
  )
  record "(c) benchmark suite" PASS "$points; $(basename "$json")"
else
  json=""
  record "(c) benchmark suite" FAIL "exit $rc; see suite.log"
fi

# --- d. summary -----------------------------------------------------------------------------
say "(d) summary (also in summary.md)"
elapsed=$((SECONDS - START))
{
  echo "## ooo_wrap gpu_check, $(date -u +%Y-%m-%dT%H:%M:%SZ), ${elapsed}s"
  echo
  echo "| check | result | detail |"
  echo "|---|---|---|"
  if ((${#CHECKS[@]})); then printf '%s\n' "${CHECKS[@]}"; fi
  echo
  if [[ -n "$json" ]]; then
    "$PYTHON" benchmarks/suite.py --summarize "$json" || echo "(could not summarize $json)"
    echo
    echo "To publish: copy $(basename "$json") (and its .png) into benchmarks/results/ and commit."
  fi
  if ((elapsed > 480)); then echo "WARNING: took ${elapsed}s, over the 8-minute goal."; fi
  if ((FAILED)); then echo "RESULT: FAILED (see the logs in $OUT_DIR)"; else echo "RESULT: all checks passed"; fi
} | tee "$OUT_DIR/summary.md"
return "$FAILED"
}

# Everything is shown and also kept in the log; the status is main's.
status=0
main 2>&1 | tee "$LOG" || status=$?
exit "$status"
