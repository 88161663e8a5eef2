"""The torch-version guards, tested on the CPU by hiding the newer API.

CI runs one torch; the machines that run the kit may run an older one (down to the
declared minimum, 2.6). Each guard in ``ooo_wrap/_compat.py`` is exercised here both
with the newer API present and with it hidden behind a stand-in object.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ooo_wrap import _compat
from ooo_wrap._runtime.backend import AcceleratorBackend

CUDA_DEVICE_TYPE = 1  # what torch.Stream.device_type holds for a CUDA stream: an int


class _OldStream:
    """A CUDA stream as torch before ``torch.Stream.is_capturing`` shows it."""

    device_type = CUDA_DEVICE_TYPE
    device_index = 0
    device = torch.device("cuda", 0)


class _NewStream(_OldStream):
    def __init__(self, capturing: bool) -> None:
        self.capturing = capturing

    def is_capturing(self) -> bool:
        return self.capturing


def _capturing(monkeypatch: pytest.MonkeyPatch, value: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: value)


@pytest.mark.parametrize("capturing", [True, False])
def test_capture_detected_without_stream_is_capturing(
    monkeypatch: pytest.MonkeyPatch, capturing: bool
) -> None:
    # torch 2.6 to 2.11: no torch.Stream.is_capturing; the CUDA query must be used. The
    # stream's device_type is an int there, so comparing it with "cuda" never matched.
    _capturing(monkeypatch, capturing)
    assert not hasattr(_OldStream(), "is_capturing")
    assert _compat.stream_is_capturing(_OldStream()) is capturing
    assert AcceleratorBackend().is_capturing(_OldStream()) is capturing


def test_capture_query_prefers_the_stream_method(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_be_called() -> bool:
        raise AssertionError("the CUDA-only query was used although the stream has its own")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", must_not_be_called)
    assert _compat.stream_is_capturing(_NewStream(True)) is True
    assert _compat.stream_is_capturing(_NewStream(False)) is False


def test_non_cuda_stream_without_the_method_is_not_capturing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _capturing(monkeypatch, True)  # a CUDA capture elsewhere says nothing of this stream

    class _XpuStream:
        device_type = 12
        device_index = 0
        device = torch.device("xpu", 0)

    assert _compat.stream_is_capturing(_XpuStream()) is False


def test_real_cpu_stream_device_type_is_an_int() -> None:
    # The premise of the fix: on this torch, too, device_type is not a string.
    stream: Any = torch.Stream(device="cpu")
    assert isinstance(stream.device_type, int)
    assert torch.device(stream.device).type == "cpu"


def test_the_private_classes_are_recognised() -> None:
    # Hidden (a torch without them), the guards answer "no" with one warning: see
    # test_compat_names.py, which hides each name from a fresh process.
    import torch.utils.checkpoint as checkpoint
    from torch import nn

    assert _compat.is_compiled_module(nn.Linear(2, 2)) is False
    assert _compat.is_checkpoint_early_stop(RuntimeError("x")) is False
    assert _compat.is_checkpoint_early_stop(checkpoint._StopRecomputationError()) is True


def test_checkpoint_unpacks_are_wrapped_once_and_only_where_torch_has_the_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.utils.checkpoint as checkpoint

    def unpack(holder: object) -> torch.Tensor:
        return torch.zeros(1)

    class Hook(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, frame: object) -> None:
            super().__init__(lambda x: x, unpack)

    def wrap(inner: _compat.UnpackHook) -> _compat.UnpackHook:
        return lambda holder: inner(holder) + 1

    monkeypatch.setattr(checkpoint, "_checkpoint_hook", Hook)
    assert _compat.wrap_checkpoint_unpacks(wrap) is True
    wrapped = checkpoint._checkpoint_hook
    assert issubclass(wrapped, Hook) and wrapped is not Hook
    assert wrapped(None).unpack_hook(None).item() == 1  # type: ignore[no-untyped-call]
    assert _compat.wrap_checkpoint_unpacks(wrap) is True
    assert checkpoint._checkpoint_hook is wrapped  # not wrapped twice
    monkeypatch.delattr(checkpoint, "_checkpoint_hook")
    assert _compat.wrap_checkpoint_unpacks(wrap) is False


@pytest.mark.parametrize("before", [False, True])
def test_the_stale_capture_stream_override_is_set_for_the_block_only(before: bool) -> None:
    if not hasattr(torch.autograd.graph, "set_override_stale_capture_stream"):
        pytest.skip("this torch has no stale capture stream override")
    torch.autograd.graph.set_override_stale_capture_stream(before)
    try:
        with _compat.stale_capture_streams_overridden() as overridden:
            assert overridden is True
            assert torch._C._override_stale_capture_stream() is True
        assert torch._C._override_stale_capture_stream() is before
        with pytest.raises(KeyError), _compat.stale_capture_streams_overridden():
            raise KeyError("inside")
        assert torch._C._override_stale_capture_stream() is before
    finally:
        torch.autograd.graph.set_override_stale_capture_stream(False)  # the process default


@pytest.mark.parametrize("hidden", ["setter", "getter"])
def test_without_the_stale_capture_stream_override_nothing_changes(
    hidden: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11 has neither; a torch with one half only is treated alike.
    calls: list[bool] = []
    monkeypatch.setattr(
        torch.autograd.graph, "set_override_stale_capture_stream", calls.append, raising=False
    )
    monkeypatch.setattr(torch._C, "_override_stale_capture_stream", lambda: False, raising=False)
    owner = torch.autograd.graph if hidden == "setter" else torch._C
    name = (
        "set_override_stale_capture_stream"
        if hidden == "setter"
        else "_override_stale_capture_stream"
    )
    monkeypatch.delattr(owner, name)
    with _compat.stale_capture_streams_overridden() as overridden:
        assert overridden is False
    assert calls == []


def test_forward_hook_dicts_are_the_ones_registration_fills() -> None:
    module = torch.nn.Linear(2, 2)
    pre = module.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True)
    post = module.register_forward_hook(lambda m, a, o: None, always_call=True)
    dicts = _compat.forward_hook_dicts(module)
    assert [sorted(d) for d in dicts] == [[pre.id], [pre.id], [post.id], [], [post.id]]
    pre.remove()
    post.remove()
    assert all(not d for d in dicts)


def test_a_flop_table_that_changed_shape_counts_no_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    # Present but no longer called as the cost model calls it: the table is not used (and
    # _compat warns once), rather than every op silently counting 0 FLOPs through it.
    import warnings

    import torch.utils.flop_counter as flop_counter

    assert _compat.flop_formulas()[0] is flop_counter.flop_registry
    changed = {torch.ops.aten.mm: lambda *args, **kwargs: 0}
    monkeypatch.setattr(flop_counter, "flop_registry", changed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warned once per process: maybe already
        assert _compat.flop_formulas() == ({}, None)


class _Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_is_left_from_under_another_which_stays() -> None:
    below, above = _Passing(), _Passing()
    below.__enter__()
    with above:
        assert _compat.leave_dispatch_mode(below) is True
        assert torch._C._len_torch_dispatch_stack() == 1
        assert torch._C._get_dispatch_stack_at(0) is above
        assert _compat.leave_dispatch_mode(below) is False  # not on the stack any more
    assert torch._C._len_torch_dispatch_stack() == 0


def test_without_the_stack_functions_a_dispatch_mode_is_left_from_the_top(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mode = _Passing()
    mode.__enter__()
    monkeypatch.delattr(torch._C, "_get_dispatch_stack_at")
    assert _compat.leave_dispatch_mode(mode) is True
    monkeypatch.undo()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_live_bytes_use_the_accelerator_query_where_there_is_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[torch.device] = []
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda d: asked.append(d) or 7)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 99)
    device = torch.device("cuda", 0)
    assert _compat.device_live_bytes(device) == 7 and asked == [device]
    assert AcceleratorBackend().live_bytes(device) == 7


@pytest.mark.parametrize(("device", "expected"), [("cuda", 99), ("xpu", 0)])
def test_live_bytes_without_the_accelerator_query(
    monkeypatch: pytest.MonkeyPatch, device: str, expected: int
) -> None:
    # torch 2.6 to 2.8: no torch.accelerator.memory_allocated; CUDA can still be asked,
    # other devices say 0 (the weight-gradient split then never lags).
    monkeypatch.delattr(torch.accelerator, "memory_allocated")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 99)
    assert _compat.device_live_bytes(torch.device(device, 0)) == expected
