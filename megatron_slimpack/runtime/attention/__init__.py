"""Sliced attention: a document's slice attends to its earlier slices through a KV cache.

    core.py             the core attention module megatron-core's layer spec holds (SlicedDotProductAttention,
                        its Transformer Engine variant), the spec helpers, RoPE of packed rows
    kernels.py          the backends (Transformer Engine, flash-attn, torch) on THD slices with a KV prefix
    backend_probe.py    the start-up probe that picks the fastest backend that runs and agrees on a GPU
    kv_store.py         the per-document KV cache handed from slice to slice
    seq_params.py       the packed-sequence parameters of a MicroPack (host and device boundaries)
    batch.py            a MicroPack's tokens, positions, labels and boundaries
    rope.py             rotary embeddings at each token's absolute position in its document
    context_parallel.py a DP-Merge group's shares of one MicroPack's attention

The core attention's public names are importable from this package.
"""
from .core import (  # noqa: F401
    BACKENDS,
    BackendUnavailable,
    KVStore,
    SlicedDotProductAttention,
    SlicedSeqParams,
    available_backends,
    core_attention_spec,
    resolve_backend,
    slimpack_layer_spec,
    with_sliced_core_attention,
)
