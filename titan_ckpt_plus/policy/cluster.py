"""Checkpoint costs and intervals of a whole cluster, on paper (pure; no torch).

A :class:`Cluster` describes the model, the machines and their failure rate;
:func:`plan` turns it into one row per tier of the plugin, a total, and the
synchronous PFS save the tiers replace. Units: bytes, seconds, and decimal
GB (1e9 bytes) per second, as in the design article (405e9 x 14 B = 5.67 TB).

Bytes (checkpointed state, fully sharded, DP replicas written once)::

    total_bytes = params x bytes_per_param
    bytes/rank  = total_bytes / gpus                         (average per GPU)
    node_bytes  = bytes/rank x min(gpus, gpus_per_node)

Typical ``bytes_per_param`` (the design article, section 2): 2 for bf16 weights
only; 12 for torchtitan's FSDP2 (fp32 parameters + Adam m and v); 14 for the
Megatron path (bf16 parameters + fp32 master + m + v); 16 adds bf16 gradients,
which a checkpoint does not need.

Local tier (every failure, ``M_any``)::

    delta_local = bytes/rank / host_copy_bw       what training waits for (the
                                                  device->host copy; the plugin
                                                  overlaps it with fwd/bwd, so
                                                  this is an upper bound)
    write       = node_bytes / nvme_bw            own parts to node-local NVMe
    replication = factor x node_bytes / network_bw  parts sent to `factor` nodes
    commit      = write + max(replication, factor x node_bytes / nvme_bw)
                  (the copies are sent after the own write and the receivers
                  fsync them to their NVMe before the commit vote)
    tau_local   = max(sqrt(2 delta_local M_any), commit)

PFS tier (failures the local tier and its replicas cannot recover)::

    drain       = total_bytes / min(pfs_bw, nodes x network_bw)
    M_unrec     = M_any / p_unrecoverable
    tau_pfs     = max(sqrt(2 drain M_unrec), drain, tau_local)

A PFS save blocks nothing (the drainer copies a committed local step), so,
as in the plugin (``schedule.py``), its Young cost is the drain's background
write time, and an interval shorter than the drain would only queue drains;
a PFS step is a local step, so never more often than ``tau_local``.
``p_unrecoverable`` is an assumption: the fraction of failures after which no
committed local step survives (both copies lost, every node folder wiped, or
no replication and the node or its disk replaced).

Synchronous PFS save (no tiers; every failure recovers from the PFS)::

    delta_sync = drain;  tau_sync = sqrt(2 delta_sync M_any)

Job MTBF: ``job_mtbf_hours`` if given, else ``mtbf_gpu_hours / gpus`` (a
per-GPU share of every interruption, whatever its cause).

Expected waste (fraction of wall time, first order as in ``young.py``)::

    lost work per failure = tau / 2 + lag
        lag = commit (local), drain (PFS), 0 (sync): a failure before the save
        is durable falls back to the save before (exact for lag <= tau)
    local:  delta_local / tau_local + (1 - p) (tau_local / 2 + commit) / M_any
    PFS:    (tau_pfs / 2 + drain) / M_unrec            (= p (...) / M_any)
    sync:   delta_sync / tau_sync + (tau_sync / 2) / M_any   (= sqrt(2 delta/M))

Restart time ``R`` adds ``R / M_any`` to every strategy alike; it is reported
apart (:func:`restart_fraction`), not in the rows. ``busy`` is the fraction of
the interval the tier's background work occupies its disks or network
(commit / tau_local, drain / tau_pfs).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace

from .young import LLAMA3_MTBF_S, young_interval

GB = 1e9

# Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs, as a
# per-GPU MTBF: 54 d x 16384 / 419 = 50,676 h (5.8 years per GPU).
LLAMA3_GPUS = 16384
LLAMA3_MTBF_GPU_HOURS = LLAMA3_MTBF_S * LLAMA3_GPUS / 3600


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class Cluster:
    """A training job on a cluster. Bandwidths in GB/s (1e9 bytes/s)."""

    name: str = field(default="custom", metadata=_help("label printed with the table"))
    params: float = field(default=8e9, metadata=_help("model parameters (e.g. 405e9 or 405B)"))
    bytes_per_param: float = field(
        default=12.0,
        metadata=_help("checkpointed bytes per parameter: 2 bf16 weights only, 12 fp32 weights + Adam "
                       "(torchtitan FSDP2), 14 bf16 + fp32 master + Adam (Megatron)"))
    gpus: int = field(default=8, metadata=_help("GPUs (ranks) in the job"))
    gpus_per_node: int = field(default=8, metadata=_help("GPUs per node"))
    host_copy_gbps: float = field(default=25.0, metadata=_help("device->host copy, GB/s per GPU"))
    nvme_gbps: float = field(default=5.0, metadata=_help("node-local NVMe write, GB/s per node"))
    network_gbps: float = field(default=25.0, metadata=_help("network for replication and drain, GB/s per node"))
    pfs_gbps: float = field(default=5.0, metadata=_help("parallel file system write, GB/s aggregate"))
    mtbf_gpu_hours: float = field(default=LLAMA3_MTBF_GPU_HOURS,
                                  metadata=_help("MTBF per GPU, hours (job MTBF = this / gpus)"))
    job_mtbf_hours: float | None = field(default=None, metadata=_help("job MTBF, hours (overrides per GPU)"))
    replication_factor: int = field(default=0, metadata=_help("copies of each rank's part on other nodes"))
    restart_s: float = field(default=300.0, metadata=_help("seconds from a failure to training again"))
    p_unrecoverable: float = field(
        default=0.1, metadata=_help("fraction of failures no committed local step survives (0..1)"))

    def __post_init__(self) -> None:
        positive = ("params", "bytes_per_param", "gpus", "gpus_per_node", "host_copy_gbps", "nvme_gbps",
                    "network_gbps", "pfs_gbps", "mtbf_gpu_hours")
        for name in positive:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        for name in ("gpus", "gpus_per_node", "replication_factor"):
            v = getattr(self, name)
            if not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
                raise ValueError(f"{name} must be a whole number, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.job_mtbf_hours is not None and not self.job_mtbf_hours > 0:
            raise ValueError(f"job_mtbf_hours must be > 0, got {self.job_mtbf_hours!r}")
        if not self.restart_s >= 0:
            raise ValueError(f"restart_s must be >= 0, got {self.restart_s!r}")
        if not 0.0 <= self.p_unrecoverable <= 1.0:
            raise ValueError(f"p_unrecoverable must be in [0, 1], got {self.p_unrecoverable!r}")
        if self.replication_factor < 0:
            raise ValueError(f"replication_factor must be >= 0, got {self.replication_factor}")
        if self.replication_factor >= self.nodes:
            # Each copy must land on another node (failure domain), as the plugin checks at start.
            raise ValueError(f"replication_factor {self.replication_factor} needs at least "
                             f"{self.replication_factor + 1} nodes; the job has {self.nodes}")

    # -- derived quantities --------------------------------------------------

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus, self.gpus_per_node)

    @property
    def total_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def bytes_per_rank(self) -> float:
        return self.total_bytes / self.gpus

    @property
    def node_bytes(self) -> float:
        return self.bytes_per_rank * self.ranks_per_node

    @property
    def pfs_effective_gbps(self) -> float:
        """The PFS aggregate, unless the nodes' links cannot carry it."""
        return min(self.pfs_gbps, self.nodes * self.network_gbps)

    @property
    def job_mtbf_s(self) -> float:
        hours = self.job_mtbf_hours if self.job_mtbf_hours is not None else self.mtbf_gpu_hours / self.gpus
        return hours * 3600.0

    @property
    def unrecoverable_mtbf_s(self) -> float:
        """MTBF of failures only the PFS recovers: M_any / p_unrecoverable (inf when p = 0)."""
        return self.job_mtbf_s / self.p_unrecoverable if self.p_unrecoverable > 0 else math.inf


@dataclass(frozen=True)
class TierRow:
    """One line of the plan; None where a quantity does not apply."""

    tier: str  # "local", "pfs", "local+pfs" (the plugin, total), "sync-pfs"
    bytes_per_rank: float
    delta_s: float  # training blocked per save
    write_s: float | None = None  # own parts to NVMe (per node)
    replication_s: float | None = None  # sending factor x node bytes
    drain_s: float | None = None  # total bytes to the PFS
    mtbf_s: float | None = None  # MTBF of the failures this tier recovers
    tau_s: float | None = None  # compute time between saves
    rule: str = ""  # what set tau: young, write-bound, raised to local
    lost_per_failure_s: float | None = None  # tau / 2 + lag
    busy: float | None = None  # background time / tau
    waste: float = 0.0  # expected fraction of wall time


def _tau(cost_s: float, mtbf_s: float, floor_s: float, floor_rule: str) -> tuple[float, str]:
    tau = math.inf if math.isinf(mtbf_s) else young_interval(cost_s, mtbf_s)
    return (floor_s, floor_rule) if floor_s > tau else (tau, "young")


def plan(cluster: Cluster) -> list[TierRow]:
    """Rows ``local``, ``pfs``, ``local+pfs`` (their sum) and ``sync-pfs``; formulas in the module doc."""
    c = cluster
    m_any, m_unrec, p = c.job_mtbf_s, c.unrecoverable_mtbf_s, c.p_unrecoverable
    per_rank, node = c.bytes_per_rank, c.node_bytes

    delta_local = per_rank / (c.host_copy_gbps * GB)
    write = node / (c.nvme_gbps * GB)
    replication = c.replication_factor * node / (c.network_gbps * GB)  # 0 (shown "-") without replication
    copies_write = c.replication_factor * node / (c.nvme_gbps * GB)
    commit = write + max(replication, copies_write)
    tau_l, rule_l = _tau(delta_local, m_any, commit, "write-bound")
    lost_l = tau_l / 2 + commit
    repl_shown = replication if c.replication_factor else None
    local = TierRow("local", per_rank, delta_local, write, repl_shown, None, m_any, tau_l, rule_l,
                    lost_l, commit / tau_l, delta_local / tau_l + (1 - p) * lost_l / m_any)

    drain = c.total_bytes / (c.pfs_effective_gbps * GB)
    tau_p, rule_p = _tau(drain, m_unrec, drain, "drain-bound")
    if math.isinf(m_unrec):
        rule_p = "never (p_unrecoverable 0)"
    elif tau_p < tau_l:
        tau_p, rule_p = tau_l, "raised to local"
    lost_p = tau_p / 2 + drain
    waste_p = 0.0 if math.isinf(m_unrec) else lost_p / m_unrec
    pfs = TierRow("pfs", per_rank, 0.0, None, None, drain, m_unrec, tau_p, rule_p, lost_p,
                  0.0 if math.isinf(tau_p) else drain / tau_p, waste_p)

    total = TierRow("local+pfs", per_rank, delta_local, write, repl_shown, drain, m_any,
                    waste=local.waste + pfs.waste)

    tau_s = young_interval(drain, m_any)
    sync = TierRow("sync-pfs", per_rank, drain, None, None, None, m_any, tau_s, "young", tau_s / 2,
                   None, drain / tau_s + tau_s / 2 / m_any)
    return [local, pfs, total, sync]


def restart_fraction(cluster: Cluster) -> float:
    """Wall time lost to restarts, R / M_any, the same for every strategy."""
    return cluster.restart_s / cluster.job_mtbf_s


# -- presets ----------------------------------------------------------------

# H100-class nodes of 8 GPUs. Sources: the design article
# (shared/notes/seed-distributed-checkpoint.txt) and the Llama 3 paper.
#   host copy 25 GB/s per GPU   PCIe 5.0 x16 in practice (article: 25-30 GB/s, 64 nominal)
#   NVMe      5 GB/s per node   one data-centre drive, fsync'd (article: "a few GB/s per node")
#   network  25 GB/s per node   one 200 Gb/s front-end NIC; replication runs on gloo (TCP)
#   PFS       5 / 100 / 500 GB/s aggregate: one client, a 100 GB/s-class PFS, and the
#             article's 500 GB/s for 405B
#   MTBF      50,676 h per GPU: Llama 3's 419 interruptions in 54 days on 16,384 GPUs
#             (job MTBF 3.09 h there, 49.5 h on 1,024 GPUs, 264 days on 8)
#   bytes/param 12 for 8B (torchtitan FSDP2), 14 for 70B and 405B (the article's Megatron
#             accounting: 405B -> 5.7 TB, ~350 MB per GPU)
#   replication 1 copy on another node; none on a single node
#   p_unrecoverable 0.1 with replication; 0.3 without (a failure that replaces the node
#             or its disk loses the only local copy)
#   restart   300 s (the Llama 3 paper: minutes at that scale)
PRESETS: dict[str, Cluster] = {
    "llama3-8b-8gpu": Cluster(
        name="llama3-8b-8gpu", params=8e9, bytes_per_param=12, gpus=8, gpus_per_node=8,
        host_copy_gbps=25, nvme_gbps=5, network_gbps=25, pfs_gbps=5,
        replication_factor=0, p_unrecoverable=0.3, restart_s=300),
    "llama3-70b-1024gpu": Cluster(
        name="llama3-70b-1024gpu", params=70e9, bytes_per_param=14, gpus=1024, gpus_per_node=8,
        host_copy_gbps=25, nvme_gbps=5, network_gbps=25, pfs_gbps=100,
        replication_factor=1, p_unrecoverable=0.1, restart_s=300),
    "llama3-405b-16384gpu": Cluster(
        name="llama3-405b-16384gpu", params=405e9, bytes_per_param=14, gpus=16384, gpus_per_node=8,
        host_copy_gbps=25, nvme_gbps=5, network_gbps=25, pfs_gbps=500,
        replication_factor=1, p_unrecoverable=0.1, restart_s=300),
}

FIELD_HELP = {f.name: f.metadata.get("help", "") for f in fields(Cluster)}

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(value) -> float:
    """405e9, "405e9", "405B", "70b", "1.5T" -> a number of parameters."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip().replace("_", "").replace(",", "")
    scale = _SUFFIX.get(text[-1:].lower(), 1.0) if text and text[-1].isalpha() else 1.0
    if scale != 1.0:
        text = text[:-1]
    try:
        return float(text) * scale
    except ValueError:
        raise ValueError(f"expected a number like 405e9 or 405B, got {value!r}") from None


def with_overrides(base: Cluster, **overrides) -> Cluster:
    """``base`` with the given fields replaced (None values ignored); validates names."""
    unknown = sorted(set(overrides) - set(FIELD_HELP))
    if unknown:
        raise ValueError(f"unknown cluster field(s) {unknown}; known: {sorted(FIELD_HELP)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if "params" in given:
        given["params"] = parse_count(given["params"])
    if "mtbf_gpu_hours" in given and "job_mtbf_hours" not in given:
        given["job_mtbf_hours"] = None  # a per-GPU MTBF given now replaces an inherited job MTBF
    return replace(base, **given)


def _toml():
    """tomllib (Python 3.11+), or tomli, its backport, on 3.10."""
    try:
        import tomllib
    except ModuleNotFoundError:
        import tomli as tomllib
    return tomllib


def load_cluster(path: str) -> Cluster:
    """A cluster from a JSON or TOML file: the fields of :class:`Cluster` at the
    top level or under ``[cluster]``; ``base = "<preset>"`` starts from a preset."""
    with open(path, "rb") as f:
        raw = f.read()
    tomllib = _toml()
    if path.endswith(".toml"):
        data = tomllib.loads(raw.decode("utf-8"))
    else:
        try:
            data = json.loads(raw)
        except ValueError:
            try:
                data = tomllib.loads(raw.decode("utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: neither JSON nor TOML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table/object of cluster fields")
    if isinstance(data.get("cluster"), dict):
        data = data["cluster"]
    data = dict(data)
    base_name = data.pop("base", None)
    if base_name is not None and base_name not in PRESETS:
        raise ValueError(f"{path}: unknown base {base_name!r}; presets: {sorted(PRESETS)}")
    base = PRESETS[base_name] if base_name else Cluster()
    data.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    return with_overrides(base, **data)


def get_cluster(name_or_path: str) -> Cluster:
    """A preset by name, else a JSON/TOML file."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.isfile(name_or_path):
        return load_cluster(name_or_path)
    raise ValueError(f"--cluster {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a file")


# -- text ---------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float | None) -> str:
    """Seconds, with 3 significant digits; min / h / d once long."""
    if s is None:
        return "-"
    if math.isinf(s):
        return "inf"
    for unit, scale in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if s >= 2 * scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s:.3g} s"


def _hours(h: float) -> str:
    return "inf" if math.isinf(h) else (f"{h:,.0f}" if h >= 100 else f"{h:.3g}")


def describe(cluster: Cluster) -> list[str]:
    """Header lines: the inputs and the quantities every row shares."""
    c = cluster
    mtbf = (f"job MTBF {_hours(c.job_mtbf_s / 3600)} h (given)" if c.job_mtbf_hours is not None else
            f"job MTBF {_hours(c.job_mtbf_s / 3600)} h = {_hours(c.mtbf_gpu_hours)} h per GPU / {c.gpus} GPUs")
    m_unrec = f"{_hours(c.unrecoverable_mtbf_s / 3600)} h"
    return [
        f"cluster {c.name}: {c.params / 1e9:g}B params x {c.bytes_per_param:g} B = {fmt_bytes(c.total_bytes)}; "
        f"{c.gpus} GPUs on {c.nodes} node(s) of {c.ranks_per_node}; {fmt_bytes(c.bytes_per_rank)} per GPU, "
        f"{fmt_bytes(c.node_bytes)} per node",
        f"bandwidth GB/s: host copy {c.host_copy_gbps:g}/GPU, NVMe {c.nvme_gbps:g}/node, "
        f"network {c.network_gbps:g}/node, PFS {c.pfs_gbps:g} aggregate"
        + (f" (capped at {c.pfs_effective_gbps:g} by the nodes' links)" if c.pfs_effective_gbps < c.pfs_gbps else ""),
        f"{mtbf}; p_unrecoverable {c.p_unrecoverable:g} -> PFS-only MTBF {m_unrec}; "
        f"replication factor {c.replication_factor}",
    ]


PLAN_HEADER = ["tier", "bytes/rank", "delta", "write", "replicate", "drain", "MTBF", "tau", "tau_rule",
               "lost/failure", "busy_%", "waste_%"]


def plan_cells(rows: list[TierRow]) -> list[list[str]]:
    """The rows as strings, in ``PLAN_HEADER`` order."""
    out = []
    for r in rows:
        out.append([
            r.tier, fmt_bytes(r.bytes_per_rank),
            "0 (drained)" if r.tier == "pfs" else fmt_seconds(r.delta_s),
            fmt_seconds(r.write_s), fmt_seconds(r.replication_s), fmt_seconds(r.drain_s),
            fmt_seconds(r.mtbf_s), fmt_seconds(r.tau_s), r.rule or "-", fmt_seconds(r.lost_per_failure_s),
            "-" if r.busy is None else f"{r.busy * 100:.2g}", f"{r.waste * 100:.3g}",
        ])
    return out


def summary(cluster: Cluster, rows: list[TierRow]) -> list[str]:
    """Footer lines: what the tiers buy over a synchronous PFS save, and restarts."""
    by = {r.tier: r for r in rows}
    tiers, sync = by["local+pfs"].waste, by["sync-pfs"].waste
    ratio = f"{sync / tiers:.3g}x less" if tiers > 0 else "all of it"
    return [
        f"waste: local+pfs {tiers * 100:.3g}% vs sync-pfs {sync * 100:.3g}% ({ratio}); "
        f"restarts ({cluster.restart_s:g} s each) add {restart_fraction(cluster) * 100:.3g}% to both",
    ]
