"""``pickle`` and ``torch.save`` of wrapped models: stored plain, wrapped again on load."""

from __future__ import annotations

import copy
import io
import os
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

import ooo_wrap
from ooo_wrap import EventKind
from ooo_wrap.testing import SimulatedBackend
from tests.support.serialize_helpers import (
    Recorder,
    SwitchableBackend,
    Towers,
    assert_same_state,
    hook_counts,
    hook_layout,
    pickle_round_trip,
    wrapped,
)

# --- pickle / torch.save ----------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trips_to_a_working_wrapped_model(protocol: int) -> None:
    model = wrapped(streams=2, stages=["towers.0", "towers.2"])
    loaded = pickle_round_trip(model, protocol)
    assert type(loaded) is type(model)
    assert isinstance(loaded, ooo_wrap.OOOModule)
    assert loaded.plan == model.plan
    assert_same_state(loaded, model)
    x = torch.randn(4, 8)
    out, expected = loaded(x), model(x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(loaded.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert loaded.stats.stage_calls == 2
    assert [e.reason for e in loaded.events] == ["simulated", "unpickled"]


def test_pickling_leaves_the_original_untouched() -> None:
    model = wrapped()
    hooks_before = hook_counts(model)
    events_before = model.events
    pickle.dumps(model)
    assert hook_counts(model) == hooks_before
    assert model.events == events_before
    model(torch.randn(2, 8))
    assert model.stats.stage_calls == 3


def test_pickle_keeps_options_and_user_hooks() -> None:
    plain = Towers()
    plain.root_hook = Recorder()
    plain.stage_hook = Recorder()
    plain.register_forward_hook(plain.root_hook)
    plain.towers[2].register_forward_hook(plain.stage_hook)
    plain.alias = plain.towers[0]  # a stage registered under a second name
    model = ooo_wrap.OOOModule(
        plain,
        streams=2,
        stages=["towers.0", "towers.1", "towers.2"],
        backend=SimulatedBackend(),
        planner="static",
    )
    loaded = pickle_round_trip(model)
    assert loaded.alias is loaded.towers[0]
    assert hook_counts(loaded) == hook_counts(model)
    with torch.profiler.profile() as prof:
        loaded(torch.randn(2, 8))
    assert not [e for e in prof.events() if e.name.startswith("ooo/")]  # ranges were off
    assert (loaded.root_hook.calls, loaded.stage_hook.calls) == (1, 1)
    assert (plain.root_hook.calls, plain.stage_hook.calls) == (0, 0)
    assert loaded.plan.max_streams == 2


def test_pickle_keeps_profile_ranges() -> None:
    loaded = pickle_round_trip(wrapped(profile_ranges=True))
    with torch.profiler.profile() as prof:
        loaded(torch.randn(2, 8))
    names = sorted(e.name for e in prof.events() if e.name.startswith("ooo/"))
    assert names == ["ooo/towers.0", "ooo/towers.1", "ooo/towers.2"]


def test_torch_save_whole_model_round_trips() -> None:
    model = wrapped()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, ooo_wrap.OOOModule) and isinstance(loaded, Towers)
    assert_same_state(loaded, model)
    loaded(torch.randn(2, 8)).sum().backward()
    assert loaded.stats.stage_calls == 3
    # torch.load's default (weights_only=True) refuses whole models, wrapped or not.
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buffer)


def test_state_dict_save_loads_into_wrapped_and_plain_models() -> None:
    model = wrapped()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    plain, rewrapped = Towers(), wrapped()
    plain.load_state_dict(state)
    rewrapped.load_state_dict(state)
    assert_same_state(plain, model)
    assert_same_state(rewrapped, model)


def test_unpickled_model_falls_back_where_the_backend_is_unsupported() -> None:
    model = ooo_wrap.OOOModule(Towers(), backend=SwitchableBackend(), planner="static")
    data = pickle.dumps(model)
    SwitchableBackend.available = False
    try:
        loaded = pickle.loads(data)
    finally:
        SwitchableBackend.available = True
    assert type(loaded) is Towers  # plain and working, not half-wrapped
    assert [(e.kind, e.reason) for e in ooo_wrap.events_for(loaded)] == [
        (EventKind.DISABLED, "no_accelerator")
    ]
    assert_same_state(loaded, model)
    loaded(torch.randn(2, 8)).sum().backward()


def test_simulated_backend_pickles_as_a_fresh_backend() -> None:
    backend = SimulatedBackend(log_size=7)
    backend.new_stream(torch.device("cpu"))
    loaded = pickle.loads(pickle.dumps(backend))
    assert isinstance(loaded, SimulatedBackend) and loaded.log == ()
    for _ in range(10):
        loaded.current_stream()
    assert len(loaded.log) == 7
    keep_all = pickle.loads(pickle.dumps(SimulatedBackend(keep_all=True)))
    for _ in range(20_000):
        keep_all.current_stream()
    assert len(keep_all.log) == 20_000


def test_a_wrapped_model_inside_a_pickled_parent_is_wrapped_again() -> None:
    outer = nn.Sequential(wrapped(), nn.ReLU())
    loaded = pickle_round_trip(outer)
    assert isinstance(loaded[0], ooo_wrap.OOOModule)
    loaded(torch.randn(2, 8))
    assert loaded[0].stats.stage_calls == 3


# --- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.cuda
def test_copies_and_saves_on_a_gpu() -> None:
    model = ooo_wrap.OOOModule(Towers().cuda(), streams=3, planner="static")
    assert isinstance(model, ooo_wrap.OOOModule)
    x = torch.randn(4, 8, device="cuda")
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(x), model(x))
    assert clone.stats.stage_calls == 3
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, ooo_wrap.OOOModule)
    loaded(x).sum().backward()
    assert loaded.stats.stage_calls == 3
    buffer.seek(0)
    on_cpu = torch.load(buffer, map_location="cpu", weights_only=False)
    assert type(on_cpu) is Towers  # loaded onto the CPU: left plain, and the events say why
    assert [e.reason for e in ooo_wrap.events_for(on_cpu)] == ["cpu"]
    on_cpu(x.cpu()).sum().backward()


ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_loaded_hook_ids_are_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = Towers()
    plain.pre = Recorder("pre")
    handle = plain.register_forward_pre_hook(plain.pre)
    data = pickle.dumps(ooo_wrap.OOOModule(plain, backend=SimulatedBackend(), planner="static"))
    # As in a fresh process, where the id counter never handed out the loaded ids: the
    # wrapper's root pre-hook, registered first, would get the user pre-hook's id.
    monkeypatch.setattr(RemovableHandle, "next_id", handle.id)
    loaded = pickle.loads(data)
    loaded(torch.randn(2, 8))
    assert loaded.pre.calls == 1
    assert hook_layout(loaded)[0] == ("", "_forward_pre_hooks", ["ooo", "pre"])


def test_loading_moves_the_hook_counter_only_as_registering_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plain = Towers()
    plain.pre = Recorder("pre")
    monkeypatch.setattr(RemovableHandle, "next_id", 1000)
    plain.register_forward_pre_hook(plain.pre)
    wrapped = ooo_wrap.OOOModule(plain, backend=SimulatedBackend(), planner="static")
    data = pickle.dumps(wrapped)
    monkeypatch.setattr(RemovableHandle, "next_id", 5)  # a fresh process, ids 5 and up free
    loaded = pickle.loads(data)
    # One fresh id per loaded hook and per wrapper hook: never a jump past the loaded ids.
    assert RemovableHandle.next_id < 1000
    later = Recorder("later")
    loaded.register_forward_pre_hook(later)
    loaded(torch.randn(2, 8))
    assert (loaded.pre.calls, later.calls) == (1, 1)
    assert hook_layout(loaded)[0] == ("", "_forward_pre_hooks", ["ooo", "pre", "later"])


LOAD_IN_A_FRESH_PROCESS = """
import sys
import torch
from torch.utils.hooks import RemovableHandle
first_id = RemovableHandle.next_id
model = torch.load(sys.argv[1], weights_only=False)
model(torch.randn(2, 8)).sum().backward()
print(first_id, type(model).__qualname__, model.stats.stage_calls, model.towers[0].hook.calls)
print([e.reason for e in model.events])
"""


def test_torch_save_loads_in_a_fresh_process(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = Towers()
    plain.towers[0].hook = Recorder("stage-0")
    # Id 3 is what a fresh process gives the wrapper's 4th hook (towers.0's forward hook).
    monkeypatch.setattr(RemovableHandle, "next_id", 3)
    plain.towers[0].register_forward_hook(plain.towers[0].hook)
    monkeypatch.undo()
    path = tmp_path / "model.pt"
    torch.save(ooo_wrap.OOOModule(plain, backend=SimulatedBackend(), planner="static"), path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0 OOOTowers 3 1\n['simulated', 'unpickled']\n"
