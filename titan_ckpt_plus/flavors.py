"""Extra model flavors for tests and benchmarks (llama3; a tiny qwen3).

``torchtitan.models.llama3.get_train_spec()`` builds a new TrainSpec on every call but passes the
module-level dict ``llama3_args`` itself as ``model_args``, so adding keys to that dict is seen by
``get_train_spec("llama3")`` (and by any spec later derived from it with ``dataclasses.replace``).
Use them with ``--model.flavor tiny`` / ``100M`` / ``1B``.
"""

from __future__ import annotations

__all__ = ["FLAVORS", "register"]


def _flavors() -> dict:
    from torchtitan.models.llama3 import TransformerModelArgs

    return {
        # ~0.3M parameters: fast unit/e2e tests (a step takes well under a second on CPU).
        "tiny": TransformerModelArgs(
            dim=64, n_layers=2, n_heads=4, vocab_size=2048, rope_theta=500000
        ),
        # ~102M parameters (fp32 model ~0.41 GB, with AdamW state ~1.2 GB per checkpoint):
        # checkpoint-save benchmark.  vocab 2048 matches the demo tokenizer.
        "100M": TransformerModelArgs(
            dim=768, n_layers=14, n_heads=12, vocab_size=2048, rope_theta=500000
        ),
        # ~0.98B parameters: Llama 3.2 1B's shape with the demo vocabulary (fp32 model
        # ~3.9 GB, with AdamW state ~11.8 GB per checkpoint): the GPU check.
        "1B": TransformerModelArgs(
            dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
            multiple_of=256, vocab_size=2048, rope_theta=500000
        ),
    }


FLAVORS = ("tiny", "100M", "1B")


def _qwen3_tiny():
    """qwen3's debugmodel holds 390 MB of state per rank; this one 2 MB, with its
    features kept (tied embeddings, q/k norm, grouped KV heads)."""
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    return Qwen3ModelArgs(vocab_size=2048, max_seq_len=4096, head_dim=16, dim=64, n_layers=2,
                          n_heads=4, n_kv_heads=2, qk_norm=True, hidden_dim=128,
                          rope_theta=1000000, enable_weight_tying=True)


def register() -> None:
    """Add the flavors to torchtitan's model args (idempotent; never overrides)."""
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.qwen3 import qwen3_args

    for name, args in _flavors().items():
        llama3_args.setdefault(name, args)
    qwen3_args.setdefault("tiny", _qwen3_tiny())
