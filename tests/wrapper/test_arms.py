"""Measured search: the candidate arms raced on a simulated clock, the fastest kept."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind, OOOConfigError
from ooo_wrap._wrapper.lifecycle import WrapState
from ooo_wrap._wrapper.registry import wrapped
from ooo_wrap.testing import SimulatedBackend
from ooo_wrap.testing._simulated import StreamCall


class ThreeTowers(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.towers = nn.ModuleList(
            [nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim)) for _ in range(3)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = sum(tower(x) for tower in self.towers)  # type: ignore[assignment]
        return out


class Attention(nn.Module):
    """A sequence model whose step grows with the square of the sequence length."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(1, 2), dim=-1)
        out: torch.Tensor = self.out(attention @ v)
        return out


def mlp_chain(dim: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim)
    )


class ArmClock:
    """A step clock that prices each step by the arm it ran: ``times[arm]`` ms (plain's
    for arms not listed), scaled by ``scale(calls)`` and a uniform noise factor."""

    def __init__(
        self,
        times: dict[str, float],
        noise: float = 0.0,
        seed: int = 0,
        scale: Callable[[Sequence[StreamCall]], float] | None = None,
    ) -> None:
        self.times, self.noise, self.rng, self.scale = times, noise, random.Random(seed), scale
        self.model: nn.Module | None = None

    def __call__(self, calls: Sequence[StreamCall]) -> float:
        assert self.model is not None
        tuner = state(self.model).tuner
        arm = tuner.active.name if tuner is not None else "plain"
        base = self.times.get(arm, self.times["plain"])
        factor = self.scale(calls) if self.scale is not None else 1.0
        return base * factor * (1 + self.rng.uniform(-self.noise, self.noise))


def state(model: nn.Module) -> WrapState:
    return wrapped[model]


def wrap_timed(model: nn.Module, clock: ArmClock, **options: object) -> ooo_wrap.OOOModule:
    backend = SimulatedBackend(step_time=clock)
    wrapped_model = ooo_wrap.OOOModule(model, backend=backend, **options)  # type: ignore[arg-type]
    clock.model = wrapped_model
    return wrapped_model


def train_until_decided(
    model: nn.Module, inputs: Callable[[int], torch.Tensor], limit: int = 400
) -> int:
    """Train (SGD steps) until tuning decides; the number of training steps it took."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, limit + 1):
        model(inputs(step)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        tuning = model.tuning  # type: ignore[attr-defined]
        if tuning is not None and tuning.decision != "pending":
            return step
    raise AssertionError(f"tuning did not decide in {limit} steps: {model.tuning}")


def towers_input(step: int) -> torch.Tensor:
    return torch.randn(4, 8)


def arm_names(model: nn.Module) -> list[str]:
    return [arm.name for arm in state(model).arms]


def test_a_three_tower_model_races_plain_and_several_candidates() -> None:
    model = wrap_timed(ThreeTowers(), ArmClock({"plain": 10.0}))
    model(torch.randn(4, 8)).sum().backward()  # the learning forward
    names = arm_names(model)
    assert names[0] == "plain" and len(names) >= 3
    # Each kind is raced before a second variant of a kind: stages, the split, both.
    assert {"wgrad"} <= set(names)
    assert any("+wgrad" in name for name in names)
    assert any(name in ("regions", "static") for name in names)


@pytest.mark.parametrize("index", [1, 2, 3])
def test_the_arm_the_clock_makes_fastest_is_kept(index: int) -> None:
    probe = wrap_timed(ThreeTowers(), ArmClock({"plain": 10.0}))
    probe(torch.randn(4, 8)).sum().backward()
    name = arm_names(probe)[index]
    times = {arm: 10.0 for arm in arm_names(probe)} | {name: 9.0}  # 10 % faster
    model = wrap_timed(ThreeTowers(), ArmClock(times))
    train_until_decided(model, towers_input)
    tuning = model.tuning
    assert tuning is not None and tuning.decision == name
    assert [arm.name for arm in tuning.arms] == arm_names(probe)
    assert tuning.speedup == pytest.approx(10 / 9)
    assert (EventKind.TUNED, "kept") in [(e.kind, e.reason) for e in model.events]
    # Only the winner's hooks remain: its stages' (if any) and the root's two.
    kept = next(arm for arm in state(model).arms if arm.name == name)
    assert state(model).tuner is None and state(model).scheduler is not None
    assert len(state(model).handles) == 2 + 2 * len(kept.plan.stages)


def test_the_split_alone_is_kept_where_it_alone_is_fastest() -> None:
    model = wrap_timed(ThreeTowers(), ArmClock({"plain": 10.0, "wgrad": 8.5}))
    train_until_decided(model, towers_input)
    assert model.tuning is not None and model.tuning.decision == "wgrad"
    assert model.plan.stages == ()


def test_noise_with_no_real_difference_keeps_plain() -> None:
    kept_plain = 0
    for seed in range(20):
        model = wrap_timed(ThreeTowers(), ArmClock({"plain": 10.0}, noise=0.05, seed=seed))
        train_until_decided(model, towers_input, limit=1000)
        assert model.tuning is not None
        kept_plain += model.tuning.decision == "plain"
    assert kept_plain >= 19


def test_a_chain_has_the_split_as_a_candidate_and_keeps_it_when_faster() -> None:
    model = wrap_timed(mlp_chain(), ArmClock({"plain": 10.0, "wgrad": 9.0}))
    train_until_decided(model, towers_input)
    assert arm_names(model) == ["plain", "wgrad"]
    assert model.tuning is not None and model.tuning.decision == "wgrad"


def test_a_chain_without_the_split_has_no_candidate_and_runs_plain() -> None:
    model = wrap_timed(mlp_chain(), ArmClock({"plain": 10.0}), split_weight_grads=False)
    model(torch.randn(4, 8)).sum().backward()
    assert model.tuning is None
    assert [e.reason for e in model.events if e.kind is EventKind.DISABLED] == ["no_parallelism"]


def test_dynamic_padding_decides_within_each_shape() -> None:
    lengths = [5, 9, 13, 17, 21, 25, 29, 33]

    current = {"length": lengths[0]}
    clock = ArmClock(
        {"plain": 10.0, "wgrad": 9.0}, noise=0.01, scale=lambda calls: current["length"] ** 2
    )
    model = wrap_timed(Attention(), clock, tune_steps=6)

    def inputs(step: int) -> torch.Tensor:
        length = lengths[step % len(lengths)]
        # The clock prices the step that ends now, whose length was set a step ago.
        current["length"] = lengths[(step - 1) % len(lengths)]
        return torch.randn(2, length, 8)

    steps = train_until_decided(model, inputs, limit=2000)
    tuning = model.tuning
    assert tuning is not None and tuning.decision == "wgrad"
    assert tuning.shapes == len(lengths) and "8 shapes" in tuning.compared
    assert steps <= 10 * 6 * len(tuning.arms)


def test_a_pinned_arm_runs_with_nothing_raced() -> None:
    model = wrap_timed(ThreeTowers(), ArmClock({"plain": 10.0}), tune_arm="wgrad")
    model(torch.randn(4, 8)).sum().backward()
    assert model.tuning is None
    assert (EventKind.TUNED, "pinned") in [(e.kind, e.reason) for e in model.events]
    assert state(model).scheduler is not None and state(model).scheduler.weight_grads is not None


def test_an_unknown_pinned_arm_runs_plain_and_names_the_arms() -> None:
    model = wrap_timed(ThreeTowers(), ArmClock({"plain": 10.0}), tune_arm="nonesuch")
    model(torch.randn(4, 8)).sum().backward()
    (disabled,) = [e for e in model.events if e.kind is EventKind.DISABLED]
    assert disabled.reason == "pinned" and "wgrad" in disabled.message


@pytest.mark.parametrize(
    ("options", "match"), [({"tune_arms": 0}, "tune_arms"), ({"tune_arm": 3}, "tune_arm")]
)
def test_bad_search_options_are_refused(options: dict[str, object], match: str) -> None:
    with pytest.raises(OOOConfigError, match=match):
        ooo_wrap.OOOModule(ThreeTowers(), backend=SimulatedBackend(), **options)  # type: ignore[arg-type]


def test_tune_arms_limits_the_race() -> None:
    model = wrap_timed(ThreeTowers(), ArmClock({"plain": 10.0}), tune_arms=1)
    model(torch.randn(4, 8)).sum().backward()
    assert len(arm_names(model)) == 2


def test_every_arm_computes_the_same_math() -> None:
    torch.manual_seed(0)
    reference = ThreeTowers()
    plain = ThreeTowers()
    plain.load_state_dict(reference.state_dict())
    model = wrap_timed(reference, ArmClock({"plain": 10.0}, noise=0.05))
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(40):  # every arm runs some of these steps
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for net, opt in ((model, opt_a), (plain, opt_b)):
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_phase_transitions_follow_the_table() -> None:
    from ooo_wrap._errors import OOOError
    from ooo_wrap._wrapper.lifecycle import Phase

    model = wrap_timed(ThreeTowers(), ArmClock({"plain": 10.0}))
    wrap_state = state(model)
    ooo_wrap.unwrap(model)
    with pytest.raises(OOOError, match="may not go from unwrapped to tuning"):
        wrap_state._enter(Phase.TUNING)
    assert wrap_state.phase is Phase.UNWRAPPED
