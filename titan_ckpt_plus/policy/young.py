"""First-order checkpoint-interval formulas (Young 1974, Daly 2006).

All times are in seconds. ``delta`` is the time a checkpoint *blocks*
training (for an async save: the snapshot stall, not the background write),
``mtbf`` is the mean time between failures that this checkpoint protects
against, ``tau`` is the compute time between two checkpoints.

The first-order model charges, per unit of wall time,
``delta / tau`` for saving plus ``lost_work(tau) / mtbf`` for redoing work
after a failure, with ``lost_work(tau) = tau / 2``. Minimising gives Young's
``tau = sqrt(2 delta M)`` and the overhead ``sqrt(2 delta / M)``. It is only
meaningful while ``delta << tau << M``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_DAY = 86400.0

# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days
# (Llama 3 paper, section 3.3.4) -> M = 3.09 h.
LLAMA3_MTBF_S = 54 * SECONDS_PER_DAY / 419


def _check(delta_s: float, mtbf_s: float) -> None:
    """Reject inputs for which the formulas silently return nonsense."""
    if not delta_s >= 0.0:  # also catches NaN
        raise ValueError(f"delta_s must be >= 0, got {delta_s!r}")
    if not mtbf_s > 0.0:
        raise ValueError(f"mtbf_s must be > 0, got {mtbf_s!r}")


def young_interval(delta_s: float, mtbf_s: float) -> float:
    """Young's optimum compute time between checkpoints: sqrt(2 delta M)."""
    _check(delta_s, mtbf_s)
    return math.sqrt(2.0 * delta_s * mtbf_s)


def daly_interval(delta_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Daly's first-order interval: sqrt(2 delta (M + R)) - delta.

    Daly accounts for the restart time R and for the checkpoint itself being
    exposed to failures, hence the ``- delta``. When ``delta >= M`` the
    expansion is meaningless (it can even go negative); Daly's advice for
    that regime is to checkpoint once per MTBF, so we return ``M``.
    """
    _check(delta_s, mtbf_s)
    if not restart_s >= 0.0:
        raise ValueError(f"restart_s must be >= 0, got {restart_s!r}")
    if delta_s >= mtbf_s:
        return mtbf_s
    return math.sqrt(2.0 * delta_s * (mtbf_s + restart_s)) - delta_s


def overhead_fraction(delta_s: float, mtbf_s: float) -> float:
    """Fraction of wall time lost at Young's optimum: sqrt(2 delta / M).

    This is the *total* first-order waste (saving + redone work), split
    half and half at the optimum; restart time is not included.
    """
    _check(delta_s, mtbf_s)
    return math.sqrt(2.0 * delta_s / mtbf_s)


def expected_lost_work(tau_s: float) -> float:
    """Expected work redone per failure: tau / 2.

    A failure lands uniformly within the interval, so on average half of it
    is redone. With a blocking save the exact value is (tau + delta) / 2; the
    delta / 2 term is second order and Young's formula drops it, so we do
    too (this keeps ``overhead = delta/tau + lost/M`` consistent).
    """
    if not tau_s >= 0.0:
        raise ValueError(f"tau_s must be >= 0, got {tau_s!r}")
    return tau_s / 2.0


def waste_fraction(delta_s: float, tau_s: float, mtbf_s: float) -> float:
    """Expected fraction of wall time lost with interval ``tau``: saving
    (delta / tau) plus redone work (tau / 2 per failure, one per M). At Young's
    tau it equals ``overhead_fraction``; the ratio to that says how far a chosen
    interval is off."""
    _check(delta_s, mtbf_s)
    if not tau_s > 0.0:
        raise ValueError(f"tau_s must be > 0, got {tau_s!r}")
    return delta_s / tau_s + expected_lost_work(tau_s) / mtbf_s


def checkpoints_per_day(tau_s: float, delta_s: float = 0.0) -> float:
    """Checkpoints written per wall-clock day: one per (tau + delta) cycle."""
    cycle = tau_s + delta_s
    if not cycle > 0.0:
        raise ValueError(f"tau_s + delta_s must be > 0, got {cycle!r}")
    return SECONDS_PER_DAY / cycle


@dataclass(frozen=True)
class YoungRow:
    """One line of the planning table (all times in seconds)."""

    delta_s: float
    tau_s: float
    overhead: float  # fraction of wall time, not percent
    lost_work_s: float
    checkpoints_per_day: float


def young_table(deltas: list[float], mtbf_s: float) -> list[YoungRow]:
    """Young's interval and its consequences for each checkpoint cost."""
    rows = []
    for delta in deltas:
        tau = young_interval(delta, mtbf_s)
        rows.append(
            YoungRow(
                delta_s=delta,
                tau_s=tau,
                overhead=overhead_fraction(delta, mtbf_s),
                lost_work_s=expected_lost_work(tau),
                checkpoints_per_day=checkpoints_per_day(tau, delta),
            )
        )
    return rows
