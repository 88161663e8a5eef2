"""``check()`` proves every arm measured tuning might keep, one verdict per arm."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import OOOConfigError
from ooo_wrap._planner.cost import H200
from ooo_wrap.testing import CheckFailed, check
from tests.planner.test_reference_gpu import MEASURED
from tests.planner.test_reference_gpu import Towers as TwoTowers
from tests.runtime.test_checkpoint_amp import Mixed
from tests.support import dataflow_models as models
from tests.support.cli_factories import Leaky
from tests.wrapper.test_arms import ThreeTowers, mlp_chain


def test_a_three_tower_model_proves_several_arms_one_verdict_line_each() -> None:
    report = check(ThreeTowers(), torch.randn(4, 8))
    assert report.ok, str(report)
    assert len(report.arms) >= 2 and "plain" not in report.arms
    assert {"wgrad", "static"} <= set(report.arms)  # the split alone, and the stage rule
    lines = str(report).splitlines()
    assert lines[0].startswith(f"ooo_wrap check: OK ({len(report.arms)} arms, 2 steps each; ")
    for name in report.arms:
        (line,) = [line for line in lines if line.startswith(f"  arm {name}: ")]
        assert line == f"  arm {name}: OK (0 races, 0 allocator hazards, 0 parity mismatches)"
    # Each arm ran pinned on its own copy: its own streams, its own report.
    wgrad, static = report.arm_report("wgrad"), report.arm_report("static")
    assert wgrad.arms == ("wgrad",) and not wgrad.by_arm and wgrad.ok
    assert {row.stream for row in static.ops} == {"default", "side1", "side2", "side3"}
    assert {row.stream for row in wgrad.ops if row.forward} == {"default"}  # no stage
    assert any(row.backward for row in wgrad.ops if row.stream != "default")  # dW off it
    assert report.shown_arm == report.arms[0] and report.ops == report.by_arm[0].ops
    with pytest.raises(Exception, match="no arm 'regions'"):
        report.arm_report("regions")


def test_split_weight_grads_true_puts_the_split_in_every_arm() -> None:
    report = check(ThreeTowers(), torch.randn(4, 8), split_weight_grads=True)
    assert report.ok, str(report)
    assert report.arms and all("wgrad" in name for name in report.arms)


def test_split_weight_grads_false_checks_only_stage_arms() -> None:
    report = check(ThreeTowers(), torch.randn(4, 8), split_weight_grads=False)
    assert report.ok, str(report)
    assert report.arms == ("static",)  # one arm: the report is that arm's own
    assert not report.by_arm and "  arm static: OK (" in str(report)


def test_the_static_planner_proves_the_static_plans_arms() -> None:
    report = check(ThreeTowers(), torch.randn(4, 8), planner="static")
    assert report.ok, str(report)
    assert set(report.arms) == {"static", "wgrad", "static+wgrad"}
    assert report.learning_step is None  # no step learns: the arms are known at wrap time


def test_one_broken_arm_fails_the_report_and_is_the_one_shown() -> None:
    # Stage outputs reach the caller in an opaque box: every arm with stages is broken,
    # the split alone (no stage) is not.
    report = check(Leaky(), torch.randn(4, 8), planner="static")
    assert not report.ok
    assert report.arm_report("wgrad").ok, str(report.arm_report("wgrad"))
    assert not report.arm_report("static").ok
    assert report.shown_arm == next(name for name in report.arms if name != "wgrad")
    text = str(report)
    assert text.splitlines()[0].startswith("ooo_wrap check: FAILED (3 arms, 2 steps each; ")
    assert "  arm wgrad: OK (0 races, 0 allocator hazards, 0 parity mismatches)" in text
    assert "  arm static: FAILED (" in text
    assert f"  ops per stream (arm {report.shown_arm})" in text
    assert "  allocator hazard [arm static]: " in text or "  race [arm static]: " in text
    # The whole report's findings are every arm's.
    parts = report.by_arm
    assert len(report.allocator_hazards) == sum(len(p.allocator_hazards) for p in parts)
    assert len(report.races) == sum(len(p.races) for p in parts)
    with pytest.raises(CheckFailed, match="arm static: FAILED"):
        report.raise_if_failed()


def test_tune_arm_proves_one_arm_and_a_wrong_name_says_which_exist() -> None:
    report = check(ThreeTowers(), torch.randn(4, 8), tune_arm="wgrad")
    assert report.ok and report.arms == ("wgrad",), str(report)
    with pytest.raises(OOOConfigError, match=r"tune_arm='regions'.*static, wgrad, static\+wgrad"):
        check(ThreeTowers(), torch.randn(4, 8), tune_arm="regions")
    with pytest.raises(OOOConfigError, match="tune_arm='plain'"):
        check(ThreeTowers(), torch.randn(4, 8), tune_arm="plain")


@pytest.mark.parametrize("planner", ["dataflow", "static"])
def test_a_model_with_no_candidate_runs_plain_and_is_ok(planner: str) -> None:
    # A chain has no two stages that can overlap; with the split off no arm but plain
    # remains: nothing runs on a side stream, so nothing can race.
    model = mlp_chain() if planner == "dataflow" else nn.Sequential(nn.Linear(8, 8))
    report = check(model, torch.randn(4, 8), planner=planner, split_weight_grads=False)  # type: ignore[arg-type]
    assert report.ok and report.arms == () and report.not_checked is None
    assert report.runs_plain is not None
    assert report.runs_plain.startswith("the model runs plain (")
    assert "nothing can race" in report.runs_plain
    assert str(report) == f"ooo_wrap check: OK: {report.runs_plain}"
    report.raise_if_failed()


def test_the_static_planner_with_one_stage_still_proves_the_split() -> None:
    # The tuner races the split alone on such a model (split_weight_grads="auto"): so
    # does the check, instead of calling the model plain.
    report = check(nn.Sequential(nn.Linear(8, 8)), torch.randn(4, 8), planner="static")
    assert report.ok and report.arms == ("wgrad",), str(report)


def test_a_learned_plan_with_one_side_stage_is_an_arm() -> None:
    # The wrapper with tune=False runs this plan (right on a side stream, left on the
    # caller's); the tuner might keep it too, so check() must prove it.
    x = torch.randn(8, 16)
    learned = ooo_wrap.plan(TwoTowers(), example_inputs=(x,), gpu=MEASURED)
    assert [stage.name for stage in learned.stages] == ["right"]
    report = check(TwoTowers(), x, gpu=MEASURED, split_weight_grads=False)
    assert "regions" in report.arms, str(report)


def test_the_split_arm_of_an_autocast_model_is_clean() -> None:
    # Under an outer autocast both copies train inside one autocast region: the second
    # step of each reads autocast's cached weight casts, made before the first step's
    # SGD update, as the stock layers do.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = check(Mixed(), torch.randn(5, 12), streams=2, planner="static", tune_arm="wgrad")
    assert report.ok, str(report)
    assert {e.name for e in report.parity} >= {"output", "grad:a.0.weight"}


@pytest.mark.parametrize("arm", ["static+overlap", "static+wgrad+overlap"])
def test_the_split_arm_of_branches_sharing_running_statistics_is_clean(arm: str) -> None:
    # With deferred joins, branch b's stream waits on branch a's pending join because
    # they share the batch norm whose running statistics each updates in place.
    model, x = models.SharedStats(), torch.randn(32, 64)
    tiny = dataclasses.replace(H200, fork_join_us=1e-6)
    report = check(model, x, streams=2, steps=3, overlap_forward=True, gpu=tiny, tune_arm=arm)
    assert report.ok, str(report)
