"""Let megatron-core 0.16.1 run on a machine without a GPU (tests, CPU demo, profiling).

megatron-core assumes CUDA in a few places that the CPU path reaches. `apply()` replaces exactly
those, only when no GPU is present, and only once; `undo()` restores the originals. Each patch
says what it replaces and why. Nothing here changes numerics: on CPU the replaced functions
would raise, not compute something else.

Found by running a GPTModel (local spec, RoPE, GQA) forward and backward on CPU:
  1. the CUDA RNG tracker (`tensor_parallel.get_cuda_rng_tracker().fork()` in attention dropout
     and `model_parallel_cuda_manual_seed`) reads and writes CUDA generator states;
  2. `torch.cuda.current_device()` is used as a device for RoPE's `inv_freq` (and in p2p/DDP);
  3. `get_default_causal_mask` builds the causal mask with `device="cuda"`;
  4. `LanguageModule.setup_embeddings_and_output_layer` moves the last pipeline stage's copy of
     tied word embeddings with `.cuda()` before summing it with the first stage's.
The pipeline schedule (a later issue) will add its own entries here (hard-coded
`device="cuda"` in schedules, `torch.cuda.synchronize()` in p2p) when it needs them.
"""
from __future__ import annotations

import contextlib
from functools import lru_cache, wraps
from typing import Any

import torch

_originals: dict[str, Any] = {}  # what `apply` replaced, of as many kinds as it patches


def needed() -> bool:
    """True when megatron-core would hit CUDA-only code: no usable GPU."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return bool(_originals)


class CpuRNGStatesTracker:
    """Stands in for megatron's `CudaRNGStatesTracker`: named RNG streams on the CPU generator.

    Megatron keeps a separate CUDA generator state per parallel region (data-parallel, tensor-
    parallel, expert) and `fork(name)` swaps it in. Here the same is done with the CPU generator,
    so dropout in tensor-parallel regions stays reproducible and differs across TP ranks as on GPU.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG stream {name!r} or seed {seed} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            # Tests that never call model_parallel_cuda_manual_seed still run dropout-free code
            # inside fork(); give them a deterministic stream rather than an error.
            self.add(name, 2718 + len(self.states_))
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


@lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


@contextlib.contextmanager
def _tensor_cuda_stays_on_cpu():
    """`Tensor.cuda()` returns the tensor itself while inside (it would raise on CPU torch)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _on_cpu(method):
    @wraps(method)
    def run(*args, **kwargs):
        with _tensor_cuda_stays_on_cpu():
            return method(*args, **kwargs)
    return run


def apply(force: bool = False) -> bool:
    """Install the CPU replacements if no GPU is present (or `force`). Idempotent.

    Returns True when the patches are in place after the call.
    """
    if is_applied():
        return True
    if not (force or needed()):
        return False
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as transformer_utils

    # 1. RNG tracker: megatron creates its tracker lazily on first use; installing ours first
    #    (and marking it initialised) makes every `get_cuda_rng_tracker()` return it.
    _originals["rng_tracker"] = (mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # 2. torch.cuda.current_device() raises "Torch not compiled with CUDA" on CPU; megatron uses
    #    it only as a `device=` argument (RoPE inv_freq, p2p buffers, DDP), so "cpu" is right.
    _originals["current_device"] = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]  # a device where an index was
    # 3. The default causal mask of the local (non-TE) softmax is allocated on "cuda".
    #    fused_softmax imported the function by name, so both references are replaced.
    _originals["causal_mask"] = (transformer_utils.get_default_causal_mask, fused_softmax.get_default_causal_mask)
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    # 4. Tied embeddings with PP > 1: the last stage's copy is moved with `weight.data.cuda()`
    #    before the all-reduce that gives it the first stage's values; on CPU it stays put.
    _originals["setup_embeddings"] = LanguageModule.setup_embeddings_and_output_layer
    LanguageModule.setup_embeddings_and_output_layer = _on_cpu(LanguageModule.setup_embeddings_and_output_layer)
    return True


def undo() -> None:
    """Restore everything `apply()` replaced."""
    if not is_applied():
        return
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as transformer_utils

    mp_random._CUDA_RNG_STATE_TRACKER, mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _originals["rng_tracker"]
    torch.cuda.current_device = _originals["current_device"]
    transformer_utils.get_default_causal_mask, fused_softmax.get_default_causal_mask = _originals["causal_mask"]
    LanguageModule.setup_embeddings_and_output_layer = _originals["setup_embeddings"]
    _originals.clear()
