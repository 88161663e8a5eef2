"""Models and helpers shared by the serialization tests (importable, so picklable)."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch import nn

import ooo_wrap
from ooo_wrap.testing import SimulatedBackend


class Recorder:
    """A picklable forward (pre-)hook that counts its calls."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.calls = 0

    def __call__(self, module: nn.Module, *args_and_output: Any) -> None:
        self.calls += 1


def hook_layout(model: nn.Module) -> list[tuple[str, str, list[str]]]:
    """Per module and hook dict, the hooks in the order they run: a Recorder's name, or
    ``ooo`` for the wrapper's."""
    layout = []
    for name, module in model.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(module, kind).values()
            names = [hook.name if isinstance(hook, Recorder) else "ooo" for hook in hooks]
            if names:
                layout.append((name, kind, names))
    return layout


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


def wrapped(**options: Any) -> nn.Module:
    options.setdefault("backend", SimulatedBackend())
    options.setdefault("planner", "static")  # the copy protocol, from the first forward
    return ooo_wrap.OOOModule(Towers(), **options)  # type: ignore[no-any-return]


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]


def assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], msg=key)


def pickle_round_trip(model: nn.Module, protocol: int = pickle.HIGHEST_PROTOCOL) -> Any:
    return pickle.loads(pickle.dumps(model, protocol=protocol))
