"""The node-local tier: one folder per node, one part per rank per step.

    <local_folder>/step-N/rank-00003.data    the rank's staged buffer, raw bytes
                         rank-00003.layout  where each tensor lives in it (plain pickle)
                         rank-00003.json    manifest: sizes and CRC-32C of both, step,
                                            world size, layout fingerprint (written last)
                         COMMIT.json        written by the node's first rank once every
                                            rank of the job reported its part durable

A step is a recovery candidate on this node only with COMMIT.json, and for a rank
only if its own manifest matches the job (world size, layout) and its checksums pass.
Each rank deletes only its own files, so no rank can delete a part another rank of the
node is still reading.
"""

import os
import shutil
import time

from titan_ckpt_plus.tiers import files

COMMIT = "COMMIT.json"


class LocalTier:
    def __init__(self, root: str, rank: int, world_size: int, first_on_node: bool,
                 keep_latest_k: int) -> None:
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.first_on_node = first_on_node
        self.keep_latest_k = keep_latest_k
        os.makedirs(root, exist_ok=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def _part(self, step: int, suffix: str, rank: int | None = None) -> str:
        r = self.rank if rank is None else rank
        return os.path.join(self.step_dir(step), f"rank-{r:05d}.{suffix}")

    def write_part(self, step: int, data, describe, on_chunk=None, before_chunk=None) -> tuple[bytes, bytes]:
        """Write this rank's part durably; returns its manifest's bytes (what a
        replica receiver stores as is) and its layout's. `describe()` gives the layout
        bytes and the manifest's fields; it is called once the data is written, so
        the caller can make them while the disk works. Raises on I/O error."""
        os.makedirs(self.step_dir(step), exist_ok=True)
        self._drop_stale(step, [self.rank])
        with files.DurableBatch() as batch:
            data_entry = batch.write(self._part(step, "data"), data, on_chunk, before_chunk)
            layout_bytes, meta = describe()
            manifest = dict(meta, step=step, rank=self.rank, world_size=self.world_size,
                            written_at=time.time())
            manifest["files"] = {"data": data_entry,
                                 "layout": batch.write(self._part(step, "layout"), layout_bytes)}
            raw = files.json_bytes(manifest)
            batch.write(self._part(step, "json"), raw)
        return raw, layout_bytes

    def write_replica(self, step: int, rank: int, manifest: bytes, layout: bytes, data) -> None:
        """Store a verified copy of another rank's part under that rank's file names."""
        os.makedirs(self.step_dir(step), exist_ok=True)
        self._drop_stale(step, [rank])
        with files.DurableBatch() as batch:
            batch.write(self._part(step, "data", rank), data)
            batch.write(self._part(step, "layout", rank), layout)
            batch.write(self._part(step, "json", rank), manifest)

    def _drop_stale(self, step: int, ranks: list[int]) -> None:
        """A step number saved again (after a restart from an older step) must not
        keep the previous incarnation's commit or manifests."""
        stale = [self._part(step, "json", r) for r in ranks]
        if self.first_on_node and self.rank in ranks:
            stale.append(os.path.join(self.step_dir(step), COMMIT))
        for p in stale:
            if os.path.exists(p):
                os.remove(p)

    def commit(self, step: int, info: dict) -> None:
        """The marker's directory fsync also makes the parts' renames durable (they
        are in the same folder and came first); the root's, the step folder's name."""
        if self.first_on_node:
            files.atomic_write_json(os.path.join(self.step_dir(step), COMMIT),
                                    dict(info, step=step, committed_at=time.time()))
            files.fsync_dir(self.root)

    def wait_for_commit(self, step: int, timeout_s: float = 2.0) -> None:
        """Until this node's first rank has written the step's COMMIT.json. Deleting
        old parts makes the file system commit its journal; the other ranks wait for
        the marker before they purge, so that work does not land inside the marker's
        fsync (it made the commit 10 ms slower, one save in three)."""
        path = os.path.join(self.step_dir(step), COMMIT)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.001)

    def steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        return sorted(s for s in map(files.step_of, os.listdir(self.root)) if s is not None)

    def committed_steps(self) -> list[int]:
        return [s for s in self.steps()
                if os.path.isfile(os.path.join(self.step_dir(s), COMMIT))]

    def manifest(self, step: int, rank: int | None = None) -> dict | None:
        try:
            return files.read_json(self._part(step, "json", rank))
        except (OSError, ValueError):
            return None

    def held_parts(self, layout_tag: dict) -> dict[int, list[int]]:
        """Committed step -> ranks whose parts (own node's or replicas) this node
        folder holds with a manifest matching the job's world size and parallel
        layout. Checksums are checked later, when a step is chosen."""
        out = {}
        for s in self.committed_steps():
            ranks = []
            for name in os.listdir(self.step_dir(s)):
                if name.startswith("rank-") and name.endswith(".json") and name[5:-5].isdigit():
                    m = self.manifest(s, int(name[5:-5]))
                    if m and m.get("world_size") == self.world_size and m.get("layout_tag") == layout_tag:
                        ranks.append(int(name[5:-5]))
            if ranks:
                out[s] = sorted(ranks)
        return out

    def read_raw(self, step: int, rank: int | None = None):
        """The part's three files as stored (manifest, layout, data), unverified."""
        out = []
        for suffix in ("json", "layout", "data"):
            path = self._part(step, suffix, rank)
            data = bytearray(os.path.getsize(path))
            with open(path, "rb") as f:
                f.readinto(data)
            out.append(data)
        return bytes(out[0]), bytes(out[1]), out[2]

    def read_part(self, step: int, rank: int | None = None) -> tuple[bytes, bytearray, int]:
        """(layout bytes, data, bytes read), both verified against the manifest."""
        m = self.manifest(step, rank)
        if m is None:
            raise files.CorruptCheckpoint(f"{self._part(step, 'json', rank)}: missing or unreadable")
        _, layout, data = self.read_raw(step, rank)
        files.check_bytes(self._part(step, "layout", rank), layout, m["files"]["layout"])
        files.check_bytes(self._part(step, "data", rank), data, m["files"]["data"])
        return layout, data, len(layout) + len(data)

    def _remove_step(self, s: int, held: list[int]) -> None:
        d = self.step_dir(s)
        if self.first_on_node and os.path.exists(os.path.join(d, COMMIT)):
            os.remove(os.path.join(d, COMMIT))
        for r in [self.rank, *held]:
            for suffix in ("json", "layout", "data"):
                p = self._part(s, suffix, r)
                if os.path.exists(p):
                    os.remove(p)
        try:
            os.rmdir(d)
        except OSError:
            # leftovers of a torn write: remove once no rank's manifest remains
            if not any(n.startswith("rank-") and n.endswith(".json") for n in os.listdir(d)):
                shutil.rmtree(d, ignore_errors=True)

    def discard(self, step: int, held: list[int]) -> None:
        """Remove this rank's files of an uncommitted step (own part, received copies)."""
        if os.path.isdir(self.step_dir(step)):
            try:
                self._remove_step(step, held)
            except FileNotFoundError:
                pass

    def purge(self, protected: set[int], held: list[int] | None = None,
              committed_now: int | None = None) -> list[int]:
        """Keep the newest `keep_latest_k` committed steps, anything newer than the
        newest commit (being written) and `protected` (being drained); delete the
        files this rank is responsible for (its own part, and the replicas it received
        from `held` ranks) of every other step. Returns the steps touched.
        `committed_now`: the step all ranks just voted committed, which counts even
        before this node's first rank has written its COMMIT.json."""
        committed = sorted(set(self.committed_steps()) | ({committed_now} - {None}))
        if not committed:
            return []
        keep = set(committed[-self.keep_latest_k:]) | protected
        newest = committed[-1]
        gone = []
        for s in self.steps():
            if s in keep or s > newest:
                continue
            try:
                self._remove_step(s, held or [])
            except FileNotFoundError:
                pass  # another rank of this node removed it first
            gone.append(s)
        return gone
