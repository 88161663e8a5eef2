"""Verdicts for ``scripts/gpu_check.sh``: a pytest junit report and a benchmark JSON.

Standard library only (no torch import), so each call costs milliseconds::

    python3 scripts/gpu_kit.py junit REPORT.xml --exit-status 0
    python3 scripts/gpu_kit.py bench RESULTS.json --exit-status 0

Each prints one line for the summary and exits 0 for a pass, 1 for a failure and 3 for a
run cut short at its time limit with nothing failed (a partial result, not a pass).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

PASS, FAIL, PARTIAL = 0, 1, 3
# The reason tests/conftest.py gives when it skips a ``cuda`` test: matched exactly, so a
# test that skips for a reason of its own that merely mentions CUDA is not counted here.
NO_CUDA_REASON = "no cuda device on this machine"
# What ``timeout -s INT`` makes pytest exit with (KeyboardInterrupt), or timeout itself.
INTERRUPTED = {2, 124, 130, 137}


def junit_verdict(path: Path, exit_status: int) -> tuple[int, str]:
    """The verdict on a pytest junit report and pytest's exit status."""
    if not path.is_file():
        return FAIL, f"no junit report (pytest exit {exit_status})"
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as error:
        return FAIL, f"unreadable junit report ({error}); pytest exit {exit_status}"
    cases = list(root.iter("testcase"))
    failed = sum(1 for c in cases if c.find("failure") is not None or c.find("error") is not None)
    skips = [c.find("skipped") for c in cases]
    skipped = [s for s in skips if s is not None]
    no_cuda = sum(1 for s in skipped if (s.get("message") or "").strip() == NO_CUDA_REASON)
    # A module that failed to import is an <error> in a testcase of its own.
    passed = len(cases) - failed - len(skipped)
    line = (
        f"{passed} passed, {failed} failed or errored, {len(skipped)} skipped "
        f"({no_cuda} for lack of CUDA), pytest exit {exit_status}"
    )
    if failed or no_cuda or not passed:
        return FAIL, line
    if exit_status in INTERRUPTED:
        return PARTIAL, f"{line}; stopped at its time limit"
    if exit_status != 0:
        return FAIL, line
    return PASS, line


def bench_verdict(path: Path, exit_status: int) -> tuple[int, str]:
    """The verdict on a benchmark JSON (written after every point) and the suite's status."""
    if not path.is_file():
        return FAIL, f"no benchmark JSON (suite exit {exit_status})"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        return FAIL, f"unreadable benchmark JSON ({error}); suite exit {exit_status}"
    counts = {
        key: len(report.get(key) or [])
        for key in ("results", "errors", "fallbacks", "out_of_memory", "skipped")
    }
    # "<point> [<mode>]: <error>": one mode of a measured point (a graph that could not
    # be captured, say); "<point>: <error>": the whole point.
    mode_errors = sum(1 for e in report.get("errors") or [] if _names_a_mode(e))
    planned = report.get("points_planned") or "?"
    line = (
        f"{counts['results']} of {planned} points measured, "
        f"{counts['errors'] - mode_errors} failed, {mode_errors} modes of measured points "
        f"failed, {counts['fallbacks']} fell back, {counts['out_of_memory']} out of memory, "
        f"{counts['skipped']} not started for time; suite exit {exit_status}"
    )
    if counts["errors"] or counts["fallbacks"] or not counts["results"]:
        return FAIL, line
    if not report.get("complete"):
        return PARTIAL, f"{line}; INCOMPLETE (stopped at its time limit)"
    if exit_status != 0:
        return FAIL, line
    return PASS, line


def _names_a_mode(entry: str) -> bool:
    return entry.split(": ", 1)[0].endswith("]")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the verdict line; the exit status is the verdict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("kind", choices=("junit", "bench"))
    parser.add_argument("path", type=Path)
    parser.add_argument("--exit-status", type=int, default=0, help="the step's exit status")
    args = parser.parse_args(argv)
    judge = junit_verdict if args.kind == "junit" else bench_verdict
    verdict, line = judge(args.path, args.exit_status)
    print(line)
    return verdict


if __name__ == "__main__":
    sys.exit(main())
