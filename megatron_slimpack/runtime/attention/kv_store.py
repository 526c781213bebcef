"""The per-document KV store of sliced attention (docs/design.md section 3).

A slice's queries attend to its document's earlier slices. Their K/V live here, per (sample,
layer), as detached leaves that require grad. Later slices read them through `PrefixRead`, whose
backward adds each later slice's dK/dV into the entry's fp32 accumulators (`grad_key`,
`grad_value`; the leaves' own `.grad` stays empty): a long document's prefix collects gradients
from many slices, and summing them in bf16 would round at every addition. `KVGradHandOff` adds
the accumulated gradients, cast once to the model's dtype, to the slice's own K/V when the slice
itself runs backward (complete by then: backward runs a chain's MicroPacks in reverse), then
frees the entry.

Forward re-runs are normal under Megatron's activation recompute (`CheckpointFunction` runs a
layer's forward once without grad, then again in backward with grad). So every side effect here
is idempotent: a slice's prefix is the entries that start *before* it (never its own), `put` of a
stored slice returns the first run's entry (with the gradients accumulated in it), and the
gradient hand-off is wired only in a grad-enabled pass.

`stored_and_prefixed` is the one loop both attention paths (whole MicroPacks and a DP-Merge
member's share) run per layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, cast

import torch
from torch import Tensor


@dataclass
class KVEntry:
    """K/V of one finished slice in one layer, and the fp32 sums of later slices' dK/dV (None
    until a later slice's backward has run)."""

    key: Tensor
    value: Tensor
    grad_key: Optional[Tensor] = None
    grad_value: Optional[Tensor] = None

    @property
    def length(self) -> int:
        return self.key.shape[0]

    def accumulate(self, grad_key: Optional[Tensor], grad_value: Optional[Tensor]) -> None:
        """Add one later slice's dK/dV in fp32."""
        # The first gradient is copied (autograd may reuse its buffer), later ones added in place.
        if grad_key is not None:
            self.grad_key = (grad_key.to(torch.float32, copy=True) if self.grad_key is None
                             else self.grad_key.add_(grad_key))
        if grad_value is not None:
            self.grad_value = (grad_value.to(torch.float32, copy=True) if self.grad_value is None
                               else self.grad_value.add_(grad_value))


class PrefixRead(torch.autograd.Function):
    """Identity on a stored slice's (key, value) leaves; backward adds their gradients to the
    entry's fp32 accumulators and passes nothing on to the leaves."""

    @staticmethod
    def forward(ctx, key, value, entry):
        ctx.entry = entry
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        return key.view_as(key), value.view_as(value)

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        ctx.entry.accumulate(grad_key, grad_value)
        return None, None, None


def read_prefix(entry: KVEntry) -> tuple[Tensor, Tensor]:
    """The entry's (key, value) for a later slice's attention; its gradients reach the entry's
    fp32 accumulators (outside autograd, no accumulation: the leaves as they are)."""
    if not torch.is_grad_enabled():
        return entry.key, entry.value
    return PrefixRead.apply(entry.key, entry.value, entry)


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
        """Bytes of the stored K/V and of their accumulated (fp32) gradients."""
        total = 0
        for slices in self._entries.values():
            for entry in slices.values():
                for tensor in (entry.key, entry.value, entry.grad_key, entry.grad_value):
                    total += 0 if tensor is None else tensor.numel() * tensor.element_size()
        return total


def slice_prefix(store: Optional[KVStore], sample_id: int, layer: int, start: int) -> list[KVEntry]:
    """The K/V of a slice's earlier slices; refuses a slice whose earlier slices are missing."""
    prefix = store.prefix(sample_id, layer, before=start) if store is not None else []
    held = sum(entry.length for entry in prefix)
    if held != start:
        raise RuntimeError(
            f"slice [{start}, ...) of sample {sample_id} in layer {layer} found {held} prefix tokens in "
            "the KV store: its earlier slices must run forward first (and not be freed yet)"
        )
    return prefix


class KVGradHandOff(torch.autograd.Function):
    """Identity on (k, v); in backward adds the dK/dV that later slices accumulated (in fp32) in
    the stored entries, cast once to the gradient's dtype, then frees the entries."""

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
            if entry.grad_key is not None:
                grad_key[begin:end] = (entry.grad_key + grad_key[begin:end]).to(grad_key.dtype)
            if entry.grad_value is not None:
                grad_value[begin:end] = (entry.grad_value + grad_value[begin:end]).to(grad_value.dtype)
            ctx.store.free(sample_id, ctx.layer, start)
        return grad_key, grad_value, None, None, None


def stored_and_prefixed(store: Optional[KVStore], layer: int, key: Tensor, value: Tensor, bounds: Sequence[int],
                        sample_ids: Sequence[int], starts: Sequence[int],
                        keeps_kv: Sequence[bool]) -> tuple[Tensor, Tensor]:
    """The kernel's keys and values: per slice (rows [bounds[i], bounds[i+1]) of key/value, in
    natural position order), its stored prefix followed by its own rows. Stores the slices a
    later slice continues and wires their gradient hand-off (in a grad-enabled pass)."""
    owners, prefixes = [], []
    for i, (sample_id, start) in enumerate(zip(sample_ids, starts)):
        begin, end = bounds[i], bounds[i + 1]
        prefixes.append(slice_prefix(store, sample_id, layer, start))
        if keeps_kv[i]:
            # Slices that keep their keys and values come with a store.
            entry = cast(KVStore, store).put(sample_id, layer, start, key[begin:end], value[begin:end])
            owners.append((begin, end, sample_id, start, entry))
    if owners and torch.is_grad_enabled():
        key, value = KVGradHandOff.apply(key, value, store, layer, owners)
    if not any(prefixes):  # no prefixes anywhere: the kernel reads k/v as they are
        return key, value
    keys, values = [], []
    for i, prefix in enumerate(prefixes):
        for entry in prefix:
            stored_key, stored_value = read_prefix(entry)
            keys.append(stored_key)
            values.append(stored_value)
        keys.append(key[bounds[i]:bounds[i + 1]])
        values.append(value[bounds[i]:bounds[i + 1]])
    return torch.cat(keys), torch.cat(values)
