"""A restart's side of the tiers (collective): the newest checkpoint every rank can
load, found, its parts fetched where a node lacks them, checked, and read (a local
step), opened for DCP (a local step of another layout) or verified (a PFS step).

recovery.py decides (pure: which candidates, in which order, who sends which part);
this module does it, over the engine's commit group, before the first step, when no
background work runs yet. The engine (checkpointer.py) keeps the save path; it owns
the tiers and the group and makes a Restorer per recover() call.
"""

import logging
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from titan_ckpt_plus import recovery, staging
from titan_ckpt_plus.replication import Part, Wire, check_part
from titan_ckpt_plus.tiers import reshard
from titan_ckpt_plus.tiers.files import CorruptCheckpoint
from titan_ckpt_plus.tiers.local import LocalTier
from titan_ckpt_plus.tiers.pfs import PfsTier, agree

log = logging.getLogger("titan_ckpt_plus")

_REFUSED = "the job's state refused it: "
_WROTE = "after writing some of the state"


@dataclass
class Recovery:
    tier: str | None  # "local", "pfs" or None (nothing usable)
    step: int = -1
    state: Any = None  # local: the saved state, tensors as views of the read buffer
    resharded_from: int = 0  # local, another layout's step (loaded in recover()): its world size
    partly_loaded: int = -1  # a resharded step whose failed load wrote some of the state
    parts_fetched: list = field(default_factory=list)  # resharded: (node's first rank, old rank) whose data moved
    parts_lacking: int = 0  # resharded: the parts node folders lacked (their layouts moved, their data if read)
    bytes_read: dict = field(default_factory=lambda: {"local": 0, "peer": 0, "pfs": 0})
    bytes_total: dict = field(default_factory=dict)  # summed over ranks
    skipped: list = field(default_factory=list)  # (tier, step, reason)
    steps_found: list = field(default_factory=list)  # every step of this job some tier holds

class Restorer:
    """One recover() call's walk over the candidates, on every rank in the same order.
    `s`: the engine's TierSettings (rank, world size, job id, layout tags, node ranks,
    local_reshard, read_only)."""

    def __init__(self, s, local: LocalTier, pfs: PfsTier, pg) -> None:
        self.s, self.local, self.pfs, self.pg = s, local, pfs, pg

    def recover(self, load_resharded: Callable[[Any], int] | None = None, only_step: int = -1) -> Recovery:
        """Collective: agree on the newest checkpoint every rank can load (`only_step`, if
        not -1: that step alone, from whichever tier holds it: torchtitan's load_step), fetch
        missing local parts from the nodes holding replicas, verify, and return it
        (a local state already read and checked, or a PFS step to dcp.load). A local
        step of another layout (local_reshard) is loaded here, by `load_resharded(reader)`
        (dcp.load into the job's state; returns bytes read): if DCP cannot read it (it
        raises on every rank alike), the next candidate is tried and loads over it
        (`partly_loaded` says whether it must: the caller refuses a model-only one). An
        error of the job's own state (a dataloader refusing another DP degree) is raised:
        the PFS step would meet it too. With `read_only` (load_only: a look at a step) it
        writes nothing into the node folders: no marks, no fetched parts (a reshard that
        would fetch some is skipped; the PFS step loads instead)."""
        rec = Recovery(None)
        gathered: list = [None] * self.s.world_size
        held, other, parts = self._local_view(load_resharded is not None)
        dist.all_gather_object(gathered, (held, other, parts, self._node_ranks()[0], self._pfs_view()),
                               group=self.pg)
        reports = [g[0] for g in gathered]
        other = {s: why for g in gathered for s, why in g[1].items()}
        reshardable = recovery.reshard_plans([g[2] for g in gathered], [g[3] for g in gathered],
                                             skip={s for r in reports for s in r})
        unless = ("some part of it is held on no node" if self.s.local_reshard and load_resharded
                  else "local_reshard = false")
        for step in sorted(s for s in other if not any(s in r for r in reports) and s not in reshardable):
            rec.skipped.append(("local", step, f"{other[step]} ({unless}: only a PFS step reshards)"))
        if self.s.read_only:  # a reshard that fetches parts writes them into node folders
            for step in [s for s, (_, plan) in reshardable.items() if plan]:
                del reshardable[step]
                rec.skipped.append(("local", step, "node folders lack parts of it, and load_only = true "
                                    "fetches nothing into them"))
        for step, ranks in recovery.missing_parts(reports).items():
            rec.skipped.append(("local", step, f"no valid part of ranks {ranks[:8]} on any node"))
        pfs_steps, unseen = recovery.common_pfs_steps([g[4] for g in gathered])
        rec.skipped += [("pfs", step, why) for step, why in unseen]
        rec.steps_found = sorted({s for r in reports for s in r} | set(other) | {s for g in gathered for s in g[4][0]})
        cands = recovery.ordered_candidates(reports, pfs_steps, reshardable)
        if only_step != -1:  # load_step: that step alone, and only its skips said
            rec.skipped = [x for x in rec.skipped if x[1] == only_step]
            cands = [c for c in cands if c[1] == only_step]
        for tier, step in cands:
            if tier == "local":
                state, why = self._fetch_local(step, recovery.pull_plan(reports, step), rec)
                why = agree(why, self.pg)
                if not why:
                    rec.tier, rec.step, rec.state = tier, step, state
                    break
            elif tier == "reshard":
                why, fetched = self._load_resharded(step, *reshardable[step], load_resharded, rec)
                if not why:
                    rec.tier, rec.step, rec.resharded_from = "local", step, reshardable[step][0]
                    rec.parts_lacking, rec.parts_fetched = len(reshardable[step][1]), fetched
                    break
            else:
                ok, why = self.pfs.verify(step, self.pg)
                if ok:
                    rec.tier, rec.step = tier, step
                    break
            rec.skipped.append(("pfs" if tier == "pfs" else "local", step, why))
        unlisted = [why for _, why in (g[4] for g in gathered)]
        if rec.tier is None and all(unlisted):  # the same on every rank: all raise alike
            raise RuntimeError(f"[titan_ckpt_plus] no rank could list the PFS folder {self.pfs.folder} "
                               f"(rank 0: {unlisted[0]}), and no local step loads: its steps are unknown, "
                               "so starting over could lose them. Fix: make the folder readable on every "
                               "node, and restart.")
        totals = torch.tensor([rec.bytes_read[k] for k in ("local", "peer")], dtype=torch.int64)
        dist.all_reduce(totals, group=self.pg)
        rec.bytes_total = {"local": int(totals[0]), "peer": int(totals[1])}
        return rec

    def _local_view(self, reshard: bool) -> tuple[dict, dict, dict]:
        """This node folder's committed steps as recover() gathers them: parts held in
        this layout, steps of another layout, and those steps' parts (`reshard`). A
        folder this rank cannot read (a failing disk) holds nothing: it must not raise
        before the gather its peers wait in; its parts then come from replicas or the PFS."""
        try:
            held = self.local.held_parts(self.s.layout_tags)
            other = self.local.other_layout_steps(held, self.s.layout_tags)
        except OSError as e:
            log.warning(f"[titan_ckpt_plus] rank {self.s.rank} could not read its local steps ({e!r}): it "
                        "reports none, so the job loads from replicas or the PFS")
            return {}, {}, {}
        try:
            if not self.s.read_only:
                self.local.mark_old_layout(other, held)
        except OSError as e:  # retention then counts them as this run's: worth a line, not the job
            log.warning(f"[titan_ckpt_plus] could not mark local steps {sorted(other)} as another layout's: {e!r}")
        try:
            parts = self.local.other_layout_parts(other) if self.s.local_reshard and reshard else {}
        except OSError as e:
            log.warning(f"[titan_ckpt_plus] could not read local steps {sorted(other)} of another layout ({e!r})")
            parts = {}
        return held, other, parts

    def _pfs_view(self) -> tuple[dict, str]:
        """(step -> the folder this rank would load it from, "") of the PFS steps it
        sees, or ({}, why) where it cannot list them: gathered, so every rank tries the
        same PFS steps (recovery.common_pfs_steps)."""
        try:
            return {s: self.pfs.step_dir(s) for s in self.pfs.steps()}, ""
        except OSError as e:
            return {}, repr(e)

    def _fetch_local(self, step: int, plan: list, rec: Recovery):
        """This rank's part of `step`: from its node folder, or sent by a holder.
        Every rank walks `plan` in the same order, so the transfers pair up."""
        me, part, why, sender = self.s.rank, None, "", ""
        wire = Wire(self.pg)
        try:
            limit = shutil.disk_usage(self.local.root).free + (1 << 30)
        except OSError as e:  # still walk the plan, refusing what comes (limit 0): the pairs stay in step
            limit, why = 0, f"its node folder: {e!r}"
        for holder, receiver in plan:
            if me == holder:
                self._send_part(wire, step, receiver, receiver, limit)
            elif me == receiver:
                part, got = wire.exchange(None, None, holder, limit)
                why = why or got
                if part is not None:
                    rec.bytes_read["peer"] += part.nbytes()
                    sender = f"its part from rank {holder}: "
        try:
            if why:
                return None, why
            if part is not None:
                check_part(part, me, step, self.s.world_size, self.s.job_id, self.s.layout_tag)
                layout_bytes, data = part.layout, part.data
            else:
                layout_bytes, data, n = self.local.read_part(step)
                rec.bytes_read["local"] += n
            layout = staging.StateLayout.from_bytes(layout_bytes)
            buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
            return staging.rebuild(layout, buf), ""
        except Exception as e:
            return None, sender + (str(e) if isinstance(e, CorruptCheckpoint) else repr(e))

    def _node_ranks(self) -> list[int]:
        return self.s.node_ranks if self.s.rank in self.s.node_ranks else [self.s.rank]

    def _send_part(self, wire: Wire, step: int, rank: int, receiver: int, limit: int, data: bool = True) -> None:
        """A holder's side of a recovery transfer: `rank`'s part of `step` as stored (the
        receiver checks it; without `data`, its manifest and layout alone), or word that
        there is none to send."""
        try:
            out = Part(*self.local.read_raw(step, rank, data=data))
        except OSError:
            out = None
        wire.exchange(receiver, out, None, limit)

    def _load_resharded(self, step: int, world_size: int, plan: list, load, rec: Recovery) -> tuple[str, list]:
        """Collective: the layouts of the parts this node folder lacks fetched (`plan`:
        recovery.reshard_plans), the folder's own parts checked, then loaded by
        `load(reader)`, whose reads fetch first the lacking parts the node's ranks read,
        and only those (_fetch_read); ("" once done on every rank, else why not; the
        parts whose data moved, (node's first rank, old rank))."""
        order = recovery.fetch_order(plan)  # the holders chosen once: a part's layout and data from one
        why = agree(self._fetch_parts(step, world_size, order, rec, data=False), self.pg)
        reader, fetched = None, []
        if not why:
            try:
                # the node's ranks check its parts' data once between them
                node = self._node_ranks()
                lacking = [old for _, receiver, old in plan if receiver == node[0]]
                reader, nbytes = reshard.open_step(self.local, step, world_size,
                                                   (node.index(self.s.rank), len(node)), lacking)
                reader.fetch = lambda read: self._fetch_read(step, world_size, order, read, rec, fetched)
                rec.bytes_read["local"] += nbytes
            except Exception as e:
                why = str(e) if isinstance(e, CorruptCheckpoint) else repr(e)
            why = agree(why, self.pg)
        if not why:
            err = None
            try:
                rec.bytes_read["local"] += load(reader)
            except CheckpointException as e:  # DCP could not read it: on every rank alike
                why = f"loading it resharded failed{' ' + _WROTE if reader.wrote else ''}: {e}"
            except Exception as e:  # the job's own state refused it (maybe on some ranks only)
                err, why = e, f"{_REFUSED}{e!r}"
            why = agree(why, self.pg)  # every rank gets here: none waits alone
            if err is not None:
                raise err
            if _REFUSED in why:
                raise RuntimeError(f"[titan_ckpt_plus] loading local step {step} resharded: {why}")
            if _WROTE in why:  # on every rank: only a whole state loaded over it may follow
                rec.partly_loaded = step
        return (f"{why} (resharding from world size {world_size})" if why else "", fetched)

    def _fetch_read(self, step: int, world_size: int, order: list, read: set[int], rec: Recovery,
                    fetched: list) -> str:
        """Collective, from the reader's read_data once DCP has planned which old ranks'
        parts each rank reads (`read`): of `order`, the parts a node folder lacks and some
        rank of the node reads, fetched whole by its first rank. A node that lost a neighbor
        reads a few parts, not the whole step; those go in `fetched`. "" or why not, the
        same on every rank."""
        wanted: list = [None] * self.s.world_size
        dist.all_gather_object(wanted, (self._node_ranks()[0], sorted(read)), group=self.pg)
        reads: dict[int, set] = {}
        for node, olds in wanted:
            reads.setdefault(node, set()).update(olds)
        order = [(holder, node, old) for holder, node, old in order if old in reads.get(node, ())]
        fetched[:] = [(node, old) for _, node, old in order]
        return agree(self._fetch_parts(step, world_size, order, rec), self.pg)

    def _fetch_parts(self, step: int, world_size: int, order: list, rec: Recovery, data: bool = True) -> str:
        """The parts of `step` (saved by `world_size` ranks) in `order` ((holder,
        receiver, old rank): recovery.fetch_order), stored as replicas are: streamed to
        their files, checked on arrival (without `data`: their manifests and layouts
        alone, which DCP's metadata is made from). Every rank walks the same list, so
        the transfers pair up. Returns "" or why not."""
        me, why, limit = self.s.rank, "", 0
        wire, store = Wire(self.pg), self.local.old_run_view(world_size)
        if any(receiver == me for _, receiver, _ in order):
            try:
                limit = shutil.disk_usage(self.local.root).free
                self.local.adopt_step(step, world_size)
            except OSError as e:  # still walk the plan, refusing what comes (limit 0): the holders send regardless
                why, limit = f"marking step {step}'s folder: {e!r}", 0
        for holder, receiver, old in order:
            if me == holder:
                self._send_part(wire, step, old, receiver, limit, data)
            elif me == receiver:
                try:
                    with store.receive_replica(step, old) as sink:
                        part, err = wire.exchange(None, None, holder, limit, sink=sink.write)
                        if part is None:
                            raise CorruptCheckpoint(err)
                        got = sink.entry() if data else None
                        check_part(part, old, step, world_size, self.s.job_id, None, streamed=got, data=data)
                        sink.finish(part.manifest, part.layout)
                    rec.bytes_read["peer"] += len(part.manifest) + len(part.layout) + (got["size"] if data else 0)
                except Exception as e:  # the exchange is whole; the pairs stay in step
                    why = why or f"part of rank {old} from rank {holder}: {e}"
        return why
