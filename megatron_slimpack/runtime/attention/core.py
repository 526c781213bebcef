"""The SlimPack core attention: a MicroPack's slices attend to their documents' earlier slices
(docs/design.md section 3).

megatron-core's `SelfAttention` projects q/k/v of the *current* tokens, applies RoPE and calls its
core attention. Ours (swapped in through the layer spec, `with_sliced_core_attention`) reads each
slice's prefix K/V from the KV store and stores its own (kv_store.py), then runs a bottom-right
causal varlen kernel (kernels.py) over [prefix + slice] keys. A DP-Merge member's share of a
MicroPack takes the context-parallel path (context_parallel.py). The per-MicroPack metadata is a
`SlicedSeqParams` (seq_params.py).

Modules, no cycle: kv_store, kernels, seq_params (leaves) <- batch <- context_parallel <- attention.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, Optional

import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from .backend_probe import probed_backend
from .context_parallel import cp_sliced_attention, runs_attention
from .kernels import (  # noqa: F401  (re-exported: the runtime's public names)
    BACKENDS,
    KERNELS,
    BackendUnavailable,
    NoFusedAttentionBackend,
    UnfusedAttentionError,
    UnsupportedAttentionOption,
    available_backends,
    check_attention_options,
    resolve_backend,
    segment_attention,
    takes_host_bounds,
    takes_option,
    torch_kernel,
)
from .kv_store import KVStore, stored_and_prefixed  # noqa: F401
from .rope import apply_rotary_rows
from .seq_params import PositionRuns, SlicedSeqParams


# ---- the core attention --------------------------------------------------------------------
class SlicedAttentionMixin:
    """Backend-independent part: segments, KV prefix look-up/storage, gradient hand-off.
    A backend class provides `_attend(q, k, v, cu_q, cu_kv, max_q, max_kv, bounds=None) -> [Tq, H*D]`
    (`bounds`: cu_q and cu_kv as host ints, where known)."""

    layer_number: int
    config: Any  # the Megatron TransformerConfig, set by the attention module it is mixed into
    _attend: Callable[..., torch.Tensor]  # the backend's kernel call (above)

    def forward(
        self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
        packed_seq_params=None, **unused,
    ):
        if attention_bias is not None:
            raise NotImplementedError("sliced attention does not support an attention bias")
        if isinstance(packed_seq_params, SlicedSeqParams):
            query, key = self._rotated(query, key, packed_seq_params)
            return self._sliced(query, key, value, packed_seq_params)
        if packed_seq_params is not None:  # stock THD packing: whole sequences, causal
            cu = packed_seq_params.cu_seqlens_q
            return self._attend(query, key, value, cu, cu, packed_seq_params.max_seqlen_q,
                                packed_seq_params.max_seqlen_q)
        # sbhd [s, b, h, d]: every batch row is one causal sequence (the mask is assumed causal)
        s, b = query.shape[:2]

        def to_thd(x):
            return x.transpose(0, 1).reshape(b * s, *x.shape[2:])

        bounds = list(range(0, (b + 1) * s, s))
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        out = self._attend(to_thd(query), to_thd(key), to_thd(value), cu, cu, s, s, bounds=(bounds, bounds))
        return out.view(b, s, -1).transpose(0, 1).contiguous()

    def _rotated(self, query, key, params: SlicedSeqParams):
        """RoPE at the tokens' absolute positions (the model leaves it to us: rope.py)."""
        if params.rotary_freqs is None:
            return query, key
        return apply_rotary_rows(query, params.rotary_freqs, self.config), apply_rotary_rows(
            key, params.rotary_freqs, self.config)

    def _attend_positions(self, q, k, v, cu_q, cu_kv, q_positions, runs=None):
        """Local queries at arbitrary absolute positions against natural-order keys (DP-Merge):
        runs of consecutive positions through this backend's bottom-right causal kernel."""
        runs = runs if runs is not None else PositionRuns.of(cu_q, cu_kv, q_positions)
        return runs_attention(self._attend, q, k, v, runs)

    def _sliced(self, query, key, value, params: SlicedSeqParams):
        if not params.padding:
            return self._sliced_tokens(query, key, value, params)
        # Sequence-parallel padding rows (batch.py) attend to nothing: zeros, no gradient to anyone.
        real = query.shape[0] - params.padding
        out = self._sliced_tokens(query[:real], key[:real], value[:real], params)
        return torch.cat([out, out.new_zeros((params.padding, *out.shape[1:]))])

    def _sliced_tokens(self, query, key, value, params: SlicedSeqParams):
        if params.cp is not None:  # a merged MicroPack: this member's token share
            return cp_sliced_attention(self, query, key, value, params)
        if params.cu_seqlens_attn_kv is None:
            raise ValueError("SlicedSeqParams.cu_seqlens_attn_kv is missing (build batches with runtime.batch)")
        bounds = params.slice_bounds
        keys, values = stored_and_prefixed(params.kv_store, self.layer_number, key, value,
                                           bounds, params.sample_ids, params.starts, params.keeps_kv)
        return self._attend(query, keys, values, params.slice_cu_seqlens, params.cu_seqlens_attn_kv,
                            params.max_seqlen_q, params.max_seqlen_attn_kv, bounds=(bounds, params.attn_kv_bounds))


class SlicedDotProductAttention(SlicedAttentionMixin, MegatronModule):
    """Core attention for megatron-core's local and TE specs with the torch or flash kernel."""

    def __init__(
        self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
        attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None, pg_collection=None, backend: str = "torch",
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("sliced attention runs with context_parallel_size=1: SlimPack replaces "
                                      "Megatron's context parallelism with slicing and DP-Merge groups "
                                      "(runtime/pipeline/merge.py)")
        check_attention_options(config)
        self.layer_number = max(1, layer_number)
        self.kernel = KERNELS[backend]
        self.kernel_options: Optional[dict] = {"bounds": None} if takes_host_bounds(self.kernel) else None
        # Megatron's --deterministic-mode reaches the kernels that take it (flash-attn's backward).
        if getattr(config, "deterministic_mode", False) and takes_option(self.kernel, "deterministic"):
            self.kernel_options = dict(self.kernel_options or {}, deterministic=True)
        # The scale megatron-core's attention passes (TransformerConfig.softmax_scale), else 1/sqrt(d).
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _attend(self, q, k, v, cu_q, cu_kv, max_q, max_kv, bounds=None):
        dropout = self.dropout_p if self.training else 0.0
        options = dict(self.kernel_options) if self.kernel_options is not None else {}
        if "bounds" in options:
            options["bounds"] = bounds
        # Attention dropout draws from Megatron's model-parallel RNG stream (as its own core
        # attention does): each TP rank holds other heads, so their masks must differ.
        with get_cuda_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext():
            out = self.kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, self.softmax_scale, dropout, **options)
        return out.reshape(out.shape[0], -1)


def refuse_unfused_attention(module) -> None:
    """Make a Transformer Engine `DotProductAttention` raise `UnfusedAttentionError` instead of
    running its unfused backend (TE calls it as the submodule `unfused_attention`; from TE 2.11 it
    takes THD inputs and allocates heads x Tq x Tk scores: ~1 TB at 256K tokens)."""
    unfused = getattr(module, "unfused_attention", None)
    if not isinstance(unfused, torch.nn.Module):
        return

    def refuse(*_):
        raise UnfusedAttentionError(
            "Transformer Engine chose its unfused attention for the sliced THD attention (neither its cuDNN "
            "fused nor its flash backend accepted this shape); it would allocate the full query x key score "
            "matrix. Install cuDNN >= 9.6 (sm90+) or flash-attn >= 2.1, or run with the 'flash' attention "
            "backend")

    unfused.register_forward_pre_hook(refuse)


# Transformer Engine fused attention (THD, padding_causal_bottom_right): only where TE imports.
try:  # pragma: no cover - needs TE and a GPU
    import transformer_engine  # noqa: F401
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TESlicedDotProductAttention(SlicedAttentionMixin, TEDotProductAttention):
        """TE's fused attention on [prefix + slice] keys. megatron's `AttnMaskType` has no
        bottom-right padding mask, so TE's own forward is called with TE's mask name. The softmax
        scale and TE's deterministic setting reach TE through megatron-core's constructor. TE picks
        its backend per call; its unfused path (the full score matrix) is refused when it would run."""

        def __init__(self, config, *args, **kwargs):
            check_attention_options(config)
            super().__init__(config, *args, **kwargs)
            refuse_unfused_attention(self)

        def _attend(self, q, k, v, cu_q, cu_kv, max_q, max_kv, bounds=None):
            import transformer_engine.pytorch as te

            out = te.DotProductAttention.forward(
                self, q, k, v, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
                cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_kv=cu_kv.to(torch.int32),
                max_seqlen_q=max_q, max_seqlen_kv=max_kv,
            )
            return out.reshape(out.shape[0], -1)

except ImportError:
    TESlicedDotProductAttention = None  # type: ignore[misc,assignment]  # a class only with Transformer Engine


# ---- layer specs ---------------------------------------------------------------------------
def build_core_attention(backend: str, config):
    """One layer's SlimPack core attention of `backend` for `config`, built as the layer spec builds it."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    return build_module(core_attention_spec(backend), config=config, layer_number=1,
                        attn_mask_type=AttnMaskType.causal, attention_type="self")


def _probed_backend(config) -> str:
    """'auto' on a GPU: the fastest fused backend that runs this model's attention
    (backend_probe.py), probed once per shape class and logged; refuses where none does."""
    return probed_backend(config, torch.device("cuda", torch.cuda.current_device()),
                          lambda name: build_core_attention(name, config))


def core_attention_spec(backend: str = "auto", config=None) -> ModuleSpec:
    """The SlimPack core attention for `backend`. 'auto': the fastest this machine runs; on a GPU,
    with the model's `config`, the fastest that passes a start-up probe (backend_probe.py)."""
    if backend == "auto" and config is not None and torch.cuda.is_available():
        backend = _probed_backend(config)
    backend = resolve_backend(backend)
    if backend == "te":
        return ModuleSpec(module=TESlicedDotProductAttention)
    return ModuleSpec(module=SlicedDotProductAttention, params={"backend": backend})


def with_sliced_core_attention(spec, backend: str = "auto", config=None):
    """A copy of `spec` (a layer ModuleSpec, or a block spec with `layer_specs`) whose layers'
    core attention is SlimPack's; everything else in the layers is left as it is. `config`: the
    model's, for the start-up probe of backend 'auto' on a GPU."""
    core = core_attention_spec(backend, config)
    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = getattr(layer.submodules, "self_attention", None)
        if attention is None or not hasattr(attention.submodules, "core_attention"):
            continue
        attention.submodules = dataclasses.replace(attention.submodules, core_attention=core)
    return spec


def slimpack_layer_spec(
    backend: str = "auto", *, normalization: str = "RMSNorm", qk_layernorm: bool = False,
    use_te_layers: Optional[bool] = None, config=None,
) -> ModuleSpec:
    """A megatron-core GPT layer spec whose core attention runs slices with a KV prefix.

    The rest of the layer is megatron's own: the TE spec where TE and a GPU are present
    (`use_te_layers=None`), the local spec otherwise. Use with `model.SlimPackGPTModel` so RoPE
    follows absolute positions.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te_layers is None:
        use_te_layers = torch.cuda.is_available() and TESlicedDotProductAttention is not None
    if use_te_layers:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    return with_sliced_core_attention(spec, backend, config)
