"""Bayesian MTBF estimate from a handful of observed failures.

A job sees few failures, so the raw estimate exposure / failures is
undefined before the first failure and very noisy after it. A conjugate
Gamma prior on the failure rate fixes both: it starts from a guess and
hands over to the data as failures accumulate.
"""

from __future__ import annotations

import math


def _finite_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (value > 0.0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)


def _check_evidence(failures: int, exposure_s: float) -> None:
    if isinstance(failures, bool) or not isinstance(failures, int) or failures < 0:
        raise ValueError(f"failures must be an int >= 0, got {failures!r}")
    if isinstance(exposure_s, bool) or not isinstance(exposure_s, (int, float)):
        raise ValueError(f"exposure_s must be a number, got {exposure_s!r}")
    if not (exposure_s >= 0.0 and math.isfinite(exposure_s)):
        raise ValueError(f"exposure_s must be finite and >= 0, got {exposure_s!r}")


class GammaPoissonMTBF:
    """Failure rate lambda ~ Gamma(shape, rate); failures ~ Poisson(lambda T).

    The prior is worth ``prior_weight`` pseudo-failures observed over
    ``prior_weight * prior_mtbf_s`` seconds: shape = w, rate = w * M0.
    After k failures over exposure T the posterior is
    Gamma(w + k, w * M0 + T).

    Estimator: ``mtbf_s = rate / shape = (w M0 + T) / (w + k)``, i.e. the
    inverse of the posterior mean failure rate. It is the plain
    exposure / failures estimate with the prior's pseudo-counts added, so it
    is finite from the start and easy to explain. The posterior mean of the
    MTBF itself, rate / (shape - 1), is not used: it is infinite while
    shape <= 1 and biased towards long intervals (the costly direction).
    """

    def __init__(self, prior_mtbf_s: float, prior_weight: float = 1.0):
        self.prior_mtbf_s = _finite_positive("prior_mtbf_s", prior_mtbf_s)
        self.prior_weight = _finite_positive("prior_weight", prior_weight)
        self.prior_shape = self.prior_weight
        self.prior_rate = self.prior_weight * self.prior_mtbf_s
        self.failures = 0
        self.exposure_s = 0.0

    def observe(self, failures: int = 0, exposure_s: float = 0.0) -> "GammaPoissonMTBF":
        """Add evidence (e.g. one failure, or running time since last call)."""
        _check_evidence(failures, exposure_s)
        self.failures += failures
        self.exposure_s += float(exposure_s)
        return self

    def set_evidence(self, failures: int, exposure_s: float) -> "GammaPoissonMTBF":
        """Replace the evidence with totals, e.g. from a re-read failure ledger."""
        _check_evidence(failures, exposure_s)
        self.failures = failures
        self.exposure_s = float(exposure_s)
        return self

    @property
    def shape(self) -> float:
        return self.prior_shape + self.failures

    @property
    def rate(self) -> float:
        return self.prior_rate + self.exposure_s

    @property
    def failure_rate(self) -> float:
        """Posterior mean failure rate, failures per second."""
        return self.shape / self.rate

    @property
    def mtbf_s(self) -> float:
        """MTBF estimate in seconds: posterior rate / posterior shape."""
        return self.rate / self.shape

    def __repr__(self) -> str:
        return (
            f"GammaPoissonMTBF(prior_mtbf_s={self.prior_mtbf_s:g}, "
            f"prior_weight={self.prior_weight:g}, failures={self.failures}, "
            f"exposure_s={self.exposure_s:g}, mtbf_s={self.mtbf_s:g})"
        )
