"""The parts of a plan: samples and where their tokens come from, slices, MicroPacks, stage
tasks and replica plans, with the array code over them that the plan, its validator, the
planner and the simulator share (`slice_table`, `pack_figures`, `backward_sequence`, ...).

The `Plan` of a whole global batch is in `plan.py`, its rules in `validate.py`; both build on
these types, so this module imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain, repeat
from operator import itemgetter
from typing import Iterable, NamedTuple, Sequence

import numba
import numpy as np

from ..errors import SlimPackError


class PlanError(SlimPackError):
    """A plan (or planner input) that breaks a rule; the message names the rule and the culprit."""


class Sample(NamedTuple):
    """One document of `length` tokens; `sample_id` is unique within the global batch."""

    sample_id: int
    length: int


class SampleSource(NamedTuple):
    """Where a sample's tokens come from: tokens [offset, offset + length) of corpus document
    `document` (length: the sample's). Strategies that cut or renumber documents (megatron-fixed,
    slimpipe, wlb-llm) record each sample's origin here, so token sources never treat a sample id
    as an index into the batch."""

    document: int
    offset: int


def default_sources(count: int) -> list[SampleSource]:
    """(i, 0) for the i-th input length: each length is a whole document of its own. A count
    equal to the last one gets a copy of the last result (a layout search plans one batch on
    hundreds of layouts; the tuples are immutable, the list is the caller's own)."""
    if _last_default_sources[0] != count:
        _last_default_sources[:] = [count, sources_of(range(count), repeat(0))]
    return list(_last_default_sources[1])


_last_default_sources: list = [-1, []]  # (the count, its sources) of `default_sources`' last call


def sources_of(documents: Iterable[int], offsets: Iterable[int]) -> list[SampleSource]:
    """SampleSource(document, offset) of each pair of Python ints, in order."""
    # tuple.__new__ through map: a third of the NamedTuple constructor's time, for ~10^5 samples
    return list(map(tuple.__new__, repeat(SampleSource), zip(documents, offsets)))


def check_sources(sources, count: int) -> list[SampleSource]:
    """`sources` (one (document, offset) pair per input length; None: `default_sources`) as
    SampleSource tuples of Python ints, or PlanError."""
    if sources is None:
        return default_sources(count)
    if len(sources) != count:
        raise PlanError(f"sample-sources: {len(sources)} sources given for {count} lengths; give one "
                        "(document, offset) pair per length")
    try:
        if not all(len(pair) == 2 for pair in sources):
            raise TypeError("an entry is not a pair")
        flat = np.fromiter(chain.from_iterable(sources), dtype=np.int64, count=2 * count)
    except (TypeError, ValueError, OverflowError) as error:
        raise PlanError(f"sample-sources: sources must be (document, offset) integer pairs ({error})") from error
    if count and flat.min() < 0:
        index = int(np.argmax(flat < 0)) // 2
        raise PlanError(f"sample-sources: source {index} is {tuple(flat[2 * index:2 * index + 2].tolist())}; "
                        "documents and offsets are non-negative")
    values = iter(flat.tolist())
    return sources_of(values, values)  # consecutive (document, offset) pairs


def overlapping_documents(sources, lengths) -> list[int]:
    """Documents of which two of `sources` (with `lengths`) overlap, sorted. A global batch holds
    a document twice only when it spans an epoch boundary (small corpora); a plan records those of
    its input (`Plan.repeated_documents`), whose pieces may then overlap."""
    count = len(lengths)
    if count < 2:
        return []
    table = np.fromiter(chain.from_iterable(sources), dtype=np.int64, count=2 * count).reshape(-1, 2)
    return sorted(set(overlaps(table[:, 0], table[:, 1], np.asarray(lengths, dtype=np.int64))[0].tolist()))


def overlaps(document: np.ndarray, offset: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(documents, index pairs) of the overlaps between neighbours in (document, offset) order (in
    sorted order, a range that overlaps a later one overlaps its next neighbour)."""
    order = np.lexsort((offset, document))
    same = document[order][1:] == document[order][:-1]
    overlap = np.flatnonzero(same & (offset[order][:-1] + length[order][:-1] > offset[order][1:]))
    return document[order][overlap], np.stack([order[overlap], order[overlap + 1]], axis=1)


class Slice(NamedTuple):
    """Tokens [start, end) of a sample. Its queries attend to [0, end) of the same sample.
    (A NamedTuple: the planner creates hundreds of thousands per step.)"""

    sample_id: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def attention_pairs(self) -> int:
        """(query, key) pairs under causal masking, the KV prefix included."""
        n = self.length
        return n * self.start + n * (n + 1) // 2


def samples_of(lengths: Iterable[int]) -> list[Sample]:
    """Sample(i, length) for the i-th length (tuple.__new__, as in `whole_slices`). A list equal to
    the last one given gets a copy of the last result: a layout search plans one batch on hundreds
    of layouts (~10^5 documents at 256K: 50 ms to make, 1 ms to compare and copy)."""
    if isinstance(lengths, list) and lengths == _last_batch.lengths:
        return list(_last_batch.samples)
    samples = list(map(tuple.__new__, repeat(Sample), enumerate(lengths)))
    if isinstance(lengths, list):
        _last_batch.keep(list(lengths), samples)
        return list(samples)
    return samples


def whole_slices_of(lengths: list[int]) -> list[Slice]:
    """Slice(i, 0, length) of the i-th length: each document whole, indexed by sample id. Kept for
    the last batch `samples_of` was given (read only: the tuples are immutable; copy the list
    before changing it), so a search's plannings of one batch pick their MicroPacks' slices from
    it instead of making ~10^5 tuples each."""
    if not isinstance(lengths, list) or lengths != _last_batch.lengths:
        samples_of(list(lengths))
    if _last_batch.whole is None:
        _last_batch.whole = whole_slices(_last_batch.samples)
    return _last_batch.whole


class _LastBatch:
    """The lengths `samples_of` was last given as a list, their samples and (once asked for)
    their whole slices."""

    def __init__(self):
        self.keep(None, [])

    def keep(self, lengths: list[int] | None, samples: list[Sample]) -> None:
        self.lengths, self.samples = lengths, samples
        self.whole: list[Slice] | None = None


_last_batch = _LastBatch()


def whole_slices(samples: Iterable[Sample]) -> list[Slice]:
    """Slice(sample_id, 0, length) of each sample (tuple.__new__: ~2x faster than the NamedTuple
    constructor, which matters for the ~10^5 documents of a long-context global batch)."""
    samples = list(samples)
    return list(map(tuple.__new__, repeat(Slice), zip(map(itemgetter(0), samples), repeat(0),
                                                      map(itemgetter(1), samples))))


@dataclass
class MicroPack:
    """Slices of different samples run as one packed (THD) forward call."""

    slices: list[Slice]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.slices)

    @property
    def attention_pairs(self) -> int:
        return sum(s.attention_pairs for s in self.slices)

    @property
    def sample_ids(self) -> list[int]:
        return [s.sample_id for s in self.slices]


# ("F", forward_unit_index) or ("B", backward_unit_index); with virtual pipeline stages
# (ParallelConfig.vpp > 1) every task also names its model chunk: ("F", unit, chunk).
Task = tuple


def task_chunk(task: Task) -> int:
    """The model chunk a stage-order task runs on (0 without virtual stages)."""
    return task[2] if len(task) > 2 else 0


def tasks_of_chunk(order: list[Task], chunk: int) -> list[tuple[str, int]]:
    """The (kind, unit) tasks of one model chunk, in program order."""
    return [(task[0], task[1]) for task in order if task_chunk(task) == chunk]


def slice_table(micropacks: list[MicroPack]) -> tuple[np.ndarray, np.ndarray]:
    """(slices per MicroPack, every slice as a row [sample_id, start, end]) as int64 arrays:
    one pass in C over the NamedTuples, for the planner's and validator's array code."""
    counts = np.fromiter((len(m.slices) for m in micropacks), dtype=np.int64, count=len(micropacks))
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(m.slices for m in micropacks)), dtype=np.int64,
                       count=3 * int(counts.sum()))
    return counts, flat.reshape(-1, 3)


def last_forward_needed(forward_units: Sequence[Sequence[int]], backward_units: Sequence[Sequence[int]]) -> np.ndarray:
    """For each backward unit, the last forward unit holding one of its MicroPacks: it may run only
    after that forward (vectorised: MicroPacks number in the thousands)."""
    sizes = [len(members) for members in backward_units]
    if 0 in sizes:
        raise ValueError("a backward unit is empty")
    if not sizes:
        return np.zeros(0, dtype=np.int64)
    forward_members = np.fromiter(chain.from_iterable(forward_units), dtype=np.int64)
    backward_members = np.fromiter(chain.from_iterable(backward_units), dtype=np.int64)
    unit_of = np.full(int(max(forward_members.max(initial=-1), backward_members.max())) + 1, -1, dtype=np.int64)
    unit_of[forward_members] = np.repeat(np.arange(len(forward_units)), [len(members) for members in forward_units])
    owners = unit_of[backward_members]
    if (owners < 0).any():
        raise ValueError(f"MicroPack {int(backward_members[np.argmax(owners < 0)])} is in no forward unit")
    return np.maximum.reduceat(owners, np.cumsum([0] + sizes[:-1]))


def micropack_figures(micropacks: list[MicroPack], table=None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, attention pairs) of every MicroPack, as float arrays (`table`: their
    `slice_table`, if already at hand)."""
    counts, table = table if table is not None else slice_table(micropacks)
    if len(table) == 0 or counts.min() == 0:  # reduceat needs every MicroPack non-empty
        return (np.array([m.num_tokens for m in micropacks], dtype=float),
                np.array([m.attention_pairs for m in micropacks], dtype=float))
    length = (table[:, 2] - table[:, 1]).astype(float)
    pairs = length * table[:, 1] + length * (length + 1) / 2
    starts = np.cumsum(counts) - counts
    return np.add.reduceat(length, starts), np.add.reduceat(pairs, starts)


def sequence_sharded_pairs(micropacks: list[MicroPack], cp: int, table=None) -> np.ndarray:
    """Per MicroPack, `cp` times the attention pairs of its busiest context-parallel rank when the
    pack is sharded as one sequence: its tokens, in pack order, cut into 2*cp chunks, rank r
    holding chunks r and 2cp-1-r (the zigzag that balances one causal sequence). Under document
    masking a token attends only its own document (and its slice's KV prefix), so the ranks'
    pairs differ; every layer waits for the busiest. `cp` times it is what `pairs / cp` pricing
    needs to charge that rank. Sharding each document instead (per-document zigzag: Megatron's
    THD path, the SlimPack runtime) leaves the ranks within a token per chunk of `pairs / cp`.
    `table`: the MicroPacks' `slice_table`, if already at hand."""
    counts, table = table if table is not None else slice_table(micropacks)
    if cp == 1 or len(table) == 0:
        return micropack_figures(micropacks, (counts, table))[1]
    start, length = table[:, 1].astype(float), (table[:, 2] - table[:, 1]).astype(float)
    pack_of = np.repeat(np.arange(len(counts)), counts)
    pack_tokens = np.bincount(pack_of, weights=length, minlength=len(counts))
    before_pack = np.cumsum(pack_tokens) - pack_tokens
    offset = np.cumsum(length) - length - before_pack[pack_of]  # where each slice starts in its pack
    per_rank = np.zeros((len(counts), cp))
    chunks = 2 * cp
    for j in range(chunks):
        low = np.floor(j * pack_tokens / chunks)[pack_of]
        high = np.floor((j + 1) * pack_tokens / chunks)[pack_of]
        first = np.maximum(offset, low)
        taken = np.maximum(0.0, np.minimum(offset + length, high) - first)
        # the token at pack position x of a slice attends start + (x - offset) + 1 keys
        weight_of_first = start + (first - offset) + 1.0
        pairs = taken * weight_of_first + taken * (taken - 1.0) / 2.0
        per_rank[:, j if j < cp else chunks - 1 - j] += np.bincount(pack_of, weights=pairs, minlength=len(counts))
    return cp * per_rank.max(axis=1)


class PackFigures(NamedTuple):
    """Per-MicroPack figures the cost model charges (float arrays, one entry per MicroPack)."""

    tokens: np.ndarray
    pairs: np.ndarray  # attention pairs, KV prefixes included
    continued: np.ndarray  # tokens in slices a later slice of their sample continues (K/V kept)
    prefix: np.ndarray  # KV-prefix tokens its slices read (the earlier slices of their samples)
    masked: np.ndarray  # query x key entries (length x end) of its slices that read a prefix


def pack_figures(micropacks: list[MicroPack], table=None) -> PackFigures:
    """`PackFigures` of every MicroPack (`table`: their `slice_table`, if already at hand)."""
    counts, table = table if table is not None else slice_table(micropacks)
    tokens, pairs = micropack_figures(micropacks, (counts, table))
    pack_of = np.repeat(np.arange(len(micropacks)), counts)
    sample, start, end = table[:, 0].astype(np.int64), table[:, 1], table[:, 2]
    continued = np.zeros(len(table), dtype=bool)
    later = start > 0
    if later.any():
        span = int(end.max()) + 1  # (sample, position) as one integer key
        continued = np.isin(sample * span + end, sample[later] * span + start[later])
    length = (end - start).astype(float)

    def per_pack(values: np.ndarray) -> np.ndarray:
        return np.bincount(pack_of, weights=values, minlength=len(micropacks))

    return PackFigures(tokens, pairs, per_pack(length * continued), per_pack(start.astype(float)),
                       per_pack(length * end * later))


def chain_heads(micropacks: list[MicroPack], table=None) -> np.ndarray:
    """The first MicroPack of every MicroPack's chain: MicroPacks are linked by sharing a sample
    (`table`: their `slice_table`, if already at hand)."""
    heads = np.arange(len(micropacks))
    counts, table = table if table is not None else slice_table(micropacks)
    # Only a sample with a continuation slice (start > 0) links MicroPacks; the rest stay alone,
    # so the union-find below walks only the few linked ones.
    continued = np.unique(table[table[:, 1] > 0, 0])
    if not len(continued):
        return heads
    linked = np.flatnonzero(np.isin(table[:, 0], continued))
    pack_of = np.repeat(heads, counts)[linked]
    # A chain's head is the first (lowest) MicroPack of its connected component, whatever the
    # order the links are joined in: sorted by sample, each MicroPack joins the one before.
    by_sample = np.argsort(table[linked, 0], kind="stable")
    return _lowest_of_components(table[linked, 0][by_sample], pack_of[by_sample], len(micropacks))


@numba.njit(cache=True, nogil=True)
def _lowest_of_components(sample_ids: np.ndarray, packs: np.ndarray, count: int) -> np.ndarray:
    """For each of `count` MicroPacks, the lowest one it is linked to (directly or not), where
    consecutive entries with the same sample id link their MicroPacks (union-find, the lower
    index the root)."""
    parent = np.arange(count)
    for entry in range(1, len(sample_ids)):
        if sample_ids[entry] == sample_ids[entry - 1]:
            root, other = _root(parent, packs[entry]), _root(parent, packs[entry - 1])
            parent[max(root, other)] = min(root, other)
    for index in range(count):
        parent[index] = _root(parent, index)
    return parent


@numba.njit(cache=True, nogil=True)
def _root(parent: np.ndarray, index: int) -> int:
    while parent[index] != index:
        parent[index] = parent[parent[index]]  # path halving
        index = parent[index]
    return index


def backward_sequence(micropacks: list[MicroPack], table=None) -> list[int]:
    """The order in which MicroPacks run backward: chains in forward order, each reversed, so a
    later slice's backward (which completes its prefix's KV gradients) always comes first."""
    heads = chain_heads(micropacks, table)
    return np.lexsort((-np.arange(len(heads)), heads)).tolist()


@dataclass
class ReplicaPlan:
    """The work of one data-parallel replica, or of a DP-Merge group when `dp_ranks` has several
    ranks (those ranks run it together with context parallelism, before their own replica plans).
    """

    micropacks: list[MicroPack]
    forward_units: list[list[int]]
    backward_units: list[list[int]]
    stage_orders: list[list[Task]]
    dp_ranks: list[int]

    @property
    def is_merge_group(self) -> bool:
        return len(self.dp_ranks) > 1

    @property
    def num_tokens(self) -> int:
        return sum(m.num_tokens for m in self.micropacks)

    @property
    def sample_ids(self) -> list[int]:
        return sorted({s for m in self.micropacks for s in m.sample_ids})

    def backward_sequence(self) -> list[int]:
        return backward_sequence(self.micropacks)

    def backward_unit_of(self) -> dict[int, int]:
        return {mp: unit for unit, members in enumerate(self.backward_units) for mp in members}

    def __reduce__(self):
        # Pickled as one slice table (a search shelves hundreds of plans of ~10^5 slices, and a
        # comparison's workers hand plans back): ~10x faster than NamedTuple by NamedTuple.
        counts, table = slice_table(self.micropacks)
        return _replica_from_table, (counts, table, self.forward_units, self.backward_units, self.stage_orders,
                                     self.dp_ranks)

    def to_dict(self) -> dict:
        return {
            "dp_ranks": list(self.dp_ranks),
            "micropacks": [[[s.sample_id, s.start, s.end] for s in m.slices] for m in self.micropacks],
            "forward_units": [list(u) for u in self.forward_units],
            "backward_units": [list(u) for u in self.backward_units],
            "stage_orders": [[list(task) for task in order] for order in self.stage_orders],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "ReplicaPlan":
        return cls(
            micropacks=[MicroPack([Slice(*map(int, s)) for s in m]) for m in data["micropacks"]],
            forward_units=[[int(i) for i in u] for u in data["forward_units"]],
            backward_units=[[int(i) for i in u] for u in data["backward_units"]],
            stage_orders=[[(str(task[0]),) + tuple(int(i) for i in task[1:]) for task in order]
                          for order in data["stage_orders"]],
            dp_ranks=[int(r) for r in data["dp_ranks"]],
        )


def _replica_from_table(counts: np.ndarray, table: np.ndarray, forward_units, backward_units, stage_orders,
                        dp_ranks) -> ReplicaPlan:
    """A `ReplicaPlan` from its pickled form (`ReplicaPlan.__reduce__`)."""
    slices = list(map(tuple.__new__, repeat(Slice), zip(*(column.tolist() for column in table.T))))
    ends = np.cumsum(counts).tolist()
    micropacks = [MicroPack(slices[start:end]) for start, end in zip([0] + ends[:-1], ends)]
    return ReplicaPlan(micropacks, forward_units, backward_units, stage_orders, dp_ranks)
