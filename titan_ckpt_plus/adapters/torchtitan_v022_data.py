"""torchtitan 0.2.2 side of dataloader resumption by global sample count (issue 5).

`install()` re-registers the TrainSpec of every model family built on torchtitan's
text dataloader (llama3, llama4, deepseek_v3, qwen3, gpt_oss) with `build_dataloader`
as its `build_dataloader_fn` (model flavors still resolve: the spec keeps the family's
model-args dict) and installs the DCP load hook of `titan_ckpt_plus.data.dcp_hint`.

`build_dataloader` is active when `[checkpoint] enable = true`, `tier_local = true` and
`[checkpoint] dataloader_resume = "global_samples"` (the default); otherwise it returns
torchtitan's own per-rank loader, unchanged. Active, it

  - checks the batch geometry against the DP degree (a `ConfigError` naming the keys,
    raised while the trainer is built, before any step),
  - tokenizes a local (map-style) dataset once into a cached token index
    (`titan_ckpt_plus.data.token_index`; cache folder $TITAN_CKPT_DATA_CACHE or
    ~/.cache/titan_ckpt_plus/token_index) and serves the global stream from it,
  - falls back to per-rank state for a streaming dataset (it cannot be indexed ahead),
  - can load a per-rank checkpoint written by stock torchtitan at the same DP degree
    (by delegating to torchtitan's loader) and refuses one at another DP degree with
    a message that says how to proceed,
  - records every yielded microbatch's global sequence ids when
    TITAN_CKPT_SAMPLE_LOG=<path> is set (JSON lines {step, microbatch, rank, dp_rank,
    dp_degree, seq_ids}).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

from torchtitan.tools.logging import logger

from titan_ckpt_plus.config import ConfigError
from titan_ckpt_plus.data import dcp_hint, token_index
from titan_ckpt_plus.data.global_stream import GlobalStream
from titan_ckpt_plus.data.loader import SAMPLE_LOG_ENV, GlobalSampleLoader

MODES = ("global_samples", "per_rank")
MODELS = ("llama3", "llama4", "deepseek_v3", "qwen3", "gpt_oss")  # torchtitan 0.2.2's text families
_PROBES = ("", "Hello, world!", "  leading spaces\nand a newline\t tab 123 ÄÖÜ 漢字 🙂")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def _short(xs: list[int], k: int = 8) -> str:
    return ", ".join(map(str, xs[:k])) + (", ..." if len(xs) > k else "")


def resolve_global_batch(job_config, dp_world_size: int) -> int:
    """The global batch in sequences; a ConfigError naming the keys to change when
    the DP degree cannot divide it."""
    t = job_config.training
    b, d = t.local_batch_size, dp_world_size
    if b < 1:
        raise ConfigError(f"[training] local_batch_size = {b} is invalid. Fix: set it >= 1.")
    g = t.global_batch_size if t.global_batch_size > 0 else b * d
    if g % (b * d) == 0:
        return g
    fixes = [f"set --training.global_batch_size to a multiple of local_batch_size x DP "
             f"degree = {b * d} (e.g. {b * d * max(1, round(g / (b * d)))})"]
    if g % d == 0:
        fixes.append(f"or keep it and set --training.local_batch_size to one of "
                     f"{_short(_divisors(g // d))}")
    if g % b == 0:
        fixes.append(f"or run at a DP degree that divides {g // b} (global_batch_size / "
                     f"local_batch_size): {_short(_divisors(g // b))} "
                     "(set by [parallelism] data_parallel_shard_degree x "
                     "data_parallel_replicate_degree and the number of ranks)")
    raise ConfigError(
        f"[training] global_batch_size = {g} cannot be divided over data-parallel degree "
        f"{d} with [training] local_batch_size = {b}: every step takes global_batch_size "
        f"sequences of the global data stream, local_batch_size per DP rank per microbatch, "
        f"so it must be a multiple of {b} x {d} = {b * d}. Fix: " + "; ".join(fixes) + ".")


def check_mode(ckpt) -> str:
    mode = getattr(ckpt, "dataloader_resume", "global_samples")
    if mode not in MODES:
        raise ConfigError(
            f"[checkpoint] dataloader_resume = {mode!r} is unknown. Fix: \"global_samples\" "
            "(resume by global sample count, any DP degree) or \"per_rank\" (torchtitan's "
            "per-rank dataloader state).")
    return mode


# ---- tokenizer --------------------------------------------------------------------

def tokenizer_fingerprint(tokenizer) -> str:
    """What determines the token ids: the tokenizer's serialized form when it has one,
    its BOS/EOS handling, and the encoding of a few probe strings."""
    h = hashlib.sha256(f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}".encode())
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "to_str"):
        h.update(inner.to_str().encode())
    for attr in ("bos_id", "eos_id", "hf_adds_bos", "hf_adds_eos"):
        h.update(f"{attr}={getattr(tokenizer, attr, None)!r}".encode())
    for probe in _PROBES:
        h.update(json.dumps(tokenizer.encode(probe, add_bos=True, add_eos=True)).encode())
    return h.hexdigest()[:32]


def batch_encoder(tokenizer):
    """texts -> token lists, each exactly `tokenizer.encode(text, add_bos=True,
    add_eos=True)` (what torchtitan's text dataset packs). For torchtitan's own
    HuggingFaceTokenizer the Rust batch encoder is used, with the same BOS/EOS rule."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    inner = getattr(tokenizer, "tokenizer", None)
    if type(tokenizer).encode is HuggingFaceTokenizer.encode and hasattr(inner, "encode_batch"):
        bos = None if tokenizer.hf_adds_bos else tokenizer.bos_id
        eos = None if tokenizer.hf_adds_eos else tokenizer.eos_id

        def encode_batch(texts: list[str]) -> list[list[int]]:
            out = []
            for enc in inner.encode_batch(texts):
                ids = list(enc.ids)
                if bos is not None:
                    ids.insert(0, bos)
                if eos is not None:
                    ids.append(eos)
                out.append(ids)
            return out

        return encode_batch
    return lambda texts: [tokenizer.encode(t, add_bos=True, add_eos=True) for t in texts]


# ---- dataset -> stream -----------------------------------------------------------------

def _texts(ds, text_processor):
    for batch in ds.iter(batch_size=1024):
        cols = list(batch)
        for i in range(len(batch[cols[0]]) if cols else 0):
            yield text_processor({c: batch[c][i] for c in cols})


def open_stream(tokenizer, job_config, cache_dir: str | None = None) -> tuple[GlobalStream | None, str]:
    """(the global stream, "") or (None, why it cannot be indexed)."""
    from datasets import Dataset
    from torchtitan.hf_datasets.text_datasets import _validate_dataset

    name = job_config.training.dataset.lower()
    path, load, text_processor = _validate_dataset(name, job_config.training.dataset_path)
    cache_dir = cache_dir or token_index.default_cache_dir()
    files = token_index.local_files_signature(path)
    parts = {"dataset": name, "path": os.path.abspath(path) if files is not None else path,
             "files": files, "tokenizer": tokenizer_fingerprint(tokenizer),
             "packing": "encode(text, add_bos=True, add_eos=True), concatenated"}
    index = None
    if files is not None:  # a local dataset already indexed: no need to load it at all
        key = token_index.cache_key(parts)
        if os.path.isfile(os.path.join(cache_dir, key, "meta.json")):
            index = token_index.TokenIndex.open(os.path.join(cache_dir, key))
    if index is None:
        ds = load(path)
        if not isinstance(ds, Dataset):
            return None, (f"dataset {name!r} at {path} is a streaming dataset, which cannot be "
                          "indexed ahead")
        if files is None:
            parts["fingerprint"] = getattr(ds, "_fingerprint", None)
            parts["num_rows"] = len(ds)
        key = token_index.cache_key(parts)
        vocab = tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else None
        index = token_index.build_or_open(
            cache_dir, key, lambda: _texts(ds, text_processor), batch_encoder(tokenizer),
            vocab_size=vocab, total_docs=len(ds), provenance=parts)
    identity = {"n_tokens": index.n_tokens, "tokens_sha256": index.digest, "index": index.path}
    return GlobalStream(index.tokens, job_config.training.seq_len, identity), ""


# ---- the TrainSpec hook ------------------------------------------------------------------

def _stock_builder():
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    return build_text_dataloader


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, *,
                     per_rank_builder=None, **kwargs):
    """torchtitan's `build_dataloader_fn`."""
    per_rank_builder = per_rank_builder or _stock_builder()
    stock = functools.partial(per_rank_builder, dp_world_size=dp_world_size, dp_rank=dp_rank,
                              tokenizer=tokenizer, job_config=job_config, **kwargs)
    ckpt = job_config.checkpoint
    mode = check_mode(ckpt)
    if not (ckpt.enable and getattr(ckpt, "tier_local", False)) or mode == "per_rank":
        return stock()  # plugin off: torchtitan's loader, so the files stay stock
    global_batch = resolve_global_batch(job_config, dp_world_size)
    if tokenizer is None:
        raise ConfigError("[checkpoint] dataloader_resume = \"global_samples\" needs a tokenizer "
                          "([model] hf_assets_path). Fix: set it, or dataloader_resume = \"per_rank\".")
    if getattr(job_config.training.dataloader, "num_workers", 0) and dp_rank == 0:
        logger.info("[titan_ckpt_plus] [training.dataloader] num_workers is not used by the "
                    "global-sample loader (it reads a memory-mapped token file in process)")
    stream, why = open_stream(tokenizer, job_config)
    loader = GlobalSampleLoader(
        stream, dp_rank=dp_rank, dp_world_size=dp_world_size,
        local_batch_size=job_config.training.local_batch_size, global_batch_size=global_batch,
        rank=int(os.environ.get("RANK", "0")), sample_log=os.environ.get(SAMPLE_LOG_ENV) or None,
        per_rank_factory=stock, per_rank_reason=why)
    if stream is not None and dp_rank == 0:
        logger.info(
            f"[titan_ckpt_plus] global-sample dataloader: {stream.n_tokens} tokens "
            f"({stream.sequences_per_pass:.0f} sequences of {stream.window} tokens per pass) from "
            f"{stream.identity['index']}; global batch {global_batch} = DP {dp_world_size} x "
            f"local batch {job_config.training.local_batch_size} x {loader.accum} microbatches")
    return loader


_installed = False


def install() -> None:
    """Idempotent: the text families' TrainSpec dataloaders and the DCP load hook."""
    global _installed
    if _installed:
        return
    _installed = True
    from torchtitan.protocols import train_spec as ts

    text_loader = _stock_builder()
    for name in MODELS:
        try:
            spec = ts.get_train_spec(name)
        except Exception as e:  # a family this install cannot import: its jobs fail anyway
            logger.debug(f"[titan_ckpt_plus] train spec {name!r} not available: {e!r}")
            continue
        if getattr(spec.build_dataloader_fn, "_titan_ckpt_plus", False):
            continue
        if spec.build_dataloader_fn is not text_loader and name not in ts._extra_train_specs:
            continue  # not torchtitan's text loader: the global stream would not be its data
        hook = functools.partial(build_dataloader, per_rank_builder=spec.build_dataloader_fn)
        hook._titan_ckpt_plus = True
        new = dataclasses.replace(spec, build_dataloader_fn=hook)
        if name in ts._extra_train_specs:  # someone registered it before us: wrap theirs
            ts._extra_train_specs[name] = new
        else:
            ts.register_train_spec(name, new)
    dcp_hint.install()


def main(argv: list[str] | None = None) -> None:
    """Build the token index ahead of training (same arguments as the training job):

        python -m titan_ckpt_plus.adapters.torchtitan_v022_data --job.config_file job.toml
    """
    import logging
    import sys

    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    install()
    job_config = ConfigManager().parse_args(sys.argv[1:] if argv is None else argv)
    spec = get_train_spec(job_config.model.name)
    tokenizer = spec.build_tokenizer_fn(job_config) if spec.build_tokenizer_fn else None
    if tokenizer is None:
        raise SystemExit("this job has no tokenizer ([model] hf_assets_path)")
    stream, why = open_stream(tokenizer, job_config)
    if stream is None:
        raise SystemExit(f"nothing to build: {why}; its dataloader state stays per rank")
    print(f"token index ready: {stream.identity['index']} ({stream.n_tokens} tokens, "
          f"{stream.sequences_per_pass:.0f} sequences of seq_len {stream.seq_len} + 1 per pass)")


if __name__ == "__main__":
    main()
