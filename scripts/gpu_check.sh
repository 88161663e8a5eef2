#!/usr/bin/env bash
# GPU validation kit for ooo_wrap: one command on a machine with one CUDA GPU.
#
#   bash scripts/gpu_check.sh            # everything, in at most 300 s
#   bash scripts/gpu_check.sh --quick    # a second look after a fix, about 90 s
#
# Nothing is installed and nothing is downloaded: torch with CUDA, pytest (pytest-timeout
# if present), numpy and matplotlib must already be there. The checkout is used through
# PYTHONPATH. Five files go to $OUT (else gpu_check_out/<UTC time>/): summary.md,
# gpu_check.log (every step's output), benchmark_<time>.json and its .png, and
# reference_gpu_<time>.json (launch, fork/join and kernel floor measured on this GPU, as a
# ooo_wrap.ReferenceGPU: pass it as gpu= or --gpu PATH). summary.md is
# rewritten after every step, and the JSON after every benchmark point, so a run stopped
# from outside keeps what it had. Steps, each given what is left of the time budget; one
# that cannot get its minimum is "not run", not failed:
#   0. preflight: python, torch>=2.6, a visible CUDA GPU (stops here otherwise), pytest
#   a. tests/gpu/test_cuda.py alone: the verdict that matters (per-test timeout, SIGINT at the
#      step's limit so that the junit report is still written)
#   b. CUDA Stream Sanitizer: record_stream preflight, wrapped training runs that must be
#      silent (stages alone, and with the weight-gradient split), and races it must flag
#      (a toy, the wrapper with its fork wait removed, the split with its dW wait removed)
#   c. benchmark suite, every point in seven modes interleaved (plain and wrapped eager,
#      wrapped with overlap_forward=True, tuned, with the weight-gradient split, plain and
#      wrapped with the whole step captured as a CUDA graph); full: the default sweep of
#      four families, cut to the time left;
#      quick: 3 points (the towers target, the transformer, the launch-bound fanout)
#   d. optional, if time is left (not in --quick): the other `cuda` tests (torch.compile
#      with inductor, DDP and FSDP with NCCL in spawned processes)
# Exit status: 0 every required check (a-c) passed, 1 one failed, 3 one did not run to its
# end (no verdict). Benchmark targets are reported, not enforced.
# Environment: OUT; PYTHON (default python3); GPU_CHECK_BUDGET_S (default 290, quick 100);
# OOO_WRAP_COMMIT (the commit, where the checkout has no .git); GPU_CHECK_OPTIONAL=0 skips d.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
QUICK=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    -h | --help) sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$arg' (use --quick or nothing)" >&2; exit 2 ;;
  esac
done
PYTHON="${PYTHON:-python3}"
if ((QUICK)); then BUDGET_S="${GPU_CHECK_BUDGET_S:-100}"; else BUDGET_S="${GPU_CHECK_BUDGET_S:-290}"; fi
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
OUT_DIR="${OUT:-$ROOT/gpu_check_out/$STAMP}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu_check.log"
SUMMARY="$OUT_DIR/summary.md"
JSON="$OUT_DIR/benchmark_$STAMP.json"
PLOT="$OUT_DIR/benchmark_$STAMP.png"
REFERENCE_GPU="$OUT_DIR/reference_gpu_$STAMP.json" # launch, fork/join, kernel floor measured
WORK="$(mktemp -d)" # step reports the verdicts are read from; never in $OUT
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" # this checkout, whatever is installed
export PYTHONUNBUFFERED=1
COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || true)"
export OOO_WRAP_COMMIT="${COMMIT:-${OOO_WRAP_COMMIT:-unknown}}"
# Per step: the seconds it asks for (its limit, within the time left) and the least it
# needs to start; docs/gpu-kit.md estimates each from its sizes.
if ((QUICK)); then
  MODE="quick" A_WANT=50 B_WANT=35 C_WANT=45
else
  MODE="full" A_WANT=120 B_WANT=100 C_WANT=130
fi

START=$SECONDS
CHECKS=()
FAILED=0
INCOMPLETE=0 # a required check not run, or cut short: no verdict either way

say() { printf '\n[gpu_check +%ss] %s\n' "$((SECONDS - START))" "$*"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }

record() { # check name, PASS|FAIL|PARTIAL|NOT RUN, detail
  CHECKS+=("| $1 | $2 | $3 |")
  if [[ "$2" == FAIL ]]; then FAILED=1; fi
  if [[ "$2" != PASS && "$2" != FAIL && "$1" != *optional* ]]; then INCOMPLETE=1; fi
  printf '[gpu_check] %s: %s (%s)\n' "$1" "$2" "$3"
  write_summary
}

verdict_name() { # gpu_kit.py's exit status as a word
  case "$1" in 0) echo PASS ;; 3) echo PARTIAL ;; *) echo FAIL ;; esac
}

starts() { # name, seconds it needs at least: false (and "not run") if they are not left
  if (($(left) < $2)); then
    record "$1" "NOT RUN" "only $(left)s of the ${BUDGET_S}s budget left; it needs $2s"
    return 1
  fi
}

limit() { # a step's time limit: what it asks for, within the time left less 10 s (the
  # grace after SIGINT and the summary)
  local want=$1 l
  l=$(($(left) - 10))
  if ((l < want)); then want=$l; fi
  echo "$want"
}

run_limited() { # seconds, command...: SIGINT at the limit (pytest still writes its report)
  local seconds=$1
  shift
  if command -v timeout >/dev/null 2>&1; then
    timeout -s INT -k 15 "$seconds" "$@"
  else
    "$@" # no coreutils timeout: run without a limit
  fi
}

write_summary() { # rewritten after every step; the benchmark table once there is one
  {
    echo "## ooo_wrap gpu_check ($MODE), $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - START))s of ${BUDGET_S}s"
    echo
    echo "git $OOO_WRAP_COMMIT; log: gpu_check.log; benchmark: $(basename "$JSON")"
    echo
    echo "| check | result | detail |"
    echo "|---|---|---|"
    if ((${#CHECKS[@]})); then printf '%s\n' "${CHECKS[@]}"; fi
    if [[ -s "$WORK/benchmark.md" ]]; then
      echo
      cat "$WORK/benchmark.md"
    fi
    if [[ "${1:-}" == final ]]; then
      echo
      if (($((SECONDS - START)) > 300)); then
        echo "WARNING: took $((SECONDS - START))s, over the 300 s goal."
      fi
      if ((FAILED)); then
        echo "RESULT: FAILED"
      elif ((INCOMPLETE)); then
        echo "RESULT: INCOMPLETE (a required check did not run to its end; no verdict)"
      else
        echo "RESULT: every required check passed"
      fi
    else
      echo
      echo "(still running: this file is rewritten after every step)"
    fi
  } >"$SUMMARY"
}

main() {
say "ooo_wrap GPU check ($MODE, budget ${BUDGET_S}s) in $ROOT, git $OOO_WRAP_COMMIT; output in $OUT_DIR"

# --- 0. preflight -------------------------------------------------------------------------
say "preflight: python, torch with CUDA, a visible GPU, pytest"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  record "preflight" FAIL "no '$PYTHON' on PATH (set PYTHON=...)"
  write_summary final
  return 1
fi
rc=0
"$PYTHON" - >"$WORK/preflight.txt" 2>&1 <<'PY' || rc=$?
import sys

try:
    import torch
except ImportError:
    sys.exit("error: torch is not installed; this kit installs nothing")
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit(
        "error: no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False); "
        "this script needs one"
    )
version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if version < (2, 6):
    sys.exit(f"error: ooo_wrap needs torch>=2.6, found {torch.__version__}")
print(f"{torch.cuda.device_count()} CUDA device(s); cuda:{torch.cuda.current_device()}: "
      f"{torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
try:
    import pytest
except ImportError:
    sys.exit("error: pytest is not installed; this kit installs nothing")
try:
    import pytest_timeout  # noqa: F401
except ImportError:
    print("pytest-timeout: missing (tests run without a per-test timeout)")
else:
    print("pytest-timeout: present")
PY
cat "$WORK/preflight.txt"
if ((rc != 0)); then
  record "preflight" FAIL "$(tail -n 1 "$WORK/preflight.txt")"
  echo "[gpu_check] stopped before running anything"
  write_summary final
  return 1
fi
TIMEOUT_ARGS=()
if grep -q '^pytest-timeout: present' "$WORK/preflight.txt"; then TIMEOUT_ARGS=(--timeout 90); fi
record "preflight" PASS "$(head -n 2 "$WORK/preflight.txt" | paste -sd ';' -)"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
fi

# --- a. tests/gpu/test_cuda.py ------------------------------------------------------------------
name="(a) tests/gpu/test_cuda.py"
if starts "$name" 30; then
  say "$name, at most $(limit "$A_WANT")s"
  rc=0
  run_limited "$(limit "$A_WANT")" "$PYTHON" -m pytest tests/gpu/test_cuda.py -v -rs -p no:cacheprovider \
    "${TIMEOUT_ARGS[@]}" --junitxml="$WORK/cuda.xml" || rc=$?
  v=0
  detail=$("$PYTHON" scripts/gpu_kit.py junit "$WORK/cuda.xml" --exit-status "$rc") || v=$?
  if ((v == 3)); then v=1; fi # cut short, this verdict is incomplete: a failure here
  record "$name" "$(verdict_name "$v")" "$detail"
fi

# --- b. CUDA Stream Sanitizer -----------------------------------------------------------------
name="(b) CUDA Stream Sanitizer"
if starts "$name" 30; then
  say "$name, at most $(limit "$B_WANT")s"
  quick_flag=()
  if ((QUICK)); then quick_flag=(--quick); fi
  rc=0
  TORCH_CUDA_SANITIZER=1 run_limited "$(limit "$B_WANT")" "$PYTHON" scripts/sanitizer_check.py \
    "${quick_flag[@]}" 2>&1 | tee "$WORK/sanitizer.log" || rc=$?
  verdict=$(sed -n 's/^verdict: //p' "$WORK/sanitizer.log" | tail -n 1)
  if [[ $rc -eq 0 && "$verdict" == PASS:* ]]; then
    record "$name" PASS "${verdict#PASS: }"
  elif [[ -n "$verdict" ]]; then
    record "$name" FAIL "exit $rc; ${verdict#FAIL: }"
  else
    record "$name" FAIL "exit $rc before its verdict; see gpu_check.log"
  fi
fi

# --- c. benchmark suite ---------------------------------------------------------------------
name="(c) benchmark suite"
if starts "$name" 30; then
  # Every mode at every point, in one process: eager, overlap_forward, tuned, the
  # weight-gradient split, CUDA graphs.
  modes=(--overlap-forward --tuned --split --graphs)
  if ((QUICK)); then
    sweep=(--models towers,transformer,fanout --dtypes float32 --towers-batches 16
      --towers-widths 2048 --transformer-batches 32 --fanout-batches 256 --warmup 3
      --steps 15 --overhead-repeats 10 --overhead-calls 100)
  else
    sweep=(--warmup 5 --steps 30)
  fi
  step_limit=$(limit "$C_WANT")
  # New points stop 20 s before the limit: room for the point in flight and the plot.
  points_s=$((step_limit - 20))
  if ((points_s < 5)); then points_s=5; fi
  say "$name ($MODE), new points for ${points_s}s, at most ${step_limit}s"
  rc=0
  run_limited "$step_limit" "$PYTHON" benchmarks/suite.py --require-gpu "${sweep[@]}" \
    "${modes[@]}" --budget-s "$points_s" --json "$JSON" --plot "$PLOT" \
    --reference-gpu "$REFERENCE_GPU" || rc=$?
  v=0
  detail=$("$PYTHON" scripts/gpu_kit.py bench "$JSON" --exit-status "$rc") || v=$?
  if [[ -f "$JSON" ]]; then
    "$PYTHON" benchmarks/suite.py --summarize "$JSON" >"$WORK/benchmark.md" 2>&1 || true
  fi
  record "$name" "$(verdict_name "$v")" "$detail"
fi

# --- d. optional: the other cuda tests ------------------------------------------------------
name="(d) other cuda tests (optional)"
if ((QUICK)); then
  record "$name" "NOT RUN" "--quick"
elif [[ "${GPU_CHECK_OPTIONAL:-1}" == 0 ]]; then
  record "$name" "NOT RUN" "GPU_CHECK_OPTIONAL=0"
elif starts "$name" 50; then
  say "$name, at most $(limit 300)s"
  optional_timeout=()
  if ((${#TIMEOUT_ARGS[@]})); then optional_timeout=(--timeout 120); fi
  rc=0
  # --continue-on-collection-errors: a module that fails to import is one error, and
  # every other module still runs.
  run_limited "$(limit 300)" "$PYTHON" -m pytest tests -m cuda --ignore=tests/gpu/test_cuda.py \
    --continue-on-collection-errors -v -rs -p no:cacheprovider "${optional_timeout[@]}" \
    --junitxml="$WORK/optional.xml" || rc=$?
  v=0
  detail=$("$PYTHON" scripts/gpu_kit.py junit "$WORK/optional.xml" --exit-status "$rc") || v=$?
  record "$name" "$(verdict_name "$v")" "$detail"
fi

say "summary (also in summary.md)"
write_summary final
cat "$SUMMARY"
if ((FAILED)); then return 1; fi
if ((INCOMPLETE)); then return 3; fi
return 0
}

# Everything is shown and also kept in the one log; the status is main's.
status=0
main 2>&1 | tee "$LOG" || status=$?
exit "$status"
