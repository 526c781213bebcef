"""Model, hardware and parallel-layout presets.

Every figure the cost model uses comes from here, so a comparison between strategies is
only ever a comparison of schedules, never of assumptions.
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace

import numpy as np

from .errors import SlimPackError

GIB = 1024**3


class SpecError(SlimPackError):
    """A preset that does not exist or a layout that does not fit the model."""


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder (RMSNorm, SwiGLU, RoPE, optional GQA)."""

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None  # None: no GQA (one KV head per query head)
    vocab_size: int = 32000
    swiglu: bool = True

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_hidden_size(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        """Weights of one transformer layer (attention + MLP + two norms)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        attention = h * h + 2 * h * self.kv_hidden_size + h * h  # q, k, v, out
        mlp = (3 if self.swiglu else 2) * h * f
        return attention + mlp + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        # untied input embedding and output layer + final norm
        return self.num_layers * self.params_per_layer + 2 * self.embedding_params + self.hidden_size

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator and the links around it.

    `peak_flops` is the dense bf16 peak per device. `kernels` names the kernel speeds it is priced
    with (costmodel/kernels.py): "h100-published" (GEMM and attention fitted to published H100
    measurements) or "generic" (one saturating curve: `max_efficiency` of peak, half of it at
    `half_efficiency_tokens`). Bandwidths are per device, bytes/s, as NCCL's bus bandwidth:
    `intra_node_bandwidth` over NVLink, `inter_node_bandwidth` over the network on two nodes,
    falling log-linearly in the node count to `inter_node_bandwidth_at_scale` at
    `scale_nodes` nodes. `memory_bandwidth` is the HBM peak (element-wise kernels reach
    `ELEMENTWISE_BANDWIDTH_SHARE` of it). `sustained_compute_share` scales the GEMM and
    attention rates (`benchmarks/cost_anchors.py --fit` derives it from published end-to-end runs).
    """

    name: str
    peak_flops: float
    memory_bytes: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    gpus_per_node: int = 8
    link_latency_s: float = 10e-6
    max_efficiency: float = 0.55
    half_efficiency_tokens: int = 1024
    kernel_overhead_s: float = 2e-4  # per MicroPack per stage: launches, packing, host work
    usable_memory_fraction: float = 0.92  # allocator fragmentation and framework buffers
    kernels: str = "generic"
    memory_bandwidth: float = 0.0  # 0: element-wise work not priced apart (the generic curve covers it)
    inter_node_bandwidth_at_scale: float = 0.0  # 0: the same as inter_node_bandwidth at any scale
    scale_nodes: int = 128
    # Share of the kernel tables' rates a device sustains through a training run (micro-benchmarks
    # run short bursts at boost clocks; a training step runs for seconds at the power limit).
    sustained_compute_share: float = 1.0

    def network_bandwidth(self, nodes: int) -> float:
        """Per-GPU bus bandwidth of a collective spanning `nodes` nodes (1: NVLink)."""
        if nodes <= 1:
            return self.intra_node_bandwidth
        at_scale = self.inter_node_bandwidth_at_scale or self.inter_node_bandwidth
        if nodes <= 2 or self.scale_nodes <= 2:
            return self.inter_node_bandwidth
        share = min(1.0, math.log2(nodes / 2) / math.log2(self.scale_nodes / 2))
        return self.inter_node_bandwidth + share * (at_scale - self.inter_node_bandwidth)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ParallelConfig:
    """A Megatron parallel layout. `cp` is context parallelism for every sequence."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    # Virtual pipeline stages (model chunks) per pipeline rank: Megatron's interleaved 1F1B
    # (--num-virtual-stages-per-pipeline-rank). Chunk c of rank s is virtual stage c * pp + s.
    vpp: int = 1
    recompute: str = "none"  # RECOMPUTE_MODES (none | selective | selective-mlp | full) or block-N
    # with tp > 1, as Megatron recommends for long context; the runtime runs it (runtime/attention/batch.py)
    sequence_parallel: bool = True
    zero1: bool = True  # distributed optimizer (optimizer state sharded over dp*cp)

    def __post_init__(self):
        for name in ("dp", "pp", "tp", "cp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.vpp > 1 and self.pp == 1:
            raise SpecError(f"ParallelConfig.vpp={self.vpp} needs pipeline parallelism (pp > 1): virtual "
                            "stages interleave model chunks over the pipeline ranks")
        check_recompute_mode(self.recompute)

    def layers_recomputed_whole(self, chunk_layers: int) -> int:
        """Of a model chunk's `chunk_layers` layers, how many recompute their whole forward in
        backward: all with full recompute, the first N with block-N, none otherwise."""
        if self.recompute == "full":
            return chunk_layers
        return min(block_recompute_layers(self.recompute), chunk_layers)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def virtual_stages(self) -> int:
        """Model chunks in the whole pipeline (pp x vpp)."""
        return self.pp * self.vpp

    def check_model(self, model: ModelSpec) -> None:
        """Raise SpecError if this layout cannot split the model evenly."""
        if model.num_layers % self.pp:
            raise SpecError(
                f"{model.name} has {model.num_layers} layers, not divisible by pp={self.pp}; "
                f"choose pp among {divisors(model.num_layers)}"
            )
        if model.num_layers % self.virtual_stages:
            raise SpecError(
                f"{model.name} has {model.num_layers} layers, not divisible by pp x vpp = {self.virtual_stages}; "
                f"choose vpp among {divisors(model.num_layers // self.pp)}"
            )
        chunk = model.num_layers // self.virtual_stages
        if block_recompute_layers(self.recompute) >= chunk:
            raise SpecError(
                f"recompute {self.recompute} recomputes every one of the {chunk} layers of a model chunk "
                f"({model.name} on pp x vpp = {self.virtual_stages}); use recompute 'full', or block-N with N < {chunk}"
            )
        if model.num_attention_heads % self.tp or model.kv_heads % self.tp:
            raise SpecError(
                f"{model.name} has {model.num_attention_heads} attention heads and {model.kv_heads} KV heads, "
                f"not divisible by tp={self.tp}; choose tp among {divisors(model.kv_heads)}"
            )

    def padded_tokens(self, tokens):
        """Rows a MicroPack of `tokens` occupies once padded for sequence parallelism: the runtime
        pads each of its cp shares (the largest is ceil(tokens / cp)) to a multiple of tp
        (runtime/attention/batch.py, runtime/attention/context_parallel.py). Scalars and numpy arrays alike."""
        if not (self.sequence_parallel and self.tp > 1):
            return tokens
        share = np.ceil(np.asarray(tokens, dtype=float) / self.cp)
        return np.ceil(share / self.tp) * self.tp * self.cp

    def describe(self) -> str:
        pipeline = f"pp{self.pp}" + (f" vpp{self.vpp}" if self.vpp > 1 else "")
        text = f"tp{self.tp} {pipeline} cp{self.cp} dp{self.dp}"
        return text if self.recompute == "none" else f"{text} rc-{self.recompute}"

    def with_(self, **changes) -> "ParallelConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        data = asdict(self)
        if self.vpp == 1:  # plain 1F1B: plans and their fingerprints as before virtual stages
            del data["vpp"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelConfig":
        return cls(**data)


# Megatron's activation recompute, lightest first (each frees more memory and re-runs more work):
# none; selective (`--recompute-granularity selective`, its default `--recompute-modules core_attn`);
# selective-mlp (`--recompute-modules core_attn mlp`: the MLP block too); full (every layer whole:
# `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`).
RECOMPUTE_MODES = ("none", "selective", "selective-mlp", "full")
# The `--recompute-modules` of each selective mode.
SELECTIVE_MODULES = {"selective": ("core_attn",), "selective-mlp": ("core_attn", "mlp")}
# Full recompute of some layers: block-N recomputes the first N layers of every model chunk whole
# and keeps the others' activations (`--recompute-granularity full --recompute-method block
# --recompute-num-layers N`); fewer layers re-run than with full, for more memory held.
BLOCK_RECOMPUTE = re.compile(r"block-[1-9][0-9]*")


def block_recompute_layers(mode: str) -> int:
    """N of a block-N recompute mode; 0 for the others."""
    if not mode.startswith("block-"):  # the cost model asks on every layer figure
        return 0
    return int(mode[len("block-"):]) if BLOCK_RECOMPUTE.fullmatch(mode) else 0


def check_recompute_mode(mode: str) -> str:
    """`mode` if it is one of RECOMPUTE_MODES or block-N (N >= 1); SpecError naming them otherwise."""
    if mode in RECOMPUTE_MODES or block_recompute_layers(mode):
        return mode
    raise SpecError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)} or block-N (the first N layers of "
                    f"every model chunk recomputed whole, N >= 1), got {mode!r}")


def recompute_order(mode: str) -> tuple[int, int]:
    """Lightest first: none, selective, selective-mlp, block-1, block-2, ..., full."""
    full = RECOMPUTE_MODES.index("full")
    if block_recompute_layers(mode):
        return full, block_recompute_layers(mode)  # between selective-mlp and full
    rank = RECOMPUTE_MODES.index(mode)
    return (full + 1, 0) if rank == full else (rank, 0)


def recompute_includes(mode: str, lighter: str) -> bool:
    """Whether recompute `mode` re-runs everything `lighter` re-runs, so that on the same plans it
    takes at least `lighter`'s time (and holds at most its activations). A partial order: selective
    and block-N re-run different work, so neither includes the other; full includes every mode,
    block-N every block-M with M <= N, selective-mlp selective, and every mode none."""
    if lighter == "none" or mode == lighter or mode == "full":
        return True
    if mode == "none" or lighter == "full":
        return False
    layers, lighter_layers = block_recompute_layers(mode), block_recompute_layers(lighter)
    if layers or lighter_layers:
        return 0 < lighter_layers <= layers
    return RECOMPUTE_MODES.index(lighter) <= RECOMPUTE_MODES.index(mode)


def block_recompute_modes(chunk_layers: int) -> list[str]:
    """block-1 .. block-(chunk_layers - 1): every block mode of a model chunk that is not full."""
    return [f"block-{layers}" for layers in range(1, chunk_layers)]


def recompute_flags(mode: str) -> list[str]:
    """Megatron-LM's flags that train with recompute `mode` (RECOMPUTE_MODES or block-N)."""
    if mode == "none":
        return []
    if block_recompute_layers(mode):
        return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                str(block_recompute_layers(mode))]
    if mode == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if mode == "selective":  # Megatron's default modules
        return ["--recompute-granularity", "selective"]
    return ["--recompute-granularity", "selective", "--recompute-modules", *SELECTIVE_MODULES[mode]]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("llama-7b", 32, 4096, 11008, 32),
        ModelSpec("llama-13b", 40, 5120, 13824, 40),
        ModelSpec("llama-70b", 80, 8192, 28672, 64, num_query_groups=8),
        # Our 150B: a deeper, wider Llama-70B-style GQA model (the paper does not publish its
        # dimensions): 96 layers, hidden 12288, 96 heads, 8 KV groups, ffn 32768 -> 150.3B params.
        ModelSpec("llama-150b-gqa", 96, 12288, 32768, 96, num_query_groups=8),
        # Small models that train on a CPU in the demo and tests.
        # Llama 3 (arXiv 2407.21783, Table 3), for the published end-to-end runs the cost model is checked on.
        ModelSpec("llama3-8b", 32, 4096, 14336, 32, num_query_groups=8, vocab_size=128256),
        ModelSpec("llama3-70b", 80, 8192, 28672, 64, num_query_groups=8, vocab_size=128256),
        ModelSpec("llama3-405b", 126, 16384, 53248, 128, num_query_groups=8, vocab_size=128256),
        # Megatron-LM's weak-scaling GPT models (README "Model table": GELU MLP of 4h, vocabulary 131072).
        ModelSpec("gpt-7.1b", 30, 4096, 16384, 32, vocab_size=131072, swiglu=False),
        ModelSpec("gpt-70b", 84, 8192, 32768, 64, vocab_size=131072, swiglu=False),
        ModelSpec("gpt-177b", 96, 12288, 49152, 96, vocab_size=131072, swiglu=False),
        ModelSpec("tiny", 4, 128, 352, 4, num_query_groups=2, vocab_size=256),
        ModelSpec("small", 8, 256, 704, 8, num_query_groups=4, vocab_size=256),
    )
}

HARDWARE: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        # H100 SXM: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3. NVLink 4 all-gather/reduce-scatter bus
        # bandwidth ~370 GB/s (NCCL maintainers, nccl-tests issue 212); 8x400 Gb/s InfiniBand NDR,
        # one NIC per GPU: ~47 GB/s bus bandwidth on 2 nodes, ~32 GB/s at 128 nodes (NCCL issue 1229).
        HardwareSpec("h100-sxm", 989e12, 80 * 10**9, 370e9, 47e9, kernels="h100-published",
                     memory_bandwidth=3.35e12, inter_node_bandwidth_at_scale=32e9, sustained_compute_share=0.741),
        # H200: the H100's SMs and clocks with 141 GB of HBM3e at 4.8 TB/s.
        HardwareSpec("h200", 989e12, 141 * 10**9, 370e9, 47e9, kernels="h100-published",
                     memory_bandwidth=4.8e12, inter_node_bandwidth_at_scale=32e9, sustained_compute_share=0.741),
        HardwareSpec("a100", 312e12, 80 * 10**9, 300e9, 25e9, max_efficiency=0.6),
        # A 2-core CPU running fp32: figures are replaced by `slimpack profile` in practice.
        HardwareSpec(
            "cpu", 60e9, 16 * GIB, 5e9, 5e9, gpus_per_node=64, link_latency_s=50e-6,
            max_efficiency=0.5, half_efficiency_tokens=64, kernel_overhead_s=2e-3,
        ),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise SpecError(f"unknown model preset {name!r}; known: {', '.join(MODELS)}") from None


def get_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE[name]
    except KeyError:
        raise SpecError(f"unknown hardware preset {name!r}; known: {', '.join(HARDWARE)}") from None


def model_from_dict(data: dict) -> ModelSpec:
    return ModelSpec(**data)


def hardware_from_dict(data: dict) -> HardwareSpec:
    return HardwareSpec(**data)


__all__ = [
    "GIB", "SpecError", "ModelSpec", "HardwareSpec", "ParallelConfig", "RECOMPUTE_MODES", "SELECTIVE_MODULES",
    "BLOCK_RECOMPUTE", "block_recompute_layers", "check_recompute_mode", "recompute_order", "recompute_includes",
    "block_recompute_modes", "recompute_flags", "MODELS",
    "HARDWARE", "get_model", "get_hardware", "divisors", "model_from_dict", "hardware_from_dict",
]
