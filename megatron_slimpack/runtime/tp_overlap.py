"""Tensor-parallel collectives hidden behind the GEMMs next to them, for MicroPacks of any size.

Under sequence parallelism every layer all-gathers its input before the column-parallel GEMMs
(QKV, fc1) and reduce-scatters the row-parallel GEMMs' output (proj, fc2); backward runs the
mirror images. Run as one collective and then one GEMM, the GEMM waits for the whole exchange.
Transformer Engine's userbuffers hide it by cutting the exchange into a ring of TP-size chunks,
each chunk's GEMM running while the next chunk travels, but they register buffers of one fixed
shape, so a run whose micro-batches change size (every SlimPack MicroPack does) cannot use them
(`--tp-comm-overlap` is refused).

This module runs the same ring with ordinary point-to-point sends whose buffers are allocated
per call, so any MicroPack length (a multiple of the TP size, which sequence parallelism already
pads to) works:

- all-gather + GEMM (`_GatherMatmul`, column-parallel forward; row-parallel backward): a rank
  multiplies the chunk it holds while sending it to the next rank and receiving the previous
  rank's; after TP steps it has multiplied every chunk.
- GEMM + reduce-scatter (`_MatmulScatter`, row-parallel forward; column-parallel backward): the
  partial sum of chunk c starts on rank c+1 and travels the ring, each rank adding its own
  partial (computed while the previous sum travels), and ends, complete, on rank c.
- the column-parallel backward regathers the input shards beside the gradient's ring (the forward
  keeps only each rank's own shard, as megatron's sequence-parallel linear does), and each weight
  gradient is one GEMM over the gathered rows, as megatron's.

The outputs and input gradients are the collective-then-GEMM ones up to floating-point summation
order; the weight gradients are the same bits. `norm.sequence_parallel_spec(..., tp_overlap=True)`
swaps megatron-core's `ColumnParallelLinear`/`RowParallelLinear` for the classes below in a layer
spec (`overlapped_linear`; `--slimpack-tp-overlap`, local spec); every other case (no sequence
parallelism, TP 1, frozen weights, deferred embedding wgrad) runs megatron's own path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


@dataclass(frozen=True)
class Ring:
    """A TP group as a ring: this rank, the group size, and the global ranks it sends to and
    receives from."""
    group: dist.ProcessGroup
    rank: int
    size: int
    next: int
    previous: int

    @classmethod
    @functools.lru_cache(maxsize=None)
    def of(cls, group: dist.ProcessGroup) -> "Ring":
        """The ring of `group`, built once per group (every layer's every call asks for it)."""
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        return cls(group, rank, size, dist.get_global_rank(group, (rank + 1) % size),
                   dist.get_global_rank(group, (rank - 1) % size))

    def pass_on(self, outgoing: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Start sending `outgoing` to the next rank and receiving as many tensors of the same
        shapes from the previous one; returns the receive buffers and the requests to wait on."""
        incoming = [torch.empty_like(tensor) for tensor in outgoing]
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag) for tag, tensor in enumerate(outgoing)]
        ops += [dist.P2POp(dist.irecv, tensor, self.previous, self.group, tag) for tag, tensor in enumerate(incoming)]
        return incoming, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


def _rows(tensor: torch.Tensor, chunk: int, index: int) -> torch.Tensor:
    return tensor[index * chunk:(index + 1) * chunk]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _gather_multiply(shard: torch.Tensor, ring: Ring, multiply) -> None:
    """Pass every rank's `shard` around the ring, calling `multiply(index, chunk)` on each chunk
    (this rank's first) while the next one travels."""
    current = shard.contiguous()
    for step in range(ring.size - 1):
        (incoming,), requests = ring.pass_on([current])
        multiply((ring.rank - step) % ring.size, current)  # while `current` travels
        _wait(requests)
        current = incoming
    multiply((ring.rank + 1) % ring.size, current)


def _multiply_scatter(ring: Ring, partial, carried: torch.Tensor | None = None, receive=None) -> torch.Tensor:
    """The sum over ranks of `partial(index)` for this rank's chunk index: each chunk's running
    sum travels the ring, every rank adding its partial, computed while the previous sum travels.
    With `carried`, every rank's `carried` shard travels the ring beside the sums, and
    `receive(index, shard)` is called on each (this rank's first)."""
    running = partial((ring.rank - 1) % ring.size)
    if carried is not None:
        receive(ring.rank, carried)
    for step in range(1, ring.size):
        incoming, requests = ring.pass_on([running] if carried is None else [running, carried])
        own = partial((ring.rank - 1 - step) % ring.size)  # while `running` travels
        _wait(requests)
        running = own + incoming[0]
        if carried is not None:
            carried = incoming[1]
            receive((ring.rank - step) % ring.size, carried)
    return running


def _weight_grad(grad_output: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, fused: bool):
    """The gradient to return for `weight`, one GEMM over the whole gathered rows as megatron's
    (a sum of per-chunk GEMMs would round each partial to the weight's dtype: bf16). With
    gradient-accumulation fusion it is added to `weight.main_grad` and megatron's placeholder is
    returned (its DDP then skips the weight's own accumulation, as after megatron's fused wgrad
    kernel; the GEMM itself runs in the weight's dtype, as megatron's unfused path)."""
    grad = _flat(grad_output).t().matmul(_flat(inputs))
    if not (fused and hasattr(weight, "main_grad")):
        return grad
    weight.main_grad.add_(grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    placeholder = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return placeholder(weight.main_grad.shape, dtype=grad.dtype, device=grad.device)


class _GatherMatmul(torch.autograd.Function):
    """all-gather(shard along rows) @ weight.T (+ bias), as a ring."""

    @staticmethod
    def forward(ctx, shard, weight, bias, ring: Ring, fused: bool):
        chunk = shard.shape[0]
        output = shard.new_empty((chunk * ring.size, *shard.shape[1:-1], weight.shape[0]))
        _gather_multiply(shard, ring, lambda index, rows: torch.matmul(rows, weight.t(),
                                                                       out=_rows(output, chunk, index)))
        if bias is not None:
            output += bias
        ctx.save_for_backward(shard, weight)
        ctx.ring, ctx.fused, ctx.has_bias = ring, fused, bias is not None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        ring, chunk = ctx.ring, shard.shape[0]
        grad_output = grad_output.contiguous()
        # the input shards travel with the input gradient's partial sums: regathered, not saved whole
        full = shard.new_empty((chunk * ring.size, *shard.shape[1:]))
        grad_shard = _multiply_scatter(ring, lambda index: torch.matmul(_rows(grad_output, chunk, index), weight),
                                       shard.contiguous(), lambda index, rows: _rows(full, chunk, index).copy_(rows))
        grad_bias = _flat(grad_output).sum(dim=0) if ctx.has_bias else None
        return grad_shard, _weight_grad(grad_output, full, weight, ctx.fused), grad_bias, None, None


class _MatmulScatter(torch.autograd.Function):
    """reduce-scatter(full @ weight.T) along rows, as a ring."""

    @staticmethod
    def forward(ctx, full, weight, ring: Ring, fused: bool):
        chunk = full.shape[0] // ring.size
        ctx.save_for_backward(full, weight)
        ctx.ring, ctx.fused = ring, fused
        return _multiply_scatter(ring, lambda index: torch.matmul(_rows(full, chunk, index), weight.t()))

    @staticmethod
    def backward(ctx, grad_shard):
        full, weight = ctx.saved_tensors
        ring, chunk = ctx.ring, grad_shard.shape[0]
        grad_full = torch.empty_like(full)
        grad_output = grad_shard.new_empty((chunk * ring.size, *grad_shard.shape[1:]))

        def multiply(index, grad_rows):
            torch.matmul(grad_rows, weight, out=_rows(grad_full, chunk, index))
            _rows(grad_output, chunk, index).copy_(grad_rows)

        _gather_multiply(grad_shard, ring, multiply)
        return grad_full, _weight_grad(grad_output, full, weight, ctx.fused), None, None


def _ring_applies(linear, weight: torch.Tensor) -> bool:
    return (linear.sequence_parallel and linear.tp_group is not None and Ring.of(linear.tp_group).size > 1
            and weight.requires_grad and not getattr(linear, "explicit_expert_comm", False))


class OverlappedColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's `ColumnParallelLinear` whose sequence-parallel input gather runs as a ring
    behind the GEMM (`_GatherMatmul`)."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not (_ring_applies(self, weight) and kwargs.get("sequence_parallel")
                and kwargs.get("grad_output_buffer") is None and not kwargs.get("allreduce_dgrad")):
            return super()._forward_impl(input, weight, *args, **kwargs)
        return _GatherMatmul.apply(input, weight, kwargs.get("bias"), Ring.of(self.tp_group),
                                   bool(kwargs.get("gradient_accumulation_fusion")))


class OverlappedRowParallelLinear(RowParallelLinear):
    """megatron-core's `RowParallelLinear` whose sequence-parallel output reduce-scatter runs as a
    ring behind the GEMM (`_MatmulScatter`)."""

    def forward(self, input_):
        if not (_ring_applies(self, self.weight) and self.input_is_parallel):
            return super().forward(input_)
        ring = Ring.of(self.tp_group)
        if input_.shape[0] % ring.size:
            raise ValueError(f"sequence parallelism needs the token count ({input_.shape[0]}) to be a multiple of the "
                             f"TP size ({ring.size}); SlimPack batches are padded to it (runtime/attention/batch.py)")
        output = _MatmulScatter.apply(input_, self.weight, ring, bool(self.gradient_accumulation_fusion))
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


_OVERLAPPED = {ColumnParallelLinear: OverlappedColumnParallelLinear, RowParallelLinear: OverlappedRowParallelLinear}


def overlapped_linear(module):
    """The overlapped class for megatron-core's local linear `module`, or None for any other module."""
    return _OVERLAPPED.get(module) if isinstance(module, type) else None


__all__ = ["Ring", "OverlappedColumnParallelLinear", "OverlappedRowParallelLinear", "overlapped_linear"]
