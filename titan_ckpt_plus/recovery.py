"""Which checkpoint to try, in which order, and who sends which part (pure; no torch).

Every rank reports, per committed local step, the ranks whose parts its node folder
holds (its own node's ranks, plus the replicas it received). A local step is usable
when every rank's part is held somewhere; a rank whose node lacks its part pulls it
from the first holder. Candidates are tried newest first, local before PFS at the
same step (faster, and it never touches the PFS); one that fails its checks on any
rank is skipped and the next is tried. A local step of another layout (a changed world
size) is a candidate too, "reshard", where every rank's node folder holds all its parts
(with [checkpoint] local_reshard): DCP reshards it from there (tiers/reshard.py).
"""

_ORDER = {"local": 2, "reshard": 1, "pfs": 0}  # at the same step


def pull_plan(reports: list[dict], step: int) -> list[tuple[int, int]] | None:
    """(holder, receiver) for every rank whose node lacks its own part of `step`;
    None if some part is held nowhere. `reports[r]`: step -> ranks held by r's node."""
    plan = []
    for r in range(len(reports)):
        if r in reports[r].get(step, ()):
            continue
        holders = [h for h in range(len(reports)) if r in reports[h].get(step, ())]
        if not holders:
            return None
        plan.append((holders[0], r))
    return plan


def missing_parts(reports: list[dict]) -> dict[int, list[int]]:
    """step -> ranks whose part is held nowhere (for the log), newest first."""
    world = len(reports)
    steps = set().union(*(set(rep) for rep in reports)) if reports else set()
    out = {}
    for s in sorted(steps, reverse=True):
        held = set().union(*(set(rep.get(s, ())) for rep in reports))
        if len(held) < world:
            out[s] = sorted(set(range(world)) - held)
    return out


def reshardable_everywhere(reports: list[dict]) -> dict[int, int]:
    """step -> old world size, for the steps every rank's node folder holds whole
    (`reports[r]`: rank r's LocalTier.reshardable), at the same world size."""
    if not reports:
        return {}
    return {s: w for s, w in reports[0].items() if all(rep.get(s) == w for rep in reports[1:])}


def ordered_candidates(reports: list[dict], pfs_steps: list[int],
                       reshard_steps=()) -> list[tuple[str, int]]:
    steps = set().union(*(set(rep) for rep in reports)) if reports else set()
    local = [s for s in steps if pull_plan(reports, s) is not None]
    cands = ([("local", s) for s in local] + [("reshard", s) for s in reshard_steps]
             + [("pfs", s) for s in pfs_steps])
    return sorted(cands, key=lambda c: (c[1], _ORDER[c[0]]), reverse=True)
