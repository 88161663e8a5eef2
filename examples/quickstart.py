"""Quickstart: out-of-order backprop for a model with independent towers.

Run: ``python examples/quickstart.py``. On a machine with an accelerator the stages run on
real side streams; on a CPU-only machine the same hooks run on the CPU with
``ooo_wrap.testing.SimulatedBackend`` (virtual streams), and the output says which.
"""

from __future__ import annotations

import torch
from torch import nn

import ooo_wrap
import ooo_wrap.testing
from ooo_wrap.testing import SimulatedBackend

IN_FEATURES, CLASSES = 64, 10


class Towers(nn.Module):
    """``num_towers`` independent MLPs over the same input, summed: backward can overlap."""

    def __init__(self, num_towers: int = 4, width: int = 1024, depth: int = 3) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(IN_FEATURES, width),
                *(m for _ in range(depth - 1) for m in (nn.ReLU(), nn.Linear(width, width))),
                nn.ReLU(),
                nn.Linear(width, CLASSES),
            )
            for _ in range(num_towers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([tower(x) for tower in self.towers]).sum(dim=0)


def build_model() -> nn.Module:
    """The example model (fixed seed, so two calls build identical models)."""
    torch.manual_seed(0)
    return Towers()


def example_input(batch: int = 512) -> torch.Tensor:
    """One batch of inputs for :func:`build_model`'s model."""
    return torch.randn(batch, IN_FEATURES)


def main() -> None:
    available = torch.accelerator.is_available()
    accelerator = torch.accelerator.current_accelerator() if available else None
    device = accelerator or torch.device("cpu")
    backend = None if accelerator is not None else SimulatedBackend()
    if accelerator is not None:
        print(f"Running on {device}: stages use real side streams.")
    else:
        print("No accelerator here: running the real hooks on virtual streams (SimulatedBackend).")

    model = ooo_wrap.OOOModule(build_model().to(device), streams=4, backend=backend)
    print(model.plan)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = example_input().to(device)
    target = torch.randint(0, CLASSES, (x.shape[0],), device=device)
    for step in range(5):
        loss = nn.functional.cross_entropy(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")

    print("events:")
    for event in ooo_wrap.events_for(model):
        print(f"  {event}")
    if isinstance(model, ooo_wrap.OOOModule):  # else it fell back; the events say why
        print(model.stats)
    if accelerator is None:
        # No GPU to race on here: prove the synchronization on virtual streams instead.
        print(ooo_wrap.testing.check(build_model(), example_input()))


if __name__ == "__main__":
    main()
