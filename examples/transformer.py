"""A small reference transformer whose stages are its blocks: a mostly sequential chain.

Run: ``python examples/transformer.py``. Each block depends on the one before it, so there
is little for out-of-order backprop to reorder; it is the reference transformer of the
benchmarks, kept as the no-regression reference rather than a showcase. Real side streams on an
accelerator, ``SimulatedBackend`` on a CPU-only machine.
"""

from __future__ import annotations

import torch
from torch import nn

import ooo_wrap
from ooo_wrap.testing import SimulatedBackend


class Block(nn.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token ids in, next-token logits out; ``ooo_stage_names`` makes the blocks the stages."""

    def __init__(
        self, vocab: int = 256, dim: int = 64, heads: int = 4, depth: int = 4, seq: int = 32
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.ooo_stage_names = [f"blocks.{i}" for i in range(depth)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


VOCAB, SEQ = 256, 32


def build_model() -> nn.Module:
    """The reference model (fixed seed, so two calls build identical models)."""
    torch.manual_seed(0)
    return TinyTransformer(vocab=VOCAB, seq=SEQ)


def example_input(batch: int = 8) -> torch.Tensor:
    """One batch of token ids for :func:`build_model`'s model."""
    return torch.randint(0, VOCAB, (batch, SEQ))


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

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = example_input().to(device)
    for step in range(5):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")

    print("events:")
    for event in ooo_wrap.events_for(model):
        print(f"  {event}")
    if isinstance(model, ooo_wrap.OOOModule):  # else it fell back; the events say why
        print(model.stats)


if __name__ == "__main__":
    main()
