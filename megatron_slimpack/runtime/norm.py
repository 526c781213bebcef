"""Torch LayerNorm/RMSNorm that also runs under sequence parallelism.

megatron-core's local spec normalizes with `WrappedTorchNorm` when apex is absent (every CPU
machine, and GPU machines without NVIDIA apex), and that refuses `sequence_parallel=True`: under
sequence parallelism each tensor-parallel rank normalizes only its share of the tokens, so the
weights' gradients are partial sums that must be summed over the TP group. TE's `TENorm` and
apex's `FusedLayerNorm` say so by marking their weights `sequence_parallel`, and megatron-core's
`finalize_model_grads` (and the SlimPack schedule's own fallback) then all-reduce them. This
norm does the same with torch's modules, so SlimPack runs `--sequence-parallel` on the local
spec too. The math is torch's; only the mark is added.

`sequence_parallel_spec(spec, config)` swaps it in for `WrappedTorchNorm` (layers and the
block's final norm); every other spec is returned as it is.
"""
from __future__ import annotations

import copy
import dataclasses

import torch


class SequenceParallelTorchNorm:
    """`WrappedTorchNorm` without its sequence-parallel refusal: a torch LayerNorm/RMSNorm whose
    weights carry `sequence_parallel` (summed over the TP group after backward)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        unsupported = [name for name in ("layernorm_zero_centered_gamma", "persist_layer_norm",
                                         "memory_efficient_layer_norm") if getattr(config, name, False)]
        if unsupported:
            raise ValueError(f"the torch norm does not support {', '.join(unsupported)}: turn it off, or use "
                             "Transformer Engine's layer spec")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"the torch norm supports {sorted(kinds)}, not {config.normalization!r}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _uses_torch_norm(module) -> bool:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return module is WrappedTorchNorm


def _swap_torch_norms(spec):
    """A copy of a ModuleSpec whose `WrappedTorchNorm` submodules, at any depth (the layer's
    norms, an attention's q/k norms), are `SequenceParallelTorchNorm`; `spec` itself if it has none."""
    submodules = getattr(spec, "submodules", None)
    if submodules is None or not dataclasses.is_dataclass(submodules):
        return spec
    swaps = {}
    for field in dataclasses.fields(submodules):
        old = getattr(submodules, field.name)
        new = SequenceParallelTorchNorm if _uses_torch_norm(old) else _swap_torch_norms(old)
        if new is not old:
            swaps[field.name] = new
    if not swaps:
        return spec
    spec = copy.copy(spec)
    spec.submodules = dataclasses.replace(submodules, **swaps)
    return spec


def sequence_parallel_spec(spec, config, *, vp_stage=None, pp_rank=None):
    """`spec` (a layer ModuleSpec or TransformerBlockSubmodules) ready for `config`: under
    sequence parallelism with torch norms, a block spec whose layers' and final norms are
    `SequenceParallelTorchNorm`; otherwise `spec` unchanged."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        _get_block_submodules,
    )

    if not getattr(config, "sequence_parallel", False):
        return spec
    block = _get_block_submodules(config, spec, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = [_swap_torch_norms(layer) for layer in block.layer_specs]
    final = SequenceParallelTorchNorm if _uses_torch_norm(block.layer_norm) else block.layer_norm
    if final is block.layer_norm and all(new is old for new, old in zip(layers, block.layer_specs)):
        return spec
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final)
