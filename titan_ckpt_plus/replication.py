"""Moving a rank's local part to another rank over a torch.distributed group.

The same exchange serves replication after a save (each rank sends its part to its
peers while receiving its sources' parts) and recovery (a holder sends a lost part to
the rank that needs it). What arrives is data, not instructions: the receiver bounds
the sizes before allocating, names the files itself, parses the manifest as JSON, and
checks sizes and CRC-32C before anything is kept or unpickled.

On gloo the host buffers go on the wire as they are; on NCCL they pass through a
reused device buffer in chunks, so no part is ever whole in GPU memory. A replica's
data is not whole in host memory either: it arrives chunk by chunk in one reused
buffer and goes on to its file (`sink`), checksummed on the way.
"""

import json
import mmap
from dataclasses import dataclass

import torch
import torch.distributed as dist

from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.local import part_matches

MAX_MANIFEST = 1 << 20


@dataclass
class Part:
    manifest: bytes
    layout: bytes
    data: object  # any buffer: numpy array, bytearray, memoryview; None once streamed to a sink

    def sizes(self) -> list[int]:
        return [len(self.manifest), len(self.layout), memoryview(self.data).nbytes]

    def nbytes(self) -> int:
        return sum(self.sizes())


class Wire:
    """Point-to-point transfers of parts on one process group."""

    def __init__(self, pg, device: torch.device | None = None) -> None:
        self.pg = pg
        self.device = device  # None: gloo, host tensors; else NCCL through this device
        self._dev_buf = None
        self._dev_in = None
        self._chunk: torch.Tensor | None = None  # where streamed data lands, chunk by chunk

    def _bytes_tensor(self, buf) -> torch.Tensor:
        mv = memoryview(buf).cast("B")
        if mv.readonly:  # manifests and layouts: small, copy them rather than alias
            mv = memoryview(bytearray(mv))
        return torch.frombuffer(mv, dtype=torch.uint8) if len(mv) else torch.empty(0, dtype=torch.uint8)

    def _wire(self, n: int, incoming: bool = False) -> torch.Tensor:
        """A reused device buffer for one chunk, one each way."""
        buf = self._dev_in if incoming else self._dev_buf
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, files.piece_size(n)), dtype=torch.uint8, device=self.device)
            if incoming:
                self._dev_in = buf
            else:
                self._dev_buf = buf
        return buf[:n]

    def _landing_chunk(self, n: int) -> torch.Tensor:
        """The reused host buffer streamed data lands in (page-aligned: its file is
        written with O_DIRECT)."""
        if self._chunk is None or self._chunk.numel() < n:
            self._chunk = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)
        return self._chunk[:n]

    def _swap(self, peer_send, values: list[int], peer_recv, n: int) -> list[int] | None:
        """Send `values` to peer_send while receiving n int64s from peer_recv."""
        dev = self.device or "cpu"
        ops = []
        if peer_send is not None:
            ops.append(dist.P2POp(dist.isend, torch.tensor(values, dtype=torch.int64, device=dev),
                                  peer_send, self.pg))
        got = torch.zeros(n, dtype=torch.int64, device=dev)
        if peer_recv is not None:
            ops.append(dist.P2POp(dist.irecv, got, peer_recv, self.pg))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return got.cpu().tolist() if peer_recv is not None else None

    def exchange(self, peer_send: int | None, part: Part | None, peer_recv: int | None,
                 max_bytes: int, sink=None) -> tuple[Part | None, str]:
        """Send `part` (None: tell the peer we have nothing) to `peer_send` while
        receiving from `peer_recv`. Returns (received part, "") or (None, reason).
        Three steps: sizes, then the receiver's accept/refuse, then the bytes, so a
        refused part is never sent and both sides stay in step. `sink`: the received
        data goes to sink(chunk) as it arrives (each chunk valid until it returns; it
        must not raise, or the peer is left waiting) and the part's data is None; else
        it lands whole in a new buffer (recovery, which loads it)."""
        sizes = [1, *part.sizes()] if part is not None else [0, 0, 0, 0]
        hin = self._swap(peer_send, sizes, peer_recv, 4)
        why = ""
        if hin is not None:
            ok, m, l, d = hin
            if not ok:
                why = f"rank {peer_recv} had no part to send"
            elif not (0 < m <= MAX_MANIFEST and 0 <= l <= max_bytes and 0 <= d <= max_bytes):
                why = f"rank {peer_recv} announced implausible sizes {hin[1:]} (limit {max_bytes})"
        accept = hin is not None and not why
        ack = self._swap(peer_recv, [int(accept)], peer_send, 1)
        send = part is not None and peer_send is not None and bool(ack and ack[0])
        kept, incoming = [], []  # what lands whole here (the manifest, the layout, unsunk data)
        if accept:
            kept = [bytearray(hin[1]), bytearray(hin[2])] + ([] if sink else [bytearray(hin[3])])
            incoming = [(len(b), self._bytes_tensor(b)) for b in kept] + ([(hin[3], sink)] if sink else [])
        outgoing = [part.manifest, part.layout, part.data] if send else []
        self._move(peer_send, outgoing, peer_recv, incoming)
        if accept:
            return Part(bytes(kept[0]), bytes(kept[1]), None if sink else kept[2]), ""
        return None, why

    def _move(self, peer_send, outgoing, peer_recv, incoming) -> None:
        """`incoming`: (bytes, where) in order, `where` a tensor to receive into or a
        sink the bytes are streamed to through one reused chunk."""
        out_t = [self._bytes_tensor(b) for b in outgoing]
        chunks_out = [(t, i, m) for t in out_t for i, m in _pieces(t.numel())]
        chunks_in = [(where, i, m) for n, where in incoming for i, m in _pieces(n)]
        for k in range(max(len(chunks_out), len(chunks_in))):
            ops, landing = [], None
            if k < len(chunks_out):
                t, i, m = chunks_out[k]
                src = t[i : i + m]
                if self.device is not None:
                    src = self._wire(src.numel()).copy_(src)
                ops.append(dist.P2POp(dist.isend, src, peer_send, self.pg))
            if k < len(chunks_in):
                where, i, n = chunks_in[k]
                dst = self._landing_chunk(n) if callable(where) else where[i : i + n]
                landing = (where, dst, self._wire(n, incoming=True) if self.device is not None else dst)
                ops.append(dist.P2POp(dist.irecv, landing[2], peer_recv, self.pg))
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            if landing is not None:
                where, dst, got = landing
                if got is not dst:
                    dst.copy_(got)
                if callable(where):
                    where(memoryview(dst.numpy()))


def _pieces(n: int) -> list[tuple[int, int]]:
    """(start, length) of the chunks an item of n bytes travels in; both ends split it
    alike (files.piece_size: the landing chunk stays a small share of the part)."""
    step = files.piece_size(n)
    return [(i, min(step, n - i)) for i in range(0, n, step)]


def check_part(part: Part, rank: int, step: int, world_size: int, job_id: str,
               layout_tag: dict | None, streamed: dict | None = None, data: bool = True) -> dict:
    """The received part's manifest, if it is this job's part of `rank` at `step`, in
    the layout `rank` has (None: a part of a run at another world size, any layout),
    and its bytes match it; else CorruptCheckpoint.
    `streamed`: the size and CRC-32C of data that went to a sink as it arrived.
    Without `data`, the manifest and layout were sent alone."""
    try:
        manifest = json.loads(part.manifest)
        entries = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise files.CorruptCheckpoint(f"rank {rank} step {step}: unreadable manifest ({e})") from None
    if not part_matches(manifest, rank, step, job_id, world_size, layout_tag):
        got = {k: manifest.get(k) for k in ("job_id", "rank", "step", "world_size")}
        want = {"job_id": job_id, "rank": rank, "step": step, "world_size": world_size}
        what = (f"manifest is for {got}, expected {want}" if got != want
                else "manifest's layout differs from that rank's")
        raise files.CorruptCheckpoint(f"rank {rank} step {step}: {what}")
    files.check_bytes(f"rank {rank} step {step} layout", part.layout, entries["layout"])
    if not data:
        return manifest
    if streamed is None:
        files.check_bytes(f"rank {rank} step {step} data", part.data, entries["data"])
    else:
        files.check_entry(f"rank {rank} step {step} data", streamed["size"], streamed[files.SUM], entries["data"])
    return manifest
