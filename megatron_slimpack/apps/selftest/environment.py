"""Section 1: versions, the device, and which attention backend `auto` picks and why."""
from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

import torch

from ... import __version__
from ...runtime.attention import kernels
from ...runtime.attention.backend_probe import NoFusedAttentionBackend, probed_choice, probed_shape_classes
from ...runtime.attention.core import build_core_attention
from ...runtime.model import tiny_config

NOT_INSTALLED = "not installed"

# distribution names to try, in order (wheels and source builds name them differently)
_DISTRIBUTIONS = {
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch",
                           "transformer_engine_torch"),
    "flash-attn": ("flash-attn", "flash_attn"),
    "megatron-core": ("megatron-core", "megatron_core"),
}
_MODULES = {"transformer-engine": "transformer_engine", "flash-attn": "flash_attn", "megatron-core": "megatron.core"}


def package_version(name: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    for distribution in _DISTRIBUTIONS[name]:
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    module = _MODULES[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        found = False
    return NOT_INSTALLED if not found else "installed (version unknown: no package metadata)"


def versions() -> dict[str, str]:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or f"{NOT_INSTALLED} (a CPU build of torch)",
        "cudnn": str(cudnn) if cudnn else NOT_INSTALLED,
        "transformer-engine": package_version("transformer-engine"),
        "flash-attn": package_version("flash-attn"),
        "megatron-core": package_version("megatron-core"),
    }


def gpu_absent_reason() -> str:
    """Why no GPU check runs here ("" when a GPU is visible)."""
    if torch.cuda.is_available():
        return ""
    if torch.version.cuda is None:
        return f"no CUDA GPU: torch {torch.__version__} is a CPU build"
    return "no CUDA GPU visible (torch.cuda.is_available() is False: no device, driver, or CUDA_VISIBLE_DEVICES)"


def describe_device(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"type": "cpu", "threads": torch.get_num_threads(), "gpu": gpu_absent_reason() or "present, not used"}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "capability": f"sm_{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count()}


def backend_reasons() -> dict[str, str]:
    """For each backend: "available" or why this machine cannot run it (kernels.py's own tests)."""
    available = kernels.available_backends()
    reasons: dict[str, str] = {}
    for name in ("te", "flash"):
        package = kernels.PACKAGE_OF[name]
        if name in available:
            reasons[name] = "available"
        elif not torch.cuda.is_available():
            reasons[name] = "needs a CUDA GPU"
        elif importlib.util.find_spec(package) is None:
            reasons[name] = f"{package} not installed ({kernels.INSTALL_HINT[name]})"
        elif name == "te":
            reasons[name] = "megatron.core.extensions.transformer_engine does not import with this transformer-engine"
        else:
            reasons[name] = (f"flash-attn {package_version('flash-attn')} < 2.1 (older versions align causal masks "
                             "top-left)")
    reasons["torch"] = ("available: fused on this GPU in bf16/fp16 (PyTorch's varlen flash attention), the fp32 "
                        "reference per segment" if kernels.torch_fused_on_gpu()
                        else "available (reference kernel, always; per segment)")
    return reasons


def probed_backend():
    """On a GPU: the runtime's start-up probe (runtime/attention/backend_probe.py) for a bf16 GQA attention,
    as a model's layers would run it (cached per shape class); None without a GPU (only the torch
    kernel runs). Raises NoFusedAttentionBackend where no fused backend runs it."""
    if not torch.cuda.is_available():
        return None
    config = tiny_config(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2, bf16=True,
                         params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    return probed_choice(config, torch.device("cuda", torch.cuda.current_device()),
                         lambda name: build_core_attention(name, config))


def backend_choice() -> dict:
    """What backend 'auto' runs, and a sentence saying why: on a GPU the start-up probe's choice
    (or its refusal: no fused backend runs), otherwise the fastest available
    (`resolve_backend("auto")`); and the backend per shape class probed in this process."""
    reasons = backend_reasons()
    try:
        probe = probed_backend()
    except NoFusedAttentionBackend as refusal:
        return {"auto": "refused", "available": kernels.available_backends(), "why": str(refusal),
                "backends": reasons, "shape_classes": probed_shape_classes()}
    chosen = probe.backend if probe is not None else kernels.resolve_backend("auto")
    passed_over = [f"{name}: {reasons[name]}" for name in kernels.BACKENDS[:kernels.BACKENDS.index(chosen)]
                   if reasons[name] != "available"]
    why = "the fastest available (order te, flash, torch)"
    if probe is not None:
        why = "the fastest that passed the start-up probe (bf16, GQA, a KV prefix; against the fp32 torch kernel)"
        passed_over += [f"{name}: {reason}" for name, reason in probe.passed_over.items()]
    if passed_over:
        why += "; " + "; ".join(passed_over)
    return {"auto": chosen, "available": kernels.available_backends(), "why": why, "backends": reasons,
            "shape_classes": probed_shape_classes()}


def environment(device: torch.device) -> dict:
    try:
        backend = backend_choice()
    except Exception as error:  # noqa: BLE001 - e.g. a transformer-engine that fails to load its libraries
        backend = {"auto": "unknown", "available": [], "backends": {},
                   "why": f"choosing the backend failed: {type(error).__name__}: {error}"}
    return {"megatron-slimpack": __version__, "versions": versions(), "device": describe_device(device),
            "attention_backend": backend}
