"""Make stock torchtitan 0.2.2 train on a machine without any accelerator (CPU + gloo).

torchtitan 0.2.2 assumes a GPU: ``torchtitan.tools.utils.get_device_info`` falls back to
``"cuda"`` when no accelerator is found, several modules capture ``device_type`` /
``device_module`` at import time, the metrics code calls CUDA-only memory functions, and FSDP2
reduce-scatters with ``ReduceOp.PREMUL_SUM``, which gloo does not implement; the MoE router
counts tokens per expert with ``torch.histc`` on int64, which has no CPU kernel.

``apply_if_needed()`` patches exactly those points, only when no accelerator is present.  It is
called from the package's import hook (``[experimental] custom_import = "titan_ckpt_plus"``),
which torchtitan imports inside ``Trainer.__init__`` before it sets the device and before
``init_process_group``, so every patch is in place before it is needed.  On a CUDA (or any other
accelerator) machine it does nothing and returns ``False``.
"""

from __future__ import annotations

import os
import resource
import sys
import types

import torch

__all__ = ["apply_if_needed", "is_active", "accelerator_present"]

_ACTIVE = False
# torchtitan's fallback device when no accelerator is found (tools/utils.py:37).
_STALE_DEVICE_TYPE = "cuda"


def accelerator_present() -> bool:
    """True when torch sees CUDA/ROCm or any other accelerator (MPS, XPU, MTIA, privateuse1)."""
    if torch.cuda.is_available():
        return True
    accel = getattr(torch, "accelerator", None)
    if accel is not None and accel.is_available():
        return True
    return torch._utils._get_available_device_type() is not None


def usable_cores() -> int:
    """The cores this process may run on (all of them where the OS cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def training_fills_cores(local_ranks: int) -> bool:
    """Whether this node's ranks, each with torch's intra-op threads, keep every core
    this process may use busy: a background thread's CPU then comes out of training's."""
    return local_ranks * torch.get_num_threads() >= usable_cores()


def cpu_has_bf16_dot(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 natively (avx512_bf16 or amx_bf16 among its
    /proc/cpuinfo flags; True where they cannot be read). Without, torch's bf16 GEMMs on
    the CPU fall back to a scalar loop: torchtitan's default bf16 mixed precision made a
    2-rank debugmodel step 3.6 s against 0.40 s in fp32 on an AVX2 host (2026-12-03).
    The benchmarks, the demo and the MoE test train in fp32 there (fp32_args)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return True
    return flags is None or bool({"avx512_bf16", "amx_bf16"} & set(flags))


FP32_ARG = "--training.mixed_precision_param=float32"


def fp32_args() -> list[str]:
    """The torchtitan option that trains in fp32 mixed precision where this CPU has no
    bf16 dot products, else none: the fix slow_bf16_warning names, and what the demo,
    the benchmarks and the MoE test pass (bf16 would dilute what a save costs a step
    about ninefold; the checkpointed state is fp32 either way)."""
    return [] if cpu_has_bf16_dot() else [FP32_ARG]


def slow_bf16_warning(param_dtype: str, sharded: bool) -> str | None:
    """What to tell a CPU job that trains in bf16 mixed precision (FSDP's param_dtype,
    applied only when the model is sharded) on a CPU without bf16 dot products: its
    steps are several times slower and nothing else says why."""
    if not _ACTIVE or not sharded or param_dtype != "bfloat16" or cpu_has_bf16_dot():
        return None
    return ("this CPU has no bf16 dot products (no avx512_bf16 or amx_bf16): [training] "
            'mixed_precision_param = "bfloat16" runs every matrix multiply in a scalar loop, '
            f'several times slower. Fix: mixed_precision_param = "float32" ({FP32_ARG}); '
            "the state saved is fp32 either way.")


def is_active() -> bool:
    """True once the CPU fallback has been applied in this process."""
    return _ACTIVE


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux (bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class _CpuDeviceModule(types.ModuleType):
    """Stand-in for ``torch.cpu`` handed to torchtitan as its ``device_module``.

    It forwards everything to ``torch.cpu`` and adds what torchtitan calls on a device module but
    ``torch.cpu`` lacks (metrics.py DeviceMemoryMonitor), plus an int ``current_device()``:
    ``torch.cpu.current_device()`` returns the string ``"cpu"``, which breaks
    ``barrier(device_ids=[device_module.current_device()])`` in distributed/utils.py
    ``set_pg_timeouts``.  ``torch.cpu`` itself is left untouched.
    """

    def __init__(self) -> None:
        super().__init__("titan_ckpt_plus.cpu_fallback.cpu_device_module")

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        """Device index for barrier(device_ids=...): torch.device("cpu", 0) is valid."""
        return 0

    @staticmethod
    def get_device_name(device=None) -> str:
        """Shown in torchtitan's "CPU capacity: ..." log line."""
        import platform

        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device=None):
        """Only ``total_memory`` is read (memory percentages in the metrics line)."""
        return types.SimpleNamespace(
            name="cpu", total_memory=_total_memory_bytes(), multi_processor_count=os.cpu_count()
        )

    @staticmethod
    def memory_stats(device=None) -> dict:
        """Process peak RSS stands in for CUDA's peak active/reserved bytes."""
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        """No-op: the peak RSS of a process cannot be reset."""

    @staticmethod
    def empty_cache() -> None:
        """No-op: the CPU allocator has no cache to empty."""

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return _peak_rss_bytes()

    @staticmethod
    def memory_allocated(device=None) -> int:
        return _peak_rss_bytes()


_CPU_DEVICE_MODULE = _CpuDeviceModule()


def _get_device_info_cpu() -> tuple[str, types.ModuleType]:
    """Replacement for torchtitan.tools.utils.get_device_info (its fallback is "cuda")."""
    return "cpu", _CPU_DEVICE_MODULE


def _patch_torchtitan_device() -> None:
    """Point torchtitan at ("cpu", CPU device module) everywhere it looks.

    tools/utils.py computes ``device_type, device_module`` once at import ("cuda", torch.cuda);
    components/metrics.py, distributed/utils.py (picks the NCCL backend from it),
    distributed/parallel_dims.py, tools/profiling.py (and distributed/dual_pipe_v.py, which calls
    get_device_info at import) copy those names into their own globals.  We rebind the names in
    every already-imported torchtitan module that still holds the stale values, and replace
    ``get_device_info`` so modules imported later also get the CPU values.
    """
    import torchtitan.tools.utils as tt_utils

    tt_utils.get_device_info = _get_device_info_cpu
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "torchtitan" or name.startswith("torchtitan.")):
            continue
        g = getattr(mod, "__dict__", None)
        if not isinstance(g, dict):
            continue
        if g.get("device_type") == _STALE_DEVICE_TYPE:
            g["device_type"] = "cpu"
        dm = g.get("device_module")
        if dm is torch.cuda or dm is torch.cpu:
            g["device_module"] = _CPU_DEVICE_MODULE


def _patch_fsdp_sum_reduction() -> None:
    """Make FSDP2 reduce-scatter with ReduceOp.SUM, which gloo supports.

    torchtitan's parallelize functions call ``set_gradient_divide_factor(1.0)`` on every
    FSDPModule (llama3 parallelize.py ``disable_fsdp_gradient_division``; llama4, flux and the
    experiments reuse it).  With fp32/bf16 reduce dtype, FSDP then uses
    ``ReduceOp.PREMUL_SUM(1.0)``, which gloo rejects.  ``set_force_sum_reduction_for_comms(True)``
    switches to a plain SUM with a separate (here: 1.0) post-scale: numerically the same.
    We hook the public ``set_gradient_divide_factor`` so it works for every model and for modules
    wrapped in any order, without touching torchtitan's model code.
    """
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor
    if getattr(original, "_titan_ckpt_plus_cpu", False):
        return

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    set_gradient_divide_factor._titan_ckpt_plus_cpu = True  # type: ignore[attr-defined]
    set_gradient_divide_factor.__doc__ = original.__doc__
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _histc_integer(input, bins=100, min=0, max=0, *, out=None):
    """torch.histc for integer CPU tensors, which torch lacks ("histogram_cpu" not
    implemented for 'Long'): the MoE router counts tokens per expert with it. Same bins
    as histc's float rule, floor((x - min) * bins / (max - min)) with x == max in the
    last bin, in integer arithmetic, so the counts are exact; same dtype as the input."""
    original = _histc_integer.original
    if input.is_floating_point() or input.device.type != "cpu" or out is not None:
        kwargs = {} if out is None else {"out": out}
        return original(input, bins=bins, min=min, max=max, **kwargs)
    x = input.reshape(-1).long()
    lo, hi = int(min), int(max)
    if lo == hi and x.numel():  # histc's rule: the data's own range
        lo, hi = int(x.min()), int(x.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    x = x[(x >= lo) & (x <= hi)]
    idx = torch.div((x - lo) * bins, hi - lo, rounding_mode="floor").clamp_(max=bins - 1)
    return torch.bincount(idx, minlength=bins).to(input.dtype)


def _patch_integer_histc() -> None:
    if getattr(torch.histc, "__name__", "") == "_histc_integer":
        return
    _histc_integer.original = torch.histc
    torch.histc = _histc_integer


def _patch_moe_permute_indices() -> None:
    """Expert parallelism permutes tokens with a triton kernel unless told `use_cpu`, and
    torchtitan's MoE code never tells it: route CPU tensors to its own CPU version."""
    from torchtitan.models.moe import utils as moe_utils

    original = moe_utils.generate_permute_indices
    if getattr(original, "_titan_ckpt_plus_cpu", False):
        return

    def generate_permute_indices(tokens_per_expert_group, *args, **kwargs):
        if tokens_per_expert_group.device.type == "cpu":
            kwargs["use_cpu"] = True
        return original(tokens_per_expert_group, *args, **kwargs)

    generate_permute_indices._titan_ckpt_plus_cpu = True  # type: ignore[attr-defined]
    moe_utils.generate_permute_indices = generate_permute_indices


def apply_if_needed() -> bool:
    """Apply the CPU/gloo fallback if no accelerator is present.

    Returns True when the fallback is active (applied now or by an earlier call), False on a
    machine with CUDA or another accelerator, where nothing is changed.  Safe to call repeatedly;
    logs one line through torchtitan's logger the first time it applies.
    """
    global _ACTIVE
    if _ACTIVE:
        # Re-run the cheap rebinding in case torchtitan modules were imported since.
        _patch_torchtitan_device()
        return True
    if accelerator_present():
        return False

    _patch_torchtitan_device()
    _patch_fsdp_sum_reduction()
    _patch_integer_histc()
    _patch_moe_permute_indices()
    _ACTIVE = True

    from torchtitan.tools.logging import logger

    logger.info(
        "titan_ckpt_plus: no accelerator found, CPU fallback active "
        "(device 'cpu', gloo backend, FSDP sum reduction, integer histc, MoE CPU permutation)"
    )
    return True
