"""Sliced attention: a MicroPack's slices attend to their documents' earlier slices (design.md 3).

megatron-core's `SelfAttention` projects q/k/v of the *current* tokens, applies RoPE and calls its
core attention. Our core attention (swapped in through the layer spec) then, per slice:
  * reads the K/V of the sample's earlier slices from a per-sample, per-layer `KVStore`,
  * writes its own K/V there as detached leaves that require grad (when a later slice follows),
  * runs a varlen causal kernel with bottom-right alignment over [prefix + slice] keys.
Later slices' backward accumulates dK/dV into those leaves' `.grad`; `_InjectKVGrad` adds them to
the slice's own K/V gradient when the slice itself runs backward, then frees the entry.

The per-MicroPack metadata travels in `SlicedSeqParams`, a `PackedSeqParams` describing the
current tokens only (cu_seqlens_q == cu_seqlens_kv, so megatron's RoPE and reshapes stay right)
plus the slices' sample ids, starts, the store and the kernel's own kv lengths.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

BACKENDS = ("te", "flash", "torch")  # fastest first
_PACKAGE_OF = {"te": "transformer_engine", "flash": "flash_attn"}
_INSTALL_HINT = {"te": "pip install transformer-engine[pytorch]", "flash": "pip install flash-attn --no-build-isolation"}


class BackendUnavailable(RuntimeError):
    """An attention backend was requested that this machine cannot run."""


# ---- KV store ------------------------------------------------------------------------------
@dataclass
class KVEntry:
    """K/V of one finished slice in one layer: leaves whose .grad collects later slices' dK/dV."""

    key: Tensor
    value: Tensor

    @property
    def length(self) -> int:
        return self.key.shape[0]


class KVStore:
    """K/V of slices whose later slices are still pending, by (sample, layer), in slice order."""

    def __init__(self):
        self._entries: dict[tuple[int, int], dict[int, KVEntry]] = {}

    def prefix(self, sample_id: int, layer: int, before: Optional[int] = None) -> list[KVEntry]:
        """The sample's stored slices in this layer (those starting before `before`, if given)."""
        slices = self._entries.get((sample_id, layer), {})
        return [entry for start, entry in slices.items() if before is None or start < before]

    def put(self, sample_id: int, layer: int, start: int, key: Tensor, value: Tensor) -> KVEntry:
        """Store a slice's K/V as leaves; idempotent: a forward re-run under activation recompute
        gets the entry of the first run back, with the gradients later slices accumulated in it."""
        slices = self._entries.setdefault((sample_id, layer), {})
        if start not in slices:
            slices[start] = KVEntry(key.detach().requires_grad_(), value.detach().requires_grad_())
        return slices[start]

    def free(self, sample_id: int, layer: int, start: int) -> None:
        slices = self._entries.get((sample_id, layer), {})
        slices.pop(start, None)
        if not slices:
            self._entries.pop((sample_id, layer), None)

    def clear(self) -> None:
        self._entries.clear()

    def sample_ids(self) -> set[int]:
        """Samples with K/V held."""
        return {sample_id for sample_id, _ in self._entries}

    def discard(self, sample_ids) -> None:
        """Drop every entry of these samples (after a forward-only pass)."""
        wanted = set(sample_ids)
        for key in [key for key in self._entries if key[0] in wanted]:
            del self._entries[key]

    def __len__(self) -> int:
        return sum(len(slices) for slices in self._entries.values())

    def nbytes(self) -> int:
        """Bytes of the stored K/V and of their accumulated gradients."""
        total = 0
        for slices in self._entries.values():
            for entry in slices.values():
                for leaf in (entry.key, entry.value):
                    total += leaf.numel() * leaf.element_size() * (1 + (leaf.grad is not None))
        return total


def slice_prefix(store: "KVStore | None", sample_id: int, layer: int, start: int) -> list[KVEntry]:
    """The K/V of a slice's earlier slices; refuses a slice whose earlier slices are missing."""
    prefix = store.prefix(sample_id, layer, before=start) if store is not None else []
    held = sum(entry.length for entry in prefix)
    if held != start:
        raise RuntimeError(
            f"slice [{start}, ...) of sample {sample_id} in layer {layer} found {held} prefix tokens in "
            "the KV store: its earlier slices must run forward first (and not be freed yet)"
        )
    return prefix


@dataclass
class SlicedSeqParams(PackedSeqParams):
    """THD metadata of one MicroPack: the standard fields describe its current tokens; the
    extra fields say which slice each segment is and where its K/V prefix lives."""

    sample_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    keeps_kv: list[bool] = field(default_factory=list)  # a later slice of the sample follows
    kv_store: Optional[KVStore] = None
    cu_seqlens_attn_kv: Optional[Tensor] = None  # prefix + slice per segment: the kernel's keys
    max_seqlen_attn_kv: Optional[int] = None
    # DP-Merge (context_parallel.py): the current tokens are this member's share of the
    # MicroPack; their absolute positions, and how the shares fit together.
    token_positions: Optional[Tensor] = None
    cp: Optional[object] = None  # context_parallel.CPLayout

    def __post_init__(self):
        if not (len(self.sample_ids) == len(self.starts) == len(self.keeps_kv)):
            raise ValueError("SlicedSeqParams: sample_ids, starts and keeps_kv must have one entry per slice")


# ---- gradient hand-off ---------------------------------------------------------------------
class _InjectKVGrad(torch.autograd.Function):
    """Identity on (k, v); in backward adds the dK/dV that later slices accumulated in the
    stored leaves (complete by then: backward runs chains in reverse), then frees the entries."""

    @staticmethod
    def forward(ctx, key, value, store, layer, owners):
        # owners: [(row_begin, row_end, sample_id, start, entry)] for the slices that stored K/V
        ctx.store, ctx.layer, ctx.owners = store, layer, owners
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        owners, ctx.owners = ctx.owners, []
        # Out of place: autograd may hand the same buffer to other consumers.
        grad_key, grad_value = grad_key.clone(), grad_value.clone()
        for begin, end, sample_id, start, entry in owners:
            if entry.key.grad is not None:
                grad_key[begin:end] += entry.key.grad
            if entry.value.grad is not None:
                grad_value[begin:end] += entry.value.grad
            ctx.store.free(sample_id, ctx.layer, start)
        return grad_key, grad_value, None, None, None


# ---- kernels: packed q [Tq, H, D], k/v [Tk, G, D] -> [Tq, H, D], bottom-right causal --------
Kernel = Callable[..., Tensor]


def segment_attention(qs: Tensor, ks: Tensor, vs: Tensor, mask: Tensor | None, scale, dropout_p: float) -> Tensor:
    """One segment's queries [Tq, H, D] against its keys/values [Tk, G, D] with torch SDPA; no
    mask means plain causal. Inputs go in as [1, H, T, D]: on CPU only 4-D inputs reach the fused
    flash kernel (3-D ones take the math path: ~4x slower and it saves the Tq x Tk probabilities)."""
    def heads_first(x: Tensor) -> Tensor:
        return x.transpose(0, 1).unsqueeze(0)

    out = F.scaled_dot_product_attention(
        heads_first(qs), heads_first(ks), heads_first(vs), attn_mask=mask, is_causal=mask is None,
        dropout_p=dropout_p, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, dropout_p):
    """Reference: one scaled_dot_product_attention per segment (CPU and tests)."""
    bounds_q, bounds_kv = cu_q.tolist(), cu_kv.tolist()
    outputs = []
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i]:bounds_q[i + 1]]
        ks, vs = k[bounds_kv[i]:bounds_kv[i + 1]], v[bounds_kv[i]:bounds_kv[i + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        # Bottom-right: query i sees keys [0, i + lk - lq]; with no prefix this is plain causal.
        mask = None if lq == lk else torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        outputs.append(segment_attention(qs, ks, vs, mask, scale, dropout_p))
    return torch.cat(outputs)


def flash_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, dropout_p):
    """flash-attn 2: `causal=True` is bottom-right aligned since 2.1; GQA native."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q.to(torch.int32), cu_kv.to(torch.int32), max_q, max_kv,
        dropout_p=dropout_p, softmax_scale=scale, causal=True,
    )


KERNELS: dict[str, Kernel] = {"torch": torch_kernel, "flash": flash_kernel}


# ---- the core attention --------------------------------------------------------------------
class SlicedAttentionMixin:
    """Backend-independent part: segments, KV prefix look-up/storage, gradient hand-off.
    A backend class provides `_attend(q, k, v, cu_q, cu_kv, max_q, max_kv) -> [Tq, H*D]`."""

    layer_number: int

    def forward(
        self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
        packed_seq_params=None, **unused,
    ):
        if attention_bias is not None:
            raise NotImplementedError("sliced attention does not support an attention bias")
        if isinstance(packed_seq_params, SlicedSeqParams):
            return self._sliced(query, key, value, packed_seq_params)
        if packed_seq_params is not None:  # stock THD packing: whole sequences, causal
            cu = packed_seq_params.cu_seqlens_q
            return self._attend(query, key, value, cu, cu, packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_q)
        # sbhd [s, b, h, d]: every batch row is one causal sequence (the mask is assumed causal)
        s, b = query.shape[:2]
        to_thd = lambda x: x.transpose(0, 1).reshape(b * s, *x.shape[2:])  # noqa: E731
        cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        out = self._attend(to_thd(query), to_thd(key), to_thd(value), cu, cu, s, s)
        return out.view(b, s, -1).transpose(0, 1).contiguous()

    def _attend_positions(self, q, k, v, cu_q, cu_kv, q_positions, runs=None):
        """Local queries at arbitrary absolute positions against natural-order keys (DP-Merge):
        runs of consecutive positions through this backend's bottom-right causal kernel."""
        from .context_parallel import PositionRuns, runs_attention

        runs = runs if runs is not None else PositionRuns.of(cu_q, cu_kv, q_positions)
        return runs_attention(self._attend, q, k, v, runs)

    def _sliced(self, query: Tensor, key: Tensor, value: Tensor, params: SlicedSeqParams) -> Tensor:
        if params.cp is not None:  # a merged MicroPack: this member's token share
            from .context_parallel import cp_sliced_attention

            return cp_sliced_attention(self, query, key, value, params)
        store, layer = params.kv_store, self.layer_number
        bounds = params.cu_seqlens_q.tolist()
        owners, keys, values = [], [], []
        for i, (sample_id, start) in enumerate(zip(params.sample_ids, params.starts)):
            begin, end = bounds[i], bounds[i + 1]
            prefix = slice_prefix(store, sample_id, layer, start)
            keys += [entry.key for entry in prefix]
            values += [entry.value for entry in prefix]
            if params.keeps_kv[i]:
                entry = store.put(sample_id, layer, start, key[begin:end], value[begin:end])
                owners.append((begin, end, sample_id, start, entry))
            keys.append((begin, end))
            values.append((begin, end))
        if owners and torch.is_grad_enabled():
            key, value = _InjectKVGrad.apply(key, value, store, layer, owners)
        if len(keys) == len(bounds) - 1:  # no prefixes anywhere: the kernel reads k/v as they are
            packed_key, packed_value = key, value
        else:
            packed_key = torch.cat([key[p[0]:p[1]] if isinstance(p, tuple) else p for p in keys])
            packed_value = torch.cat([value[p[0]:p[1]] if isinstance(p, tuple) else p for p in values])
        cu_kv = params.cu_seqlens_attn_kv
        if cu_kv is None:
            raise ValueError("SlicedSeqParams.cu_seqlens_attn_kv is missing (build batches with runtime.batch)")
        return self._attend(query, packed_key, packed_value, params.cu_seqlens_q, cu_kv,
                            params.max_seqlen_q, params.max_seqlen_attn_kv)


class SlicedDotProductAttention(SlicedAttentionMixin, MegatronModule):
    """Core attention for megatron-core's local and TE specs with the torch or flash kernel."""

    def __init__(
        self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
        attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None, pg_collection=None, backend: str = "torch",
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("sliced attention runs with context_parallel_size=1: SlimPack replaces Megatron's "
                                      "context parallelism with slicing and DP-Merge groups (runtime/merge.py)")
        self.layer_number = max(1, layer_number)
        self.kernel = KERNELS[backend]
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _attend(self, q, k, v, cu_q, cu_kv, max_q, max_kv):
        dropout = self.dropout_p if self.training else 0.0
        out = self.kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, self.softmax_scale, dropout)
        return out.reshape(out.shape[0], -1)


# Transformer Engine fused attention (THD, padding_causal_bottom_right): only where TE imports.
try:  # pragma: no cover - needs TE and a GPU
    import transformer_engine  # noqa: F401
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TESlicedDotProductAttention(SlicedAttentionMixin, TEDotProductAttention):
        """TE's fused attention on [prefix + slice] keys. megatron's `AttnMaskType` has no
        bottom-right padding mask, so TE's own forward is called with TE's mask name."""

        def _attend(self, q, k, v, cu_q, cu_kv, max_q, max_kv):
            import transformer_engine.pytorch as te

            out = te.DotProductAttention.forward(
                self, q, k, v, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
                cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_kv=cu_kv.to(torch.int32),
                max_seqlen_q=max_q, max_seqlen_kv=max_kv,
            )
            return out.reshape(out.shape[0], -1)

except ImportError:
    TESlicedDotProductAttention = None


# ---- backend choice and layer spec ---------------------------------------------------------
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def available_backends() -> list[str]:
    """Backends this machine can run, fastest first."""
    gpu = torch.cuda.is_available()
    found = [name for name in ("te", "flash") if gpu and _installed(_PACKAGE_OF[name])]
    if "te" in found and TESlicedDotProductAttention is None:
        found.remove("te")
    return found + ["torch"]


def resolve_backend(backend: str = "auto") -> str:
    """'auto' -> the fastest available; an explicit name is checked, with a clear error."""
    if backend == "auto":
        return available_backends()[0]
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from auto, {', '.join(BACKENDS)}")
    if backend != "torch":
        if not _installed(_PACKAGE_OF[backend]):
            raise BackendUnavailable(
                f"attention backend {backend!r} needs the package {_PACKAGE_OF[backend]!r}: {_INSTALL_HINT[backend]}"
            )
        if not torch.cuda.is_available():
            raise BackendUnavailable(f"attention backend {backend!r} needs a CUDA GPU; use backend='torch' on CPU")
    return backend


def slimpack_layer_spec(
    backend: str = "auto", *, normalization: str = "RMSNorm", qk_layernorm: bool = False,
    use_te_layers: Optional[bool] = None,
) -> ModuleSpec:
    """A megatron-core GPT layer spec whose core attention runs slices with a KV prefix.

    The rest of the layer is megatron's own: the TE spec where TE and a GPU are present
    (`use_te_layers=None`), the local spec otherwise. Use with `model.SlimPackGPTModel` so RoPE
    follows absolute positions.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    backend = resolve_backend(backend)
    if use_te_layers is None:
        use_te_layers = torch.cuda.is_available() and TESlicedDotProductAttention is not None
    if use_te_layers:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    if backend == "te":
        core = ModuleSpec(module=TESlicedDotProductAttention)
    else:
        core = ModuleSpec(module=SlicedDotProductAttention, params={"backend": backend})
    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention
    attention.submodules = dataclasses.replace(attention.submodules, core_attention=core)
    return spec
