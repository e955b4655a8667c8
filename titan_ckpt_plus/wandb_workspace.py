"""The plugin's wandb dashboard: one workspace of the `ckpt/` metrics (no torch).

`titan-ckpt wandb-workspace ENTITY/PROJECT` saves it with the wandb-workspaces library;
`--dry-run --out FILE` writes the same workspace as JSON without touching the network.
Every key a panel plots is one the plugin logs (telemetry.metrics_of), checked by a
test against an offline run's records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from titan_ckpt_plus.telemetry import PREFIX


@dataclass(frozen=True)
class Panel:
    section: str
    title: str
    keys: tuple[str, ...]  # without the ckpt/ prefix
    y_title: str


PANELS = (
    Panel("Save cost", "training blocked per save (delta), per tier", ("local/delta_s", "pfs/delta_s"), "s"),
    Panel("Save cost", "staging and background write time, per tier",
          ("local/staging_s", "local/background_write_s", "pfs/background_write_s"), "s"),
    Panel("Save cost", "background write bandwidth, per tier", ("local/write_MBps", "pfs/write_MBps"), "MB/s"),
    Panel("Save cost", "time to a durable local commit", ("local/time_to_commit_s",), "s"),
    Panel("Replication", "replication time", ("replication/seconds",), "s"),
    Panel("Replication", "replication bytes sent and bandwidth", ("replication/bytes_sent", "replication/MBps"),
          "bytes, MB/s"),
    Panel("Drain", "PFS drain lag behind the newest local commit", ("pfs/drain_lag_steps",), "steps"),
    Panel("Drain", "newest committed step, per tier", ("local/committed_step", "pfs/committed_step"), "step"),
    Panel("Interval", "local interval vs Young's tau", ("interval/local_s", "interval/local_tau_s"), "s"),
    Panel("Interval", "PFS interval vs Young's tau", ("interval/pfs_s", "interval/pfs_tau_s"), "s"),
    Panel("Interval", "expected waste: interval in use vs Young's (PFS saving at its drain time)",
          ("interval/expected_waste_local", "interval/expected_waste_local_optimal",
           "interval/expected_waste_pfs", "interval/expected_waste_pfs_optimal"), "fraction of time"),
    Panel("Interval", "MTBF estimates", ("interval/mtbf_any_h", "interval/mtbf_unrecoverable_h"), "h"),
    Panel("Interval", "failures seen (a step up marks each)", ("interval/failures_any",), "failures"),
    Panel("Recovery", "recovery time", ("recovery/seconds",), "s"),
    Panel("Recovery", "recovery bytes per source",
          ("recovery/bytes_local", "recovery/bytes_peer", "recovery/bytes_pfs"), "bytes"),
    Panel("Recovery", "step recovered", ("recovery/step",), "step"),
)


def panel_keys() -> list[str]:
    return sorted({f"{PREFIX}/{k}" for p in PANELS for k in p.keys})


def build(entity: str, project: str, name: str):
    """The workspace object (wandb_workspaces), one section per panel group."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    sections: dict = {}
    for p in PANELS:
        sections.setdefault(p.section, []).append(wr.LinePlot(
            title=p.title, y=[f"{PREFIX}/{k}" for k in p.keys], title_y=p.y_title))
    return ws.Workspace(entity=entity, project=project, name=name,
                        sections=[ws.Section(name=f"{PREFIX}: {s}", panels=panels, is_open=True)
                                  for s, panels in sections.items()])


def spec(workspace) -> dict:
    """What would be saved, as JSON: wandb's own view model, and the panel list."""
    view = json.loads(workspace._to_model().model_dump_json())
    return {"panels": [{"section": p.section, "title": p.title, "keys": [f"{PREFIX}/{k}" for k in p.keys]}
                       for p in PANELS], "wandb_view": view}


def save(workspace) -> str:
    """Save to wandb; returns the workspace's URL. Raises RuntimeError with a plain
    message when there are no credentials or wandb cannot be reached."""
    import wandb
    from wandb.errors import CommError, UsageError

    try:
        wandb.Api()  # reads WANDB_API_KEY or ~/.netrc; no network
    except UsageError as e:
        raise RuntimeError(f"no wandb credentials ({e}). Run `wandb login` or set WANDB_API_KEY; "
                           "or write the workspace to a file with --dry-run --out FILE") from None
    try:
        workspace.save()
    except (CommError, OSError) as e:
        raise RuntimeError(f"cannot reach wandb ({e}). Check the network and WANDB_BASE_URL; "
                           "or write the workspace to a file with --dry-run --out FILE") from None
    return workspace.url
