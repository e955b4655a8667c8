"""A torchtitan-compatible dataloader over the global stream, resumable at any DP degree.

Split rule. Let b = local batch size, D = DP degree, G = global batch size and
A = G / (b*D) the gradient-accumulation steps. Training step k (1-based) consumes
global sequences [(k-1)*G, k*G). Its microbatch m (0 <= m < A) on DP rank r is

    sequences  (k-1)*G + m*b*D + r*b  ...  + b - 1

so every microbatch takes the next b*D sequences of the stream, rank by rank. After
any number of whole steps the position is a multiple of G, whatever D was.

State (one key, the same value on every rank, so DCP stores it once):

    {"global_samples": '{"format": "titan_ckpt_plus.global_samples", "version": 1,
                        "mode": "global_samples", "consumed": <sequences>,
                        "steps": <global batches>, "seq_len": .., "global_batch_size": ..,
                        "dp_degree": .., "stream": {"n_tokens": .., "tokens_sha256": ..}}'}

Per-rank mode (a checkpoint with torchtitan's per-rank state loaded at the same DP
degree, or a streaming dataset): iteration and state are delegated to a stock
per-rank loader, and the state gets the stock keys plus a "global_samples" marker
with "mode": "per_rank".

No torchtitan import here: the per-rank loader comes from a factory.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

import torch

from titan_ckpt_plus.data.global_stream import GlobalStream

log = logging.getLogger("titan_ckpt_plus.data")

STATE_KEY = "global_samples"
FORMAT = "titan_ckpt_plus.global_samples"
VERSION = 1
SAMPLE_LOG_ENV = "TITAN_CKPT_SAMPLE_LOG"


class DataResumeError(RuntimeError):
    """The checkpoint's dataloader state cannot be continued by this job; the message
    says why and how to proceed."""


def microbatch_ids(consumed: int, dp_rank: int, dp_world_size: int,
                   local_batch_size: int) -> range:
    """Global sequence ids of DP rank `dp_rank`'s microbatch that starts at global
    position `consumed` (the split rule)."""
    start = consumed + dp_rank * local_batch_size
    return range(start, start + local_batch_size)


def per_rank_mismatch_message(saved_degree: int | str, degree: int) -> str:
    return (
        "[titan_ckpt_plus] the checkpoint holds torchtitan's per-rank dataloader state "
        f"(one position per DP rank, written at data-parallel degree {saved_degree} by stock "
        "torchtitan or with [checkpoint] dataloader_resume = \"per_rank\"), and this job "
        f"runs at data-parallel degree {degree}. Per-rank positions cannot be re-split "
        "across another number of ranks. To proceed, either (a) resume once more at "
        f"data-parallel degree {saved_degree}: the data then continues exactly where it "
        "stopped, or (b) restart the data stream: add `--checkpoint.exclude_from_loading "
        "dataloader` (model, optimizer, lr schedule and step are still loaded; the data "
        "starts again at sequence 0 of the global stream, so sequences seen before may be "
        "seen again). Checkpoints written after (b) carry global-sample state and can be "
        "resumed at any data-parallel degree."
    )


class _SampleLog:
    """Test/debug hook: one JSON line per yielded microbatch, appended with O_APPEND
    (one write per line) so that ranks can share the file and a kill loses nothing."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict) -> None:
        os.write(self.fd, (json.dumps(record) + "\n").encode())


class GlobalSampleLoader:
    """Iterable of ({"input": LongTensor[b, seq_len]}, labels LongTensor[b, seq_len]);
    Stateful (state_dict / load_state_dict). torchtitan calls next() once per
    microbatch, gradient-accumulation steps times per step."""

    def __init__(self, stream: GlobalStream | None, *, dp_rank: int, dp_world_size: int,
                 local_batch_size: int, global_batch_size: int, rank: int = 0,
                 sample_log: str | None = None,
                 per_rank_factory: Callable[[], Any] | None = None,
                 per_rank_reason: str = "") -> None:
        b, d, g = local_batch_size, dp_world_size, global_batch_size
        if b < 1 or d < 1 or not 0 <= dp_rank < d:
            raise ValueError(f"bad split: local_batch_size={b}, dp_rank={dp_rank}, dp_world_size={d}")
        if g < 1 or g % (b * d):
            raise ValueError(f"global_batch_size {g} is not a positive multiple of "
                             f"local_batch_size {b} x dp_world_size {d}")
        self.stream = stream
        self.dp_rank, self.dp_world_size = dp_rank, d
        self.local_batch_size, self.global_batch_size = b, g
        self.accum = g // (b * d)
        self.rank = rank
        self.consumed = 0  # global sequences handed out (all ranks together)
        self.steps = 0  # whole global batches handed out
        self._mb = 0  # microbatches handed out in the current step
        self._per_rank_factory = per_rank_factory
        self._delegate = None
        self._load_hint: dict | None = None
        self._fresh = True  # neither iterated nor loaded yet
        self._sample_log = _SampleLog(sample_log) if sample_log else None
        if stream is None:  # e.g. a streaming dataset: per-rank from the start
            if per_rank_factory is None:
                raise ValueError("no stream and no per-rank loader")
            self._delegate = per_rank_factory()
            if dp_rank == 0:
                log.warning(f"[titan_ckpt_plus] dataloader state is per rank ({per_rank_reason}); "
                            "a restart at another data-parallel degree will be refused")

    # ---- iteration -----------------------------------------------------------

    @property
    def per_rank(self) -> bool:
        return self._delegate is not None

    def __iter__(self):
        while True:
            if self._delegate is not None:
                self._fresh = False
                yield from self._delegate
                return
            yield self._next_microbatch()

    def _next_microbatch(self):
        self._fresh = False
        c = self.consumed
        ids = microbatch_ids(c, self.dp_rank, self.dp_world_size, self.local_batch_size)
        x = torch.from_numpy(self.stream.sequences(ids.start, len(ids)))
        if self._sample_log is not None:
            self._sample_log.write({"step": self.steps + 1, "microbatch": self._mb,
                                    "rank": self.rank, "dp_rank": self.dp_rank,
                                    "dp_degree": self.dp_world_size, "seq_ids": list(ids)})
        self.consumed = c + self.local_batch_size * self.dp_world_size
        self._mb += 1
        if self._mb == self.accum:
            self._mb = 0
            self.steps += 1
        return {"input": x[:, :-1].contiguous()}, x[:, 1:].contiguous()

    # ---- state -----------------------------------------------------------------

    def _info(self) -> dict:
        if self._delegate is not None:
            return {"format": FORMAT, "version": VERSION, "mode": "per_rank",
                    "dp_degree": self.dp_world_size}
        return {"format": FORMAT, "version": VERSION, "mode": "global_samples",
                "consumed": self.consumed, "steps": self.steps,
                "seq_len": self.stream.seq_len, "global_batch_size": self.global_batch_size,
                "dp_degree": self.dp_world_size,
                "stream": {k: self.stream.identity.get(k) for k in ("n_tokens", "tokens_sha256")}}

    def state_dict(self) -> dict[str, Any]:
        """The state to save. Two exceptions, both before the first batch: while a DCP
        load is planned, the checkpoint's key shape (see expect_checkpoint_keys); and
        otherwise {} (nothing consumed yet), so that a load through the local tier,
        which keeps the live keys and copies the saved ones, hands over whatever
        format the checkpoint holds."""
        if self._load_hint is not None:
            return dict(self._load_hint)
        if self._fresh:
            return {}
        sd: dict[str, Any] = {}
        if self._delegate is not None:
            sd.update(self._delegate.state_dict())
        sd[STATE_KEY] = json.dumps(self._info(), sort_keys=True)
        return sd

    def expect_checkpoint_keys(self, keys) -> None:
        """Called (by the DCP load hook) with the dataloader keys a checkpoint holds,
        before it is read: the next state_dict() returns that shape, so DCP reads our
        own state or torchtitan's per-rank state alike. Raises early when the
        checkpoint cannot be continued by this job. `keys=None` (metadata unreadable):
        our usual keys, so that DCP reports a missing key instead of loading nothing."""
        if keys is None:
            self._load_hint = {STATE_KEY: ""} if self._delegate is None else {
                f"dp_rank_{self.dp_rank}": b"", "world_size": 0, STATE_KEY: ""}
            return
        keys = set(keys)
        stock = sorted(k for k in keys if k.startswith("dp_rank_"))
        if not stock and STATE_KEY not in keys:
            raise DataResumeError(
                "[titan_ckpt_plus] the checkpoint has no dataloader state this job can read "
                f"(keys: {sorted(keys)[:6]}). To proceed, add `--checkpoint.exclude_from_loading "
                "dataloader` to start the data at sequence 0 of the global stream.")
        if stock:
            mine = f"dp_rank_{self.dp_rank}"
            if mine not in keys or len(stock) != self.dp_world_size:
                raise DataResumeError(per_rank_mismatch_message(len(stock), self.dp_world_size))
            hint: dict[str, Any] = {mine: b"", "world_size": 0}
            if STATE_KEY in keys:
                hint[STATE_KEY] = ""
        else:
            if self.stream is None:
                raise DataResumeError(
                    "[titan_ckpt_plus] the checkpoint holds a global-sample dataloader "
                    "position, but this job's dataset cannot be indexed (it is streaming), so "
                    "that position cannot be continued. To proceed, use the indexed (local) "
                    "dataset the checkpoint was trained on, or add "
                    "`--checkpoint.exclude_from_loading dataloader` to restart the data.")
            hint = {STATE_KEY: ""}
        self._load_hint = hint

    def clear_load_hint(self) -> None:
        self._load_hint = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_hint = None
        self._fresh = False
        if not state_dict:  # saved before the first batch: position 0
            return
        info = json.loads(state_dict[STATE_KEY]) if state_dict.get(STATE_KEY) else None
        stock = sorted(k for k in state_dict if k.startswith("dp_rank_"))
        if info is not None and info.get("format") != FORMAT:
            raise DataResumeError(f"[titan_ckpt_plus] unknown dataloader state format {info.get('format')!r}")
        if info is None or info.get("mode") == "per_rank":
            if not stock:
                raise DataResumeError(
                    "[titan_ckpt_plus] the checkpoint's dataloader state is incomplete (no "
                    "global-sample position and no per-rank state). To proceed, add "
                    "`--checkpoint.exclude_from_loading dataloader` to restart the data.")
            self._load_per_rank(state_dict)
            return
        if self.stream is None:
            self.expect_checkpoint_keys({STATE_KEY})  # raises the streaming error
        self._load_global(info)

    def _load_global(self, info: dict) -> None:
        if info.get("version", 0) > VERSION:
            raise DataResumeError(f"[titan_ckpt_plus] dataloader state version {info['version']} "
                                  f"is newer than this plugin reads ({VERSION}); upgrade titan_ckpt_plus.")
        if info["seq_len"] != self.stream.seq_len:
            raise DataResumeError(
                f"[titan_ckpt_plus] the checkpoint's data position counts sequences of "
                f"seq_len {info['seq_len']}, this job has [training] seq_len = "
                f"{self.stream.seq_len}: the global stream differs, so the position cannot "
                f"be carried over. To proceed, set --training.seq_len {info['seq_len']}, or add "
                "`--checkpoint.exclude_from_loading dataloader` to restart the data.")
        saved = info.get("stream") or {}
        mine = {k: self.stream.identity.get(k) for k in ("n_tokens", "tokens_sha256")}
        if saved and saved != mine and self.dp_rank == 0:
            log.warning(
                f"[titan_ckpt_plus] the tokenized dataset differs from the checkpoint's "
                f"({saved} vs {mine}): the data continues at global sequence "
                f"{info['consumed']} of the new stream, but exactly-once no longer holds.")
        if info["global_batch_size"] != self.global_batch_size and self.dp_rank == 0:
            log.warning(
                f"[titan_ckpt_plus] global batch size changed from {info['global_batch_size']} "
                f"(DP {info['dp_degree']}) to {self.global_batch_size}. Every sequence is "
                "still used exactly once, but the optimization differs; set "
                f"--training.global_batch_size {info['global_batch_size']} to keep it.")
        self.consumed, self.steps, self._mb = int(info["consumed"]), int(info["steps"]), 0
        if self.dp_rank == 0:
            log.info(
                f"[titan_ckpt_plus] data resumes at global sequence {self.consumed} (step "
                f"{self.steps}, pass {self.stream.epoch_of(self.consumed)} over the corpus); "
                f"saved at DP {info['dp_degree']}, now DP {self.dp_world_size} x local batch "
                f"{self.local_batch_size} x {self.accum} microbatches = global batch "
                f"{self.global_batch_size}")

    def _load_per_rank(self, state_dict: dict) -> None:
        mine = f"dp_rank_{self.dp_rank}"
        saved_degree = state_dict.get("world_size")
        if mine not in state_dict or saved_degree != self.dp_world_size:
            raise DataResumeError(per_rank_mismatch_message(
                saved_degree if saved_degree is not None else "unknown", self.dp_world_size))
        if self._delegate is None:
            if self._per_rank_factory is None:
                raise DataResumeError("[titan_ckpt_plus] per-rank dataloader state cannot be "
                                      "loaded: no per-rank loader available")
            self._delegate = self._per_rank_factory()
            if self.dp_rank == 0:
                log.warning(
                    "[titan_ckpt_plus] the checkpoint holds torchtitan's per-rank dataloader "
                    f"state (DP {saved_degree}); it is loaded as is and this run continues with "
                    "torchtitan's per-rank data order, saving per-rank state. A restart at "
                    "another data-parallel degree needs `--checkpoint.exclude_from_loading "
                    "dataloader` once.")
        self._delegate.load_state_dict({mine: state_dict[mine], "world_size": saved_degree})
