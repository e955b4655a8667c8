"""Where each rank's local part is replicated (pure; no torch).

Rank r's part is copied to ranks r + k*jump (mod world) for k = 1..factor, as in
NVIDIA's clique replication, but the result is checked against real failure domains:
a copy that would land in the source's own domain (host), or two copies in one
domain, is refused at start-up, because it would die with the source.
"""

from dataclasses import dataclass


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class ReplicaPlacement:
    world_size: int
    factor: int
    jump: int
    domains: tuple  # failure domain of each rank, e.g. "host/node_rank"

    def __post_init__(self) -> None:
        if self.factor < 0:
            raise PlacementError(
                f"[checkpoint] replication_factor = {self.factor} is invalid. "
                "Fix: 0 (off) or the number of other nodes that hold a copy (e.g. 1).")
        if self.factor == 0:
            return
        if self.jump <= 0:
            raise PlacementError(
                f"[checkpoint] replication_jump = {self.jump} is invalid. Fix: a positive "
                "number of ranks, normally the ranks per node (0 picks that).")
        n_domains = len(set(self.domains))
        if self.factor >= n_domains:
            raise PlacementError(
                f"[checkpoint] replication_factor = {self.factor} needs {self.factor + 1} failure "
                f"domains (hosts) but the job has {n_domains}. Fix: lower replication_factor "
                f"to at most {n_domains - 1}, or set it to 0 for a single-node job.")
        for r in range(self.world_size):
            seen = {self.domains[r]}
            for peer in self.peers(r):
                if self.domains[peer] in seen:
                    raise PlacementError(
                        f"[checkpoint] replication_jump = {self.jump}, replication_factor = "
                        f"{self.factor}: rank {r}'s copy would go to rank {peer} on "
                        f"{self.domains[peer]}, a failure domain that already holds it. "
                        "Fix: set replication_jump to the number of ranks per node.")
                seen.add(self.domains[peer])

    def peers(self, rank: int) -> list[int]:
        """Ranks that hold copies of `rank`'s part."""
        return [(rank + k * self.jump) % self.world_size for k in range(1, self.factor + 1)]

    def sources(self, rank: int) -> list[int]:
        """Ranks whose parts `rank` holds copies of (same k order as peers)."""
        return [(rank - k * self.jump) % self.world_size for k in range(1, self.factor + 1)]
