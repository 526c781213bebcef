"""The plan: the data structure between the planner, the simulator and the runtime.

A `Plan` is everything one global batch needs: which slices of which documents form each
MicroPack, how MicroPacks are grouped into forward units and (differently) into backward units,
and the exact task list of every pipeline stage. It can be dumped to JSON, inspected, simulated
and replayed; `Plan.validate()` checks every rule of docs/design.md section 2 (`validate.py`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import itemgetter
from pathlib import Path
from typing import cast

import numpy as np

from ..specs import ParallelConfig
from .types import PlanError, ReplicaPlan, Sample, SampleSource, sources_of
from .validate import check_plan

# Strategies whose samples are not the input lengths (they cut documents or carry them across
# steps): their plans must say where every sample comes from.
RENUMBERING_STRATEGIES = frozenset({"megatron-fixed", "megatron-stock", "slimpipe", "wlb-llm"})


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
    _given_sources: list[SampleSource] | None = field(default=None, init=False, repr=False, compare=False)
    sample_sources: list[SampleSource] | None = None  # read through `_default_sources`, never None
    # Documents the planner's input held more than once (overlapping pieces: a global batch across an
    # epoch boundary of a small corpus); only their samples may overlap.
    repeated_documents: list[int] = field(default_factory=list)

    FORMAT_VERSION = 1

    def __post_init__(self):
        if self._given_sources is None and self.strategy in RENUMBERING_STRATEGIES:
            raise PlanError(
                f"sample-sources: a {self.strategy} plan renumbers its samples and must give each sample's "
                "(document, offset) in sample_sources")

    def __reduce__(self):
        # Samples and sources as arrays (see `ReplicaPlan.__reduce__`); default sources stay unbuilt.
        samples, sources = (None if pairs is None else
                            np.fromiter(chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs))
                            for pairs in (self.samples, self._given_sources))
        return _plan_from_arrays, (self.replicas, samples, self.parallel, self.context_length, self.strategy,
                                   self.max_micropack_tokens, self.metadata, sources, self.repeated_documents)

    # ---- queries -------------------------------------------------------------------------
    def _sources(self) -> list[SampleSource]:
        # The property below never returns None.
        return cast("list[SampleSource]", self.sample_sources)

    @property
    def num_tokens(self) -> int:
        return sum(map(itemgetter(1), self.samples))  # each Sample's length, without attribute lookups

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
        """Check every invariant of docs/design.md section 2 (`check_plan`); raise PlanError naming the
        broken rule; return the plan."""
        check_plan(self.replicas, self.samples, self.sample_sources, self.repeated_documents, self.parallel,
                   self.context_length, self.max_micropack_tokens)
        return self


def _default_sources(plan: Plan) -> list[SampleSource]:
    """`Plan.sample_sources`: the sources given, else (sample id, 0) for each sample, built where
    first read: a layout search makes hundreds of plans of ~10^5 samples and reads the sources of
    none but the finalists' (the runtime's token source, validation, JSON)."""
    if plan._given_sources is None:
        plan._given_sources = sources_of(map(tuple.__getitem__, plan.samples, repeat(0)), repeat(0))
    return plan._given_sources


def _set_sources(plan: Plan, sources: list[SampleSource] | None) -> None:
    plan._given_sources = sources


# The dataclass keeps `sample_sources` as its field (the constructor's keyword, `replace`, equality,
# repr); reading it goes through `_default_sources`.
Plan.sample_sources = property(_default_sources, _set_sources)  # type: ignore[assignment]


def _plan_from_arrays(replicas, samples: np.ndarray, parallel, context_length, strategy, max_micropack_tokens,
                      metadata, sources: np.ndarray | None, repeated_documents) -> Plan:
    """A `Plan` from its pickled form (`Plan.__reduce__`)."""
    def pairs(flat: np.ndarray, kind) -> list:
        return list(map(tuple.__new__, repeat(kind), zip(flat[0::2].tolist(), flat[1::2].tolist())))

    return Plan(replicas, pairs(samples, Sample), parallel, context_length, strategy, max_micropack_tokens, metadata,
                None if sources is None else pairs(sources, SampleSource), repeated_documents)
