"""Host reads that no aten op shows on the CPU, seen as the Tensor methods they are.

On a GPU, ``.tolist()``, ``.numpy()``, ``.cpu()`` and printing copy a tensor to the host
and wait for the device; on the CPU they read the memory in place (``.cpu()`` returns the
tensor itself, printing runs with dispatch modes off), so the detector's dispatch mode
sees nothing. A ``TorchFunctionMode`` (public, ``torch.overrides``) sees the methods.

It also knows one op that syncs the host on the CPU only: ``F.one_hot`` with a class
count checks its range with ``.item()`` there, and with device asserts on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._compat import ModeArgs, ModeFunc, ModeKwargs, ModeTypes

__all__ = ["HostReads"]

# Tensor method -> the name its host read is recorded as (a key of ``_ops.HOST_SYNCS``).
_READS: Mapping[Callable[..., Any], str] = {
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.__array__: "Tensor.__array__",
    torch.Tensor.cpu: "Tensor.cpu",
    torch.Tensor.to: "Tensor.to",
    torch.Tensor.__repr__: "Tensor.__repr__",
    torch.Tensor.__format__: "Tensor.__format__",
}
_one_hot = torch.nn.functional.one_hot


def _reads(func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    if func is torch.Tensor.to:
        # Only a device named as text ("cpu") is the host: a torch.device is how model
        # code follows another tensor's device (``.to(x.device)``), on a GPU no copy at
        # all, and in the simulation every device tensor is a CPU tensor.
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(target, str) and target.split(":")[0] == "cpu"
    if func is torch.Tensor.__format__:
        return bool(args[0].dim())  # a scalar formats its .item(), which shows as an op
    return True


class HostReads(TorchFunctionMode):
    """Reports each host read to ``read`` (the tensor, and the name to record it as) before
    it happens, and runs ``F.one_hot`` with a class count inside ``device_checks()``
    (whose host syncs are range checks that CUDA makes on the device)."""

    def __init__(
        self,
        read: Callable[[torch.Tensor, str], None],
        device_checks: Callable[[], AbstractContextManager[object]],
    ) -> None:
        super().__init__()
        self._read = read
        self._device_checks = device_checks

    def __torch_function__(
        self, func: ModeFunc, types: ModeTypes, args: ModeArgs = (), kwargs: ModeKwargs = None
    ) -> Any:
        kwargs = kwargs or {}
        name = _READS.get(func)
        if name is not None and _reads(func, args, kwargs):
            self._read(args[0], name)
        elif func is _one_hot and _class_count(args, kwargs) != -1:
            with self._device_checks():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _class_count(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    # -1 (the default) finds the count with .max().item(), a host sync on CUDA too.
    return kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
