"""The dataflow planner inside OOOModule: learn on the first training forward, then run it.

The models with known dataflow (Inception-style blocks, a residual chain, a GPT-style stack,
a two-tower model with a shared embedding, an MoE layer with a shared expert) are wrapped
with the default planner, trained on virtual streams and checked by the race checker.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from benchmarks.overhead import CountingBackend
from ooo_wrap import EventKind, OOOModule
from ooo_wrap._plan import Plan
from ooo_wrap.testing import SimulatedBackend, check
from tests.support import dataflow_models as models
from tests.support import doc_tables
from tests.support.edges import count_edges

# These tests are about how the wrapper learns and runs a plan, on small models: most pin the
# regions arm (tune_arm="regions"), which keeps every region the region rule finds, where
# the default keeps only the regions whose simulated step pays (at these sizes none does;
# tests/planner/test_simulate.py covers which ones pay).

Case = tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]

# CPU sizes: small enough to train under the checker, large enough (under the cost model's
# reference GPU) for the parallel branches to be worth a side stream.
CASES: dict[str, Case] = {
    "inception": (
        lambda: models.Inception(blocks=2, c=32, width=32),
        lambda: (torch.randn(8, 3, 32, 32),),
    ),
    "residual": (lambda: models.ResidualChain(dim=256, depth=4), lambda: (torch.randn(32, 256),)),
    "gpt": (lambda: models.GPT(depth=2), lambda: (torch.randint(0, 1000, (4, 64)),)),
    "two_tower": (models.TwoTower, models.two_tower_inputs),
    "moe": (models.MoE, lambda: (models.moe_input(),)),
}


# docs/planner.md's table of cross-stream waits: the figures
# test_cross_stream_waits_per_step_learned_against_static prints, row by row.
PLANNER_PAGE = doc_tables.REPO_ROOT / "docs" / "planner.md"
CROSS_STREAM_COLUMNS = (
    "model",
    "learned outcome",
    "waits per step, learned / static",
    "stage edges across streams, learned / static",
    "chain links split, static",
)


def cross_stream_table() -> list[dict[str, str]]:
    return doc_tables.table(PLANNER_PAGE, CROSS_STREAM_COLUMNS)


def build(case: str) -> tuple[nn.Module, tuple[Any, ...]]:
    make, inputs = CASES[case]
    torch.manual_seed(0)
    return make(), inputs()


def loss(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def train_step(model: nn.Module, inputs: tuple[Any, ...]) -> None:
    loss(model(*inputs)).backward()


@functools.cache
def learned(case: str) -> tuple[nn.Module, Plan]:
    """``case`` wrapped with the regions arm pinned (every region the rule finds) after one
    training step (once a session)."""
    model, inputs = build(case)
    wrapped = OOOModule(model, backend=SimulatedBackend(), tune_arm="regions")
    assert wrapped.plan.pending
    train_step(wrapped, inputs)
    return wrapped, wrapped.plan


def stream_of(the_plan: Plan, name: str) -> int | None:
    """The side stream of stage ``name``; ``None`` if it runs on the caller's stream."""
    return next((s.stream for s in the_plan.stages if s.name == name), None)


def test_the_plan_says_it_will_be_learned_then_shows_the_learned_table() -> None:
    model, inputs = build("two_tower")
    wrapped = OOOModule(model, backend=SimulatedBackend(), tune_arm="regions")
    assert "to be learned" in str(wrapped.plan) and not wrapped.plan.stages
    train_step(wrapped, inputs)
    table = str(wrapped.plan)
    assert "Learned plan (parallel)" in table and "region <root>" in table
    assert "estimate on NVIDIA H200" in table and "est. µs" in table
    assert "step" in table and "on one stream" in table
    (learned_event,) = [e for e in wrapped.events if e.kind is EventKind.PLANNED]
    assert learned_event.reason == "learned" and "not a measurement" in learned_event.message


def test_inception_gets_the_block_branches_on_distinct_streams_and_chains_on_one() -> None:
    _, the_plan = learned("inception")
    assert the_plan.stages and all(s.name.startswith("blocks.") for s in the_plan.stages)
    for block in ("blocks.0", "blocks.1"):
        branches = {
            "b1": [f"{block}.b1"],
            "b2": [f"{block}.b2", f"{block}.b2_conv"],
            "b3": [f"{block}.b3_reduce", f"{block}.b3_a", f"{block}.b3_b"],
            "pool": [f"{block}.pool"],
        }
        streams = []
        for links in branches.values():
            link_streams = {stream_of(the_plan, link) for link in links}
            assert len(link_streams) == 1, f"a chain split across streams: {links}"
            streams.append(link_streams.pop())
        side = [s for s in streams if s is not None]
        assert len(side) == len(set(side)) and len(side) >= 1  # distinct, heaviest inline
    assert the_plan.learned is not None
    assert count_edges(the_plan.learned, the_plan.learned.stage_streams).chain_splits == 0


@pytest.mark.parametrize("case", ["residual", "gpt"])
def test_chains_learn_no_parallelism_and_then_make_no_backend_call(case: str) -> None:
    model, inputs = build(case)
    backend = CountingBackend()
    wrapped = OOOModule(model, backend=backend)
    train_step(wrapped, inputs)
    (disabled,) = [e for e in wrapped.events if e.kind is EventKind.DISABLED]
    assert disabled.reason == "no_parallelism" and "longest chain:" in disabled.message
    assert "->" in disabled.message
    stats = wrapped.stats
    backend.calls.clear()
    for _ in range(3):
        train_step(wrapped, inputs)
    assert sum(backend.calls.values()) == 0, backend.calls
    assert wrapped.stats == stats  # stage calls (and forwards) are no longer counted
    assert not wrapped.plan.stages and "no_parallelism" in str(wrapped.plan)
    assert isinstance(wrapped, OOOModule)
    plain = ooo_wrap.unwrap(wrapped)
    assert type(plain) is type(build(case)[0])
    train_step(plain, inputs)


def test_two_towers_run_on_different_streams_with_their_projections() -> None:
    _, the_plan = learned("two_tower")
    query, doc = stream_of(the_plan, "query_tower"), stream_of(the_plan, "doc_tower")
    assert query != doc  # one of them may stay on the caller's stream
    for tower, proj in (("query_tower", "query_proj"), ("doc_tower", "doc_proj")):
        assert stream_of(the_plan, proj) in (stream_of(the_plan, tower), None)


def test_moe_finds_the_shared_expert_against_the_routed_ones() -> None:
    _, the_plan = learned("moe")
    assert the_plan.learned is not None and the_plan.learned.regions
    shared = stream_of(the_plan, "shared")
    experts = {stream_of(the_plan, f"experts.{i}") for i in range(4)}
    assert shared not in experts


@pytest.mark.parametrize("case", list(CASES))
def test_check_learns_on_the_first_step_and_is_clean_with_bitwise_parity(case: str) -> None:
    model, inputs = build(case)
    _, the_plan = learned(case)
    # The learned plan's arm (regions); a chain has none, and with the split off its
    # stage arms (if any) are checked instead, or it runs plain with nothing to race.
    # (A learned plan of one side stage has no arm yet: see test_checker_arms.py.)
    arm = "regions" if len(the_plan.stages) >= 2 else None
    report = check(model, *inputs, loss_fn=loss, steps=2, tune_arm=arm, split_weight_grads=False)
    assert report.ok, str(report)
    assert all(entry.max_abs_diff == 0.0 for entry in report.parity)
    if arm is not None:
        assert any(note.startswith("planned/learned") for note in report.notes)
        side = {row.stream for row in report.ops if row.forward and row.stream != "default"}
        assert len(side) == the_plan.num_streams  # the learned stages ran there in step 2


@pytest.mark.parametrize("case", list(CASES))
def test_cross_stream_waits_per_step_learned_against_static(
    case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    per_step = {}
    for planner in ("dataflow", "static"):
        model, inputs = build(case)
        wrapped = OOOModule(model, backend=SimulatedBackend(), planner=planner)
        train_step(wrapped, inputs)  # the dataflow planner learns here
        before = wrapped.stats
        train_step(wrapped, inputs)
        after = wrapped.stats
        per_step[planner] = (after.waits - before.waits) + (after.joins - before.joins)
        if planner == "dataflow":
            learned_plan = wrapped.plan.learned
    assert learned_plan is not None
    static_model, _ = build(case)
    static_streams = {s.name: s.stream for s in ooo_wrap.plan(static_model).stages}
    mine = count_edges(learned_plan, learned_plan.stage_streams)
    theirs = count_edges(learned_plan, static_streams)
    with capsys.disabled():
        print(
            f"\n{case}: learned {learned_plan.outcome}; cross-stream waits per step learned "
            f"{per_step['dataflow']}, static {per_step['static']}; stage edges across streams "
            f"learned {mine.cross_stream}/{mine.edges}, static {theirs.cross_stream}/"
            f"{theirs.edges} (chain links split: {theirs.chain_splits})"
        )
    assert mine.chain_splits == 0  # a chain link split across streams is a failure
    if learned_plan.outcome == "no_parallelism":
        assert per_step["dataflow"] == 0
    # docs/planner.md shows these figures: its row for this case must say the same.
    computed = {
        "learned outcome": f"`{learned_plan.outcome}`",
        "waits per step, learned / static": f"{per_step['dataflow']} / {per_step['static']}",
        "stage edges across streams, learned / static": (
            f"{mine.cross_stream} of {mine.edges} / {theirs.cross_stream} of {theirs.edges}"
        ),
        "chain links split, static": str(theirs.chain_splits),
    }
    shown = doc_tables.row(PLANNER_PAGE, cross_stream_table(), "model", f"(`{case}`)")
    differences = doc_tables.differences(PLANNER_PAGE, case, shown, computed)
    assert not differences, "\n".join(differences)


def test_the_planner_page_shows_one_cross_stream_row_per_case() -> None:
    rows = cross_stream_table()
    named = [re.findall(r"\(`(\w+)`\)", r["model"]) for r in rows]
    assert named == [[case] for case in CASES], f"{PLANNER_PAGE.name}: {named}"


def test_no_grad_and_disabled_forwards_do_not_learn() -> None:
    model, inputs = build("two_tower")
    wrapped = OOOModule(model, backend=SimulatedBackend(), tune_arm="regions")
    with torch.no_grad():
        wrapped(*inputs)
    with ooo_wrap.disabled():
        wrapped(*inputs)
    assert wrapped.plan.pending
    train_step(wrapped, inputs)
    assert not wrapped.plan.pending and wrapped.plan.stages


def test_a_forward_that_raises_while_observed_learns_on_the_next_one() -> None:
    model, inputs = build("two_tower")
    wrapped = OOOModule(model, backend=SimulatedBackend(), tune_arm="regions")
    hooks_before = {name: len(m._forward_hooks) for name, m in wrapped.named_modules()}
    with pytest.raises(RuntimeError):
        wrapped(inputs[0][:, :3].float(), inputs[1])  # float ids: the embedding raises
    assert wrapped.plan.pending
    assert {name: len(m._forward_hooks) for name, m in wrapped.named_modules()} == hooks_before
    train_step(wrapped, inputs)
    assert wrapped.plan.stages


def test_named_stages_that_form_one_chain_keep_their_hooks_and_say_so() -> None:
    from examples.transformer import build_model, example_input

    model = OOOModule(build_model(), streams=4, backend=SimulatedBackend())
    tokens = example_input()
    for _ in range(2):
        train_step(model, (tokens,))
    chain = [f"blocks.{i}" for i in range(4)]
    (event,) = [e for e in model.events if e.reason == "named_chain"]
    assert event.kind is EventKind.PLANNED
    assert event.message.startswith(
        "the named stages form one chain (blocks.0 -> blocks.1 -> blocks.2 -> blocks.3"
    )
    assert "they keep their hooks" in event.message
    assert "leave the stage names out" in event.message
    assert [stage.name for stage in model.plan.stages] == chain  # kept, as named
    assert model.stats.stage_calls == len(chain)  # the second step ran them on their stream
    assert "the named stages form one chain" in str(model.plan)


def test_named_stages_that_can_overlap_record_no_chain_event() -> None:
    model, inputs = build("two_tower")
    wrapped = OOOModule(model, backend=SimulatedBackend(), stages=["query_tower", "doc_tower"])
    train_step(wrapped, inputs)
    assert [e.reason for e in wrapped.events if e.kind is EventKind.PLANNED] == ["learned"]


def test_learning_that_fails_falls_back_to_the_static_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ooo_wrap._wrapper import learn as _learn

    def broken(*args: Any, **kwargs: Any) -> Plan:
        raise ValueError("no plan today")

    monkeypatch.setattr(_learn, "_learned", broken)
    model, inputs = build("two_tower")
    wrapped = OOOModule(model, backend=SimulatedBackend())
    train_step(wrapped, inputs)
    (event,) = [e for e in wrapped.events if e.kind is EventKind.PLANNED]
    assert event.reason == "static_fallback" and "no plan today" in event.message
    assert wrapped.plan == ooo_wrap.plan(build("two_tower")[0])
    train_step(wrapped, inputs)
    assert wrapped.stats.stage_calls == len(wrapped.plan.stages) + 1  # the embedding twice


def test_replan_learns_again_on_the_next_forward() -> None:
    model, inputs = build("two_tower")
    wrapped = OOOModule(model, backend=SimulatedBackend())
    train_step(wrapped, inputs)
    first = wrapped.plan
    wrapped.replan()
    assert wrapped.plan.pending
    assert [e.reason for e in wrapped.events if e.kind is EventKind.PLANNED][-1] == "replan"
    train_step(wrapped, inputs)
    assert wrapped.plan == first
    calls = wrapped.stats.stage_calls
    train_step(wrapped, inputs)
    assert wrapped.stats.stage_calls == calls + len(first.stages)


def test_replan_after_no_parallelism_learns_again() -> None:
    model, inputs = build("residual")
    wrapped = OOOModule(model, backend=SimulatedBackend())
    train_step(wrapped, inputs)
    assert not wrapped.plan.stages
    wrapped.replan()
    assert wrapped.plan.pending
    train_step(wrapped, inputs)
    disabled = [e for e in wrapped.events if e.kind is EventKind.DISABLED]
    assert disabled[-1].reason == "no_parallelism" and disabled[-1].count == 2


def test_replan_is_refused_for_the_static_planner() -> None:
    model, _ = build("two_tower")
    wrapped = OOOModule(model, backend=SimulatedBackend(), planner="static")
    with pytest.raises(ooo_wrap.OOOConfigError, match="planner='static'"):
        wrapped.replan()


def test_plan_with_example_inputs_is_the_plan_the_wrapper_learns() -> None:
    model, inputs = build("inception")
    stats_before = copy.deepcopy(model.blocks[0].b1[1].running_mean)
    offline = ooo_wrap.plan(model, example_inputs=inputs)
    assert torch.equal(model.blocks[0].b1[1].running_mean, stats_before)  # learned on a copy
    wrapped = OOOModule(build("inception")[0], backend=SimulatedBackend())
    train_step(wrapped, inputs)
    online = wrapped.plan
    assert offline == online and offline.source == "dataflow"
    # The whole learned plan, estimates included: both blocks' regions weighed (at this
    # size the simulated step pays for neither, so both plans keep no stage).
    assert offline.learned == online.learned
    assert offline.learned is not None and len(offline.learned.rejected) == 2


def test_named_stages_keep_their_names_and_learn_their_streams() -> None:
    model, inputs = build("inception")
    names = ["blocks.0.b3_reduce", "blocks.0.b3_a", "blocks.0.b3_b", "blocks.0.b1"]
    wrapped = OOOModule(model, stages=names, backend=SimulatedBackend())
    train_step(wrapped, inputs)
    assert [s.name for s in wrapped.plan.stages] == names
    assert wrapped.plan.source == "argument"
    chain = {stream_of(wrapped.plan, name) for name in names[:3]}
    assert len(chain) == 1  # round-robin would put these three on three streams
    assert stream_of(wrapped.plan, "blocks.0.b1") not in chain


def test_the_planner_option_is_checked() -> None:
    model, _ = build("two_tower")
    with pytest.raises(ooo_wrap.OOOConfigError, match="planner must be one of"):
        OOOModule(model, backend=SimulatedBackend(), planner="greedy")  # type: ignore[arg-type]
    assert type(model) is models.TwoTower


def test_the_cli_prints_the_learned_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from ooo_wrap._cli import main

    assert main(["plan", "examples.quickstart:build_model", "--input", "8x64"]) == 0
    out = capsys.readouterr().out
    assert "stages from dataflow" in out and "Learned plan" in out
    assert main(["plan", "examples.quickstart:build_model"]) == 0
    assert "pass --input SHAPE" in capsys.readouterr().out


def test_a_deep_copy_of_a_learned_model_learns_its_own_plan() -> None:
    model, inputs = build("two_tower")
    wrapped = OOOModule(model, backend=SimulatedBackend())
    train_step(wrapped, inputs)
    clone = copy.deepcopy(wrapped)
    assert isinstance(clone, OOOModule) and clone.plan.pending  # same options, fresh learning
    train_step(clone, inputs)
    assert clone.plan == wrapped.plan


def test_check_with_one_step_says_nothing_was_checked() -> None:
    model, inputs = build("two_tower")
    report = check(model, *inputs, loss_fn=loss, steps=1)
    assert not report.ok and report.not_checked is not None
    assert "pass steps >= 2" in report.not_checked
