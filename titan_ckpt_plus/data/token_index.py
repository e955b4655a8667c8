"""A tokenized corpus on disk: built once, memory-mapped by every rank.

    <cache>/<key>/tokens.bin   every document's tokens, concatenated (uint16 or uint32)
                  docs.bin     int64 start offset of each document in tokens.bin, plus the end
                  meta.json    format version, counts, dtype, sha256 of tokens.bin, provenance

Each document is encoded with BOS and EOS (torchtitan's `encode(text, add_bos=True,
add_eos=True)`) in dataset order, so `tokens.bin` is exactly the token stream that
torchtitan's HuggingFaceTextDataset packs into `seq_len + 1` windows.

`key` hashes the format version, the dataset's identity and the tokenizer's identity
(`cache_key`). One process builds it, under an exclusive `fcntl` lock on
`<cache>/<key>.lock`, into `<key>.tmp.<host>.<pid>`, then renames the folder into place
(atomic); the others wait on the lock and then open the finished folder. A folder
that exists is complete: `meta.json` is written last and the rename publishes it.

No torch, no torchtitan: tests and tools use this without a training stack.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

FORMAT_VERSION = 1
CACHE_ENV = "TITAN_CKPT_DATA_CACHE"

log = logging.getLogger("titan_ckpt_plus.data")


def default_cache_dir() -> str:
    """$TITAN_CKPT_DATA_CACHE, else $XDG_CACHE_HOME (or ~/.cache)/titan_ckpt_plus/token_index."""
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "titan_ckpt_plus", "token_index")


def cache_key(parts: dict) -> str:
    """The folder name for an index: readable prefix + hash of everything that
    determines its bytes (format version included)."""
    blob = json.dumps({"format_version": FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    digest = hashlib.sha256(blob.encode()).hexdigest()[:24]
    name = str(parts.get("dataset", "data"))
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40]
    return f"{safe}-v{FORMAT_VERSION}-{digest}"


def local_files_signature(path: str) -> list | None:
    """(relative name, size, mtime_ns) of every file under a local dataset path, or
    None when `path` is not on this file system (a hub name)."""
    if not os.path.exists(path):
        return None
    path = os.path.abspath(path)
    if os.path.isfile(path):
        st = os.stat(path)
        return [[os.path.basename(path), st.st_size, st.st_mtime_ns]]
    rows = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for f in sorted(files):
            if f.startswith("."):
                continue
            p = os.path.join(root, f)
            st = os.stat(p)
            rows.append([os.path.relpath(p, path), st.st_size, st.st_mtime_ns])
    return rows


@dataclass
class TokenIndex:
    """A built index, memory-mapped read-only."""

    path: str
    tokens: np.ndarray  # 1-D memmap
    doc_offsets: np.ndarray  # 1-D int64 memmap, n_docs + 1 entries
    meta: dict

    @property
    def n_tokens(self) -> int:
        return int(self.meta["n_tokens"])

    @property
    def n_docs(self) -> int:
        return int(self.meta["n_docs"])

    @property
    def digest(self) -> str:
        return self.meta["tokens_sha256"]

    @classmethod
    def open(cls, path: str) -> "TokenIndex":
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: index format {meta.get('format_version')}, "
                             f"this code reads {FORMAT_VERSION}")
        dtype = np.dtype(meta["dtype"])
        n = int(meta["n_tokens"])
        size = os.path.getsize(os.path.join(path, "tokens.bin"))
        if size != n * dtype.itemsize:
            raise ValueError(f"{path}/tokens.bin has {size} bytes, meta.json says "
                             f"{n} x {dtype.itemsize}")
        tokens = np.memmap(os.path.join(path, "tokens.bin"), dtype=dtype, mode="r", shape=(n,))
        offsets = np.memmap(os.path.join(path, "docs.bin"), dtype=np.int64, mode="r",
                            shape=(int(meta["n_docs"]) + 1,))
        return cls(path, tokens, offsets, meta)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Progress:
    """A tqdm bar on a terminal; otherwise a log line every `every_s` seconds."""

    def __init__(self, total: int | None, desc: str, every_s: float = 10.0) -> None:
        self.total, self.desc, self.every_s = total, desc, every_s
        self.done = 0
        self.t0 = self.last = time.monotonic()
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="doc", mininterval=1.0)
            except ImportError:
                pass

    def update(self, n: int, tokens: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            rate = self.done / max(now - self.t0, 1e-9)
            log.info(f"[titan_ckpt_plus] {self.desc}: {self.done}{of} documents{pct}, "
                     f"{tokens} tokens, {rate:.0f} docs/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _write_index(tmp: str, texts: Iterable[list[str]], encode_batch: Callable[[list[str]], list[list[int]]],
                 vocab_size: int | None, total_docs: int | None, desc: str) -> dict:
    """Tokenize batches of texts into `tmp`; returns the meta (without provenance)."""
    dtype = np.dtype(np.uint16 if vocab_size is not None and vocab_size <= 1 << 16 else np.uint32)
    limit = np.iinfo(dtype).max
    sha = hashlib.sha256()
    n_tokens, n_docs = 0, 0
    progress = _Progress(total_docs, desc)
    with open(os.path.join(tmp, "tokens.bin"), "wb") as tok_f, \
            open(os.path.join(tmp, "docs.bin"), "wb") as doc_f:
        doc_f.write(np.zeros(1, dtype=np.int64).tobytes())
        for batch in texts:
            if not batch:
                continue
            encoded = encode_batch(batch)
            lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
            flat = np.fromiter((t for e in encoded for t in e), dtype=np.int64,
                               count=int(lengths.sum()))
            if flat.size and (flat.min() < 0 or flat.max() > limit):
                raise ValueError(f"token id {int(flat.max())} does not fit {dtype} "
                                 f"(tokenizer vocab size {vocab_size})")
            raw = flat.astype(dtype).tobytes()
            tok_f.write(raw)
            sha.update(raw)
            doc_f.write((n_tokens + np.cumsum(lengths)).tobytes())
            n_tokens += int(flat.size)
            n_docs += len(batch)
            progress.update(len(batch), n_tokens)
        for f in (tok_f, doc_f):
            f.flush()
            os.fsync(f.fileno())
    progress.close()
    if n_tokens == 0:
        raise ValueError("the dataset produced no tokens")
    return {"format_version": FORMAT_VERSION, "n_tokens": n_tokens, "n_docs": n_docs,
            "dtype": dtype.name, "tokens_sha256": sha.hexdigest()}


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in items:
        batch.append(x)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def build_or_open(cache_dir: str, key: str, texts: Callable[[], Iterable[str]],
                  encode_batch: Callable[[list[str]], list[list[int]]], *,
                  vocab_size: int | None = None, total_docs: int | None = None,
                  provenance: dict | None = None, batch_size: int = 1024,
                  wait_log_s: float = 30.0) -> TokenIndex:
    """Open `<cache_dir>/<key>`, building it first if no process has yet.

    `texts()` yields the documents' texts in dataset order; it is called only by the
    process that builds. Safe when many processes (ranks, nodes sharing the folder)
    call this at once: exactly one builds, the others block on the lock file.
    """
    final = os.path.join(cache_dir, key)
    if os.path.isfile(os.path.join(final, "meta.json")):
        return TokenIndex.open(final)
    os.makedirs(cache_dir, exist_ok=True)
    lock_path = final + ".lock"
    with open(lock_path, "a+") as lock:
        t0 = time.monotonic()
        next_log = t0
        while True:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            now = time.monotonic()
            if now >= next_log:
                lock.seek(0)
                who = lock.read().strip() or "another process"
                log.info(f"[titan_ckpt_plus] waiting for the token index {final} being built "
                         f"by {who} ({now - t0:.0f}s)")
                next_log = now + wait_log_s
            time.sleep(0.2)
        try:
            if os.path.isfile(os.path.join(final, "meta.json")):
                return TokenIndex.open(final)
            lock.seek(0)
            lock.truncate()
            lock.write(f"{socket.gethostname()} pid {os.getpid()}\n")
            lock.flush()
            # We hold the lock: any temp folder of this key is a dead builder's.
            prefix = os.path.basename(final) + ".tmp."
            for name in os.listdir(cache_dir):
                if name.startswith(prefix):
                    shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)
            if os.path.exists(final):  # a folder without meta.json: not ours to trust
                shutil.rmtree(final)
            tmp = f"{final}.tmp.{socket.gethostname()}.{os.getpid()}"
            os.makedirs(tmp)
            log.info(f"[titan_ckpt_plus] building the token index {final} (one time)")
            started = time.monotonic()
            try:
                meta = _write_index(tmp, _batched(texts(), batch_size), encode_batch,
                                    vocab_size, total_docs, "tokenizing for the token index")
                meta["build_seconds"] = round(time.monotonic() - started, 3)
                meta["provenance"] = provenance or {}
                with open(os.path.join(tmp, "meta.json"), "w") as f:
                    json.dump(meta, f, indent=1, sort_keys=True, default=str)
                    f.flush()
                    os.fsync(f.fileno())
                _fsync_dir(tmp)
                os.rename(tmp, final)
                _fsync_dir(cache_dir)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.info(f"[titan_ckpt_plus] token index built: {meta['n_docs']} documents, "
                     f"{meta['n_tokens']} tokens in {meta['build_seconds']:.1f}s")
            return TokenIndex.open(final)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
