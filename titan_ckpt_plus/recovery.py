"""Which checkpoint to try, in which order (pure; no torch).

Every rank reports the local steps it can serve; all ranks see the same PFS. A local
step is usable only if every rank has its part, so the local candidates are the
intersection of the reports. Candidates are tried newest first, local before PFS at
the same step (it is faster and already verified by the node that wrote it); a
candidate that fails its checks on any rank is skipped and the next one is tried.
"""


def ordered_candidates(local_reports: list[list[int]], pfs_steps: list[int]) -> list[tuple[str, int]]:
    common = set(local_reports[0]).intersection(*map(set, local_reports[1:])) if local_reports else set()
    cands = [("local", s) for s in common] + [("pfs", s) for s in pfs_steps]
    return sorted(cands, key=lambda c: (c[1], c[0] == "local"), reverse=True)


def incomplete_local_steps(local_reports: list[list[int]]) -> dict[int, list[int]]:
    """Local steps some rank has but others lack: step -> ranks lacking it (for the log)."""
    everything = set().union(*map(set, local_reports)) if local_reports else set()
    out = {}
    for s in sorted(everything, reverse=True):
        lacking = [r for r, rep in enumerate(local_reports) if s not in rep]
        if lacking:
            out[s] = lacking
    return out
