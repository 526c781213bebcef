"""Test-only: let Megatron-LM's real trainer (`pretrain_gpt.py` -> `pretrain()` -> `train()`,
core_v0.16.1 to core_v0.19.x) run on a CPU machine with gloo.

This is *not* part of the plugin and never runs on a GPU cluster. It changes nothing numeric:
every patch replaces a CUDA-only call that would raise on CPU with its CPU meaning (the device is
the CPU, the RNG is the CPU generator, streams and synchronisation are no-ops). The list was
found by running `pretrain()` until it trained (facts in ../shared/megatron-lm/README.md):

  1. `torch.cuda.device_count` -> 1, `set_device` -> no-op, `current_device` -> the CPU device
     (runtime.compat's; not an index for the mode below: autograd runs backward functions
     outside the mode), `synchronize` / `empty_cache` -> no-op,
     memory figures -> 0, Megatron's `get_device_arch_version` -> 9 (argument checks for TP > 1);
  2. CUDA streams and events -> dummies (the DDP / optimizer code only orders work on them);
  3. CUDA RNG state and seeding -> the CPU generator (`torch.cuda.get_rng_state` and friends,
     and megatron-core's own `_get_cuda_rng_state` / `_set_cuda_rng_state` used by checkpointed
     recompute), plus megatron_slimpack's CPU RNG tracker (`runtime.compat`);
  4. `initialize_megatron(..., allow_no_cuda=True)`;
  5. `compile_helpers` -> no-op (the megatron-core wheel ships the compiled dataset helpers) and
     `megatron.legacy.fused_kernels.load` -> no-op (0.16/0.17: later releases have no legacy
     package);
  6. a `TorchFunctionMode` that maps `device='cuda'` / `'cuda:N'` / an int device to the CPU,
     keeps `Tensor.cuda()` / `.to('cuda')` on the CPU, makes `record_stream` a no-op and lets
     `Tensor.type()` report `torch.cuda.*Tensor` (the optimizer and grad-clip asserts check it).

`apply()` is called once, before `pretrain_gpt.py` is imported (see launch.py).
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _DummyStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _DummyEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


class _DummyEvent(_DummyStream):
    def record(self, *args, **kwargs):
        pass

    def elapsed_time(self, other):
        return 0.0


class CudaOnCpu(TorchFunctionMode):
    """Every tensor stays on the CPU whatever device the code names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = CPU
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to:
            args = tuple(CPU if _is_cuda_device(a) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda") else name
        return func(*args, **kwargs)


def _cpu_rng_state(*args, **kwargs):
    return torch.get_rng_state()


def _set_cpu_rng_state(state, *args, **kwargs):
    torch.set_rng_state(state)


def _manual_seed(seed, *args, **kwargs):
    torch.default_generator.manual_seed(int(seed))  # not torch.manual_seed: it calls cuda.manual_seed_all


def apply() -> None:
    cuda = torch.cuda
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.Stream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.current_stream = lambda *a, **k: _DummyStream()
    cuda.default_stream = lambda *a, **k: _DummyStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = _cpu_rng_state
    cuda.set_rng_state = _set_cpu_rng_state
    cuda.manual_seed = _manual_seed
    cuda.manual_seed_all = _manual_seed
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = _cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state

    from megatron_slimpack.runtime import compat

    compat.apply(force=True)  # the CPU RNG tracker and causal mask megatron-core itself needs
    # compat makes current_device() the CPU device itself (not an index the mode below would map):
    # autograd runs backward functions outside the mode, and megatron's sequence-parallel linear
    # layers allocate their reduce-scatter buffers there with device=current_device().

    from megatron.core.datasets import utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None
    try:
        from megatron.legacy import fused_kernels  # up to 0.17
    except ImportError:
        fused_kernels = None
    if fused_kernels is not None:
        fused_kernels.load = lambda args: None

    from megatron.training import arguments, initialize, training

    arguments.get_device_arch_version = lambda: 9

    original = initialize.initialize_megatron

    def initialize_megatron(*args, **kwargs):
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    initialize.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron

    CudaOnCpu().__enter__()  # for the life of the process
