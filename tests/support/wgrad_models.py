"""The models the weight-gradient split is tested on: an MLP chain, a conv net, a pre-norm
transformer block, tied embedding and output weights; each with an input maker."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "MODELS", "Block", "ConvNet", "Tied", "mlp_input"]


class MLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU())
        self.append(nn.Linear(32, 5))


class ConvNet(nn.Module):
    """Conv1d, Conv2d with and without bias, BatchNorm, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(1, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.c3 = nn.Conv2d(6, 4, 3, stride=2, bias=False)
        self.head = nn.Linear(4 * 1 * 7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.c1(x)).unsqueeze(1)  # (B, 1, 4, 16)
        y = F.relu(self.bn(self.c2(y)))
        y = self.c3(y)
        out: torch.Tensor = self.head(y.flatten(1))
        return out


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return out


class Tied(nn.Module):
    """Embedding and output weights tied (the head's weight first used by the embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.mid(self.emb(ids))))
        return out


def mlp_input() -> torch.Tensor:
    return torch.randn(6, 12)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "mlp": (MLP, mlp_input),
    "conv": (ConvNet, lambda: torch.randn(4, 3, 16)),
    "block": (Block, lambda: torch.randn(3, 8, 16)),
    "tied": (Tied, lambda: torch.randint(0, 20, (4, 7))),
}
