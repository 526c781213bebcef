"""The global-batch sampler: document lengths -> global batches the way a trainer sees them (a
token budget per step, seeded random order, documents longer than the context split at it,
nothing dropped or truncated)."""
from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..plan import Sample
from .lengths import WorkloadError, as_length_array, load_lengths, positive_int


@dataclass(frozen=True)
class BatchStats:
    """What one global batch holds and how well it fills its token budget."""

    num_samples: int
    num_tokens: int
    token_budget: int
    fill_ratio: float  # num_tokens / token_budget
    split_documents: int  # documents longer than the context with a piece in this batch
    split_pieces: int  # pieces of such documents in this batch
    epoch: int  # the epoch the batch's last piece was drawn in


@dataclass(frozen=True)
class GlobalBatch:
    """One global batch: sample i has `lengths[i]` tokens, taken from document
    `sources[i][0]` starting at token `sources[i][1]`."""

    step: int
    lengths: list[int]
    sample_ids: list[int]
    sources: list[tuple[int, int]]
    stats: BatchStats

    @property
    def num_tokens(self) -> int:
        return self.stats.num_tokens

    def samples(self) -> list[Sample]:
        """The batch as planner input (`plan.Sample` objects)."""
        return [Sample(sample_id, length) for sample_id, length in zip(self.sample_ids, self.lengths)]


class GlobalBatchSampler:
    """Seeded global batches of at most `global_batch_size * context_length` tokens.

    Documents are drawn without replacement in a random order that is reshuffled every epoch
    (seed + epoch). A document longer than `context_length` is split into pieces of exactly
    `context_length` tokens plus a remainder. Pieces fill the budget in order; the first piece
    that does not fit closes the batch and opens the next one, so no token is dropped or
    truncated (the batch may leave part of its budget unused; see `BatchStats.fill_ratio`).
    `state_dict()` / `load_state_dict()` resume exactly where a run stopped.
    """

    def __init__(self, lengths, context_length: int, global_batch_size: int, seed: int = 0):
        self.lengths = as_length_array(lengths, what="lengths")
        self.context_length = positive_int(context_length, "context_length")
        self.global_batch_size = positive_int(global_batch_size, "global_batch_size")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise WorkloadError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed: int = int(seed)
        self.token_budget: int = self.context_length * self.global_batch_size
        self._reset()

    # ---- position -----------------------------------------------------------------------
    def _reset(self) -> None:
        self.step = 0
        self.epoch = 0
        self._cursor = 0  # next position in this epoch's order
        self._document: int | None = None  # document being consumed, if any
        self._offset = 0  # its next unconsumed token
        self.split_documents = 0  # documents split so far (counted when drawn)
        self.split_pieces = 0  # pieces those documents were split into
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + epoch).permutation(self.lengths.size)

    def _draw_document(self) -> int:
        if self._cursor == self.lengths.size:
            self.epoch += 1
            self._cursor = 0
            self._order = self._epoch_order(self.epoch)
        document = self._document = int(self._order[self._cursor])
        self._cursor += 1
        self._offset = 0
        length = int(self.lengths[document])
        if length > self.context_length:
            self.split_documents += 1
            self.split_pieces += -(-length // self.context_length)
        return document

    def _next_piece(self) -> tuple[int, int, int]:
        """(document, start, length) of the next piece, without consuming it."""
        document = self._draw_document() if self._document is None else self._document
        remaining = int(self.lengths[document]) - self._offset
        return document, self._offset, min(self.context_length, remaining)

    def _consume(self, length: int) -> None:
        self._offset += length
        if self._offset == self.lengths[self._document]:
            self._document = None

    # ---- batches ------------------------------------------------------------------------
    def next_batch(self) -> GlobalBatch:
        lengths: list[int] = []
        sources: list[tuple[int, int]] = []
        used = 0
        while True:
            document, start, length = self._next_piece()
            if used + length > self.token_budget:
                break  # this piece opens the next batch; every piece fits an empty one
            self._consume(length)
            lengths.append(length)
            sources.append((document, start))
            used += length
        batch = GlobalBatch(
            step=self.step,
            lengths=lengths,
            sample_ids=list(range(len(lengths))),
            sources=sources,
            stats=self._stats(lengths, sources, used),
        )
        self.step += 1
        return batch

    def _stats(self, lengths: list[int], sources: list[tuple[int, int]], used: int) -> BatchStats:
        split = [doc for doc, _ in sources if self.lengths[doc] > self.context_length]
        return BatchStats(
            num_samples=len(lengths),
            num_tokens=used,
            token_budget=self.token_budget,
            fill_ratio=used / self.token_budget,
            split_documents=len(set(split)),
            split_pieces=len(split),
            epoch=self.epoch,
        )

    def __iter__(self) -> Iterator[GlobalBatch]:
        return self

    def __next__(self) -> GlobalBatch:
        return self.next_batch()

    # ---- checkpointing ------------------------------------------------------------------
    def _fingerprint(self) -> str:
        # Resuming over different lengths would silently yield other batches; refuse instead.
        digest = hashlib.sha256(self.lengths.tobytes())
        digest.update(f"{self.context_length}/{self.global_batch_size}/{self.seed}".encode())
        return digest.hexdigest()[:16]

    def state_dict(self) -> dict:
        """JSON-serialisable position; `load_state_dict` continues with exactly the same batches."""
        return {
            "fingerprint": self._fingerprint(),
            "step": self.step,
            "epoch": self.epoch,
            "cursor": self._cursor,
            "document": self._document,
            "offset": self._offset,
            "split_documents": self.split_documents,
            "split_pieces": self.split_pieces,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self._fingerprint():
            raise WorkloadError(
                "sampler state belongs to different lengths, context_length, global_batch_size or seed; "
                "resume with the same workload and settings as the run that saved it"
            )
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self._cursor = int(state["cursor"])
        self._document = None if state["document"] is None else int(state["document"])
        self._offset = int(state["offset"])
        self.split_documents = int(state["split_documents"])
        self.split_pieces = int(state["split_pieces"])
        self._order = self._epoch_order(self.epoch)


def global_batches(
    spec: str, context_length: int, global_batch_size: int, steps: int, seed: int = 0
) -> list[GlobalBatch]:
    """`steps` global batches drawn from the length source `spec` (same seed for both)."""
    steps = positive_int(steps, "steps")
    sampler = GlobalBatchSampler(load_lengths(spec, seed=seed), context_length, global_batch_size, seed=seed)
    return [sampler.next_batch() for _ in range(steps)]
