"""``copy.deepcopy`` of wrapped models; shallow copies and lone stages are refused."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind
from ooo_wrap.testing import SimulatedBackend
from tests.support.serialize_helpers import (
    Recorder,
    Towers,
    assert_same_state,
    hook_counts,
    hook_layout,
    pickle_round_trip,
    wrapped,
)

# --- deepcopy ---------------------------------------------------------------------------


def test_deepcopy_is_an_independently_wrapped_model() -> None:
    backend = SimulatedBackend()
    model = wrapped(backend=backend, profile_ranges=True)
    model(torch.randn(2, 8))
    clone = copy.deepcopy(model)
    assert type(clone) is type(model)
    assert isinstance(clone, Towers) and isinstance(clone, ooo_wrap.OOOModule)
    assert clone.plan == model.plan
    assert_same_state(clone, model)
    assert all(p is not q for p, q in zip(clone.parameters(), model.parameters(), strict=True))
    # Its own hooks: the same number as the original's, calls counted for the copy only.
    assert hook_counts(clone) == hook_counts(model)
    assert clone.stats.forwards == 0
    clone(torch.randn(2, 8))
    assert (clone.stats.forwards, model.stats.forwards) == (1, 1)
    # Fresh events, with a note of where the copy came from.
    kinds = [(e.kind, e.reason) for e in clone.events]
    assert kinds == [(EventKind.ENABLED, "simulated"), (EventKind.ENABLED, "deepcopy")]


def test_deepcopy_shares_the_backend_and_gets_its_own_streams() -> None:
    backend = SimulatedBackend()
    model = wrapped(backend=backend)
    clone = copy.deepcopy(model)
    created = [call.stream for call in backend.log if call.op == "new_stream"]
    assert len(created) == 6 and len(set(created)) == 6  # 3 for each, none shared
    backend.clear_log()
    clone(torch.randn(2, 8))
    used = {call.stream for call in backend.log if call.op == "set_stream"}
    assert used - {ooo_wrap.testing.VirtualStream(0)} == set(created[3:])


def test_deepcopy_gradients_are_independent() -> None:
    model = wrapped()
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
    model = ooo_wrap.OOOModule(plain, backend=SimulatedBackend(), planner="static")
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
    model = wrapped()
    model.me = [model]  # a reference cycle back to the wrapped model
    outer = nn.Sequential(model, nn.Identity())
    outer_copy = copy.deepcopy(outer)
    inner = outer_copy[0]
    assert isinstance(inner, ooo_wrap.OOOModule) and inner is not model
    assert inner.me[0] is inner
    inner(torch.randn(2, 8))
    assert (inner.stats.forwards, model.stats.forwards) == (1, 0)


# --- refused, with a clear error ----------------------------------------------------------


def test_a_stage_alone_cannot_be_pickled_or_copied() -> None:
    model = wrapped()
    with pytest.raises(ooo_wrap.OOOError, match=r"state_dict\(\).*unwrap"):
        pickle.dumps(model.towers[0])
    with pytest.raises(ooo_wrap.OOOError, match="stage of a wrapped model was copied"):
        copy.deepcopy(model.towers[0])
    ooo_wrap.unwrap(model)  # once unwrapped, a stage is plain again
    assert isinstance(copy.deepcopy(model.towers[0]), nn.Sequential)


def test_shallow_copy_is_refused() -> None:
    with pytest.raises(ooo_wrap.OOOError, match=r"copy\.deepcopy"):
        copy.copy(wrapped())


def test_unwrapped_model_pickles_as_plain() -> None:
    model = wrapped()
    model.unwrap()
    loaded = pickle_round_trip(model)
    assert type(loaded) is Towers
    assert hook_counts(loaded) == [0] * len(list(loaded.modules()))


def test_a_stage_referenced_outside_the_module_tree() -> None:
    model = wrapped()
    model.order = [model.towers[2], model.towers[0]]  # a plain list, not a ModuleList
    clone = copy.deepcopy(model)  # the deep copy follows every reference
    assert clone.order[0] is clone.towers[2] and clone.order[1] is clone.towers[0]
    clone(torch.randn(2, 8))
    assert clone.stats.stage_calls == 3
    with pytest.raises(ooo_wrap.OOOError, match="reference outside the model's sub-modules"):
        pickle.dumps(model)  # pickle cannot: the list would carry the stage with its hooks


def _with_hooks_before_and_after_wrapping() -> nn.Module:
    plain = Towers()
    plain.register_forward_pre_hook(Recorder("root-pre-before"))
    plain.register_forward_hook(Recorder("root-before"))
    plain.towers[1].register_forward_pre_hook(Recorder("pre-before"))
    plain.towers[1].register_forward_hook(Recorder("post-before"))
    model = ooo_wrap.OOOModule(plain, backend=SimulatedBackend(), planner="static")
    model.register_forward_hook(Recorder("root-after"))
    model.towers[1].register_forward_pre_hook(Recorder("pre-after"))
    model.towers[1].register_forward_hook(Recorder("post-after"))
    return model


def test_user_hooks_keep_their_place_around_the_wrappers() -> None:
    model = _with_hooks_before_and_after_wrapping()
    layout = hook_layout(model)
    assert ("towers.1", "_forward_hooks", ["post-before", "ooo", "post-after"]) in layout
    assert ("", "_forward_pre_hooks", ["ooo", "root-pre-before"]) in layout
    assert hook_layout(copy.deepcopy(model)) == layout
    assert hook_layout(pickle_round_trip(model)) == layout
