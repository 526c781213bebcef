"""Time and memory of MicroPacks on one pipeline stage (design.md section 4).

A MicroPack's work is summarised by two numbers: its tokens `T` and its causal attention pairs
`A` (each slice's queries against its KV prefix and itself). Linear layers scale with T,
attention with A. The analytic model turns FLOPs into seconds with a size-dependent efficiency;
the profiled model (`CostModel.from_profile`) uses per-layer coefficients fitted on this device
by `slimpack profile`. Both share the memory and communication terms and the same interface, so
the planner and simulator never know which one they hold.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import TypeVar

import numpy as np

from .errors import SlimPackError
from .specs import (
    GIB,
    HardwareSpec,
    ModelSpec,
    ParallelConfig,
    get_hardware,
    get_model,
    hardware_from_dict,
    model_from_dict,
)

# A token or pair count, or an array of them: the formulas work elementwise, and the planner prices
# whole tables of MicroPacks at once. A figure that does not depend on the counts stays a scalar.
Amount = TypeVar("Amount", float, np.ndarray)

# Backward/forward FLOP ratios (paper notes): linear layers 2x; FlashAttention's backward
# recomputes the scores, 2.5x.
LINEAR_BACKWARD_RATIO = 2.0
ATTENTION_BACKWARD_RATIO = 2.5
# Selective recompute re-runs the cheap element-wise parts (norms, SwiGLU): a small share of
# the linear forward.
SELECTIVE_RECOMPUTE_SHARE = 0.05


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
    (2kv per key) and its bottom-right mask in the compute dtype, per query x key entry
    (`per_masked_entry`, not split by tensor parallelism).
    """
    h, kv, f, d = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size, model.head_dim
    fc1 = 2 * f if model.swiglu else f
    if attention_backend == "torch":
        per_token = ((3 * h + 1) + 4 * d + (h + kv + h + 2 * kv + h + model.num_attention_heads) + (4 * h + 1)
                     + fc1 + 3 * f)
        return ActivationCoefficients(per_token * dtype_bytes, 0.0, 2 * kv * dtype_bytes, (3 * h + 1) * dtype_bytes,
                                      per_masked_entry=dtype_bytes)
    per_token = (2 * h + 2) + (h + 2 * kv) + h + h + fc1 + f
    return ActivationCoefficients(per_token * dtype_bytes, 0.0, 0.0, (2 * h + 1) * dtype_bytes)


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


def read_profile(path: str | Path) -> dict:
    """The JSON object of a `slimpack profile` file, its top-level keys checked (`ProfileError` otherwise)."""
    path = Path(path)
    try:
        data = json.loads(_profile_text(path))
    except json.JSONDecodeError as error:
        raise ProfileError(f"cost-model profile {path} is not JSON ({error.msg} at line {error.lineno} "
                           f"column {error.colno}); {REGENERATE_PROFILE}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"cost-model profile {path} holds a JSON {type(data).__name__}, not a profile object; "
                           f"{REGENERATE_PROFILE}")
    missing = [key for key in PROFILE_KEYS if key not in data]
    if missing:
        raise ProfileError(f"cost-model profile {path} lacks {', '.join(missing)}: not a `slimpack profile` file; "
                           f"{REGENERATE_PROFILE}")
    return data


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
        attention_backend: str = "flash",
        forward: TimeCoefficients | None = None,
        backward: TimeCoefficients | None = None,
        head_forward: TimeCoefficients | None = None,
        head_backward: TimeCoefficients | None = None,
        activation: ActivationCoefficients | None = None,
        source: str = "analytic",
        reference: dict | None = None,
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

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def analytic(cls, model: str | ModelSpec, hardware: str | HardwareSpec, **options) -> "CostModel":
        model = get_model(model) if isinstance(model, str) else model
        hardware = get_hardware(hardware) if isinstance(hardware, str) else hardware
        return cls(model, hardware, **options)

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
        }

    def describe(self) -> dict:
        return {"model": self.model.name, "hardware": self.hardware.name, "source": self.source}

    # ---- compute time ------------------------------------------------------------------------
    def layers_per_stage(self, parallel: ParallelConfig) -> int:
        """Layers of one model chunk: a pipeline stage's, or with virtual stages (vpp > 1) one of
        its vpp chunks'. Every time and activation figure below is per chunk; a rank's
        parameters hold all of its chunks (`stage_params`)."""
        return self.model.num_layers // parallel.virtual_stages

    def efficiency(self, tokens: float) -> float:
        # Works on scalars and numpy arrays alike (the planner costs all MicroPacks at once).
        hw = self.hardware
        return hw.max_efficiency * tokens / (tokens + hw.half_efficiency_tokens)

    def _layer_flops(self, tokens: float, pairs: float) -> tuple[float, float]:
        """(linear, attention) forward FLOPs of one layer."""
        return 2.0 * tokens * self.model.params_per_layer, 4.0 * pairs * self.model.hidden_size

    def layer_time(self, tokens: float, pairs: float, parallel: ParallelConfig, backward: bool) -> float:
        """Compute seconds of one layer on one device (its TP/CP share), communication excluded."""
        shards = parallel.tp * parallel.cp
        local_tokens, local_pairs = tokens / parallel.cp, pairs / parallel.cp
        profiled = self.profiled_backward if backward else self.profiled_forward
        if profiled is not None:
            # Coefficients are measured at tp=1, cp=1: the local share scales the token terms.
            base = profiled(local_tokens / parallel.tp, local_pairs / parallel.tp)
            return base + self._recompute_time(tokens, pairs, parallel) if backward else base
        linear, attention = self._layer_flops(tokens, pairs)
        rate = self.hardware.peak_flops * self.efficiency(local_tokens)
        if backward:
            seconds = (LINEAR_BACKWARD_RATIO * linear + ATTENTION_BACKWARD_RATIO * attention) / (rate * shards)
            return seconds + self._recompute_time(tokens, pairs, parallel)
        return (linear + attention) / (rate * shards)

    def attention_time(self, tokens: float, pairs: float, parallel: ParallelConfig, backward: bool) -> float:
        """The attention share of `layer_time` (the part that scales with attention pairs)."""
        return (self.layer_time(tokens, pairs, parallel, backward)
                - self.layer_time(tokens, 0.0 * pairs, parallel, backward))

    def _recompute_time(self, tokens: float, pairs: float, parallel: ParallelConfig) -> float:
        if parallel.recompute == "none":
            return 0.0
        forward = self.layer_time(tokens, pairs, parallel.with_(recompute="none"), backward=False)
        return forward if parallel.recompute == "full" else SELECTIVE_RECOMPUTE_SHARE * forward

    def head_time(self, tokens: float, parallel: ParallelConfig, backward: bool) -> float:
        """Output layer + loss on the last stage."""
        local = tokens / parallel.cp
        profiled = self.profiled_head_backward if backward else self.profiled_head_forward
        if profiled is not None:
            return profiled(local / parallel.tp, 0.0)
        flops = 2.0 * local * self.model.hidden_size * self.model.vocab_size / parallel.tp
        ratio = LINEAR_BACKWARD_RATIO if backward else 1.0
        return ratio * flops / (self.hardware.peak_flops * self.efficiency(local))

    def tp_comm_time(self, tokens: float, parallel: ParallelConfig, backward: bool) -> float:
        """Per layer with sequence parallelism: two all-gathers and two reduce-scatters per pass."""
        if parallel.tp == 1:
            return 0.0
        t = parallel.tp
        volume = tokens / parallel.cp * self.model.hidden_size * self.dtype_bytes * (t - 1) / t
        passes = 1 + (backward and parallel.recompute == "full")
        bandwidth = (self.hardware.intra_node_bandwidth if t <= self.hardware.gpus_per_node
                     else self.hardware.inter_node_bandwidth)
        return passes * 4 * (volume / bandwidth + self.hardware.link_latency_s)

    def cp_comm_time(self, tokens: float, parallel: ParallelConfig, backward: bool) -> float:
        """Per layer: all-gather of K and V (forward), reduce-scatter of dK/dV (backward)."""
        if parallel.cp == 1:
            return 0.0
        c = parallel.cp
        volume = 2 * tokens * self.model.kv_hidden_size / parallel.tp * self.dtype_bytes * (c - 1) / c
        bandwidth = self._group_bandwidth(parallel.tp * parallel.cp)
        steps = 2 if backward else 1  # backward re-gathers K/V and reduce-scatters their gradients
        return steps * (volume / bandwidth + (c - 1) * self.hardware.link_latency_s)

    def _group_bandwidth(self, span: int) -> float:
        hw = self.hardware
        return hw.intra_node_bandwidth if span <= hw.gpus_per_node else hw.inter_node_bandwidth

    def stage_time(
        self, tokens: float, pairs: float, parallel: ParallelConfig, *, backward: bool, last_stage: bool = False
    ) -> float:
        """Seconds for one MicroPack (or a unit's totals) on one pipeline stage."""
        layers = self.layers_per_stage(parallel)
        # Context-parallel attention exchanges K/V chunk by chunk while it computes (ring attention):
        # only the part of the exchange that outlasts the attention compute is exposed.
        exposed_cp = np.maximum(0.0, self.cp_comm_time(tokens, parallel, backward)
                                - self.attention_time(tokens, pairs, parallel, backward))
        per_layer = (
            self.layer_time(tokens, pairs, parallel, backward)
            + self.tp_comm_time(tokens, parallel, backward)
            + exposed_cp
        )
        seconds = layers * per_layer + self.hardware.kernel_overhead_s
        if last_stage:
            seconds += self.head_time(tokens, parallel, backward)
        return seconds

    def forward_time(self, tokens: float, pairs: float, parallel: ParallelConfig, last_stage: bool = False) -> float:
        return self.stage_time(tokens, pairs, parallel, backward=False, last_stage=last_stage)

    def backward_time(self, tokens: float, pairs: float, parallel: ParallelConfig, last_stage: bool = False) -> float:
        return self.stage_time(tokens, pairs, parallel, backward=True, last_stage=last_stage)

    def pass_time_bound(self, tokens: float, pairs: float, parallel: ParallelConfig, largest_pack: float) -> float:
        """Fewest seconds the last pipeline stage can spend on the forward and backward of `tokens`
        (with `pairs` attention pairs) cut into packs of at most `largest_pack` tokens. Per-token
        rates only improve with pack size and per-pack costs only add, so tokens / largest_pack
        packs of the largest size are the cheapest split; the context-parallel exchange is left out
        (it may hide behind attention)."""
        size = min(tokens, largest_pack)
        packs = tokens / size
        seconds = 0.0
        for backward in (False, True):
            per_layer = (self.layer_time(size, pairs / packs, parallel, backward)
                         + self.tp_comm_time(size, parallel, backward))
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
        bandwidth = self._group_bandwidth(parallel.tp * parallel.cp * parallel.pp)
        return self.activation_transfer_bytes(tokens, parallel) / bandwidth + self.hardware.link_latency_s

    def gradient_bytes(self, parallel: ParallelConfig) -> float:
        """fp32 gradient bytes of one device's parameter shard (largest stage)."""
        return 4.0 * self.stage_params(parallel) / parallel.tp

    def dp_reduce_time(self, parallel: ParallelConfig) -> float:
        """Ring all-reduce (or ZeRO-1 reduce-scatter + all-gather, the same volume) over dp*cp."""
        group = parallel.dp * parallel.cp
        if group == 1:
            return 0.0
        bandwidth = self._group_bandwidth(parallel.world_size)
        volume = 2.0 * (group - 1) / group * self.gradient_bytes(parallel)
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

    def activation_bytes(
        self, tokens: Amount, pairs: Amount, parallel: ParallelConfig, last_stage: bool = False,
        prefix_tokens: Amount | float = 0.0, masked_entries: Amount | float = 0.0,
    ) -> Amount:
        """Bytes one in-flight MicroPack (or unit) holds on one stage until its backward.
        `prefix_tokens`: KV-prefix tokens its slices read; `masked_entries`: query x key entries of
        its slices that read a prefix (both matter only where the kernel copies keys or keeps a mask)."""
        layers = self.layers_per_stage(parallel)
        shards = parallel.cp * (parallel.tp if parallel.sequence_parallel or parallel.tp == 1 else 1)
        if parallel.recompute == "full":
            per_layer = tokens * self.model.hidden_size * self.dtype_bytes / shards  # layer inputs only
        else:
            per_token = self.activation.per_token
            if parallel.recompute == "selective":
                per_token -= 2 * self.model.ffn_hidden_size * self.dtype_bytes  # fc1 output recomputed
            per_layer = (per_token * tokens + self.activation.per_pair * pairs / parallel.cp
                         + self.activation.per_prefix_token * prefix_tokens) / shards
            per_layer = per_layer + self.activation.per_masked_entry * masked_entries / parallel.cp
        total = layers * per_layer
        if last_stage:
            total += self.logits_bytes(tokens, parallel) + self.activation.per_model_token * tokens / shards
        return total

    def logits_bytes(self, tokens: Amount, parallel: ParallelConfig) -> Amount:
        """fp32 logits kept for the cross-entropy backward (vocab split across TP)."""
        return 4.0 * tokens / parallel.cp * self.model.vocab_size / parallel.tp

    def recompute_peak_bytes(self, tokens: Amount, pairs: Amount, parallel: ParallelConfig) -> Amount | float:
        """With full recompute, one layer's full activations exist again during its backward."""
        if parallel.recompute != "full":
            return 0.0
        return self.activation_bytes(tokens, pairs, parallel.with_(recompute="none")) / self.layers_per_stage(parallel)

    def kv_cache_bytes(self, tokens: Amount, parallel: ParallelConfig) -> Amount:
        """K/V leaves of a sample's finished slices plus their accumulating gradients, one stage."""
        per_layer = 2 * tokens * self.model.kv_hidden_size / (parallel.tp * parallel.cp) * self.dtype_bytes
        return 2 * self.layers_per_stage(parallel) * per_layer

    def memory_budget_bytes(self) -> float:
        return self.hardware.memory_bytes * self.hardware.usable_memory_fraction

    # ---- FLOPs (for MFU; real lengths, no padding, no recompute) ------------------------------
    def model_flops(self, tokens: float, pairs: float) -> float:
        """Training FLOPs of the whole model (forward x3) for these tokens and attention pairs."""
        linear, attention = self._layer_flops(tokens, pairs)
        head = 2.0 * tokens * self.model.hidden_size * self.model.vocab_size
        return 3.0 * (self.model.num_layers * (linear + attention) + head)


def format_bytes(value: float) -> str:
    return f"{value / GIB:.1f} GiB"
