"""The plan: the data structure between the planner, the simulator and the runtime.

A `Plan` is everything one global batch needs: which slices of which documents form each
MicroPack, how MicroPacks are grouped into forward units and (differently) into backward units,
and the exact task list of every pipeline stage. It can be dumped to JSON, inspected, simulated
and replayed; `Plan.validate()` checks every rule of design.md section 2.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from itertools import chain, repeat
from pathlib import Path
from typing import Iterable, NamedTuple, cast

import numpy as np

from .errors import SlimPackError
from .specs import ParallelConfig


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
    """(i, 0) for the i-th input length: each length is a whole document of its own."""
    return _sources_of(range(count), repeat(0))


def _sources_of(documents: Iterable[int], offsets: Iterable[int]) -> list[SampleSource]:
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
    return _sources_of(values, values)  # consecutive (document, offset) pairs


def overlapping_documents(sources, lengths) -> list[int]:
    """Documents of which two of `sources` (with `lengths`) overlap, sorted. A global batch holds
    a document twice only when it spans an epoch boundary (small corpora); a plan records those of
    its input (`Plan.repeated_documents`), whose pieces may then overlap."""
    count = len(lengths)
    if count < 2:
        return []
    table = np.fromiter(chain.from_iterable(sources), dtype=np.int64, count=2 * count).reshape(-1, 2)
    return sorted(set(_overlaps(table[:, 0], table[:, 1], np.asarray(lengths, dtype=np.int64))[0].tolist()))


def _overlaps(document: np.ndarray, offset: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(documents, index pairs) of the overlaps between neighbours in (document, offset) order (in
    sorted order, a range that overlaps a later one overlaps its next neighbour)."""
    order = np.lexsort((offset, document))
    same = document[order][1:] == document[order][:-1]
    overlap = np.flatnonzero(same & (offset[order][:-1] + length[order][:-1] > offset[order][1:]))
    return document[order][overlap], np.stack([order[overlap], order[overlap + 1]], axis=1)


# Strategies whose samples are not the input lengths (they cut documents or carry them across
# steps): their plans must say where every sample comes from.
RENUMBERING_STRATEGIES = frozenset({"megatron-fixed", "megatron-stock", "slimpipe", "wlb-llm"})


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
    """Sample(i, length) for the i-th length (tuple.__new__, as in `whole_slices`)."""
    new = tuple.__new__
    return [new(Sample, pair) for pair in enumerate(lengths)]


def whole_slices(samples: Iterable[Sample]) -> list[Slice]:
    """Slice(sample_id, 0, length) of each sample (tuple.__new__: ~2x faster than the NamedTuple
    constructor, which matters for the ~10^5 documents of a long-context global batch)."""
    new = tuple.__new__
    return [new(Slice, (sample_id, 0, length)) for sample_id, length in samples]


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


def last_forward_needed(forward_units: list[list[int]], backward_units: list[list[int]]) -> np.ndarray:
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
    pack_of = np.repeat(heads, counts)[linked].tolist()
    parent = {index: index for index in pack_of}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_pack: dict[int, int] = {}
    for sample_id, index in zip(table[linked, 0].tolist(), pack_of):
        root, other = find(index), find(first_pack.setdefault(sample_id, index))
        parent[max(root, other)] = min(root, other)  # a chain's root is its first MicroPack
    for index in parent:
        heads[index] = find(index)
    return heads


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


@dataclass
class Plan:
    """All replicas of one global batch plus what the planner knew and predicted."""

    replicas: list[ReplicaPlan]
    samples: list[Sample]
    parallel: ParallelConfig
    context_length: int
    strategy: str
    max_micropack_tokens: int | None = None  # per device: a k-replica merge group's MicroPacks hold up to k x this
    metadata: dict = field(default_factory=dict)
    # sample_sources[i]: where samples[i]'s tokens come from (the token source reads only this).
    # None: each sample is document `sample_id` from offset 0, allowed only for strategies whose
    # samples are the input lengths (not RENUMBERING_STRATEGIES).
    sample_sources: list[SampleSource] | None = None
    # Documents the planner's input held more than once (overlapping pieces: a global batch across an
    # epoch boundary of a small corpus); only their samples may overlap.
    repeated_documents: list[int] = field(default_factory=list)

    FORMAT_VERSION = 1

    def __post_init__(self):
        if self.sample_sources is None:
            if self.strategy in RENUMBERING_STRATEGIES:
                raise PlanError(
                    f"sample-sources: a {self.strategy} plan renumbers its samples and must give each sample's "
                    "(document, offset) in sample_sources")
            self.sample_sources = _sources_of(map(tuple.__getitem__, self.samples, repeat(0)), repeat(0))

    # ---- queries -------------------------------------------------------------------------
    def _sources(self) -> list[SampleSource]:
        # A constructed plan always has them: __post_init__ replaces None.
        return cast("list[SampleSource]", self.sample_sources)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples)

    def sample_lengths(self) -> dict[int, int]:
        return {s.sample_id: s.length for s in self.samples}

    def source_of(self) -> dict[int, tuple[int, int, int]]:
        """sample id -> (document, offset, length): the sample is tokens [offset, offset + length)
        of corpus document `document`."""
        return {sample.sample_id: (source.document, source.offset, sample.length)
                for sample, source in zip(self.samples, self._sources())}

    def replicas_of_rank(self, dp_rank: int) -> list[ReplicaPlan]:
        """What data-parallel rank `dp_rank` runs, in order: merge groups first, then its own."""
        mine = [r for r in self.replicas if dp_rank in r.dp_ranks]
        return sorted(mine, key=lambda r: not r.is_merge_group)

    def fingerprint(self) -> str:
        """A hash of the content that ranks compare to make sure they run the same plan."""
        body = json.dumps(self.to_dict(include_metadata=False), sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()[:16]

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self, include_metadata: bool = True) -> dict:
        data = {
            "format_version": self.FORMAT_VERSION,
            "strategy": self.strategy,
            "context_length": self.context_length,
            "max_micropack_tokens": self.max_micropack_tokens,
            "parallel": self.parallel.to_dict(),
            "samples": [[s.sample_id, s.length] for s in self.samples],
            "sample_sources": [[d, o] for d, o in self._sources()],
            "replicas": [r.to_dict() for r in self.replicas],
        }
        if self.repeated_documents:
            data["repeated_documents"] = list(self.repeated_documents)
        if include_metadata:
            data["metadata"] = self.metadata
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        version = data.get("format_version")
        if version != cls.FORMAT_VERSION:
            raise PlanError(f"plan format version {version!r} is not supported (expected {cls.FORMAT_VERSION})")
        strategy = str(data.get("strategy"))
        if "sample_sources" not in data and strategy in RENUMBERING_STRATEGIES:
            raise PlanError(
                f"plan JSON without sample_sources (written before they were recorded): a {strategy} plan "
                "renumbers its samples, so where their tokens come from is unknown; plan the batch again")
        try:
            samples = [Sample(int(i), int(n)) for i, n in data["samples"]]
            sources = data.get("sample_sources")
            return cls(
                replicas=[ReplicaPlan.from_dict(r) for r in data["replicas"]],
                samples=samples,
                parallel=ParallelConfig.from_dict(data["parallel"]),
                context_length=int(data["context_length"]),
                strategy=str(data["strategy"]),
                max_micropack_tokens=data.get("max_micropack_tokens"),
                metadata=data.get("metadata", {}),
                sample_sources=None if sources is None else [SampleSource(int(d), int(o)) for d, o in sources],
                repeated_documents=[int(d) for d in data.get("repeated_documents", [])],
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as error:
            raise PlanError(f"malformed plan: {error!r}") from error

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "Plan":
        path = Path(path_or_text) if not str(path_or_text).lstrip().startswith(("{", "[")) else None
        where = f"{path}" if path else "plan text"
        if path is not None and path.is_dir():
            raise PlanError(f"{path} is a directory: give the plan's JSON file")
        try:
            data = json.loads(path.read_text() if path else str(path_or_text))
        except json.JSONDecodeError as error:
            raise PlanError(f"{where} is not valid JSON: line {error.lineno}: {error.msg}") from error
        if not isinstance(data, dict):
            raise PlanError(f"{where} holds a JSON {type(data).__name__}, not a plan (an object with "
                            "format_version, replicas, samples, ...)")
        return cls.from_dict(data)

    # ---- invariants ----------------------------------------------------------------------
    def validate(self) -> "Plan":
        """Check every invariant of design.md section 2; raise PlanError naming the broken rule.

        The slice rules (coverage, order, token cap, one replica per sample) are first checked
        with array operations; only a plan that fails them takes the per-slice pass, whose
        message names the rule and the offending sample and MicroPack."""
        ids, sizes = _check_samples(self.samples, self.context_length)
        _check_sources(self.samples, self.sample_sources, self.repeated_documents)
        _check_ranks(self.replicas, self.parallel.dp)
        table = _SliceTable(self.replicas, ids, sizes, self.max_micropack_tokens)
        lengths = dict(zip(ids.tolist(), sizes.tolist())) if not table.valid else {}
        for index, replica in enumerate(self.replicas):
            _check_replica(replica, index, lengths, self.max_micropack_tokens, self.parallel,
                           slices_checked=table.valid, table=table.of_replica(index))
        if table.valid and table.one_replica_per_sample():
            return self
        seen_in: dict[int, int] = {}
        for index, replica in enumerate(self.replicas):
            for sample_id in replica.sample_ids:
                if sample_id in seen_in:
                    raise PlanError(
                        f"sample-in-one-replica: sample {sample_id} has slices in replica plans "
                        f"{seen_in[sample_id]} and {index}"
                    )
                seen_in[sample_id] = index
        missing = sorted(set(ids.tolist()) - set(seen_in))
        if missing:
            raise PlanError(f"coverage: samples {missing[:10]} are in no MicroPack")
        return self


class _SliceTable:
    """Every slice of a plan as arrays (replica, MicroPack, sample, start, end), for the fast
    pass of `Plan.validate`: `valid` says whether every per-replica slice rule holds."""

    def __init__(self, replicas: list["ReplicaPlan"], ids: np.ndarray, lengths: np.ndarray, token_cap: int | None):
        """`ids` sorted, unique; `lengths` in the same order."""
        self.known, self.known_lengths = ids, lengths
        packs = [m for r in replicas for m in r.micropacks]
        counts, table = slice_table(packs)
        self.sample, self.start, self.end = table[:, 0], table[:, 1], table[:, 2]
        self.pack = np.repeat(np.arange(len(packs)), counts)
        self.replica = np.repeat(np.repeat(np.arange(len(replicas)), [len(r.micropacks) for r in replicas]), counts)
        self.counts = counts
        self.pack_offsets = np.concatenate([[0], np.cumsum([len(r.micropacks) for r in replicas])]).astype(int)
        self.row_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
        # The cap is per device: each member of a k-replica merge group holds 1/k of its MicroPacks.
        caps = None if token_cap is None else np.repeat(
            [token_cap * len(r.dp_ranks) for r in replicas], [len(r.micropacks) for r in replicas])
        self.valid = bool(len(packs) == 0 or counts.min() > 0) and self._slices_ok() and (
            caps is None or bool((micropack_figures(packs, (counts, table))[0] <= caps).all()))

    def _slices_ok(self) -> bool:
        if len(self.sample) == 0:
            return True
        where = np.minimum(np.searchsorted(self.known, self.sample), len(self.known) - 1)
        if not (self.known[where] == self.sample).all():
            return False
        length = self.known_lengths[where]
        # By sample, then by position in the plan: each slice starts where the previous ended.
        order = np.lexsort((np.arange(len(self.sample)), self.sample))
        sample, start, end = self.sample[order], self.start[order], self.end[order]
        pack, replica, length = self.pack[order], self.replica[order], length[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = sample[1:] != sample[:-1]
        last = np.ones(len(order), dtype=bool)
        last[:-1] = first[1:]
        previous_end = np.concatenate([[0], end[:-1]])
        follows = np.where(first, start == 0, (start == previous_end) & (replica == np.roll(replica, 1)))
        distinct_pack = first | (pack != np.roll(pack, 1))
        return bool((follows & distinct_pack & (end > start) & (end <= length)).all()
                    and (end[last] == length[last]).all())

    def one_replica_per_sample(self) -> bool:
        """Every known sample appears, in exactly one replica plan (given `valid`: then each
        covered sample has exactly one slice starting at 0)."""
        return int((self.start == 0).sum()) == len(self.known)

    def of_replica(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The `slice_table` of one replica plan's MicroPacks."""
        packs = slice(self.pack_offsets[index], self.pack_offsets[index + 1])
        rows = slice(self.row_offsets[packs.start], self.row_offsets[packs.stop])
        return self.counts[packs], np.stack([self.sample[rows], self.start[rows], self.end[rows]], axis=1)


def _check_samples(samples: Iterable[Sample], context_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample ids, lengths) as arrays sorted by id, after checking them (array pass; the
    per-sample pass names the offending sample)."""
    samples = list(samples)
    table = np.fromiter(chain.from_iterable(samples), dtype=np.int64, count=2 * len(samples)).reshape(-1, 2)
    by_id = np.argsort(table[:, 0], kind="stable")
    ids, lengths = table[by_id, 0], table[by_id, 1]
    if len(ids) and (ids[1:] != ids[:-1]).all() and lengths.min() > 0 and lengths.max() <= context_length:
        return ids, lengths
    seen: set[int] = set()
    for sample in samples:
        if sample.sample_id in seen:
            raise PlanError(f"unique-sample-id: sample id {sample.sample_id} appears twice")
        if sample.length <= 0:
            raise PlanError(f"sample-length: sample {sample.sample_id} has length {sample.length}")
        if sample.length > context_length:
            raise PlanError(
                f"context-length: sample {sample.sample_id} has {sample.length} tokens > context length "
                f"{context_length}"
            )
        seen.add(sample.sample_id)
    raise PlanError("empty-batch: the plan has no samples")


def _check_sources(samples: list[Sample], sources, repeated: list[int]) -> None:
    """Every sample has a (document, offset) source, non-negative, and pieces of one document do
    not overlap unless the input held it more than once (`repeated`) (array pass; the message
    names the samples)."""
    if sources is None or len(sources) != len(samples):
        raise PlanError(f"sample-sources: the plan has {len(samples)} samples but "
                        f"{'no' if sources is None else len(sources)} sample sources; every sample needs one")
    count = len(samples)
    if not count:
        return
    lengths = np.fromiter(chain.from_iterable(samples), dtype=np.int64, count=2 * count)[1::2]
    try:
        table = np.fromiter(chain.from_iterable(sources), dtype=np.int64, count=2 * count).reshape(-1, 2)
    except (TypeError, ValueError) as error:
        raise PlanError(f"sample-sources: sources must be (document, offset) integer pairs ({error})") from error
    document, offset = table[:, 0], table[:, 1]
    if (table < 0).any():
        index = int(np.argmax((table < 0).any(axis=1)))
        raise PlanError(f"sample-sources: sample {samples[index].sample_id} has source {tuple(table[index].tolist())}; "
                        "documents and offsets are non-negative")
    documents, pairs = _overlaps(document, offset, lengths)
    if len(repeated) and len(documents):
        pairs = pairs[~np.isin(documents, np.asarray(repeated, dtype=np.int64))]
    if len(pairs):
        first, second = (int(i) for i in pairs[0])
        raise PlanError(
            f"sample-sources: samples {samples[first].sample_id} and {samples[second].sample_id} overlap in document "
            f"{int(document[first])}: tokens [{int(offset[first])}, {int(offset[first] + lengths[first])}) and "
            f"[{int(offset[second])}, {int(offset[second] + lengths[second])}) (only documents the input held twice, "
            f"listed in repeated_documents, may overlap)")


def _check_ranks(replicas: list[ReplicaPlan], dp: int) -> None:
    own: dict[int, int] = {}
    for index, replica in enumerate(replicas):
        if not replica.dp_ranks or len(set(replica.dp_ranks)) != len(replica.dp_ranks):
            raise PlanError(f"dp-ranks: replica plan {index} has dp_ranks {replica.dp_ranks}")
        for rank in replica.dp_ranks:
            if not 0 <= rank < dp:
                raise PlanError(f"dp-ranks: replica plan {index} names rank {rank}, outside 0..{dp - 1}")
        if not replica.is_merge_group:
            rank = replica.dp_ranks[0]
            if rank in own:
                raise PlanError(f"dp-ranks: rank {rank} has two replica plans ({own[rank]} and {index})")
            own[rank] = index
    absent = sorted(set(range(dp)) - set(own))
    if absent:
        raise PlanError(f"dp-ranks: data-parallel ranks {absent} have no replica plan")


def _check_replica(
    replica: ReplicaPlan, index: int, lengths: dict[int, int], token_cap: int | None, parallel: ParallelConfig,
    slices_checked: bool = False, table=None,
) -> None:
    where = f"replica plan {index}"
    if not slices_checked:
        _check_slices(replica, where, lengths, None if token_cap is None else token_cap * len(replica.dp_ranks))
    count = len(replica.micropacks)
    _check_segmentation("forward-units", replica.forward_units, list(range(count)), where)
    _check_segmentation("backward-units", replica.backward_units,
                        backward_sequence(replica.micropacks, table), where)
    _check_stage_orders(replica, where, parallel.pp, parallel.vpp)


def _check_slices(replica: ReplicaPlan, where: str, lengths: dict[int, int], token_cap: int | None) -> None:
    next_start: dict[int, int] = {}
    for mp_index, micropack in enumerate(replica.micropacks):
        if not micropack.slices:
            raise PlanError(f"empty-micropack: {where} MicroPack {mp_index} has no slices")
        if token_cap is not None and micropack.num_tokens > token_cap:
            raise PlanError(
                f"token-cap: {where} MicroPack {mp_index} has {micropack.num_tokens} tokens > cap {token_cap} "
                f"(the plan's max_micropack_tokens per device, times the replicas of a merge group)"
            )
        in_this_pack: set[int] = set()
        for piece in micropack.slices:
            sid = piece.sample_id
            if sid not in lengths:
                raise PlanError(f"unknown-sample: {where} MicroPack {mp_index} has a slice of unknown sample {sid}")
            if sid in in_this_pack:
                raise PlanError(f"slice-order: {where} MicroPack {mp_index} holds two slices of sample {sid}")
            in_this_pack.add(sid)
            expected = next_start.get(sid, 0)
            if piece.start != expected or piece.end <= piece.start or piece.end > lengths[sid]:
                raise PlanError(
                    f"coverage/slice-order: sample {sid} (length {lengths[sid]}) has slice "
                    f"[{piece.start}, {piece.end}) in {where} MicroPack {mp_index}; expected a non-empty "
                    f"slice starting at {expected}"
                )
            next_start[sid] = piece.end
    for sid, end in next_start.items():
        if end != lengths[sid]:
            raise PlanError(f"coverage: sample {sid} has {lengths[sid]} tokens but its slices end at {end}")


def _check_segmentation(rule: str, units: list[list[int]], sequence: list[int], where: str) -> None:
    flat = [mp for unit in units for mp in unit]
    for unit_index, unit in enumerate(units):
        if not unit:
            raise PlanError(f"{rule}: {where} unit {unit_index} is empty")
    if flat != sequence:
        position = next((i for i, (a, b) in enumerate(zip(flat, sequence)) if a != b), min(len(flat), len(sequence)))
        raise PlanError(
            f"{rule}: {where} units are not a contiguous segmentation of the sequence {sequence[:20]}"
            f"{'...' if len(sequence) > 20 else ''}: they list {flat[:20]} (first difference at position {position})"
        )


def _check_stage_orders(replica: ReplicaPlan, where: str, pp: int, vpp: int = 1) -> None:
    if len(replica.stage_orders) != pp:
        raise PlanError(f"stage-orders: {where} has {len(replica.stage_orders)} stage orders for pp={pp}")
    # Checked once per unit, not per stage: plans run to hundreds of thousands of tasks.
    needs = last_forward_needed(replica.forward_units, replica.backward_units).tolist()
    all_forwards, all_backwards = list(range(len(replica.forward_units))), list(range(len(needs)))
    for stage, order in enumerate(replica.stage_orders):
        widths = {len(task) for task in order}
        if widths - {3 if vpp > 1 else 2}:
            raise PlanError(f"stage-orders: {where} stage {stage} tasks must be "
                            + ("[kind, unit, chunk] with vpp > 1" if vpp > 1 else "[kind, unit] (no virtual stages)"))
        chunks = [task_chunk(task) for task in order]
        if any(not 0 <= chunk < vpp for chunk in chunks):
            raise PlanError(f"stage-orders: {where} stage {stage} names a model chunk outside 0..{vpp - 1}")
        for chunk in range(vpp):
            what = f"{where} stage {stage}" + (f" chunk {chunk}" if vpp > 1 else "")
            _check_chunk_order(tasks_of_chunk(order, chunk), what, needs, all_forwards, all_backwards)


def _check_chunk_order(order: list[tuple[str, int]], where: str, needs: list[int], all_forwards: list[int],
                       all_backwards: list[int]) -> None:
    forwards = [u for kind, u in order if kind == "F"]
    backwards = [v for kind, v in order if kind == "B"]
    if forwards != all_forwards or backwards != all_backwards or len(forwards) + len(backwards) != len(order):
        if sorted(order) == sorted([("F", u) for u in all_forwards] + [("B", v) for v in all_backwards]):
            raise PlanError(f"stage-orders: {where} runs units out of their sequence order")
        raise PlanError(f"stage-orders: {where} must run each forward and backward unit exactly once")
    done_forward = -1
    for kind, unit in order:
        if kind == "F":
            done_forward = unit
            continue
        needed = needs[unit]
        if needed > done_forward:
            raise PlanError(
                f"stage-orders: {where} runs backward unit {unit} before forward unit {needed}, "
                "whose MicroPacks it needs"
            )
