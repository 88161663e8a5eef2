"""Hide the private PyTorch names given as arguments, then import ooo_wrap and use it.

Run by ``test_compat_names.py`` in a fresh process. Each name is hidden before ``import
ooo_wrap`` (see :func:`hide`); then models are wrapped, trained (compared bitwise with
the plain model), copied, pickled, checkpointed and checked. Prints one JSON line: every
warning, the events of the wrapped models, and how ``check()`` ended.
"""

from __future__ import annotations

import collections
import copy
import functools
import importlib
import json
import pickle
import sys
import types
import warnings
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn


def without(owner: Any, name: str) -> Any:
    """A stand-in for the module or class ``owner`` that has all it has but ``name``."""
    if isinstance(owner, types.ModuleType):
        stand_in = types.ModuleType(owner.__name__)
        stand_in.__dict__.update(vars(owner))
        stand_in.__dict__.pop(name, None)
        return stand_in
    return types.SimpleNamespace(**{k: getattr(owner, k) for k in dir(owner) if k != name})


def hide(paths: list[str]) -> dict[str, Any]:
    """Stand-ins for ``torch`` and its modules without any of ``paths`` (dotted, from
    ``torch``), by module name.

    Each module or class on a path is replaced, in a stand-in of its parent, by a stand-in
    without the name, up to the stand-in ``torch``. ooo_wrap, imported while the stand-ins
    are in ``sys.modules``, sees them; torch's own code keeps reading the originals, as a
    torch that renamed the name would read the new one.
    """
    root: Any = without(torch, "")
    for path in paths:
        parts = path.split(".")[1:]
        chain = [root]
        for depth, part in enumerate(parts[:-1]):
            parent = chain[-1]
            try:
                child = getattr(parent, part)
            except AttributeError:
                child = importlib.import_module(".".join(["torch", *parts[: depth + 1]]))
            chain.append(child)
        if len(parts) == 1:
            delattr(root, parts[0])  # a name of torch itself
            continue
        # Rebuild bottom up: the owner without the name, each ancestor with the new child.
        stand_in = without(chain[-1], parts[-1])
        for parent, part in zip(reversed(chain[:-1]), reversed(parts[:-1]), strict=True):
            if parent is root:
                setattr(root, part, stand_in)
                break
            replaced = without(parent, "")
            setattr(replaced, part, stand_in)
            stand_in = replaced
        assert not hasattr(functools.reduce(getattr, parts[:-1], root), parts[-1]), path
    modules: dict[str, Any] = {}

    def collect(module: Any) -> None:  # every stand-in module, reached from the root
        modules[module.__name__] = module
        for value in vars(module).values():
            if isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) not in (
                None,
                value,
            ):
                collect(value)

    collect(root)
    return modules


class Tower(nn.Module):
    """A linear layer fed through a deque (a container only torch's pytree knows), and
    run under a non-reentrant checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, items: collections.deque[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = torch.utils.checkpoint.checkpoint(
            self.linear, items[0], use_reentrant=False
        )
        return out.relu()


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = Tower()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).tanh() + self.b(collections.deque([x]))


def train(model: nn.Module, steps: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def main(hidden: list[str]) -> dict[str, Any]:
    stand_ins = hide(hidden)
    originals = {name: sys.modules[name] for name in stand_ins}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sys.modules.update(stand_ins)
        try:
            import ooo_wrap
            from ooo_wrap import _compat
            from ooo_wrap.testing import SimulatedBackend, check
        finally:
            sys.modules.update(originals)  # what torch imports lazily sees the real ones

        torch.manual_seed(0)
        plain = Towers()
        expected = train(copy.deepcopy(plain))
        events: list[str] = []
        for options in ({}, {"planner": "static", "overlap_forward": True}):
            model = ooo_wrap.OOOModule(copy.deepcopy(plain), backend=SimulatedBackend(), **options)
            got = train(model)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), options
            for again in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
                train(again, steps=1)
            events += [f"{e.kind}/{e.reason}" for e in ooo_wrap.events_for(model)]
        try:
            report = check(Towers(), torch.randn(4, 8), planner="static")
            # Nothing proved: a copy that runs plain (the wrapper fell back), or no arm.
            unproved = report.not_checked is not None or report.runs_plain is not None
            checked = "not checked" if unproved else "ok"
            if not unproved:
                report.raise_if_failed()
        except ooo_wrap.OOOError as error:
            checked = "OOOError: " + next((p for p in hidden if p in str(error)), str(error))
        # What only a failing checkpoint or a CUDA graph capture reaches, asked directly.
        _compat.is_checkpoint_early_stop(RuntimeError("not a checkpoint's"))
        with _compat.stale_capture_streams_overridden():
            pass
    return {"warnings": [str(w.message) for w in caught], "events": events, "check": checked}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
