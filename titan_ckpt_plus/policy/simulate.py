"""Discrete-event replay of a failure trace against checkpoint policies.

The adaptive policy runs the same IntervalController and GammaPoissonMTBF
code as training does, so the simulation tests the policy, not a model of it.

Model (all times in seconds, one event per save or failure, no per-step loop):

* The job needs ``total_steps`` steps of ``step_time_s`` each.
* A save of tier X blocks training for ``delta_X`` (plus any wait for the
  previous write of X), then writes in the background for ``write_X``; it
  can be restored from only once that write has finished.
* A PFS save is also restorable after a local failure, so it resets the
  local schedule too (no local save right after a PFS one).
* Each failure is "unrecoverable_local" with probability
  ``p_unrecoverable`` (restore from the newest PFS save; local saves are
  lost), otherwise restore from the newest save of either tier. Restart takes
  ``restart_s``; a failure during a restart starts it again.
* Wasted fraction = (blocking + lost work + restart) / wall time
  = 1 - useful compute / wall time.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .controller import IntervalController
from .mtbf import GammaPoissonMTBF
from .young import young_interval

TIERS = ("local", "pfs")


@dataclass(frozen=True)
class Job:
    """The workload and the true costs the policies face."""

    total_work_s: float
    step_time_s: float
    delta_local_s: float
    delta_pfs_s: float
    restart_s: float = 0.0
    p_unrecoverable: float = 0.1
    write_local_s: float = 0.0
    write_pfs_s: float = 0.0

    def __post_init__(self):
        if not (self.total_work_s > 0 and self.step_time_s > 0):
            raise ValueError("total_work_s and step_time_s must be > 0")
        if min(self.delta_local_s, self.delta_pfs_s, self.restart_s, self.write_local_s, self.write_pfs_s) < 0:
            raise ValueError("delta, restart and write times must be >= 0")
        if not 0.0 <= self.p_unrecoverable <= 1.0:
            raise ValueError(f"p_unrecoverable must be in [0, 1], got {self.p_unrecoverable!r}")

    @property
    def total_steps(self) -> int:
        return math.ceil(self.total_work_s / self.step_time_s)

    def delta(self, tier: str) -> float:
        return self.delta_local_s if tier == "local" else self.delta_pfs_s

    def write(self, tier: str) -> float:
        return self.write_local_s if tier == "local" else self.write_pfs_s


class PoissonTrace:
    """Failure times of a Poisson process; every iteration replays the same."""

    def __init__(self, mtbf_s: float, seed: int = 0):
        if not mtbf_s > 0:
            raise ValueError(f"mtbf_s must be > 0, got {mtbf_s!r}")
        self.mtbf_s, self.seed = mtbf_s, seed

    def __iter__(self) -> Iterator[float]:
        rng, t = random.Random(self.seed), 0.0
        while True:
            t += rng.expovariate(1.0 / self.mtbf_s)
            yield t


# -- policies ---------------------------------------------------------------


class FixedPolicy:
    """Save every ``local_steps`` locally and every ``pfs_steps`` to the PFS."""

    def __init__(self, name: str, local_steps: int, pfs_steps: int):
        if local_steps < 1 or pfs_steps < 1:
            raise ValueError("intervals must be >= 1 step")
        self.name, self._intervals = name, (local_steps, pfs_steps)

    def intervals(self, now_s: float) -> tuple[int, int]:
        return self._intervals

    def on_step_time(self, seconds: float) -> None:
        pass

    def on_checkpoint(self, tier: str, blocking_s: float, write_s: float) -> None:
        pass

    def on_failure(self, now_s: float, unrecoverable_local: bool, restart_s: float) -> None:
        pass


class AdaptivePolicy:
    """IntervalController fed by two Gamma-Poisson MTBF estimates.

    "local" is protected against all failures, "pfs" against the ones the
    local tier cannot recover. Exposure is wall time since the job started.
    """

    def __init__(
        self,
        name: str,
        prior_mtbf_s: float,
        prior_pfs_mtbf_s: float,
        prior_weight: float = 1.0,
        min_interval: int = 10,
        max_interval: int = 100_000,
        use_daly: bool = False,
        smoothing: float = 0.3,
    ):
        self.name = name
        self.controller = IntervalController(min_interval, max_interval, use_daly, smoothing)
        self.any = GammaPoissonMTBF(prior_mtbf_s, prior_weight)
        self.unrecoverable = GammaPoissonMTBF(prior_pfs_mtbf_s, prior_weight)

    def intervals(self, now_s: float) -> tuple[int, int]:
        self.any.set_evidence(self.any.failures, now_s)
        self.unrecoverable.set_evidence(self.unrecoverable.failures, now_s)
        local = self.controller.interval("local", self.any.mtbf_s).steps
        pfs = self.controller.interval("pfs", self.unrecoverable.mtbf_s).steps
        return local, pfs

    def on_step_time(self, seconds: float) -> None:
        self.controller.observe_step_time(seconds)

    def on_checkpoint(self, tier: str, blocking_s: float, write_s: float) -> None:
        self.controller.observe_delta(tier, blocking_s)
        self.controller.observe_write(tier, write_s)

    def on_failure(self, now_s: float, unrecoverable_local: bool, restart_s: float) -> None:
        self.any.observe(failures=1)
        self.unrecoverable.observe(failures=int(unrecoverable_local))
        self.controller.observe_restart(restart_s)


def oracle_policy(job: Job, mtbf_s: float) -> FixedPolicy:
    """Young's interval per tier from the true MTBF and true costs."""

    def steps(tier: str, tier_mtbf_s: float) -> int:
        tau = max(young_interval(job.delta(tier), tier_mtbf_s), job.write(tier))
        return max(1, math.ceil(tau / job.step_time_s))

    pfs_mtbf = mtbf_s / job.p_unrecoverable if job.p_unrecoverable > 0 else math.inf
    pfs = steps("pfs", pfs_mtbf) if math.isfinite(pfs_mtbf) else job.total_steps + 1
    return FixedPolicy("oracle", steps("local", mtbf_s), pfs)


def standard_policies(
    job: Job,
    true_mtbf_s: float,
    prior_mtbfs_s: Iterable[float],
    prior_weight: float = 1.0,
    fixed_steps: Iterable[int] = (),
    fixed_pfs_ratio: int = 10,
    min_interval: int = 10,
    max_interval: int = 100_000,
) -> list:
    """Oracle first, then one adaptive policy per prior, then fixed ones.

    Adaptive policies assume the unrecoverable fraction is known and put
    the PFS prior at prior / p. Fixed policies save to the PFS every
    ``fixed_pfs_ratio`` local intervals.
    """
    p = max(job.p_unrecoverable, 1e-6)
    policies: list = [oracle_policy(job, true_mtbf_s)]
    for prior in prior_mtbfs_s:
        name = f"adaptive prior={prior / 3600:.3g}h"
        policies.append(AdaptivePolicy(name, prior, prior / p, prior_weight, min_interval, max_interval))
    for n in fixed_steps:
        policies.append(FixedPolicy(f"fixed {n}", n, n * fixed_pfs_ratio))
    return policies


# -- simulation -------------------------------------------------------------


@dataclass
class SimResult:
    """Totals over the measured window (the whole run unless warmed up)."""

    policy: str
    wall_s: float = 0.0
    useful_s: float = 0.0
    checkpoint_s: float = 0.0
    restart_s: float = 0.0
    failures: int = 0  # over the whole run
    unrecoverable_failures: int = 0
    checkpoints: dict = field(default_factory=lambda: {"local": 0, "pfs": 0})
    final_intervals: tuple = (0, 0)
    window_start_s: float = 0.0
    warmup_reached: bool = True

    @property
    def lost_s(self) -> float:
        """Work redone after failures (everything not otherwise accounted)."""
        return self.wall_s - self.useful_s - self.checkpoint_s - self.restart_s

    @property
    def wasted_fraction(self) -> float:
        return 1.0 - self.useful_s / self.wall_s if self.wall_s > 0 else 0.0


class _Run:
    """Mutable state of one simulation; see ``simulate``."""

    def __init__(self, job: Job, policy, trace: Iterable[float], seed: int):
        self.job, self.policy = job, policy
        self.failure_times = iter(trace)
        self.next_failure = next(self.failure_times, math.inf)
        # Failure classes come from their own stream: identical for every policy.
        self.class_rng = random.Random(f"unrecoverable:{seed}")
        self.t, self.step = 0.0, 0
        # (step, durable_at) per tier; step 0 = the initial state, always there.
        self.saves: dict[str, list] = {"local": [(0, 0.0)], "pfs": [(0, 0.0)]}
        self.anchor = {"local": 0, "pfs": 0}  # step of the last save, schedules the next
        self.busy_until = {"local": 0.0, "pfs": 0.0}  # background write running
        self.res = SimResult(policy.name)

    def fail(self) -> None:
        """Handle the failure at ``next_failure``: roll back, then restart.

        A failure during the restart starts the restart again.
        """
        job, res = self.job, self.res
        while True:
            t_fail = self.next_failure
            self.next_failure = next(self.failure_times, math.inf)
            self.t = t_fail
            unrecoverable = self.class_rng.random() < job.p_unrecoverable
            res.failures += 1
            res.unrecoverable_failures += unrecoverable

            pfs = [s for s in self.saves["pfs"] if s[1] <= t_fail][-1:]
            local = [] if unrecoverable else [s for s in self.saves["local"] if s[1] <= t_fail][-1:]
            self.saves = {"local": local, "pfs": pfs}
            self.step = max(s[0] for s in local + pfs)
            self.anchor = {"local": self.step, "pfs": pfs[0][0]}
            self.busy_until = {"local": t_fail, "pfs": t_fail}  # pending writes died
            self.policy.on_failure(t_fail, unrecoverable, job.restart_s)
            if res.failures == self.warmup_failures:
                self.open_window()

            end = t_fail + job.restart_s
            if self.next_failure >= end:
                res.restart_s += job.restart_s
                self.t = end
                return
            res.restart_s += self.next_failure - t_fail

    def open_window(self) -> None:
        """Start measuring here: forget costs so far, keep counts."""
        self.res.window_start_s = self.t
        self.res.checkpoint_s = self.res.restart_s = 0.0
        self.window_step = self.step

    def save(self, tier: str) -> bool:
        """Block for a save of ``tier``; False if a failure interrupted it."""
        job = self.job
        blocking = max(0.0, self.busy_until[tier] - self.t) + job.delta(tier)
        end = self.t + blocking
        if self.next_failure < end:
            self.res.checkpoint_s += self.next_failure - self.t
            self.fail()
            return False
        self.res.checkpoint_s += blocking
        self.t = end
        durable = end + job.write(tier)
        self.busy_until[tier] = durable
        self.saves[tier].append((self.step, durable))
        self.res.checkpoints[tier] += 1
        self.anchor[tier] = self.step
        if tier == "pfs":
            self.anchor["local"] = self.step
        self.policy.on_checkpoint(tier, job.delta(tier), job.write(tier))
        return True

    def run(self, warmup_failures: int) -> SimResult:
        job, res = self.job, self.res
        total, step_time = job.total_steps, job.step_time_s
        self.warmup_failures = warmup_failures
        self.window_step = 0
        if warmup_failures == 0:
            self.open_window()
        self.policy.on_step_time(step_time)
        while self.step < total:
            local_k, pfs_k = self.policy.intervals(self.t)
            res.final_intervals = (local_k, pfs_k)
            pfs_at = max(self.anchor["pfs"] + pfs_k, self.step)
            local_at = max(self.anchor["local"] + local_k, self.step)
            tier, target = ("pfs", pfs_at) if pfs_at <= local_at else ("local", local_at)
            target = min(target, total)
            end = self.t + (target - self.step) * step_time
            if self.next_failure < end:
                self.fail()  # rolls self.step back to a save
                continue
            self.t, self.step = end, target
            if self.step < total:
                self.save(tier)
        res.warmup_reached = res.failures >= warmup_failures
        if not res.warmup_reached:
            self.res.window_start_s, self.window_step = 0.0, 0
        res.wall_s = self.t - res.window_start_s
        res.useful_s = (total - self.window_step) * step_time
        return res


def simulate(job: Job, policy, trace: Iterable[float], seed: int = 0, warmup_failures: int = 0) -> SimResult:
    """Run ``policy`` on ``job`` under the failures in ``trace``.

    ``trace`` is any re-iterable of increasing failure times in seconds
    (a list, or a PoissonTrace). Costs are measured from the
    ``warmup_failures``-th failure on, so a prior's transient can be judged
    separately from the steady state.
    """
    return _Run(job, policy, trace, seed).run(warmup_failures)
