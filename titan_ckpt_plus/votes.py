"""How the ranks agree during a save and a drain: the writer's commit vote, the drain's
start (every part readable, rank 0's folder cleared, the plan kept) and its gather of
what each rank wrote. Both ways give every rank the same answer, in rank order.

- GlooVotes (agreements = "gloo", "auto" without helper_process (the default), or a
  hub that did not start): gloo collectives, issued by the writer's and the drain's threads.
- HubVotes (agreements = "hub", or helper_process): exchanges through the job's hub
  (tiers/hub.py): one socket round trip from the writer's or the drain's thread, where
  a collective wakes its group's gloo threads on every rank. With helper_process the
  rank's byte helper makes them, so the training process runs no collective of its own
  during a save or a drain; once the helper is gone, this process does.

An exchange through the hub is named by its stream, its step, its phase ("vote",
"start", "gather", "copied": a kept plan's gather) and how many times this rank made
that step's phase (a step drained again after a failed drain): alike on every rank,
and a rank that skipped one (it failed before it) leaves only that one to fail, not
every later one.
"""

import collections
from typing import Callable

from titan_ckpt_plus.tiers.byte_helper import ByteHelper, by_helper
from titan_ckpt_plus.tiers.hub import HubInfo, HubMember, every
from titan_ckpt_plus.tiers.pfs import all_ranks, gather
from titan_ckpt_plus.tiers.pfs_folder import copy_once_agreed


class GlooVotes:
    """Collectives over `pg`, the stream's own gloo group."""

    kind = "gloo"

    def __init__(self, pg) -> None:
        self.pg = pg

    def all_ranks(self, flags: list[bool], step: int, phase: str = "start") -> list[bool]:
        return all_ranks(flags, self.pg)

    def gather(self, obj, step: int, phase: str = "gather") -> list:
        return gather(obj, self.pg)

    def vote(self, flags: list[bool], step: int, marker: dict | None, keep: tuple) -> tuple[list[bool], None]:
        """The writer's vote; what follows it is left to the caller (None)."""
        return all_ranks(flags, self.pg), None

    def copy_planned(self, flags: list[bool], step: int, writer, why: str, seal=None) -> tuple:
        """A kept plan's drain (pfs_folder.copy_once_agreed): the start agreement, then
        `writer`'s copy (a prepared PartCopyWriter; by the byte helper if there is one)
        and the gather of every rank's (why, entries, small items' lengths). Returns
        those and None: rank 0 seals the step itself (PfsTier gives a `seal` only to
        HubVotes)."""
        return *copy_once_agreed(lambda f: all_ranks(f, self.pg), flags, writer.copy,
                                 lambda obj: gather(obj, self.pg), why, writer.small_lengths), None

    def close(self) -> None:
        """Nothing of its own: the groups are the engine's."""


class HubVotes:
    """Exchanges of one stream ("write": the vote; "drain") through the hub: by the
    byte helper `helper()` returns while it runs (on its channel of the same name),
    else here. `pg` stays the stream's gloo group, for DCP's planning of a layout's
    first drain. Raises OSError (HubError) when an exchange fails: on every rank, as
    the hub keeps one outcome per exchange."""

    kind = "hub"

    def __init__(self, stream: str, info: HubInfo, rank: int, helper: Callable[[], ByteHelper | None],
                 pg=None) -> None:
        self.stream, self.helper, self.pg = stream, helper, pg
        self.member = HubMember(info, rank, stream)  # connects only if the helper is gone
        self.made: collections.Counter = collections.Counter()  # (step, phase) -> exchanges made

    def _key(self, step: int, phase: str) -> tuple:
        if any(s != step for s, _ in self.made):  # steps only go up on a stream
            self.made.clear()
        self.made[step, phase] += 1
        return self.stream, step, phase, self.made[step, phase]

    def gather(self, obj, step: int, phase: str = "gather") -> list:
        """Every rank's `obj` (JSON: tuples come back as lists), in rank order."""
        key = self._key(step, phase)
        return by_helper(self.helper(), lambda h: h.exchange(self.stream, key, obj),
                         lambda: self.member.exchange(key, obj))

    def all_ranks(self, flags: list[bool], step: int, phase: str = "start") -> list[bool]:
        return every(self.gather([bool(f) for f in flags], step, phase))

    def vote(self, flags: list[bool], step: int, marker: dict | None, keep: tuple):
        """The writer's vote (all_ranks of `flags`). By the helper, in the same request:
        if the first flag holds on every rank, the commit marker (`marker`: its fields,
        None: not this rank's) and then local retention (LocalTier.retain's `keep`).
        Returns the flags and the marker's error ("": written, or not this rank's)
        if the helper did that, else None: the caller does it."""
        key, flags = self._key(step, "vote"), [bool(f) for f in flags]

        def here():
            return every(self.member.exchange(key, flags)), None

        def there(h: ByteHelper):
            got, why = h.vote(key, flags, marker, keep)
            return every(got), why or ""
        return by_helper(self.helper(), there, here)

    def copy_planned(self, flags: list[bool], step: int, writer, why: str, seal=None) -> tuple:
        """GlooVotes.copy_planned through the hub: by the helper in one request (its
        exchanges and the copy; on rank 0, with `seal` (PfsFolder.seal_kept's step,
        path, .metadata and small items' lengths), the step's seal and PFS retention
        too), so the drain's thread wakes once where it woke five times; else here.
        Returns the agreed flags, the gathered outcomes and the helper's retention
        outcome once it sealed the step (None: the caller seals). Its exchanges' names
        are made once, so that where the helper ended mid-request this process asks
        again under the same ones (the hub kept what the others got) and copies again,
        whole, unless the gather was decided (rank 0 may be sealing the step with the
        helper's file)."""
        # "copied", not "gather": a rank whose start said no goes on to DCP's path, whose
        # gather must be named as it is on a rank that only voted (all_ranks)
        start, gathered = self._key(step, "start"), self._key(step, "copied")
        flags, lengths = [bool(f) for f in flags], writer.small_lengths

        def here():
            done = self.member.decided(gathered)
            if done is not None:  # the helper's copy was gathered before it ended: not copied again
                return every(self.member.exchange(start, flags)), done, None
            return *copy_once_agreed(lambda f: every(self.member.exchange(start, f)), flags, writer.copy,
                                     lambda obj: self.member.exchange(gathered, obj), why, lengths), None

        def there(h: ByteHelper):
            agreed, got, sealed = h.copy_planned((start, gathered), flags, why,
                                                 None if why else writer.copy_request(), lengths, seal)
            writer.source.by_helper = got is not None and not why
            return agreed, got, sealed
        return by_helper(self.helper(), there, here)

    def close(self) -> None:
        self.member.close()
