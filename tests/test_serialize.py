"""``copy.deepcopy``, ``pickle`` and ``torch.save`` of wrapped models."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind
from ooo_wrap.testing import SimulatedBackend


class Recorder:
    """A picklable forward hook that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.calls += 1


class Towers(nn.Module):
    def __init__(self, towers: int = 3) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)) for _ in range(towers)
        )
        self.register_buffer("offset", torch.arange(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([tower(x) for tower in self.towers]).sum(0) + self.offset


class SwitchableBackend(SimulatedBackend):
    """Picklable by reference; says the device is unsupported while ``available`` is off."""

    available = True

    def __reduce__(self) -> tuple[Any, ...]:
        return (SwitchableBackend, ())

    def unsupported_reason(self, device: torch.device) -> str | None:
        return None if SwitchableBackend.available else "no_accelerator"


def _wrapped(**options: Any) -> nn.Module:
    options.setdefault("backend", SimulatedBackend())
    return ooo_wrap.OOOModule(Towers(), **options)  # type: ignore[no-any-return]


def _hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], msg=key)


def _pickle_round_trip(model: nn.Module, protocol: int = pickle.HIGHEST_PROTOCOL) -> Any:
    return pickle.loads(pickle.dumps(model, protocol=protocol))


# --- deepcopy ---------------------------------------------------------------------------


def test_deepcopy_is_an_independently_wrapped_model() -> None:
    backend = SimulatedBackend()
    model = _wrapped(backend=backend, profile_ranges=True)
    model(torch.randn(2, 8))
    clone = copy.deepcopy(model)
    assert type(clone) is type(model)
    assert isinstance(clone, Towers) and isinstance(clone, ooo_wrap.OOOModule)
    assert clone.plan == model.plan
    _assert_same_state(clone, model)
    assert all(p is not q for p, q in zip(clone.parameters(), model.parameters(), strict=True))
    # Its own hooks: the same number as the original's, calls counted for the copy only.
    assert _hook_counts(clone) == _hook_counts(model)
    assert clone.stats.forwards == 0
    clone(torch.randn(2, 8))
    assert (clone.stats.forwards, model.stats.forwards) == (1, 1)
    # Fresh events, with a note of where the copy came from.
    kinds = [(e.kind, e.reason) for e in clone.events]
    assert kinds == [(EventKind.ENABLED, "simulated"), (EventKind.ENABLED, "deepcopy")]


def test_deepcopy_shares_the_backend_and_gets_its_own_streams() -> None:
    backend = SimulatedBackend()
    model = _wrapped(backend=backend)
    clone = copy.deepcopy(model)
    created = [call.stream for call in backend.log if call.op == "new_stream"]
    assert len(created) == 6 and len(set(created)) == 6  # 3 for each, none shared
    backend.clear_log()
    clone(torch.randn(2, 8))
    used = {call.stream for call in backend.log if call.op == "set_stream"}
    assert used - {ooo_wrap.testing.VirtualStream(0)} == set(created[3:])


def test_deepcopy_gradients_are_independent() -> None:
    model = _wrapped()
    clone = copy.deepcopy(model)
    x = torch.randn(4, 8)
    clone(x).pow(2).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    model(x).pow(2).sum().backward()
    for p, q in zip(model.parameters(), clone.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
        assert p.grad is not q.grad
    with torch.no_grad():
        clone.towers[0][0].weight.add_(1.0)
    assert not torch.equal(clone.towers[0][0].weight, model.towers[0][0].weight)


def test_deepcopy_keeps_user_hooks_and_unwraps_cleanly() -> None:
    plain = Towers()
    plain.root_hook = Recorder()
    plain.stage_hook = Recorder()
    plain.register_forward_hook(plain.root_hook)
    plain.towers[1].register_forward_hook(plain.stage_hook)
    model = ooo_wrap.OOOModule(plain, backend=SimulatedBackend())
    clone = copy.deepcopy(model)
    clone(torch.randn(2, 8))
    assert (clone.root_hook.calls, clone.stage_hook.calls) == (1, 1)
    assert (model.root_hook.calls, model.stage_hook.calls) == (0, 0)
    clone.unwrap()
    assert type(clone) is Towers
    assert len(clone._forward_hooks) == 1 and len(clone.towers[1]._forward_hooks) == 1
    assert isinstance(model, ooo_wrap.OOOModule)  # the original is still wrapped
    model(torch.randn(2, 8))
    assert model.stats.forwards == 1


def test_deepcopy_inside_a_container_and_with_a_cycle() -> None:
    model = _wrapped()
    model.me = [model]  # a reference cycle back to the wrapped model
    outer = nn.Sequential(model, nn.Identity())
    outer_copy = copy.deepcopy(outer)
    inner = outer_copy[0]
    assert isinstance(inner, ooo_wrap.OOOModule) and inner is not model
    assert inner.me[0] is inner
    inner(torch.randn(2, 8))
    assert (inner.stats.forwards, model.stats.forwards) == (1, 0)


# --- pickle / torch.save ----------------------------------------------------------------


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trips_to_a_working_wrapped_model(protocol: int) -> None:
    model = _wrapped(streams=2, stages=["towers.0", "towers.2"])
    loaded = _pickle_round_trip(model, protocol)
    assert type(loaded) is type(model)
    assert isinstance(loaded, ooo_wrap.OOOModule)
    assert loaded.plan == model.plan
    _assert_same_state(loaded, model)
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
    model = _wrapped()
    hooks_before = _hook_counts(model)
    events_before = model.events
    pickle.dumps(model)
    assert _hook_counts(model) == hooks_before
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
        plain, streams=2, stages=["towers.0", "towers.1", "towers.2"], backend=SimulatedBackend()
    )
    loaded = _pickle_round_trip(model)
    assert loaded.alias is loaded.towers[0]
    assert _hook_counts(loaded) == _hook_counts(model)
    with torch.profiler.profile() as prof:
        loaded(torch.randn(2, 8))
    assert not [e for e in prof.events() if e.name.startswith("ooo/")]  # ranges were off
    assert (loaded.root_hook.calls, loaded.stage_hook.calls) == (1, 1)
    assert (plain.root_hook.calls, plain.stage_hook.calls) == (0, 0)
    assert loaded.plan.max_streams == 2


def test_pickle_keeps_profile_ranges() -> None:
    loaded = _pickle_round_trip(_wrapped(profile_ranges=True))
    with torch.profiler.profile() as prof:
        loaded(torch.randn(2, 8))
    names = sorted(e.name for e in prof.events() if e.name.startswith("ooo/"))
    assert names == ["ooo/towers.0", "ooo/towers.1", "ooo/towers.2"]


def test_torch_save_whole_model_round_trips() -> None:
    model = _wrapped()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, ooo_wrap.OOOModule) and isinstance(loaded, Towers)
    _assert_same_state(loaded, model)
    loaded(torch.randn(2, 8)).sum().backward()
    assert loaded.stats.stage_calls == 3
    # torch.load's default (weights_only=True) refuses whole models, wrapped or not.
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(buffer)


def test_state_dict_save_loads_into_wrapped_and_plain_models() -> None:
    model = _wrapped()
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer)
    plain, rewrapped = Towers(), _wrapped()
    plain.load_state_dict(state)
    rewrapped.load_state_dict(state)
    _assert_same_state(plain, model)
    _assert_same_state(rewrapped, model)


def test_unpickled_model_falls_back_where_the_backend_is_unsupported() -> None:
    model = ooo_wrap.OOOModule(Towers(), backend=SwitchableBackend())
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
    _assert_same_state(loaded, model)
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
    outer = nn.Sequential(_wrapped(), nn.ReLU())
    loaded = _pickle_round_trip(outer)
    assert isinstance(loaded[0], ooo_wrap.OOOModule)
    loaded(torch.randn(2, 8))
    assert loaded[0].stats.stage_calls == 3


# --- refused, with a clear error ----------------------------------------------------------


def test_a_stage_alone_cannot_be_pickled_or_copied() -> None:
    model = _wrapped()
    with pytest.raises(ooo_wrap.OOOError, match=r"state_dict\(\).*unwrap"):
        pickle.dumps(model.towers[0])
    with pytest.raises(ooo_wrap.OOOError, match="stage of a wrapped model"):
        copy.deepcopy(model.towers[0])
    ooo_wrap.unwrap(model)  # once unwrapped, a stage is plain again
    assert isinstance(copy.deepcopy(model.towers[0]), nn.Sequential)


def test_shallow_copy_is_refused() -> None:
    with pytest.raises(ooo_wrap.OOOError, match=r"copy\.deepcopy"):
        copy.copy(_wrapped())


def test_unwrapped_model_pickles_as_plain() -> None:
    model = _wrapped()
    model.unwrap()
    loaded = _pickle_round_trip(model)
    assert type(loaded) is Towers
    assert _hook_counts(loaded) == [0] * len(list(loaded.modules()))
