"""Which checkpoint to try, in which order, and who sends which part (pure; no torch).

Every rank reports, per committed local step, the ranks whose parts its node folder
holds (its own node's ranks, plus the replicas it received). A local step is usable
when every rank's part is held somewhere; a rank whose node lacks its part pulls it
from the first holder. Candidates are tried newest first, local before PFS at the
same step (faster, and it never touches the PFS); one that fails its checks on any
rank is skipped and the next is tried. A local step of another layout (a changed world
size) is a candidate too, "reshard", where every part is held on some node (with
[checkpoint] local_reshard): a node folder lacking some gets them from a holder, spread
over the holders and paired in rounds (fetch_order), then DCP reshards the step from each
folder (tiers/reshard.py).
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


def reshard_plans(parts: list[dict], nodes: list[int], skip=()) -> dict[int, tuple[int, list]]:
    """step -> (old world size, [(holders, receiver, old rank)]) for the steps of another
    world size whose every part some node folder holds: each node folder lacking a part
    may get it from a node holding it (node first ranks send and receive; fetch_order
    picks which): its manifest and layout, which DCP's metadata is made from, and its
    data where a rank of the node reads it (restore.Restorer._fetch_read). `parts[r]`: step -> (old
    world size, old ranks whose parts rank r's node folder holds: other_layout_parts);
    `nodes[r]`: the first rank of r's node. A step the nodes saw at different world
    sizes is left out, and so is one in `skip` (a node holds it in this layout: a fetch
    would overwrite it)."""
    folders: dict[int, dict] = {}
    for r, h in enumerate(parts):
        folders.setdefault(nodes[r], h)
    out = {}
    for step in set().union(*(set(h) for h in parts)) - set(skip) if parts else ():
        worlds = {h[step][0] for h in folders.values() if step in h}
        if len(worlds) == 1:
            world = worlds.pop()
            plan = _fill(world, {n: set(h[step][1]) if step in h else set() for n, h in folders.items()})
            if plan is not None:
                out[step] = (world, plan)
    return out


def _fill(world: int, have: dict[int, set]) -> list | None:
    """(holders, receiver, old rank) until every folder in `have` (node -> old ranks it
    holds) holds all `world` parts; None if some part is held nowhere."""
    plan = []
    for n in sorted(have):
        for old in sorted(set(range(world)) - have[n]):
            holders = tuple(m for m in sorted(have) if old in have[m])
            if not holders:
                return None
            plan.append((holders, n, old))
    return plan


def fetch_order(plan: list) -> list[tuple[int, int, int]]:
    """(holder, receiver, old rank) for each part of `plan` ((holders, receiver, old
    rank)): each from the holder that sends the fewest so far, the parts with the fewest
    holders placed first, so one node does not serve every other in turn where another
    holds the part too; then in rounds in which no node sends or receives twice. Every
    rank walks the list in this order, each transfer blocking its pair only, so a
    round's pairs move their parts at once."""
    sent: dict[int, int] = {}
    rounds: list[tuple[set, list]] = []
    for holders, receiver, old in sorted(plan, key=lambda p: (len(p[0]), p[1], p[2])):
        holder = min(holders, key=lambda m: (sent.get(m, 0), m))
        sent[holder] = sent.get(holder, 0) + 1
        busy, moves = next((r for r in rounds if not r[0] & {holder, receiver}), (set(), []))
        if not moves:
            rounds.append((busy, moves))
        busy.update((holder, receiver))
        moves.append((holder, receiver, old))
    return [move for _, moves in rounds for move in moves]


def common_pfs_steps(views: list[tuple[dict, str]]) -> tuple[list[int], list[tuple[int, str]]]:
    """The PFS steps every rank sees alike, and why each other one is left out.
    `views[r]`: rank r's (step -> the folder it would load that step from, why it
    could not list the PFS folder or ""). Each rank lists the PFS itself, and a
    shared file system's clients may disagree for a while (a step sealed just before
    a failure, a stale cache): ranks that tried different steps would load different
    states, or wait in different collectives."""
    if not views:
        return [], []
    unlisted = [f"rank {r}: {why}" for r, (_, why) in enumerate(views) if why]
    seen = set().union(*(set(v) for v, _ in views))
    common, left = [], []
    for step in sorted(seen):
        folders = [v.get(step) for v, _ in views]
        if len(set(folders)) == 1:
            common.append(step)
        elif unlisted:
            left.append((step, "not every rank could list the PFS folder (" + "; ".join(unlisted[:4]) + ")"))
        else:
            lack = [r for r, f in enumerate(folders) if f is None]
            left.append((step, f"ranks {lack[:8]} do not see it (a file system client's stale view?)" if lack
                         else "the ranks see it in different folders: " + ", ".join(sorted(set(map(str, folders))))))
    return common, left


def ordered_candidates(reports: list[dict], pfs_steps: list[int],
                       reshard_steps=()) -> list[tuple[str, int]]:
    """Step 0 is torchtitan's seed checkpoint (create_seed_checkpoint, one rank), which
    stock torchtitan loads as the model alone: from the PFS only, never the seed run's
    whole state from its local tier (its dataloader and optimizer are a one-rank job's)."""
    steps = set().union(*(set(rep) for rep in reports)) if reports else set()
    local = [s for s in steps if s != 0 and pull_plan(reports, s) is not None]
    cands = ([("local", s) for s in local] + [("reshard", s) for s in reshard_steps if s != 0]
             + [("pfs", s) for s in pfs_steps])
    return sorted(cands, key=lambda c: (c[1], _ORDER[c[0]]), reverse=True)
