"""PNG plots of a run's checkpoint events (`titan-ckpt report`), without torch.

    delta.png             training blocked per save (delta_s), per tier, over steps
    background_write.png  background write time per tier (and replication), over steps
    interval.png          per tier over wall time: the interval in use against the policy's
                          (Young's) choice, in steps and in seconds against tau; the MTBF per
                          failure class; and the expected waste of the interval in use
                          against the optimal one. Fixed intervals are compared too (the run
                          logs "interval" records either way; runs from before that did so
                          only with adaptive_interval)

Recoveries are drawn as vertical lines (at the step recovered from, or at their time);
failures likewise, from the failure ledger beside the events file (an incarnation that
ended without clean_end died at its last sign of life) and from any "failure" events;
failed saves as crosses. matplotlib is imported here only.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from titan_ckpt_plus import inspect

LEDGER = "ledger.jsonl"  # the failure ledger beside events.jsonl (policy/ledger.py)
RECOVERY_STYLE = dict(color="tab:red", linestyle="--", linewidth=1.2)
TIER_COLORS = {"local": "tab:blue", "pfs": "tab:green"}
FAILURE_STYLE = dict(color="black", linestyle=":", linewidth=1.2)


@dataclass
class Report:
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # "<png name>/<series label>" -> (x, y) as plotted (read back from the Line2D objects)
    series: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    # "<png name>" -> [(event kind, x)] for each vertical line drawn
    marks: dict[str, list[tuple[str, float]]] = field(default_factory=dict)


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def _by_tier(records: list[dict], key: str, x: str = "step") -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    for r in records:
        xv, yv = _num(r.get(x)), _num(r.get(key))
        if xv is not None and yv is not None:
            xs, ys = out.setdefault(str(r.get("tier", "?")), ([], []))
            xs.append(xv)
            ys.append(yv)
    return out


def _broken(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """Break the line where the step goes back (a restarted incarnation saves again)."""
    bx, by = [], []
    for i, (a, b) in enumerate(zip(xs, ys)):
        if i and a <= xs[i - 1]:
            bx.append(math.nan)
            by.append(math.nan)
        bx.append(a)
        by.append(b)
    return bx, by


def _plot(ax, rep: Report, png: str, label: str, xs, ys, broken=True, **style) -> None:
    line, = ax.plot(*(_broken(xs, ys) if broken else (xs, ys)), marker="o", markersize=4,
                    label=label, **style)
    px = [float(v) for v in line.get_xdata()]
    py = [float(v) for v in line.get_ydata()]
    keep = [i for i, v in enumerate(px) if not math.isnan(v)]
    rep.series[f"{png}/{label}"] = ([px[i] for i in keep], [py[i] for i in keep])


def _marks(run_dir: str, ev: list[dict]) -> list[dict]:
    """Vertical lines: recoveries (events file), failures (the failure ledger beside it,
    where each incarnation that ended without clean_end died, and any "failure" events)."""
    out = [dict(kind="recovery", step=_num(r.get("step")), time=_num(r.get("time")),
                label="recovery") for r in ev if r.get("event") == "recovery"]
    out += [dict(kind="failure", step=_num(r.get("step")), time=_num(r.get("time")),
                 label="failure" + (f" ({r['class']})" if r.get("class") else ""))
            for r in ev if r.get("event") == "failure"]
    ledger = os.path.join(os.path.dirname(inspect.events_path(run_dir)), LEDGER)
    if os.path.isfile(ledger):
        from titan_ckpt_plus.policy.ledger import FailureLedger

        summary = FailureLedger(ledger).read()
        starts = {inc.id: inc.start_t for inc in summary.incarnations}
        later = sorted(starts.values())
        for f in summary.failures:
            how = {None: "no clean end: crashed, or still running", "local": "recovered locally",
                   "peer": "recovered from a replica"}.get(f.recovered_from, f"recovered from {f.recovered_from}")
            step, t = _last_sign_of_life(ev, starts.get(f.incarnation), later, f.step, f.t)
            out.append(dict(kind="failure", step=step, time=t, label=f"failure ({how})"))
    return out


def _last_sign_of_life(ev, start, starts, step, t):
    """The ledger dates a failure by the incarnation's last heartbeat; the events file
    often knows a later step of it (a save before the next incarnation started)."""
    if start is None:
        return _num(step), _num(t)
    end = min([s for s in starts if s > start], default=math.inf)
    seen = [e for e in ev if _num(e.get("time")) is not None and start <= e["time"] < end
            and _num(e.get("step")) is not None and e.get("event") != "failure"]
    best = max(seen, key=lambda e: e["time"], default=None)
    if best is not None and (t is None or best["time"] > t):
        return float(best["step"]), float(best["time"])
    return _num(step), _num(t)


def _mark_events(ax, rep: Report, png: str, marks: list[dict], x: str, t0: float = 0.0,
                 scale: float = 1.0) -> None:
    """`marks` as labelled vertical lines; x is "step" or "time"."""
    labelled = set()
    for m in marks:
        if m[x] is None:
            continue
        label = m["label"] + (" (at the step resumed from)" if m["kind"] == "recovery" and x == "step" else "")
        style = RECOVERY_STYLE if m["kind"] == "recovery" else FAILURE_STYLE
        ax.axvline((m[x] - t0) / scale, label=None if label in labelled else label, **style)
        rep.marks.setdefault(png, []).append((m["kind"], (m[x] - t0) / scale))
        labelled.add(label)


# Per tier, the fields of an "interval" record that interval.png plots (in order).
_TIER_FIELDS = ("steps", "tau_s", "optimal_steps", "s", "waste", "optimal_waste")


def _interval_points(iv: list[dict]) -> tuple[dict, dict]:
    """({tier: [(time, *_TIER_FIELDS)]}, {failure class: [(time, mtbf_s)]}) from the
    plugin's "interval" records (local_steps, local_tau_s, pfs_..., mtbf_<class>_s)."""
    tiers: dict[str, list] = {}
    mtbf: dict[str, list] = {}
    for r in iv:
        for tier in ("local", "pfs"):
            if f"{tier}_steps" in r or f"{tier}_tau_s" in r:
                tiers.setdefault(tier, []).append(
                    (r["time"], *(_num(r.get(f"{tier}_{k}")) for k in _TIER_FIELDS)))
        for key, v in r.items():
            if key.startswith("mtbf_") and key.endswith("_s") and len(key) > 7:
                mtbf.setdefault(key[5:-2], []).append((r["time"], _num(v)))
    return tiers, mtbf


def _save(fig, ax_or_axes, path: str, rep: Report) -> None:
    for ax in ax_or_axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    rep.files.append(path)


def render(run_dir: str, out_dir: str | None = None) -> Report:
    """Write the PNGs for the run whose dump folder (or events file) is `run_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = Report()
    path = inspect.events_path(run_dir)
    ev = inspect.read_events(run_dir)
    if not ev:
        rep.notes.append(f"no events in {path}: nothing to plot")
        return rep
    out_dir = out_dir or os.path.join(os.path.dirname(path), "report")
    os.makedirs(out_dir, exist_ok=True)
    marks = _marks(run_dir, ev)
    of = lambda kind: [e for e in ev if e.get("event") == kind]  # noqa: E731
    dump = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    title_run = os.path.join(os.path.basename(os.path.dirname(dump)), os.path.basename(dump))

    # delta: training blocked per save
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for tier, (xs, ys) in sorted(_by_tier(of("stage"), "delta_s").items()):
        _plot(ax, rep, "delta", f"{tier} delta", xs, ys)
    fails = [e for e in of("save_failed") if _num(e.get("step")) is not None]
    if fails:
        xs = [float(e["step"]) for e in fails]
        ax.plot(xs, [0.0] * len(xs), "x", color="tab:red", markersize=9, label="failed save")
        rep.series["delta/failed save"] = (xs, [0.0] * len(xs))
    stage_tiers = {e.get("tier") for e in of("stage")}
    if of("pfs_commit") and "pfs" not in stage_tiers:
        ax.plot([], [], " ", label="pfs: none of its own (drained from local)")
    _mark_events(ax, rep, "delta", marks, "step")
    ax.set(title=f"Checkpoint delta (training blocked per save) - {title_run}",
           xlabel="training step", ylabel="delta (s)")
    _save(fig, [ax], os.path.join(out_dir, "delta.png"), rep)
    plt.close(fig)

    # background write time
    fig, ax = plt.subplots(figsize=(8, 4.5))
    writes = _by_tier(of("local_commit") + of("pfs_commit"), "background_write_s")
    for tier, (xs, ys) in sorted(writes.items()):
        _plot(ax, rep, "background_write", f"{tier} write", xs, ys)
    for tier, (xs, ys) in sorted(_by_tier(of("replication"), "seconds").items()):
        _plot(ax, rep, "background_write", f"replication ({tier})" if tier != "?" else "replication", xs, ys)
    _mark_events(ax, rep, "background_write", marks, "step")
    ax.set(title=f"Background checkpoint write time (off the training path) - {title_run}",
           xlabel="training step", ylabel="write time (s)")
    _save(fig, [ax], os.path.join(out_dir, "background_write.png"), rep)
    plt.close(fig)

    # intervals and MTBF over time
    iv = [e for e in of("interval") if _num(e.get("time")) is not None]
    if not iv:
        rep.notes.append("no \"interval\" records in the events file (no save measured yet?): "
                         "interval/MTBF panel skipped")
        return rep
    t0 = min(e["time"] for e in ev if _num(e.get("time")) is not None)
    span = max(e["time"] for e in iv) - t0
    unit, scale = ("h", 3600.0) if span > 7200 else ("min", 60.0) if span > 120 else ("s", 1.0)
    fig, axes = plt.subplots(4, 1, figsize=(8, 12), sharex=True)
    tiers, mtbf = _interval_points(iv)
    # (axis, field of the row, label, factor, dashed): in use solid, the policy's dashed
    lines = ((0, 1, "interval", 1.0, False), (0, 3, "Young", 1.0, True),
             (1, 4, "interval (s)", 1.0, False), (1, 2, "tau", 1.0, True),
             (3, 5, "waste, interval in use", 100.0, False), (3, 6, "waste at tau", 100.0, True))
    for tier, rows in sorted(tiers.items()):
        for ax, i, what, factor, dashed in lines:
            pts = [((r[0] - t0) / scale, r[i] * factor) for r in rows if r[i] is not None]
            if pts:
                _plot(axes[ax], rep, "interval", f"{tier} {what}", [p[0] for p in pts],
                      [p[1] for p in pts], broken=False, drawstyle="steps-post",
                      color=TIER_COLORS.get(tier), linestyle="--" if dashed else "-")
    for cls, rows in sorted(mtbf.items()):
        pts = [((t - t0) / scale, v / 3600) for t, v in rows if v is not None]
        if pts:
            _plot(axes[2], rep, "interval", f"MTBF {cls}", [p[0] for p in pts], [p[1] for p in pts],
                  broken=False, drawstyle="steps-post")
    if not any(v is not None for rows in mtbf.values() for _, v in rows):
        rep.notes.append("\"interval\" records carry no finite MTBF: MTBF panel left empty")
    for ax in axes[:3]:
        ys = [float(y) for line in ax.get_lines() for y in line.get_ydata()]
        if ys and min(ys) > 0 and max(ys) / min(ys) > 100:
            ax.set_yscale("log")  # e.g. the MTBF of any failure vs. of unrecoverable ones
    for i, ax in enumerate(axes):
        _mark_events(ax, rep, f"interval[{i}]", marks, "time", t0, scale)
    log = lambda ax: ", log scale" if ax.get_yscale() == "log" else ""  # noqa: E731
    # runs from before fixed intervals were recorded wrote these records only when adaptive
    mode = "adaptive" if any(e.get("adaptive", True) for e in iv) else "fixed"
    axes[0].set(title=f"Checkpoint interval per tier ({mode}, solid) vs Young's (dashed) - {title_run}",
                ylabel=f"interval (steps{log(axes[0])})")
    axes[1].set(title="The interval in use vs Young's tau, in seconds", ylabel=f"seconds{log(axes[1])}")
    axes[2].set(title="MTBF estimate per failure class", ylabel=f"MTBF (h{log(axes[2])})")
    axes[3].set(title="Expected cost: saving + redone work, first order (PFS saving at its drain time)",
                ylabel="% of wall time", xlabel=f"wall time since the first record ({unit})")
    _save(fig, axes, os.path.join(out_dir, "interval.png"), rep)
    plt.close(fig)
    return rep
