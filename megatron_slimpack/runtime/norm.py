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
block's final norm), and with `tp_overlap` megatron's local linears for the ring-overlapped ones
of tp_overlap.py; every other spec is returned as it is.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

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


def _torch_norm_swap(module):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return SequenceParallelTorchNorm if module is WrappedTorchNorm else None


def _swap_submodules(spec, swap):
    """A copy of a ModuleSpec whose submodules, at any depth (the layer's norms and linears, an
    attention's q/k norms), are replaced by `swap(module)` where that is not None; `spec` itself
    if none is. megatron-core 0.18+ builds the MLP as `functools.partial(MLP.as_mlp_submodule,
    submodules=...)`: such a partial is copied with its submodules swapped too."""
    if isinstance(spec, functools.partial):
        submodules = spec.keywords.get("submodules")
        swapped = _swap_fields(submodules, swap)
        if swapped is submodules:
            return spec
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": swapped})
    submodules = getattr(spec, "submodules", None)
    swapped = _swap_fields(submodules, swap)
    if swapped is submodules:
        return spec
    spec = copy.copy(spec)
    spec.submodules = swapped
    return spec


def _swap_fields(submodules, swap):
    """A copy of a submodules dataclass with `_swap_submodules` applied to each field; itself
    where nothing changes (or it is not a dataclass)."""
    if submodules is None or not dataclasses.is_dataclass(submodules):
        return submodules
    swaps = {}
    for field in dataclasses.fields(submodules):
        old = getattr(submodules, field.name)
        new = swap(old) or _swap_submodules(old, swap)
        if new is not old:
            swaps[field.name] = new
    return dataclasses.replace(submodules, **swaps) if swaps else submodules


def sequence_parallel_spec(spec, config, *, vp_stage=None, pp_rank=None, tp_overlap: bool = False):
    """`spec` (a layer ModuleSpec or TransformerBlockSubmodules) ready for `config`: under
    sequence parallelism with torch norms, a block spec whose layers' and final norms are
    `SequenceParallelTorchNorm`, and with `tp_overlap` whose local linears hide their TP
    collectives (tp_overlap.py); otherwise `spec` unchanged."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        _get_block_submodules,
    )

    from .tp_overlap import overlapped_linear

    tp = getattr(config, "tensor_model_parallel_size", 1)
    if tp_overlap and tp > 1 and not getattr(config, "sequence_parallel", False):
        raise ValueError("the TP overlap hides sequence parallelism's all-gathers and reduce-scatters: turn on "
                         "sequence parallelism (--sequence-parallel) or leave the overlap off")
    if not getattr(config, "sequence_parallel", False):
        return spec
    swapped_linears = []

    def swap(module):
        linear = overlapped_linear(module) if tp_overlap else None
        if linear is not None:
            swapped_linears.append(linear)
        return _torch_norm_swap(module) or linear

    block = _get_block_submodules(config, spec, vp_stage=vp_stage, pp_rank=pp_rank)
    layers = [_swap_submodules(layer, swap) for layer in block.layer_specs]
    if tp_overlap and tp > 1 and block.layer_specs and not swapped_linears:
        raise ValueError("the TP overlap runs on megatron-core's local linears (ColumnParallelLinear, "
                         "RowParallelLinear) and this layer spec has none (Transformer Engine's fuse the norm and "
                         "keep their own overlap for fixed shapes): use --transformer-impl local, or leave the "
                         "overlap off")
    final = _torch_norm_swap(block.layer_norm) or block.layer_norm
    if final is block.layer_norm and all(new is old for new, old in zip(layers, block.layer_specs)):
        return spec
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final)
