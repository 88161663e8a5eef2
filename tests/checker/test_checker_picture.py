"""``CheckReport.save_timeline``: the estimated step drawn as SVG or PNG, and the trace's
step boundaries and stage names."""

from __future__ import annotations

import builtins
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ooo_wrap
from ooo_wrap.testing import CheckReport, check
from ooo_wrap.testing._timeline import lay_out
from tests.planner.test_reference_gpu import MEASURED, Towers


@pytest.fixture(scope="module")
def report() -> CheckReport:
    # A measured reference with a near-free fork: the dataflow planner learns on step 1
    # (inline) and step 2 runs the static arm, each tower on a side stream.
    checked = check(Towers(), torch.randn(8, 16), gpu=MEASURED, steps=2, tune_arm="static")
    assert checked.ok and checked.learning_step == 1, str(checked)
    return checked


def test_svg_has_lanes_boxes_waits_steps_and_an_estimate_title(
    report: CheckReport, tmp_path: Path
) -> None:
    path = tmp_path / "timeline.svg"
    report.save_timeline(path)
    svg = path.read_text(encoding="utf-8")
    assert svg.startswith("<svg xmlns=") and svg.rstrip().endswith("</svg>")
    timeline = lay_out(report.trace, gpu=report.gpu)
    lanes = re.findall(r'class="lane-label"[^>]*>([^<]+)<', svg)
    assert lanes == ["default", "side1", "side2"]
    boxes = re.findall(r'<rect class="op (\w+)"', svg)
    assert len(boxes) == len(report.trace) == len(timeline.slots)
    assert set(boxes) == {"forward", "backward", "step"}
    assert svg.count('<line class="wait"') == len(timeline.waits) > 0
    assert svg.count('<line class="step-boundary"') == 2
    assert "step 1 (learning: ran inline)" in svg and ">step 2<" in svg
    assert svg.count('class="learning-step"') == 1
    (title,) = re.findall(r'<text class="title"[^>]*>([^<]+)<', svg)
    assert "measured stand-in" in title and "estimate" in title
    assert "[left]" in svg and "[right]" in svg  # stage names on hover


def test_png_with_matplotlib(report: CheckReport, tmp_path: Path) -> None:
    # matplotlib is in the test extra: this always runs where the tests do.
    path = tmp_path / "timeline.png"
    report.save_timeline(path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_png_without_matplotlib_names_the_extra(
    report: CheckReport, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.split(".")[0] == "matplotlib":
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ooo_wrap.OOOError, match=r"ooo-wrap\[plot\].*\.svg"):
        report.save_timeline(tmp_path / "timeline.png")
    report.save_timeline(tmp_path / "timeline.svg")  # needs nothing
    assert not (tmp_path / "timeline.png").exists()


def test_other_suffixes_and_empty_reports_are_refused(report: CheckReport, tmp_path: Path) -> None:
    with pytest.raises(ooo_wrap.OOOConfigError, match=r"\.svg.*\.png"):
        report.save_timeline(tmp_path / "timeline.pdf")
    # Only the learning step ran, inline: nothing was checked, but the ops are drawn.
    plain = check(Towers(), torch.randn(8, 16), steps=1, tune_arm="static")
    assert plain.not_checked is not None
    plain.save_timeline(tmp_path / "plain.svg")
    empty = CheckReport((), (), (), (), (), (), 0, not_checked="nothing ran")
    with pytest.raises(ooo_wrap.OOOError, match="nothing ran"):
        empty.save_timeline(tmp_path / "empty.svg")


def test_trace_has_step_boundaries_and_stage_names(report: CheckReport, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    report.save_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    steps = [e for e in events if e.get("cat") == "training_step" and e["ph"] == "b"]
    ends = [e for e in events if e.get("cat") == "training_step" and e["ph"] == "e"]
    assert [e["name"] for e in steps] == ["step 1 (learning: ran inline)", "step 2"]
    assert [e["id"] for e in ends] == [e["id"] for e in steps]
    assert steps[0]["ts"] < ends[0]["ts"] <= steps[1]["ts"] + 1e-9 < ends[1]["ts"]
    starts = [e for e in events if e.get("cat") == "training_step" and e["ph"] == "i"]
    assert [e["ts"] for e in starts] == [e["ts"] for e in steps]
    ops = [e for e in events if e["ph"] == "X"]
    side1 = {e["args"]["stage"] for e in ops if e["args"]["stream"] == "side1"}
    side2 = {e["args"]["stage"] for e in ops if e["args"]["stream"] == "side2"}
    assert (side1, side2) == ({"left"}, {"right"})
