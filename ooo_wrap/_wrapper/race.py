"""The race of one tuning model's arms: whose turn each step is, the steps counted, and the
decision, through a confirmation round.

Fed with timed steps by the tuner's hooks (eager steps, ``tune.py``) or by the replays of
``graphed_step``'s graphs (``_integrations/graph_race.py``); the statistics are
``tuning.py``'s.

- The arms rotate by step, separately for each input shape; the first step of each arm
  at each shape is a warm-up, not counted.
- Once every arm has ``steps`` counted steps, an arm measured slower than plain (or not
  faster after ``MAX_ROUNDS`` times the steps) leaves the race; when none is left, plain
  is kept. Else the fastest arm faster than plain (on a tie the simpler) goes to a
  **confirmation round**: it alone against plain, on fresh steps, so that racing several
  noisy arms does not manufacture a win. It is kept only if faster there too.
- Step times are read, without a host sync, from marks the device has passed; the host
  waits once for the last mark when a round runs out of steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._runtime.backend import Mark, StepClock
from .arms import Arm
from .tuning import (
    MAX_ROUNDS,
    Shape,
    Stage,
    TimedStep,
    Tuning,
    compare,
    fastest,
    timing_of,
)

__all__ = ["Race"]


class Race:
    """The race of ``arms`` (plain first), ``steps`` counted steps per arm per round, timed
    on ``clock``."""

    def __init__(self, arms: Sequence[Arm], steps: int, clock: StepClock) -> None:
        self.arms, self.steps, self.clock = tuple(arms), steps, clock
        self.stage: Stage = "racing"
        self.verdict = "pending"  # the arm this race keeps, once decided
        self.why = ""
        self.racing: list[Arm] = list(arms)  # plain first; arms measured slower leave
        self._confirming: Arm | None = None  # the race's winner, once confirming
        self._closed: list[TimedStep] = []  # finished counted steps
        self._opened_in_stage = 0  # steps begun in this stage, counted or not
        self._rotation: dict[Shape, int] = {}
        self._warmed: set[tuple[str, Shape]] = set()
        self._synced: set[Stage] = set()
        # Says why a confirmed (or not) arm is kept, where the default words do not fit
        # (an arm from the cache): ``explain(arm, kept)``.
        self.explain: Callable[[str, bool], str] | None = None

    def next_turn(self, shape: Shape) -> tuple[Arm, bool]:
        """A step begins at ``shape``: the arm whose turn it is, and whether the step may
        count (not the arm's first step at that shape, its warm-up)."""
        self._opened_in_stage += 1
        turn = self._rotation.get(shape, 0)
        self._rotation[shape] = turn + 1
        arm = self.racing[turn % len(self.racing)]
        warmed = (arm.name, shape) in self._warmed
        self._warmed.add((arm.name, shape))
        return arm, warmed

    def begun(self) -> None:
        """A step began that no arm's turn was taken for (it cannot count)."""
        self._opened_in_stage += 1

    def count(self, step: TimedStep) -> None:
        """A finished step that counts (its ``arm`` set, its marks complete)."""
        self._closed.append(step)

    def leave(self, arm: Arm) -> None:
        """``arm`` leaves the race unmeasured (its graph could not be captured)."""
        self.racing = [racing for racing in self.racing if racing is not arm]
        if len(self.racing) == 1:
            self.decided(self.arms[0], "no arm could be raced: none but plain was captured")

    def shapes(self) -> set[Shape]:
        """The input shapes of the counted steps."""
        return {step.shape for step in self._closed if step.arm is not None}

    def decided(self, arm: Arm, why: str) -> None:
        self.verdict, self.why, self.stage = arm.name, why, "decided"

    def record(self, decision: str, as_graph: bool) -> Tuning:
        """The tuning so far (step times read only from marks the device has passed)."""
        racing = [s for s in self._closed if s.stage == "racing"]
        arms = tuple(timing_of(arm, racing) for arm in self.arms)
        confirming = [s for s in self._closed if s.stage == "confirming"]
        pair = () if self._confirming is None else (self.arms[0], self._confirming)
        confirmation = tuple(timing_of(arm, confirming) for arm in pair)
        shapes = len({s.shape for s in self._closed if s.ms is not None})
        device = self.clock.device_name
        return Tuning(decision, arms, device, confirmation, shapes, self.stage, self.why, as_graph)

    def decide(self) -> None:
        """Read what the device has passed; move on from racing or confirming."""
        stage = self.stage
        counted = [s for s in self._closed if s.stage == stage]
        per_arm = min(sum(s.arm is arm for s in counted) for arm in self.racing)
        # Also final after many steps that mostly did not count (shapes never seen
        # twice, forwards that raise): the round ends, on what it could measure.
        limit = MAX_ROUNDS * self.steps
        final = per_arm >= limit or self._opened_in_stage >= 4 * limit * len(self.racing)
        if final and counted and stage not in self._synced:
            # The one host sync of a round: wait for the last mark of its last step.
            self._synced.add(stage)
            self.clock.synchronize(counted[-1].marks[-1])
        for step in counted:
            if step.ms is None and all(self.clock.done(mark) for mark in step.marks):
                step.ms = self._elapsed(step.marks)
        timings = {arm.name: timing_of(arm, counted) for arm in self.racing}
        plain = timings[self.arms[0].name].relative
        verdicts = {
            arm.name: compare(timings[arm.name].relative, plain, self.steps, final=final)
            for arm in self.racing[1:]
        }
        if stage == "confirming":
            (verdict,) = verdicts.values()
            if verdict == "pending":
                return
            winner, kept = self.racing[1], verdict == "faster"
            if self.explain is not None:
                why = self.explain(winner.name, kept)
            elif kept:
                why = "faster than plain in the race and confirmed alone"
            else:
                why = f"{winner.name} was not faster when confirmed alone"
            return self.decided(winner if kept else self.arms[0], why)
        # Racing: arms measured slower than plain leave; the rest race on while unclear.
        if not final:
            self.racing = [arm for arm in self.racing if verdicts.get(arm.name) != "not_faster"]
            if len(self.racing) == 1:
                return self.decided(self.arms[0], "no arm was faster than plain")
            racing = {arm.name for arm in self.racing}
            if any(v == "pending" for name, v in verdicts.items() if name in racing):
                return
        faster = [arm for arm in self.racing[1:] if verdicts[arm.name] == "faster"]
        if not faster:
            why = "no arm was faster than plain" if counted else "nothing could be timed"
            return self.decided(self.arms[0], why)
        self.confirm(fastest(faster, timings))

    def confirm(self, winner: Arm) -> None:
        """The winner alone against plain, on fresh steps."""
        self.stage, self.racing = "confirming", [self.arms[0], winner]
        self._confirming = winner
        self._opened_in_stage = 0
        self._rotation.clear()

    def _elapsed(self, marks: list[Mark]) -> float:
        """The step's time: start to end, less each evaluation forward cut out."""
        pairs = zip(marks[0::2], marks[1::2], strict=True)
        return sum(self.clock.elapsed_ms(start, end) for start, end in pairs)
