"""Checkpoint-interval policy: pure Python, no torch.

Young/Daly formulas, a Bayesian MTBF estimate, the failure ledger it reads
its evidence from, the controller that turns both into a step interval, and
a simulator that replays failure traces through that same code.
"""

from .controller import Decision, IntervalController
from .ledger import FailureLedger, LedgerSummary
from .mtbf import GammaPoissonMTBF
from .young import (
    LLAMA3_MTBF_S,
    checkpoints_per_day,
    daly_interval,
    expected_lost_work,
    overhead_fraction,
    waste_fraction,
    young_interval,
    young_table,
)

__all__ = [
    "LLAMA3_MTBF_S",
    "Decision",
    "FailureLedger",
    "GammaPoissonMTBF",
    "IntervalController",
    "LedgerSummary",
    "checkpoints_per_day",
    "daly_interval",
    "expected_lost_work",
    "overhead_fraction",
    "waste_fraction",
    "young_interval",
    "young_table",
]
