"""When each tier saves next, fixed or adaptive (pure; no torch).

Fixed intervals keep torchtitan's rule (save when step % interval == 0). Adaptive
intervals count from the tier's last save and are recomputed after every save from
measured costs and the MTBF estimates of the two failure classes:

    local tier:  every failure ("any")            tau = sqrt(2 delta_local M_any)
    PFS tier:    failures local + replicas could  tau = sqrt(2 delta_pfs M_unrec)
                 not recover ("unrecoverable_local")

delta_pfs is the drain's background write time: a PFS save blocks nothing (it is
drained from a committed local step), so what it costs is that write, and an
interval shorter than it would only queue drains.

Every rank must take the same decision at the same step, so the caller feeds
`IntervalPolicy.update` the same numbers on every rank (an all-reduce).

With fixed intervals the same policy runs as an observer: `assess` says what Young's
formula would choose for the measured costs and the MTBF estimate, and the expected
waste of the configured interval against it, so a user sees how far it is off.
"""

import math
from dataclasses import dataclass

from .controller import Decision, IntervalController
from .mtbf import GammaPoissonMTBF
from .young import waste_fraction


class SaveSchedule:
    def __init__(self, local_interval: int, pfs_interval: int, adaptive: bool = False) -> None:
        self.local_interval = local_interval
        self.pfs_interval = pfs_interval
        self.adaptive = adaptive
        self.last_local = 0  # step of the last save (0: the start, or the loaded step)
        self.last_pfs = 0

    def start_at(self, step: int) -> None:
        self.last_local = self.last_pfs = step

    def due(self, step: int, last_step: bool = False) -> tuple[bool, bool]:
        """(save now, also drain it to the PFS). A PFS step is always a local step."""
        if self.adaptive:
            pfs = last_step or step - self.last_pfs >= self.pfs_interval
            local = step - self.last_local >= self.local_interval
        else:
            pfs = last_step or step % self.pfs_interval == 0
            local = step % self.local_interval == 0
        return pfs or local, pfs

    def saved(self, step: int, pfs: bool) -> None:
        self.last_local = step
        if pfs:
            self.last_pfs = step


@dataclass(frozen=True)
class Measurements:
    """One save's view, identical on every rank (maxima over ranks)."""
    delta_local_s: float
    step_time_s: float
    write_local_s: float  # last finished local background write (0: none yet)
    write_pfs_s: float  # last finished PFS drain (0: none yet)
    uptime_s: float  # this incarnation's exposure so far


class IntervalPolicy:
    def __init__(self, min_interval: int, max_interval: int, prior_any_s: float,
                 prior_unrecoverable_s: float, prior_weight: float, use_daly: bool = False,
                 evidence: dict | None = None, restart_s: float = 0.0) -> None:
        """`evidence`: failure class -> (failures, exposure_s) from the ledger."""
        self.controller = IntervalController(min_interval, max_interval, use_daly=use_daly)
        if restart_s:
            self.controller.observe_restart(restart_s)
        self.mtbf = {"any": GammaPoissonMTBF(prior_any_s, prior_weight),
                     "unrecoverable_local": GammaPoissonMTBF(prior_unrecoverable_s, prior_weight)}
        self.evidence = evidence or {}

    def estimates(self, uptime_s: float) -> dict[str, float]:
        """MTBF per failure class, the running incarnation's uptime counted as exposure."""
        out = {}
        for cls, est in self.mtbf.items():
            failures, exposure = self.evidence.get(cls, (0, 0.0))
            out[cls] = est.set_evidence(failures, exposure + uptime_s).mtbf_s
        return out

    def update(self, m: Measurements) -> tuple[Decision, Decision, dict[str, float]]:
        """(local decision, PFS decision, MTBF per class) after a save."""
        c = self.controller
        c.observe_step_time(max(m.step_time_s, 1e-6))
        c.observe_delta("local", m.delta_local_s)
        if m.write_local_s:
            c.observe_write("local", m.write_local_s)
        if m.write_pfs_s:
            c.observe_delta("pfs", m.write_pfs_s)
            c.observe_write("pfs", m.write_pfs_s)
        mtbf = self.estimates(m.uptime_s)
        local = c.interval("local", mtbf["any"])
        pfs = c.interval("pfs", mtbf["unrecoverable_local"])
        if pfs.steps < local.steps:  # a PFS step is a local step: never drain more often
            pfs = Decision(local.steps, pfs.tau_s, pfs.reason + "; raised to the local interval")
        return local, pfs, mtbf


@dataclass(frozen=True)
class TierAssessment:
    """One tier's interval in use against the policy's choice (seconds at the
    measured step time; None where a cost is not measured yet)."""

    steps: int  # the interval in use
    seconds: float
    tau_s: float | None  # the policy's interval (Young's or Daly's, or the write floor)
    optimal_steps: int  # what adaptive intervals would use
    waste: float | None  # expected fraction of time lost with the interval in use
    optimal_waste: float | None  # ... with the policy's interval


def assess(steps: int, decision: Decision, cost_s: float, mtbf_s: float,
           step_time_s: float) -> TierAssessment:
    """`cost_s`: what one save costs the tier (delta; the drain's write for the PFS)."""
    seconds = steps * step_time_s if step_time_s > 0 else None  # no step timed yet

    def waste(tau: float | None) -> float | None:
        if not cost_s or not tau or math.isinf(tau) or math.isinf(mtbf_s):
            return None
        return waste_fraction(cost_s, tau, mtbf_s)

    return TierAssessment(steps, seconds, decision.tau_s, decision.steps, waste(seconds),
                          waste(decision.tau_s))
