"""The global-batch sampler: document lengths -> global batches the way a trainer sees them (a
token budget per step, seeded random order, nothing truncated). A document longer than the
context is what the caller says (`long_documents`): refused (the default), split at the context
length, or left out; the sampler counts what it split or left out."""
from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ..plan import Sample
from .lengths import WorkloadError, as_length_array, load_lengths, positive_int

# What a document longer than the context becomes: "split" cuts it into pieces of the context
# length, each a sample of its own (the paper's setting); "drop" leaves it out; "error" refuses
# the corpus before any batch is drawn.
LONG_DOCUMENT_MODES = ("split", "drop", "error")
DEFAULT_LONG_DOCUMENTS = "error"

# The most samples (documents or pieces) one global batch may be expected to hold. The paper's
# batches hold about 130,000 (128M tokens of ~1,000-token documents) and plan in seconds; time and
# memory grow with the count: a million samples (longtail, 3,800 sequences of 256K tokens) took
# 45 s and 1.2 GB on one shared core. A batch far above that (a context length of 2^30 tokens:
# 31 million samples of the `text` workload) would be drawn and planned for hours, or run out of
# memory, without a word; it is refused up front instead.
MAX_SAMPLES_PER_BATCH = 1_000_000


def check_long_documents(value) -> str:
    """`value` if it is one of `LONG_DOCUMENT_MODES`, else WorkloadError naming them."""
    if not isinstance(value, str) or value not in LONG_DOCUMENT_MODES:
        raise WorkloadError(f"long_documents must be one of {', '.join(LONG_DOCUMENT_MODES)}, got {value!r}: "
                            "split cuts a document longer than the context into pieces of the context length, "
                            "drop leaves it out, error refuses such a corpus")
    return value


class LongDocumentsError(WorkloadError):
    """A corpus with documents longer than the context that the chosen mode cannot take: "error"
    refuses any, "drop" refuses a corpus of nothing else. `message(mode_option, context_option)`
    says it with a command line's spellings (the sampler's own message: the `slimpack` command's,
    with the Python keyword)."""

    def __init__(self, lengths: np.ndarray, context_length: int, mode: str):
        too_long = lengths[lengths > context_length]
        self.count, self.documents = int(too_long.size), int(lengths.size)
        self.longest, self.shortest = int(too_long.max()), int(too_long.min())
        self.context_length, self.mode = context_length, mode
        super().__init__(self.message("--long-documents", "--context-length", python=True))

    def __reduce__(self):
        # Rebuilt from its figures, so it crosses processes (a planner worker) intact.
        return _rebuild_long_documents_error, (self.count, self.documents, self.longest, self.shortest,
                                               self.context_length, self.mode)

    def message(self, mode_option: str, context_option: str, *, python: bool = False) -> str:
        keyword = " (from Python: long_documents='split' or 'drop')" if python else ""
        context = self.context_length
        if self.mode == "drop":
            every = "the only document is" if self.documents == 1 else f"all {self.documents:,} documents are"
            return (f"{every} longer than the context length of {context:,} "
                    f"tokens (the shortest: {self.shortest:,} tokens), so {mode_option} drop leaves none to draw a "
                    f"batch from: give {mode_option} split to cut them into pieces of {context:,} tokens, each a "
                    f"sample of its own{keyword}, or a {context_option} of at least {self.shortest:,}")
        return (f"{self.count:,} of the {_documents(self.documents)} {'is' if self.count == 1 else 'are'} longer than "
                f"the context length of {context:,} tokens (the longest: {self.longest:,} tokens); say what to do "
                f"with them: {mode_option} split cuts each into pieces of at most {context:,} tokens, each a sample "
                f"of its own; {mode_option} drop leaves them out{keyword}; or a {context_option} of at least "
                f"{self.longest:,} keeps every document whole")


def _documents(count: int) -> str:
    return f"{count:,} document{'' if count == 1 else 's'}"


def _rebuild_long_documents_error(count, documents, longest, shortest, context_length, mode) -> LongDocumentsError:
    error = LongDocumentsError.__new__(LongDocumentsError)
    error.count, error.documents, error.longest, error.shortest = count, documents, longest, shortest
    error.context_length, error.mode = context_length, mode
    WorkloadError.__init__(error, error.message("--long-documents", "--context-length", python=True))
    return error


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
    # Documents longer than the context left out while this batch was drawn ("drop"), and their
    # tokens: one per draw (a document drawn again in a later epoch counts again).
    dropped_documents: int = 0
    dropped_tokens: int = 0


@dataclass(frozen=True)
class GlobalBatch:
    """One global batch: sample i has `lengths[i]` tokens, taken from document
    `sources[i][0]` starting at token `sources[i][1]`. `dropped`: the documents longer than the
    context left out while it was drawn ("drop")."""

    step: int
    lengths: list[int]
    sample_ids: list[int]
    sources: list[tuple[int, int]]
    stats: BatchStats
    dropped: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.stats.num_tokens

    def samples(self) -> list[Sample]:
        """The batch as planner input (`plan.Sample` objects)."""
        return [Sample(sample_id, length) for sample_id, length in zip(self.sample_ids, self.lengths)]


class GlobalBatchSampler:
    """Seeded global batches of at most `global_batch_size * context_length` tokens.

    Documents are drawn without replacement in a random order that is reshuffled every epoch
    (seed + epoch). A document longer than `context_length` is what `long_documents` says:
    "error" (the default) refuses such a corpus here, before any batch is drawn
    (`LongDocumentsError`: how many, the longest, the fix); "split" cuts it into pieces of exactly
    `context_length` tokens plus a remainder, each a sample of its own; "drop" skips it when it
    is drawn (counted in `dropped_documents` / `dropped_tokens` and each batch's stats). Pieces
    fill the budget in order; the first piece that does not fit closes the batch and opens the
    next one, so no token is truncated (the batch may leave part of its budget unused; see
    `BatchStats.fill_ratio`). `state_dict()` / `load_state_dict()` resume exactly where a run
    stopped.
    """

    def __init__(self, lengths, context_length: int, global_batch_size: int, seed: int = 0,
                 long_documents: str = DEFAULT_LONG_DOCUMENTS):
        self.lengths = as_length_array(lengths, what="lengths")
        self.context_length = positive_int(context_length, "context_length")
        self.global_batch_size = positive_int(global_batch_size, "global_batch_size")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise WorkloadError(f"seed must be a non-negative integer, got {seed!r}")
        self.seed: int = int(seed)
        self.long_documents: str = check_long_documents(long_documents)
        self.token_budget: int = self.context_length * self.global_batch_size
        too_long = int(np.count_nonzero(self.lengths > self.context_length))
        if too_long and (long_documents == "error" or (long_documents == "drop" and too_long == self.lengths.size)):
            raise LongDocumentsError(self.lengths, self.context_length, long_documents)
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
        self.dropped_documents = 0  # documents left out so far ("drop"; counted when drawn)
        self.dropped_tokens = 0  # their tokens
        self._dropped: list[int] = []  # those left out while the batch being drawn was
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + epoch).permutation(self.lengths.size)

    def _draw_document(self) -> int:
        while True:
            if self._cursor == self.lengths.size:
                self.epoch += 1
                self._cursor = 0
                self._order = self._epoch_order(self.epoch)
            document = int(self._order[self._cursor])
            self._cursor += 1
            length = int(self.lengths[document])
            if length <= self.context_length:
                break
            if self.long_documents == "drop":  # the constructor made sure some document fits
                self.dropped_documents += 1
                self.dropped_tokens += length
                self._dropped.append(document)
                continue
            self.split_documents += 1
            self.split_pieces += -(-length // self.context_length)
            break
        self._document = document
        self._offset = 0
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
        self._dropped = []
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
            dropped=self._dropped,
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
            dropped_documents=len(self._dropped),
            dropped_tokens=int(sum(self.lengths[document] for document in self._dropped)),
        )

    def __iter__(self) -> Iterator[GlobalBatch]:
        return self

    def __next__(self) -> GlobalBatch:
        return self.next_batch()

    # ---- checkpointing ------------------------------------------------------------------
    def _fingerprint(self) -> str:
        # Resuming over different lengths or settings would silently yield other batches; refuse instead.
        digest = hashlib.sha256(self.lengths.tobytes())
        digest.update(f"{self.context_length}/{self.global_batch_size}/{self.seed}/{self.long_documents}".encode())
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
            "dropped_documents": self.dropped_documents,
            "dropped_tokens": self.dropped_tokens,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self._fingerprint():
            raise WorkloadError(
                "sampler state belongs to different lengths, context_length, global_batch_size, seed or "
                "long_documents; resume with the same workload and settings as the run that saved it"
            )
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self._cursor = int(state["cursor"])
        self._document = None if state["document"] is None else int(state["document"])
        self._offset = int(state["offset"])
        self.split_documents = int(state["split_documents"])
        self.split_pieces = int(state["split_pieces"])
        self.dropped_documents = int(state["dropped_documents"])
        self.dropped_tokens = int(state["dropped_tokens"])
        self._order = self._epoch_order(self.epoch)


def long_document_note(batches: Sequence[GlobalBatch], lengths, context_length: int, *,
                       option: str | None = "--long-documents") -> str | None:
    """One line on the documents longer than the context in `batches` (drawn from `lengths`):
    how many were split and into how many pieces, or left out and how many tokens; None when
    there were none. `option`: how the caller spells the choice (None: it offers none)."""
    lengths = np.asarray(lengths)
    dropped = np.array([document for batch in batches for document in batch.dropped], dtype=np.int64)
    if dropped.size:
        distinct = int(np.unique(dropped).size)
        draws = f" (drawn {dropped.size:,} times)" if dropped.size > distinct else ""
        choice = f" ({option} drop; {option} split would cut them into pieces of the context length)" if option else ""
        return (f"{_documents(distinct)} longer than the context length of {context_length:,} tokens left out"
                f"{draws}, {int(lengths[dropped].sum()):,} tokens in all{choice}")
    documents = np.array([document for batch in batches for document, _ in batch.sources], dtype=np.int64)
    pieces = documents[lengths[documents] > context_length] if documents.size else documents
    if not pieces.size:
        return None
    split = np.unique(pieces)
    choice = f" ({option} split; {option} drop leaves them out, {option} error refuses them)" if option else ""
    return (f"{_documents(int(split.size))} longer than the context length of {context_length:,} tokens (the "
            f"longest: {int(lengths[split].max()):,} tokens) split into pieces of at most {context_length:,} tokens, "
            f"each a sample of its own: {int(pieces.size):,} such pieces in these batches{choice}")


def corpus_long_document_note(lengths, context_length: int, long_documents: str, *,
                              options: tuple[str | None, str] = ("--long-documents", "--context-length")) -> str | None:
    """One line on the documents of a whole corpus longer than the context and what
    `long_documents` makes of them (split or left out); None when it has none. `options`: how the
    caller spells the choice (None: it offers none) and the context length."""
    lengths = np.asarray(lengths)
    too_long = lengths[lengths > context_length]
    if not too_long.size or long_documents == "error":  # (the sampler refuses such a corpus under "error")
        return None
    option, context_option = options
    found = (f"{too_long.size:,} of the {_documents(lengths.size)} {'is' if too_long.size == 1 else 'are'} longer "
             f"than {context_option} {context_length:,} (the longest: {int(too_long.max()):,} tokens)")
    if long_documents == "drop":
        choice = f" ({option} drop; {option} split would cut them into pieces of {context_length:,} tokens)"
        return f"{found}: left out of every batch, {int(too_long.sum()):,} tokens in all{choice if option else ''}"
    pieces = int(np.sum(-(-too_long // context_length)))
    choice = f"; {option} split, {option} drop leaves them out" if option else ""
    return (f"{found}: each is split into pieces of at most {context_length:,} tokens, each a sample of its own "
            f"({pieces:,} pieces per epoch{choice})")


def expected_samples_per_batch(lengths, context_length: int, global_batch_size: int,
                               long_documents: str = DEFAULT_LONG_DOCUMENTS) -> float:
    """About how many samples (documents, or pieces of split ones) a global batch of
    `global_batch_size * context_length` tokens holds: the budget over the mean sample length."""
    array = as_length_array(lengths, what="lengths")
    context_length = positive_int(context_length, "context_length")
    budget = context_length * positive_int(global_batch_size, "global_batch_size")
    if long_documents == "drop" and np.any(array <= context_length):
        array = array[array <= context_length]
    if long_documents == "split":
        samples = int(np.sum(-(-array // context_length)))
    else:
        samples = int(array.size)
    return budget / (float(array.sum()) / samples)


def check_batch_scale(lengths, context_length: int, global_batch_size: int,
                      long_documents: str = DEFAULT_LONG_DOCUMENTS, *,
                      options: tuple[str, str] = ("--global-batch-size", "--context-length")) -> None:
    """WorkloadError where a global batch of this workload would hold more than
    `MAX_SAMPLES_PER_BATCH` samples: too many to draw and plan in reasonable time and memory.
    `options`: how the caller spells the batch size and the context length in the fix."""
    expected = expected_samples_per_batch(lengths, context_length, global_batch_size, long_documents)
    if expected <= MAX_SAMPLES_PER_BATCH:
        return
    budget = context_length * global_batch_size
    batch_option, context_option = options
    raise WorkloadError(
        f"a global batch of {global_batch_size:,} sequences of {context_length:,} tokens ({budget:,} tokens) holds "
        f"about {expected:,.0f} samples of this workload, more than the {MAX_SAMPLES_PER_BATCH:,} the planner "
        f"handles in reasonable time and memory (the paper's batches hold about 130,000): lower {batch_option} or "
        f"{context_option} (at most {MAX_SAMPLES_PER_BATCH / expected * budget:,.0f} tokens per batch here)")


def global_batches(
    spec: str, context_length: int, global_batch_size: int, steps: int, seed: int = 0,
    long_documents: str = DEFAULT_LONG_DOCUMENTS,
) -> list[GlobalBatch]:
    """`steps` global batches drawn from the length source `spec` (same seed for both);
    `long_documents`: what a document longer than the context becomes (`GlobalBatchSampler`)."""
    return draw_global_batches(load_lengths(spec, seed=seed), context_length, global_batch_size, steps, seed,
                               long_documents)


def draw_global_batches(lengths, context_length: int, global_batch_size: int, steps: int, seed: int = 0,
                        long_documents: str = DEFAULT_LONG_DOCUMENTS) -> list[GlobalBatch]:
    """The first `steps` global batches of `lengths`, after checking that a batch of this size can
    be planned (`check_batch_scale`); the sampler's errors as it raises them."""
    steps = positive_int(steps, "steps")
    sampler = GlobalBatchSampler(lengths, context_length, global_batch_size, seed=seed, long_documents=long_documents)
    check_batch_scale(lengths, context_length, global_batch_size, long_documents)
    return [sampler.next_batch() for _ in range(steps)]
