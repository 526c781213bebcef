"""Time and memory of MicroPacks on one pipeline stage (docs/design.md section 4).

A MicroPack's work is summarised by two numbers: its tokens `T` and its causal attention pairs
`A` (each slice's queries against its KV prefix and itself). Linear layers scale with T,
attention with A and, for the kernel's per-row work, with T: both sums over the MicroPack's
documents, so a pack of short documents is priced at the short documents' attention rate. The
analytic model turns FLOPs into seconds with the kernel speeds of `kernels.py` (GEMMs by shape,
attention by backend, element-wise work by memory bandwidth); the profiled model
(`CostModel.from_profile`) uses per-layer coefficients fitted on this device
by `slimpack profile`. Both share the memory and communication terms and the same interface, so
the planner and simulator never know which one they hold.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import TypeVar

import numpy as np

from ..errors import SlimPackError
from ..specs import (
    GIB,
    HardwareSpec,
    ModelSpec,
    ParallelConfig,
    get_hardware,
    get_model,
    hardware_from_dict,
    model_from_dict,
)
from .kernels import ELEMENTWISE_BANDWIDTH_SHARE, KERNEL_PROFILE_FORMAT, KernelRates, PublishedTable, kernel_rates
from .overlaps import SERIAL, Overlaps

# A token or pair count, or an array of them: the formulas work elementwise, and the planner prices
# whole tables of MicroPacks at once. A figure that does not depend on the counts stays a scalar.
Amount = TypeVar("Amount", float, np.ndarray)

# Backward/forward FLOP ratios: linear layers 2x (input and weight gradients); FlashAttention's
# backward recomputes the scores, 2.5x (five matmuls against two).
LINEAR_BACKWARD_RATIO = 2.0
ATTENTION_BACKWARD_RATIO = 2.5
# Tensor-parallel collectives per layer with sequence parallelism (each moving one [T, h]
# activation): forward all-gathers the input of the QKV and fc1 GEMMs and reduce-scatters the
# outputs of the out-projection and fc2; backward reduce-scatters the two input gradients,
# all-gathers the two output gradients, and all-gathers both inputs again for the weight
# gradients (Megatron keeps only the sequence-parallel shard).
TP_COLLECTIVES_FORWARD = 4
TP_COLLECTIVES_BACKWARD = 6
# The MLP's share of the forward's: the all-gather of fc1's input and the reduce-scatter of fc2's
# output, re-run by MLP recompute (the checkpoint holds the sequence-parallel shard of its input).
TP_COLLECTIVES_MLP_FORWARD = 2
# megatron's RotaryEmbedding caches its table per requested length; the runtime asks for a power
# of two, so the tables of every size up to the longest hold at most twice its rows.
ROPE_TABLE_COPIES = 2


@dataclass(frozen=True)
class TimeCoefficients:
    """Seconds for one transformer layer on one device: c0 + c_tok*T + c_pair*A."""

    c0: float
    per_token: float
    per_pair: float

    def __call__(self, tokens: float, pairs: float) -> float:
        return self.c0 + self.per_token * tokens + self.per_pair * pairs


@dataclass(frozen=True)
class ActivationCoefficients:
    """Bytes one layer keeps for backward per MicroPack, before TP/CP division:
    per_token*T + per_pair*A + per_prefix_token*P (P: KV-prefix tokens the MicroPack reads).
    `per_model_token` is paid once on the last stage (final norm, output-layer input)."""

    per_token: float
    per_pair: float
    per_prefix_token: float = 0.0
    per_model_token: float = 0.0
    per_masked_entry: float = 0.0  # per (query, key) entry of a slice with a KV prefix (an explicit mask)


def analytic_activation(model: ModelSpec, dtype_bytes: int, attention_backend: str) -> ActivationCoefficients:
    """Tensors one Llama layer saves for backward, itemised (h hidden, kv K/V width, f ffn, d head).

    Fused GPU path (TE / flash-attn): norm inputs and rstd (2h + 2), the QKV output (h + 2kv), the
    attention output (h, also the out-projection input), the MLP input after norm (h), the fc1
    output (2f for SwiGLU) and the SwiGLU output (f); the kernel keeps no score matrix.
    Torch reference path (4-D SDPA, which reaches torch's fused CPU flash kernel; measured with
    saved_tensors_hooks on megatron-core 0.16.1's local spec): the first torch RMSNorm keeps x, rstd
    and its output, the input of linear_qkv (3h + 1); RoPE cos/sin for q and k (4d); SDPA keeps the
    rotated q (h), k (kv), the QKV output storage that v views (h + 2kv), its output (h) and the
    log-sum-exp per head; linear_proj's input, the second norm and linear_fc1's input (4h + 1); fc1's
    output and SwiGLU's (fc1 + 3f). A slice with a KV prefix also keeps the concatenated K and V
    (2kv per key); its blockwise attention (prefix block and causal block combined by log-sum-exp)
    keeps no query x key mask, so `per_masked_entry` is 0 (a profile may still fit one).
    """
    h, kv, f, d = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size, model.head_dim
    fc1 = 2 * f if model.swiglu else f
    # Every backend: a slice with a KV prefix concatenates the prefix's K and V with its own
    # (torch.cat), and the kernel saves the concatenation for backward.
    per_prefix_token = 2 * kv * dtype_bytes
    if attention_backend == "torch":
        per_token = ((3 * h + 1) + 4 * d + (h + kv + h + 2 * kv + h + model.num_attention_heads) + (4 * h + 1)
                     + fc1 + 3 * f)
        return ActivationCoefficients(per_token * dtype_bytes, 0.0, per_prefix_token, (3 * h + 1) * dtype_bytes,
                                      per_masked_entry=0.0)
    # ... plus the rotated q and k the kernel saves (h + kv): the runtime's RoPE writes new tensors.
    per_token = (2 * h + 2) + (h + 2 * kv) + (h + kv) + h + h + fc1 + f
    return ActivationCoefficients(per_token * dtype_bytes, 0.0, per_prefix_token, (2 * h + 1) * dtype_bytes)


def mlp_saved_bytes_per_token(model: ModelSpec, dtype_bytes: int, attention_backend: str) -> float:
    """The MLP's share of `analytic_activation`'s per-token bytes beyond its input: fc1's output
    and the activation's (SwiGLU: 2f and f on the fused path; the torch path's itemisation, fc1 + 3f)."""
    f = model.ffn_hidden_size
    fc1 = 2 * f if model.swiglu else f
    return float((fc1 + (3 * f if attention_backend == "torch" else f)) * dtype_bytes)


REGENERATE_PROFILE = "regenerate it with `slimpack profile --out FILE`"
# What `to_profile_dict` writes and `from_profile` needs.
PROFILE_KEYS = ("model", "hardware", "dtype_bytes", "attention_backend", "forward", "backward", "head_forward",
                "head_backward", "activation")


class ProfileError(SlimPackError):
    """A cost-model profile that cannot be loaded: missing, not JSON, or not a `slimpack profile` file."""


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _profile_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"cost-model profile {path} does not exist; create it with `slimpack profile`") from None
    except IsADirectoryError:
        raise ProfileError(f"cost-model profile {path} is a directory; give the JSON file "
                           "`slimpack profile --out FILE` wrote") from None
    except UnicodeDecodeError:
        raise ProfileError(f"cost-model profile {path} is not a text file (not UTF-8), so not JSON; "
                           f"{REGENERATE_PROFILE}") from None
    except OSError as error:
        raise ProfileError(f"cost-model profile {path} cannot be read: {error.strerror or error}") from None


def _profile_object(path: Path) -> dict:
    """The JSON object a profile file holds (`ProfileError` for anything else)."""
    try:
        data = json.loads(_profile_text(path))
    except json.JSONDecodeError as error:
        raise ProfileError(f"cost-model profile {path} is not JSON ({error.msg} at line {error.lineno} "
                           f"column {error.colno}); {REGENERATE_PROFILE}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"cost-model profile {path} holds a JSON {type(data).__name__}, not a profile object; "
                           f"{REGENERATE_PROFILE}")
    return data


def is_kernel_profile(data: dict) -> bool:
    return data.get("format") == KERNEL_PROFILE_FORMAT


def read_profile(path: str | Path) -> dict:
    """The JSON object of a `slimpack profile` file, its top-level keys checked (`ProfileError` otherwise)."""
    path = Path(path)
    data = _profile_object(path)
    if is_kernel_profile(data):
        raise ProfileError(f"{path} is a kernel profile (`slimpack profile --kernels`): it holds kernel speeds, not "
                           "a model's coefficients; load it with `CostModel.load(path, model, hardware)`")
    missing = [key for key in PROFILE_KEYS if key not in data]
    if missing:
        raise ProfileError(f"cost-model profile {path} lacks {', '.join(missing)}: not a `slimpack profile` file; "
                           f"{REGENERATE_PROFILE}")
    return data


def read_kernel_profile(path: str | Path, data: dict | None = None) -> tuple[PublishedTable, ...]:
    """The measured tables of a `slimpack profile --kernels` file (`ProfileError` naming the problem);
    `data`: its JSON object, where already read."""
    path = Path(path)
    data = _profile_object(path) if data is None else data
    regenerate = "regenerate it with `slimpack profile --kernels --out FILE`"
    if not is_kernel_profile(data):
        raise ProfileError(f"{path} is not a kernel profile (no \"format\": \"{KERNEL_PROFILE_FORMAT}\"); "
                           f"{regenerate}")
    tables = data.get("tables")
    if not isinstance(tables, list) or not tables:
        raise ProfileError(f"kernel profile {path} has no tables; {regenerate}")
    parsed = []
    for index, table in enumerate(tables):
        try:
            parsed.append(PublishedTable.from_dict(table))
        except (TypeError, ValueError, KeyError) as error:
            raise ProfileError(f"kernel profile {path}: table {index} {_first_line(error)}; {regenerate}") from None
    return tuple(parsed)


def _profile_section(data: dict, key: str) -> dict:
    """One object of a profile (its coefficients, or the model/hardware spec)."""
    section = data[key]
    if not isinstance(section, dict):
        shown = "null" if section is None else f"a JSON {type(section).__name__}"
        raise ValueError(f"{key!r} is {shown}, not an object of fitted values")
    return section


def _profile_coefficients(data: dict, key: str, kind: type):
    """A `TimeCoefficients` / `ActivationCoefficients` from the profile's object `key`: every
    value a finite number, none missing (those with defaults may be left out), none unknown."""
    section = _profile_section(data, key)
    expected = {item.name: item.default is MISSING for item in fields(kind)}
    missing = [name for name, required in expected.items() if required and name not in section]
    unknown = [name for name in section if name not in expected]
    if missing or unknown:
        problems = ([f"lacks {', '.join(missing)}"] if missing else []) + \
                   ([f"has unknown {', '.join(unknown)}"] if unknown else [])
        raise ValueError(f"{key!r} {' and '.join(problems)}")
    for name, value in section.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{key}.{name} is {value!r}, not a finite number")
    return kind(**section)


class CostModel:
    """Forward/backward time, p2p and DP-reduction time, and memory, per pipeline stage."""

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        *,
        dtype_bytes: int = 2,
        attention_backend: str = "te",
        forward: TimeCoefficients | None = None,
        backward: TimeCoefficients | None = None,
        head_forward: TimeCoefficients | None = None,
        head_backward: TimeCoefficients | None = None,
        activation: ActivationCoefficients | None = None,
        source: str = "analytic",
        reference: dict | None = None,
        kernel_tables: tuple[PublishedTable, ...] = (),
    ):
        self.model = model
        self.hardware = hardware
        self.dtype_bytes = dtype_bytes
        self.attention_backend = attention_backend
        self.profiled_forward = forward
        self.profiled_backward = backward
        self.profiled_head_forward = head_forward
        self.profiled_head_backward = head_backward
        # profiled models: {"tokens", "layers", "seconds"} of profiler.reference_seconds at profiling time
        self.reference = reference
        self.activation = activation or analytic_activation(model, dtype_bytes, attention_backend)
        self.source = source
        self.kernels: KernelRates = kernel_rates(hardware.kernels, hardware.peak_flops, hardware.max_efficiency,
                                                 hardware.half_efficiency_tokens)
        # Measured kernel speeds (`slimpack profile --kernels`) replace the tables they measure.
        self.kernel_tables = tuple(kernel_tables)
        if self.kernel_tables:
            self.kernels = self.kernels.with_measured(self.kernel_tables, source)
        self.overlaps: Overlaps = SERIAL
        self._by_overlaps: dict[Overlaps, CostModel] = {SERIAL: self}

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def analytic(cls, model: str | ModelSpec, hardware: str | HardwareSpec, **options) -> "CostModel":
        model = get_model(model) if isinstance(model, str) else model
        hardware = get_hardware(hardware) if isinstance(hardware, str) else hardware
        return cls(model, hardware, **options)

    @classmethod
    def load(cls, cost_model: str | Path, model: str | ModelSpec, hardware: str | HardwareSpec,
             **options) -> "CostModel":
        """What a `--cost-model` value names: "analytic" (the analytic model of `model` on
        `hardware`), a kernel profile (`slimpack profile --kernels`: that analytic model with the
        measured kernel speeds in place of the tables they measure) or a model profile
        (`slimpack profile`: its own model and hardware, which then win over the arguments)."""
        if str(cost_model) == "analytic":
            return cls.analytic(model, hardware, **options)
        path = Path(cost_model)
        data = _profile_object(path)
        if is_kernel_profile(data):
            return cls.analytic(model, hardware, kernel_tables=read_kernel_profile(path, data),
                                source=f"analytic with kernels measured in {path}", **options)
        return cls.from_profile(path)

    @classmethod
    def from_profile(cls, path: str | Path) -> "CostModel":
        """Load coefficients written by `slimpack profile` (see `to_profile_dict`). A file that is
        missing, not JSON or not such a profile raises `ProfileError`, naming the file and the problem."""
        data = read_profile(path)
        try:
            return cls(
                model_from_dict(_profile_section(data, "model")),
                hardware_from_dict(_profile_section(data, "hardware")),
                dtype_bytes=int(data["dtype_bytes"]),
                attention_backend=data["attention_backend"],
                forward=_profile_coefficients(data, "forward", TimeCoefficients),
                backward=_profile_coefficients(data, "backward", TimeCoefficients),
                head_forward=_profile_coefficients(data, "head_forward", TimeCoefficients),
                head_backward=_profile_coefficients(data, "head_backward", TimeCoefficients),
                activation=_profile_coefficients(data, "activation", ActivationCoefficients),
                source=f"profile:{path}",
                reference=data.get("reference"),
                kernel_tables=tuple(PublishedTable.from_dict(t) for t in data.get("kernel_tables", [])),
            )
        except (TypeError, ValueError) as error:  # a section with missing, unknown or non-numeric fields
            raise ProfileError(f"cost-model profile {path} is malformed: {_first_line(error)}; "
                               f"{REGENERATE_PROFILE}") from None

    def to_profile_dict(self) -> dict:
        def coefficients(value):
            return asdict(value) if value is not None else None

        return {
            "model": self.model.to_dict(),
            "hardware": self.hardware.to_dict(),
            "dtype_bytes": self.dtype_bytes,
            "attention_backend": self.attention_backend,
            "forward": coefficients(self.profiled_forward),
            "backward": coefficients(self.profiled_backward),
            "head_forward": coefficients(self.profiled_head_forward),
            "head_backward": coefficients(self.profiled_head_backward),
            "activation": asdict(self.activation),
            "reference": self.reference,
            "kernel_tables": [table.to_dict() for table in self.kernel_tables],
        }

    def describe(self) -> dict:
        return {"model": self.model.name, "hardware": self.hardware.name, "source": self.source}

    def with_overlaps(self, overlaps: Overlaps) -> "CostModel":
        """This model pricing communication as a run with `overlaps` does (one object per overlap
        set, so the simulator's per-model lookups stay shared)."""
        if overlaps == self.overlaps:
            return self
        base = self._by_overlaps[SERIAL]
        if overlaps not in base._by_overlaps:
            view = copy.copy(base)
            view.overlaps = overlaps
            base._by_overlaps[overlaps] = view
        return base._by_overlaps[overlaps]

    # ---- compute time ------------------------------------------------------------------------
    def pack_half_tokens(self, parallel: ParallelConfig) -> float:
        """MicroPack tokens at which the per-token cost of its GEMMs is twice the asymptote's
        (their rows cost `(rows + half_dim)`; a device holds 1/cp of the rows). Zero for a profiled
        model (its intercept carries the per-pack cost)."""
        if self.profiled_forward is not None:
            return 0.0
        return self.kernels.gemm.half_dim * parallel.cp

    def layers_per_stage(self, parallel: ParallelConfig) -> int:
        """Layers of one model chunk: a pipeline stage's, or with virtual stages (vpp > 1) one of
        its vpp chunks'. Every time and activation figure below is per chunk; a rank's
        parameters hold all of its chunks (`stage_params`)."""
        return self.model.num_layers // parallel.virtual_stages

    def gemm_shapes(self, parallel: ParallelConfig) -> list[tuple[int, int]]:
        """(output, input) widths on one device of a layer's forward GEMMs: QKV, out-projection,
        fc1, fc2 (tensor parallelism splits one of the two)."""
        m, t = self.model, parallel.tp
        h, kv, f = m.hidden_size, m.kv_hidden_size, m.ffn_hidden_size
        fc1 = 2 * f if m.swiglu else f
        return [((h + 2 * kv) // t, h), (h, h // t), (fc1 // t, h), (h, f // t)]

    def gemm_time(self, tokens: Amount, parallel: ParallelConfig, mlp_only: bool = False) -> Amount:
        """Forward seconds of one layer's GEMMs for `tokens` rows on one device (`mlp_only`: fc1
        and fc2, what MLP recompute re-runs)."""
        gemm = self.kernels.gemm
        shapes = self.gemm_shapes(parallel)[2:] if mlp_only else self.gemm_shapes(parallel)
        seconds = sum(gemm.seconds(tokens, n, k) for n, k in shapes)
        return seconds / self.hardware.sustained_compute_share

    def mlp_forward_time(self, tokens: float, parallel: ParallelConfig) -> float:
        """What `--recompute-modules mlp` re-runs in a layer's backward: the MLP block's forward
        (fc1, the activation, fc2; its TP collectives are counted in `tp_comm_time`)."""
        local = tokens / parallel.cp
        if self.profiled_forward is not None:  # no itemised GEMMs: the MLP's share of the layer's token term
            return self.profiled_forward.per_token * local / parallel.tp * self._mlp_flop_share()
        f = self.model.ffn_hidden_size
        activation = (3 * f if self.model.swiglu else 2 * f) * local * self.dtype_bytes / parallel.tp
        elementwise = (activation / (self.hardware.memory_bandwidth * ELEMENTWISE_BANDWIDTH_SHARE)
                       if self.hardware.memory_bandwidth else 0.0)
        return self.gemm_time(local, parallel, mlp_only=True) + elementwise

    def _mlp_flop_share(self) -> float:
        shapes = self.gemm_shapes(ParallelConfig())
        return sum(n * k for n, k in shapes[2:]) / sum(n * k for n, k in shapes)

    def elementwise_time(self, tokens: Amount, parallel: ParallelConfig, backward: bool) -> Amount:
        """Memory-bound work of one layer: two norms and two residual adds (read and write [T, h]),
        RoPE of q and k, the MLP activation (SwiGLU reads 2f, writes f; GELU f and f). Backward
        moves about twice the bytes. Zero where the device has no bandwidth figure."""
        if not self.hardware.memory_bandwidth:
            return 0.0 * tokens
        m = self.model
        h, kv, f = m.hidden_size, m.kv_hidden_size, m.ffn_hidden_size
        elements = 4 * h + 6 * h + 2 * (h + kv) + (3 * f if m.swiglu else 2 * f)
        nbytes = tokens * elements * self.dtype_bytes / parallel.tp * (2.0 if backward else 1.0)
        return nbytes / (self.hardware.memory_bandwidth * ELEMENTWISE_BANDWIDTH_SHARE)

    def attention_time(self, tokens: float, pairs: float, parallel: ParallelConfig, backward: bool) -> float:
        """Seconds of one layer's core attention on one device: its share of the heads (TP) and of
        every document's pairs and rows (CP), at the attention backend's rate."""
        local_tokens, local_pairs = tokens / parallel.cp, pairs / parallel.cp
        profiled = self.profiled_backward if backward else self.profiled_forward
        if profiled is not None:
            return (profiled(local_tokens / parallel.tp, local_pairs / parallel.tp)
                    - profiled(local_tokens / parallel.tp, 0.0 * local_pairs))
        rate = self.kernels.attention(self.attention_backend, backward)
        flops_per_pair = 4.0 * self.model.hidden_size / parallel.tp * (ATTENTION_BACKWARD_RATIO if backward else 1.0)
        return rate.seconds(flops_per_pair, local_pairs, local_tokens) / self.hardware.sustained_compute_share

    def _layer_flops(self, tokens: float, pairs: float) -> tuple[float, float]:
        """(linear, attention) forward FLOPs of one layer."""
        return 2.0 * tokens * self.model.params_per_layer, 4.0 * pairs * self.model.hidden_size

    def layer_time(self, tokens: float, pairs: float, parallel: ParallelConfig, backward: bool) -> float:
        """Compute seconds of one layer on one device (its TP/CP share), communication excluded;
        a backward includes what the recompute mode re-runs."""
        local_tokens = tokens / parallel.cp
        profiled = self.profiled_backward if backward else self.profiled_forward
        if profiled is not None:
            # Coefficients are measured at tp=1, cp=1: the local share scales the token terms.
            base = profiled(local_tokens / parallel.tp, pairs / parallel.cp / parallel.tp)
        else:
            ratio = LINEAR_BACKWARD_RATIO if backward else 1.0
            base = (ratio * self.gemm_time(local_tokens, parallel)
                    + self.attention_time(tokens, pairs, parallel, backward)
                    + self.elementwise_time(local_tokens, parallel, backward))
        return base + self._recompute_time(tokens, pairs, parallel) if backward else base

    def _recompute_time(self, tokens: float, pairs: float, parallel: ParallelConfig) -> float:
        """What Megatron re-runs in a layer's backward: with `--recompute-granularity selective`
        (its default `--recompute-modules core_attn`) the core attention forward, with
        `--recompute-modules core_attn mlp` the MLP's forward too; with full recompute the whole
        layer forward; with block-N that of N of the chunk's layers (per layer: its share)."""
        if parallel.recompute == "none":
            return 0.0
        if parallel.recompute in ("selective", "selective-mlp"):
            attention = self.attention_time(tokens, pairs, parallel, backward=False)
            return attention + (self.mlp_forward_time(tokens, parallel) if parallel.recompute == "selective-mlp"
                                else 0.0)
        return self.whole_layer_share(parallel) * self.layer_time(tokens, pairs, parallel.with_(recompute="none"),
                                                                  backward=False)

    def whole_layer_share(self, parallel: ParallelConfig) -> float:
        """The share of a chunk's layers whose whole forward is recomputed in backward (1 with full
        recompute, N / layers with block-N, 0 otherwise). Figures here are per layer and a chunk's
        are `layers_per_stage` times them, so block-N's layer is priced as this mix of a
        recomputed and a plain one: the chunk's totals are exact."""
        layers = self.layers_per_stage(parallel)
        return parallel.layers_recomputed_whole(layers) / layers

    def head_time(self, tokens: float, parallel: ParallelConfig, backward: bool) -> float:
        """Output layer + loss on the last stage."""
        local = tokens / parallel.cp
        profiled = self.profiled_head_backward if backward else self.profiled_head_forward
        if profiled is not None:
            return profiled(local / parallel.tp, 0.0)
        ratio = LINEAR_BACKWARD_RATIO if backward else 1.0
        gemm = (ratio * self.kernels.gemm.seconds(local, self.model.vocab_size / parallel.tp, self.model.hidden_size)
                / self.hardware.sustained_compute_share)
        if not self.hardware.memory_bandwidth:
            return gemm
        # cross-entropy over fp32 logits: written and read once each way
        logits = 2 * 4.0 * local * self.model.vocab_size / parallel.tp
        return gemm + logits / (self.hardware.memory_bandwidth * ELEMENTWISE_BANDWIDTH_SHARE)

    def tp_comm_time(self, tokens: float, parallel: ParallelConfig, backward: bool) -> float:
        """Seconds of one layer's tensor-parallel collectives, serial (`TP_COLLECTIVES_*`, each an
        all-gather or reduce-scatter of one [T/cp, h] activation; without sequence parallelism
        the same bytes as all-reduces). Full recompute re-runs the forward's in backward."""
        if parallel.tp == 1:
            return 0.0
        t = parallel.tp
        volume = tokens / parallel.cp * self.model.hidden_size * self.dtype_bytes * (t - 1) / t
        collectives = float(TP_COLLECTIVES_BACKWARD if backward else TP_COLLECTIVES_FORWARD)
        if backward and self.whole_layer_share(parallel):
            collectives += self.whole_layer_share(parallel) * TP_COLLECTIVES_FORWARD
        elif backward and parallel.recompute == "selective-mlp":
            collectives += TP_COLLECTIVES_MLP_FORWARD
        bandwidth = self.collective_bandwidth(t, stride=1)
        return collectives * (volume / bandwidth + self.hardware.link_latency_s)

    def exposed_tp_comm_time(self, tokens: float, parallel: ParallelConfig, backward: bool) -> float:
        """The part of `tp_comm_time` a run waits for: all of it, or with TP overlap (userbuffers
        chunk each collective into the GEMM next to it) what outlasts the layer's GEMMs."""
        comm = self.tp_comm_time(tokens, parallel, backward)
        if not self.overlaps.tp_comm or self.profiled_forward is not None:
            return comm
        ratio = LINEAR_BACKWARD_RATIO if backward else 1.0
        return np.maximum(0.0, comm - ratio * self.gemm_time(tokens / parallel.cp, parallel))

    def cp_comm_time(self, tokens: float, parallel: ParallelConfig, backward: bool) -> float:
        """Per layer: all-gather of K and V (forward), reduce-scatter of dK/dV (backward)."""
        if parallel.cp == 1:
            return 0.0
        c = parallel.cp
        volume = 2 * tokens * self.model.kv_hidden_size / parallel.tp * self.dtype_bytes * (c - 1) / c
        bandwidth = self.collective_bandwidth(c, stride=parallel.tp)
        steps = 2 if backward else 1  # backward re-gathers K/V and reduce-scatters their gradients
        return steps * (volume / bandwidth + (c - 1) * self.hardware.link_latency_s)

    def exposed_cp_comm_time(self, tokens: float, pairs: float, parallel: ParallelConfig, backward: bool) -> float:
        """The part of `cp_comm_time` a run waits for: all of it where the runtime gathers K/V
        before attention, or with a ring exchange what outlasts the attention compute."""
        comm = self.cp_comm_time(tokens, parallel, backward)
        if not self.overlaps.cp_exchange:
            return comm
        return np.maximum(0.0, comm - self.attention_time(tokens, pairs, parallel, backward))

    def collective_bandwidth(self, members: int, stride: int) -> float:
        """Per-GPU bus bandwidth of a collective over `members` ranks `stride` apart in Megatron's
        rank order: NVLink inside a node; across nodes the network at that node count, with one
        NIC per member in a node (NCCL runs a ring per NIC), capped by NVLink."""
        hw = self.hardware
        span = members * stride
        if span <= hw.gpus_per_node:
            return hw.intra_node_bandwidth
        per_node = max(1, hw.gpus_per_node // stride)
        nodes = math.ceil(members / per_node)
        return min(hw.intra_node_bandwidth, hw.network_bandwidth(nodes) * min(per_node, members))

    def stage_time(
        self, tokens: float, pairs: float, parallel: ParallelConfig, *, backward: bool, last_stage: bool = False
    ) -> float:
        """Seconds for one MicroPack (or a unit's totals) on one pipeline stage."""
        layers = self.layers_per_stage(parallel)
        per_layer = (
            self.layer_time(tokens, pairs, parallel, backward)
            + self.exposed_tp_comm_time(tokens, parallel, backward)
            + self.exposed_cp_comm_time(tokens, pairs, parallel, backward)
        )
        seconds = layers * per_layer + self.hardware.kernel_overhead_s
        if last_stage:
            seconds += self.head_time(tokens, parallel, backward)
        return seconds

    def stage_times(self, tokens: Amount, pairs: Amount, parallel: ParallelConfig, *,
                    backward: bool) -> tuple[Amount, Amount]:
        """`stage_time` on a middle stage and on the last, the layers' terms computed once (the
        last stage adds the head to the same sum, so both are exactly `stage_time`'s), for one
        MicroPack or elementwise for arrays of them."""
        middle = self.stage_time(tokens, pairs, parallel, backward=backward)  # type: ignore[arg-type]
        return middle, middle + self.head_time(tokens, parallel, backward)  # type: ignore[arg-type,return-value]

    def forward_time(self, tokens: float, pairs: float, parallel: ParallelConfig, last_stage: bool = False) -> float:
        return self.stage_time(tokens, pairs, parallel, backward=False, last_stage=last_stage)

    def backward_time(self, tokens: float, pairs: float, parallel: ParallelConfig, last_stage: bool = False) -> float:
        return self.stage_time(tokens, pairs, parallel, backward=True, last_stage=last_stage)

    def pass_time_bound(self, tokens: float, pairs: float, parallel: ParallelConfig, largest_pack: float) -> float:
        """Fewest seconds the last pipeline stage can spend on the forward and backward of `tokens`
        (with `pairs` attention pairs) cut into packs of at most `largest_pack` tokens. Per-token
        rates only improve with pack size and per-pack costs only add, so tokens / largest_pack
        packs of the largest size are the cheapest split. TP communication counts as far as it is
        exposed; the context-parallel exchange counts where the run waits for all of it (a blocking
        K/V gather: linear in tokens plus a latency per pack, so also cheapest in the largest packs)
        and is left out where a ring hides it behind attention."""
        size = min(tokens, largest_pack)
        packs = tokens / size
        seconds = 0.0
        for backward in (False, True):
            per_layer = (self.layer_time(size, pairs / packs, parallel, backward)
                         + self.exposed_tp_comm_time(size, parallel, backward)
                         + (0.0 if self.overlaps.cp_exchange else self.cp_comm_time(size, parallel, backward)))
            # the rank's layers: all its chunks' with virtual stages
            seconds += (self.layers_per_stage(parallel) * parallel.vpp * per_layer
                        + parallel.vpp * self.hardware.kernel_overhead_s + self.head_time(size, parallel, backward))
        return packs * seconds

    # ---- communication ------------------------------------------------------------------------
    def activation_transfer_bytes(self, tokens: Amount, parallel: ParallelConfig) -> Amount:
        """Bytes one pipeline p2p send moves per device (sequence-parallel: the TP shard)."""
        shard = parallel.tp if parallel.sequence_parallel else 1
        return tokens / parallel.cp * self.model.hidden_size * self.dtype_bytes / shard

    def p2p_time(self, tokens: Amount, parallel: ParallelConfig) -> Amount | float:
        if parallel.pp == 1:
            return 0.0
        # Pipeline neighbours are tp * cp * dp ranks apart in Megatron's order.
        bandwidth = self.collective_bandwidth(2, stride=parallel.tp * parallel.cp * parallel.dp)
        return self.activation_transfer_bytes(tokens, parallel) / bandwidth + self.hardware.link_latency_s

    def gradient_bytes(self, parallel: ParallelConfig) -> float:
        """fp32 gradient bytes of one device's parameter shard (largest stage)."""
        return 4.0 * self.stage_params(parallel) / parallel.tp

    def dp_reduce_time(self, parallel: ParallelConfig) -> float:
        """Seconds of the gradient reduction over dp*cp that a step waits for (the simulator hides
        what overlaps the last backward). With the distributed optimizer (zero1): a reduce-scatter
        of the fp32 gradients, then an all-gather of the bf16 parameters, which Megatron's
        `--overlap-param-gather` hides behind the next step's forward; without it an all-reduce
        (twice the reduce-scatter's volume)."""
        group = parallel.dp * parallel.cp
        if group == 1:
            return 0.0
        bandwidth = self.collective_bandwidth(group, stride=parallel.tp)
        share = (group - 1) / group
        if not parallel.zero1:
            volume = 2.0 * share * self.gradient_bytes(parallel)
            return volume / bandwidth + 2 * (group - 1) * self.hardware.link_latency_s
        volume = share * self.gradient_bytes(parallel)
        if not self.overlaps.param_gather:
            volume += share * self.gradient_bytes(parallel) * self.dtype_bytes / 4.0
        return volume / bandwidth + 2 * (group - 1) * self.hardware.link_latency_s

    # ---- memory ------------------------------------------------------------------------------
    def stage_params(self, parallel: ParallelConfig) -> float:
        """Parameters of the heaviest stage (first or last: embedding or output layer)."""
        layers = self.layers_per_stage(parallel) * parallel.vpp * self.model.params_per_layer
        return layers + self.model.embedding_params + (self.model.hidden_size if parallel.pp == 1 else 0)

    def static_memory_bytes(self, parallel: ParallelConfig) -> float:
        """bf16 weights + fp32 grads + fp32 master weights and Adam moments (ZeRO-1 sharded)."""
        params = self.stage_params(parallel) / parallel.tp
        optimizer = 12.0 * params / (parallel.dp * parallel.cp if parallel.zero1 else 1)
        return params * (self.dtype_bytes + 4.0) + optimizer

    def rope_table_bytes(self, context_length: int) -> float:
        """fp32 [rows, head_dim] rotary tables megatron caches, one per power-of-two size the
        runtime asks for up to the context: at most twice the largest. Held within the memory the
        budget leaves unused (`usable_memory_fraction`), like NCCL's and cuBLAS's buffers."""
        if context_length <= 0:
            return 0.0
        rows = 1 << max(int(context_length) - 1, 0).bit_length()
        return ROPE_TABLE_COPIES * rows * self.model.head_dim * 4.0

    def activation_bytes(
        self, tokens: Amount, pairs: Amount, parallel: ParallelConfig, last_stage: bool = False,
        prefix_tokens: Amount | float = 0.0, masked_entries: Amount | float = 0.0,
    ) -> Amount:
        """Bytes one in-flight MicroPack (or unit) holds on one stage until its backward.
        `prefix_tokens`: KV-prefix tokens its slices read; `masked_entries`: query x key entries of
        its slices that read a prefix (both matter only where the kernel copies keys or keeps a mask)."""
        layers = self.layers_per_stage(parallel)
        shards = activation_shards(parallel)
        whole = self.whole_layer_share(parallel)
        if whole == 1.0:
            per_layer = tokens * self.model.hidden_size * self.dtype_bytes / shards  # layer inputs only
        elif whole:  # block-N: N layers keep their inputs, the others all they save
            per_layer = (whole * self.activation_bytes(tokens, pairs, parallel.with_(recompute="full"))
                         + (1 - whole) * self.activation_bytes(tokens, pairs, parallel.with_(recompute="none"),
                                                               prefix_tokens=prefix_tokens,
                                                               masked_entries=masked_entries)) / layers
        else:
            # Selective recompute (core_attn) checkpoints the core attention: its inputs stay (q, k,
            # v are saved by the checkpoint, its output by the out-projection), what the kernel
            # alone saves goes: the K/V concatenated with a prefix, and a dense mask where one is built.
            # With mlp as well, the MLP's checkpoint keeps its input (the norm's output) and frees
            # what fc1 and the activation saved.
            selective = parallel.recompute in ("selective", "selective-mlp")
            per_token = self.activation.per_token - (self.mlp_saved_bytes_per_token
                                                     if parallel.recompute == "selective-mlp" else 0.0)
            per_layer = (per_token * tokens + self.activation.per_pair * pairs / parallel.cp
                         + (0.0 if selective else self.activation.per_prefix_token * prefix_tokens)) / shards
            if not selective:
                per_layer = per_layer + self.activation.per_masked_entry * masked_entries / parallel.cp
        total = layers * per_layer
        if last_stage:
            total += self.last_stage_bytes(tokens, parallel)
        return total

    def activation_bytes_by_stage(self, tokens: Amount, pairs: Amount, parallel: ParallelConfig,
                                  prefix_tokens: Amount | float = 0.0,
                                  masked_entries: Amount | float = 0.0) -> tuple[Amount, Amount]:
        """`activation_bytes` on a middle stage and on the last, the layers' terms computed once
        (exactly `activation_bytes`'s: the last stage adds `last_stage_bytes` to the same sum)."""
        middle = self.activation_bytes(tokens, pairs, parallel, prefix_tokens=prefix_tokens,
                                       masked_entries=masked_entries)
        return middle, middle + self.last_stage_bytes(tokens, parallel)

    def last_stage_bytes(self, tokens: Amount, parallel: ParallelConfig) -> Amount:
        """What the last stage holds per in-flight MicroPack beyond its layers': the fp32 logits and
        the final norm's and output layer's inputs."""
        shards = activation_shards(parallel)
        return self.logits_bytes(tokens, parallel) + self.activation.per_model_token * tokens / shards

    def logits_bytes(self, tokens: Amount, parallel: ParallelConfig) -> Amount:
        """fp32 logits kept for the cross-entropy backward (vocab split across TP)."""
        return 4.0 * tokens / parallel.cp * self.model.vocab_size / parallel.tp

    def recompute_peak_bytes(self, tokens: Amount, pairs: Amount, parallel: ParallelConfig) -> Amount | float:
        """What a recomputed block holds again during its layer's backward: with full recompute one
        layer's full activations, with MLP recompute one MLP's (core attention's re-run forward
        saves what the backward uses at once: counted in its layer's activations)."""
        if parallel.recompute == "selective-mlp":
            shards = activation_shards(parallel)
            return self.mlp_saved_bytes_per_token * tokens / shards + 0.0 * pairs
        if not self.whole_layer_share(parallel):
            return 0.0
        return self.activation_bytes(tokens, pairs, parallel.with_(recompute="none")) / self.layers_per_stage(parallel)

    @property
    def mlp_saved_bytes_per_token(self) -> float:
        """Bytes per token the MLP saves beyond its input (fc1's output and the activation's:
        `analytic_activation` itemises them), which MLP recompute frees."""
        return mlp_saved_bytes_per_token(self.model, self.dtype_bytes, self.attention_backend)

    def kv_cache_bytes(self, tokens: Amount, parallel: ParallelConfig) -> Amount:
        """K/V leaves of a sample's finished slices (model dtype) plus their gradients, which the
        runtime accumulates in fp32 across the slices that read them, one stage."""
        elements = 2 * tokens * self.model.kv_hidden_size / (parallel.tp * parallel.cp)
        return self.layers_per_stage(parallel) * elements * (self.dtype_bytes + 4.0)

    def memory_budget_bytes(self) -> float:
        return self.hardware.memory_bytes * self.hardware.usable_memory_fraction

    # ---- FLOPs (for MFU; real lengths, no padding, no recompute) ------------------------------
    def model_flops(self, tokens: float, pairs: float) -> float:
        """Training FLOPs of the whole model (forward x3) for these tokens and attention pairs."""
        linear, attention = self._layer_flops(tokens, pairs)
        head = 2.0 * tokens * self.model.hidden_size * self.model.vocab_size
        return 3.0 * (self.model.num_layers * (linear + attention) + head)


def activation_shards(parallel: ParallelConfig) -> int:
    """Devices one layer's activations are split over: CP ranks, and TP ranks where sequence
    parallelism (or no TP) shards the tokens rather than replicating them."""
    return parallel.cp * (parallel.tp if parallel.sequence_parallel or parallel.tp == 1 else 1)


def format_bytes(value: float) -> str:
    return f"{value / GIB:.1f} GiB"
