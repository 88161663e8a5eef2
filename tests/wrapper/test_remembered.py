"""Decisions remembered across runs (the tuning cache) and agreed across ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ooo_wrap
from ooo_wrap import EventKind
from tests.support.distributed import REPO_ROOT, run_ranks
from tests.wrapper.test_arms import ArmClock, ThreeTowers, state, wrap_timed

TIMES = {"plain": 10.0, "wgrad": 8.5}


def train(model: torch.nn.Module, steps: int, batch: int = 4) -> int:
    """SGD steps until decided (at most ``steps``); how many tuning steps it took."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        model(torch.randn(batch, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        tuning = model.tuning  # type: ignore[attr-defined]
        if tuning is not None and tuning.decision != "pending":
            return step
    return steps


def fresh(
    cache: Path | str | bool | None, times: dict[str, float] = TIMES, **options: Any
) -> ooo_wrap.OOOModule:
    torch.manual_seed(0)
    return wrap_timed(ThreeTowers(), ArmClock(times), tune_cache=cache, **options)


def test_a_second_run_starts_decided_from_the_cache(tmp_path: Path) -> None:
    first = fresh(tmp_path)
    assert train(first, 400) > 20
    assert first.tuning is not None and first.tuning.decision == "wgrad"
    (stored,) = (tmp_path / "tuning").glob("*.json")
    assert json.loads(stored.read_text())["record"]["arm"] == "wgrad"
    second = fresh(tmp_path)
    # The learning forward, then one step that tells the model's optimizer: decided.
    assert train(second, 400) == 3
    tuning = second.tuning
    assert tuning is not None and tuning.decision == "wgrad"
    assert all(arm.step_ms == () for arm in tuning.arms)  # nothing measured
    (cached,) = [e for e in second.events if (e.kind, e.reason) == (EventKind.TUNED, "cached")]
    assert "from the cache: measured on" in cached.message and str(stored) in cached.message
    assert state(second).scheduler is not None and state(second).scheduler.weight_grads


@pytest.mark.parametrize("change", ["batch", "options", "off", "retune"], ids=lambda change: change)
def test_what_misses_the_cache(tmp_path: Path, change: str) -> None:
    train(fresh(tmp_path), 400)
    if change == "batch":
        model, batch = fresh(tmp_path), 5
    elif change == "options":
        model, batch = fresh(tmp_path, streams=3), 4
    elif change == "off":
        model, batch = fresh(False), 4
    else:
        model, batch = fresh(tmp_path), 4
        assert train(model, 400) == 3
        model.retune()
    assert train(model, 400, batch) > 20
    assert model.tuning is not None and all(arm.step_ms for arm in model.tuning.arms)


def test_the_environment_turns_the_cache_off_or_moves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OOO_WRAP_CACHE", str(tmp_path / "moved"))
    train(fresh(None), 400)
    assert list((tmp_path / "moved" / "tuning").glob("*.json"))
    monkeypatch.setenv("OOO_WRAP_CACHE", "off")
    assert train(fresh(None), 400) > 20


def test_a_corrupt_cache_file_warns_once_and_tuning_runs_again(tmp_path: Path) -> None:
    train(fresh(tmp_path), 400)
    (stored,) = (tmp_path / "tuning").glob("*.json")
    stored.write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fresh(tmp_path)
        assert train(model, 400) > 20
    messages = [str(w.message) for w in caught if "tuning cache" in str(w.message)]
    assert len(messages) == 1 and str(stored) in messages[0]
    assert json.loads(stored.read_text())["record"]["arm"] == "wgrad"  # written again


def test_tune_false_writes_nothing(tmp_path: Path) -> None:
    model = fresh(tmp_path, tune=False)
    train(model, 10)
    assert not (tmp_path / "tuning").exists()


def train_lengths(model: torch.nn.Module, lengths: list[int], steps: int = 400) -> int:
    """As :func:`train`, the batch cycling over ``lengths`` (dynamic padding's loop)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        model(torch.randn(lengths[(step - 1) % len(lengths)], 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        if model.tuning is not None and model.tuning.decision != "pending":  # type: ignore[attr-defined]
            return step
    return steps


def stored_record(directory: Path) -> dict[str, Any]:
    """The one record in the cache ``directory``."""
    (stored,) = (directory / "tuning").glob("*.json")
    record: dict[str, Any] = json.loads(stored.read_text())["record"]
    return record


def lengths_of(record: dict[str, Any]) -> set[int]:
    """The batch lengths of the input shapes a record says were raced."""
    return {signature[0][0][0] for signature in record["shapes"]}


def test_a_loop_over_lengths_stores_the_set_raced_and_any_length_of_it_hits(
    tmp_path: Path,
) -> None:
    first = fresh(tmp_path)
    assert train_lengths(first, [16, 24, 32]) > 20
    assert first.tuning is not None and first.tuning.decision == "wgrad"
    assert lengths_of(stored_record(tmp_path)) == {16, 24, 32}
    # A later run whose loop starts at another length of the same loop.
    second = fresh(tmp_path)
    assert train_lengths(second, [24, 32, 16]) == 3
    assert second.tuning is not None and second.tuning.decision == "wgrad"
    assert all(arm.step_ms == () for arm in second.tuning.arms)  # nothing measured


def test_a_loop_starting_outside_the_set_raced_misses_and_replaces_the_record(
    tmp_path: Path,
) -> None:
    train_lengths(fresh(tmp_path), [16, 24, 32])
    # Its first length was never raced, though the lengths after it were.
    model = fresh(tmp_path)
    assert train_lengths(model, [40, 16, 24]) > 20
    assert model.tuning is not None and all(arm.step_ms for arm in model.tuning.arms)
    assert lengths_of(stored_record(tmp_path)) == {16, 24, 40}  # one file, the new set
    assert train_lengths(fresh(tmp_path), [24, 40, 16]) == 3


def cached_event(model: ooo_wrap.OOOModule) -> str:
    (event,) = [e for e in model.events if (e.kind, e.reason) == (EventKind.TUNED, "cached")]
    return event.message


def test_a_cached_arm_confirmed_alone_against_plain_is_kept(tmp_path: Path) -> None:
    raced = train(fresh(tmp_path), 400)
    (stored,) = (tmp_path / "tuning").glob("*.json")
    before = stored.read_bytes()
    model = fresh(tmp_path, tune_cache_confirm=True)
    steps = train(model, 400)
    assert 3 < steps < raced  # the confirmation round only: no race
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "wgrad"
    assert all(arm.step_ms == () for arm in tuning.arms)  # nothing raced
    confirmation = {arm.name: len(arm.step_ms) for arm in tuning.confirmation}
    assert confirmation.keys() == {"plain", "wgrad"} and min(confirmation.values()) >= 6
    figures = "median step 8.500 ms with wgrad vs 10.000 ms plain (1.18x, "
    assert tuning.why.startswith("from the cache, confirmed now: in the confirmation round")
    assert figures in tuning.why and str(stored) in tuning.why
    assert cached_event(model) == tuning.why
    assert state(model).scheduler is not None and state(model).scheduler.weight_grads
    assert stored.read_bytes() == before  # confirmed: the record stands as it was


def test_a_cached_arm_not_confirmed_keeps_plain_and_overwrites_the_record(
    tmp_path: Path,
) -> None:
    train(fresh(tmp_path), 400)
    model = fresh(tmp_path, {"plain": 10.0, "wgrad": 10.5}, tune_cache_confirm=True)
    train(model, 400)
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "plain"
    assert tuning.why.startswith("from the cache, not confirmed now: in the confirmation round")
    assert "median step 10.000 ms with plain vs 10.000 ms plain" not in tuning.why
    assert "with wgrad vs 10.000 ms plain" in tuning.why
    assert cached_event(model) == tuning.why
    (disabled,) = [e for e in model.events if e.kind is EventKind.DISABLED]
    assert disabled.reason == "measured_slower" and tuning.why in disabled.message
    assert state(model).scheduler is None
    assert stored_record(tmp_path)["arm"] == "plain"
    assert train(fresh(tmp_path), 400) == 3  # the next run starts from plain


def test_a_cached_plain_decision_needs_no_confirmation(tmp_path: Path) -> None:
    train(fresh(tmp_path, {"plain": 10.0}), 400)
    assert stored_record(tmp_path)["arm"] == "plain"
    model = fresh(tmp_path, {"plain": 10.0}, tune_cache_confirm=True)
    assert train(model, 400) == 3
    assert model.tuning is not None and model.tuning.decision == "plain"
    assert model.tuning.confirmation == () and "not re-measured" in cached_event(model)


_SCRIPT = """
import sys, torch, ooo_wrap
sys.path.insert(0, {root!r})
from tests.wrapper.test_arms import ArmClock, ThreeTowers, wrap_timed
from tests.wrapper.test_remembered import TIMES, train
torch.manual_seed(0)
model = wrap_timed(ThreeTowers(), ArmClock(TIMES), tune_cache={cache!r})
print(train(model, 400), model.tuning.decision)
"""


def test_a_second_process_is_decided_with_no_tuning_step(tmp_path: Path) -> None:
    script = _SCRIPT.format(root=str(REPO_ROOT), cache=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    assert runs[0][1] == runs[1][1] == "wgrad"
    assert int(runs[0][0]) > 20 and runs[1][0] == "3"


def _ranks_agree(rank: int, world_size: int, cache: str, confirm: bool = False) -> dict[str, Any]:
    """Each rank's clock favours another arm; only rank 0 may have a cache."""
    times = {"plain": 10.0, "wgrad": 8.0} if rank == 0 else {"plain": 10.0, "static": 8.0}
    torch.manual_seed(0)
    setting = cache if rank == 0 and cache else False
    clock = ArmClock(times, noise=0.01, seed=rank)
    model = wrap_timed(ThreeTowers(), clock, tune_cache=setting, tune_cache_confirm=confirm)
    steps = train(model, 400)
    assert model.tuning is not None
    # Both ranks leave together: one that tears the group down while the other is still
    # in its last step aborts that one in gloo's teardown.
    torch.distributed.barrier()
    return {"decision": model.tuning.decision, "steps": steps}


def test_ddp_ranks_keep_rank_0s_arm_measured_cached_or_confirmed_on_rank_0(tmp_path: Path) -> None:
    measured = run_ranks(_ranks_agree, str(tmp_path), timeout=300.0)  # fills rank 0's cache
    assert [r["decision"] for r in measured] == ["wgrad", "wgrad"]
    assert measured[0]["steps"] == measured[1]["steps"] > 20
    cached = run_ranks(_ranks_agree, str(tmp_path), timeout=300.0)
    assert [r["decision"] for r in cached] == ["wgrad", "wgrad"]
    # Rank 0 recalled it at the first step; the ranks agree at the next common forward.
    assert cached[0]["steps"] == cached[1]["steps"] < measured[0]["steps"]
    # Rank 0 confirms its cached arm while rank 1 races: both keep rank 0's, together.
    confirmed = run_ranks(_ranks_agree, str(tmp_path), True, timeout=300.0)
    assert [r["decision"] for r in confirmed] == ["wgrad", "wgrad"]
    assert cached[0]["steps"] < confirmed[0]["steps"] == confirmed[1]["steps"]
