"""Models with known dataflow for the planner tests: where the parallel branches are is known.

Sizes are chosen so the branches are worth a side stream under the cost model's reference
GPU (several µs of estimated device time each); the convolutional ones run on the ``meta``
device, so no CPU time is spent on them.
"""

from __future__ import annotations

import torch
from torch import nn


def conv(c_in: int, c_out: int, k: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, k, padding=k // 2), nn.BatchNorm2d(c_out), nn.ReLU()
    )


class InceptionBlock(nn.Module):
    """Four unequal branches: 1x1; 1x1 then 3x3; 1x1 then two 3x3; a bare max-pool.

    Two branches are chains of child calls written out in ``forward``, not ``Sequential``s.
    """

    def __init__(self, c_in: int, width: int) -> None:
        super().__init__()
        self.b1 = conv(c_in, width)
        self.b2 = conv(c_in, width // 2)
        self.b2_conv = conv(width // 2, width, 3)
        self.b3_reduce = conv(c_in, width // 4)  # a branch written as a chain of calls
        self.b3_a = conv(width // 4, width // 2, 3)
        self.b3_b = conv(width // 2, width, 3)
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)  # no parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.b3_b(self.b3_a(self.b3_reduce(x)))
        return torch.cat([self.b1(x), self.b2_conv(self.b2(x)), b3, self.pool(x)], dim=1)


class Inception(nn.Module):
    def __init__(self, blocks: int = 3, c: int = 64, width: int = 64) -> None:
        super().__init__()
        self.stem = conv(3, c, 3)
        layers = []
        for _ in range(blocks):
            layers.append(InceptionBlock(c, width))
            c += 3 * width
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def inception_input() -> torch.Tensor:
    return torch.empty(32, 3, 56, 56, device="meta")


class ResidualBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class ResidualChain(nn.Module):
    def __init__(self, dim: int = 512, depth: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ResidualBlock(dim) for _ in range(depth))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class GPTBlock(nn.Module):
    """Pre-norm attention (fused qkv, as in GPT-2) and MLP, each with a residual add."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 256, depth: int = 4, ctx: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, 4) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_input() -> torch.Tensor:
    return torch.randint(0, 1000, (8, 128))


class TwoTower(nn.Module):
    """A dual encoder: one embedding table shared by a query and a document tower."""

    def __init__(self, vocab: int = 1000, dim: int = 256, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)

        def tower() -> nn.Sequential:
            return nn.Sequential(*(ResidualBlock(dim) for _ in range(depth)))

        self.query_tower, self.doc_tower = tower(), tower()
        self.query_proj, self.doc_proj = nn.Linear(dim, 128), nn.Linear(dim, 128)

    def forward(self, query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        q = self.query_proj(self.query_tower(self.embed(query)).mean(1))
        d = self.doc_proj(self.doc_tower(self.embed(doc)).mean(1))
        return q @ d.T


def two_tower_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 1000, (16, 64)), torch.randint(0, 1000, (16, 128))


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.up(x)))


class MoE(nn.Module):
    """Top-2 routed experts plus an always-on shared expert (Qwen2-MoE style)."""

    def __init__(self, dim: int = 256, experts: int = 4, hidden: int = 512) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        self.shared = Expert(dim, 4 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
        routed = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows, slot = (chosen == index).nonzero(as_tuple=True)
            routed = routed.index_add(0, rows, expert(x[rows]) * weights[rows, slot, None])
        return routed + self.shared(x)


def moe_input() -> torch.Tensor:
    return torch.randn(2048, 256)


class RunningStats(nn.Module):
    """Batch norm on buffers it owns: in training each call updates them in place."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.batch_norm(x, self.mean, self.var, training=self.training)


class Normed(nn.Module):
    def __init__(self, dim: int, depth: int, norm: nn.Module) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(depth)))
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x))


class SharedStats(nn.Module):
    """Three branches; ``a`` and ``b`` normalise with the same running statistics, whose
    update (``native_batch_norm``) is a write its schema does not declare."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        shared = RunningStats(dim)
        self.a, self.b = Normed(dim, 1, shared), Normed(dim, 1, shared)
        self.c = Normed(dim, 3, RunningStats(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x) + self.c(x)


class MLPTowers(nn.Module):
    """``towers`` MLPs over one input, summed: each ``dim -> width``, ``hidden - 1`` more
    ``width x width`` layers, then ``width -> dim``, ReLU between."""

    def __init__(self, towers: int, dim: int, width: int, hidden: int) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(dim, width),
                *(m for _ in range(hidden - 1) for m in (nn.ReLU(), nn.Linear(width, width))),
                nn.ReLU(),
                nn.Linear(width, dim),
            )
            for _ in range(towers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([tower(x) for tower in self.towers]).sum(0)


class ClipBlock(nn.Module):
    """A pre-norm transformer block with separate q/k/v projections: an inner region of
    three projections between two cheap layer norms."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.out_proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class ClipTower(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(ClipBlock(dim, heads) for _ in range(depth)))
        self.ln_post = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_post(self.blocks(x))


class Clip(nn.Module):
    """CLIP-style dual encoder: an image tower and a text tower, each a chain of blocks
    whose q/k/v projections form an inner region, projected into one embedding space."""

    def __init__(
        self, dim: int = 768, depth: int = 4, heads: int = 12, vocab: int = 1000, patch: int = 16
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(3 * patch * patch, dim)
        self.vision = ClipTower(dim, depth, heads)
        self.visual_projection = nn.Linear(dim, 512, bias=False)
        self.token_embed = nn.Embedding(vocab, dim)
        self.text = ClipTower(dim, depth, heads)
        self.text_projection = nn.Linear(dim, 512, bias=False)

    def forward(self, patches: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        image = self.visual_projection(self.vision(self.patch_embed(patches))[:, 0])
        text = self.text_projection(self.text(self.token_embed(tokens))[:, -1])
        return image @ text.T


def clip_inputs(device: str = "meta") -> tuple[torch.Tensor, torch.Tensor]:
    """32 images of 7x7 patches (plus one class token's worth) and 32 texts of 77 tokens."""
    patches = torch.empty(32, 50, 3 * 16 * 16, device=device)
    return patches, torch.zeros(32, 77, dtype=torch.long, device=device)
