"""Turn measured checkpoint costs and an MTBF estimate into a step interval.

The controller only holds smoothed measurements; the MTBF is passed in on
every call so the caller decides which failure class (and estimator) a tier
is protected by: all failures for "local", failures the local tier cannot
recover for "pfs".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .young import daly_interval, young_interval

TIERS = ("local", "pfs")


@dataclass(frozen=True)
class Decision:
    """Checkpoint every ``steps`` steps.

    ``tau_s`` is the target compute time between checkpoints (after the
    write floor, before rounding and clamping); None for the default.
    ``reason`` names the rule that set it: "young", "daly", "write-bound",
    "no failures expected" or "default: ...", plus any clamp applied.
    """

    steps: int
    tau_s: float | None
    reason: str


def _ema(old: float | None, new: float, smoothing: float) -> float:
    # First sample is taken as is: there is nothing to smooth against.
    return new if old is None else old + smoothing * (new - old)


def _check_seconds(name: str, seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
        seconds >= 0.0 and math.isfinite(seconds)
    ):
        raise ValueError(f"{name} must be finite and >= 0, got {seconds!r}")
    return float(seconds)


def _check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}, expected one of {TIERS}")
    return tier


class IntervalController:
    """Young (or Daly) interval from exponentially smoothed measurements.

    ``smoothing`` is the weight of a new sample (0 < smoothing <= 1): one
    slow save should move the interval, not reset it.

    Before a tier's blocking time and the step time have both been measured
    the interval is ``default_interval`` (default: ``min_interval``): the
    first checkpoint is what measures delta, so it should come early, and a
    short interval is the safe side while nothing is known.
    """

    def __init__(
        self,
        min_interval: int,
        max_interval: int,
        use_daly: bool = False,
        smoothing: float = 0.3,
        default_interval: int | None = None,
    ):
        if not (isinstance(min_interval, int) and min_interval >= 1):
            raise ValueError(f"min_interval must be an int >= 1, got {min_interval!r}")
        if not (isinstance(max_interval, int) and max_interval >= min_interval):
            raise ValueError(f"max_interval must be an int >= min_interval, got {max_interval!r}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        default = min_interval if default_interval is None else default_interval
        if not (isinstance(default, int) and min_interval <= default <= max_interval):
            raise ValueError(f"default_interval must be an int in [min_interval, max_interval], got {default!r}")
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.use_daly = use_daly
        self.smoothing = smoothing
        self.default_interval = default
        self._delta: dict[str, float] = {}
        self._last_write: dict[str, float] = {}
        self._step_time: float | None = None
        self._restart: float | None = None

    # -- measurements ----------------------------------------------------

    def observe_delta(self, tier: str, seconds: float) -> None:
        """Time a save of this tier blocked training."""
        s = _check_seconds("seconds", seconds)
        self._delta[_check_tier(tier)] = _ema(self._delta.get(tier), s, self.smoothing)

    def observe_write(self, tier: str, seconds: float) -> None:
        """Duration of the background write; the latest one is the floor."""
        self._last_write[_check_tier(tier)] = _check_seconds("seconds", seconds)

    def observe_step_time(self, seconds: float) -> None:
        s = _check_seconds("seconds", seconds)
        if s == 0.0:
            raise ValueError("step time must be > 0")
        self._step_time = _ema(self._step_time, s, self.smoothing)

    def observe_restart(self, seconds: float) -> None:
        """Time from failure to training again (used by Daly only)."""
        self._restart = _ema(self._restart, _check_seconds("seconds", seconds), self.smoothing)

    # -- decision --------------------------------------------------------

    def interval(self, tier: str, mtbf_s: float) -> Decision:
        """Steps between saves of ``tier`` given the MTBF it protects against."""
        _check_tier(tier)
        if not mtbf_s > 0.0:
            raise ValueError(f"mtbf_s must be > 0, got {mtbf_s!r}")
        delta, step = self._delta.get(tier), self._step_time
        if delta is None or step is None:
            missing = "delta" if delta is None else "step time"
            return Decision(self.default_interval, None, f"default: no {missing} measured yet for {tier}")

        if math.isinf(mtbf_s):
            tau, reason = math.inf, "no failures expected"
        elif self.use_daly:
            tau, reason = daly_interval(delta, mtbf_s, self._restart or 0.0), "daly"
        else:
            tau, reason = young_interval(delta, mtbf_s), "young"

        # An async save cannot start before the previous one has finished.
        write = self._last_write.get(tier, 0.0)
        if write > tau:
            tau, reason = write, "write-bound"
        if math.isinf(tau):
            return Decision(self.max_interval, tau, reason + "; clamped to max_interval")

        steps = max(1, math.ceil(tau / step))
        write_steps = math.ceil(write / step)
        if steps < self.min_interval:
            steps, reason = self.min_interval, reason + "; clamped to min_interval"
        elif steps > self.max_interval:
            # The write floor wins over max_interval: an earlier save would
            # only stall until the previous write is done.
            steps = max(self.max_interval, write_steps)
            reason += "; clamped to max_interval" if steps == self.max_interval else "; write floor exceeds max_interval"
        return Decision(steps, tau, reason)
