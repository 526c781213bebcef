"""WLB-LLM: cost-balanced variable-length packing with outlier-delay queues (stateful)."""
from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ...config import DEFAULT_WLB_DELAY_FRACTIONS, SlimPackConfig, delay_fractions
from ...costmodel import SLIMPACK_RUNTIME, CostModel
from ...plan import (
    Plan,
    PlanError,
    SampleSource,
    check_sources,
    overlapping_documents,
    samples_of,
)
from ...specs import ParallelConfig
from ..compiled import pack_by_cost_targets
from ..registry import StepPlanner, register_stateful
from ..slimpack.memory import activation_budget, fullest_stage_bytes
from ..work import WorkRates
from .common import INTERLEAVED, assemble_plan, meet_interleaved_count, whole_micropacks


class PendingDocument(NamedTuple):
    """A document waiting to be scheduled: `lengths[position]` of the batch of step `step`, tokens
    [offset, offset + length) of corpus document `document` (its source, kept while it waits).
    (A NamedTuple: every planning of a layout search makes one per document of the batch.)"""

    step: int
    position: int
    length: int
    document: int = 0
    offset: int = 0

    def to_list(self) -> list[int]:
        return list(self)

    @classmethod
    def from_list(cls, values) -> "PendingDocument":
        step, index, length, document, offset = (int(v) for v in values)
        return cls(step, index, length, document, offset)


@dataclass
class MicroBatch:
    documents: list[PendingDocument]
    tokens: int = 0
    cost: float = 0.0

    def add(self, document: PendingDocument, cost: float) -> None:
        self.documents.append(document)
        self.tokens += document.length
        self.cost += cost


# A pending document's length and (document, offset), read in C over ~10^5 documents per plan.
_LENGTH, _SOURCE = operator.attrgetter("length"), operator.attrgetter("document", "offset")

# The delay thresholds a comparison tries for WLB-LLM beside the configured ones (its paper tunes
# them to the corpus; `planner.tuning`): two queues at other depths, one queue, and none.
DELAY_CANDIDATES = ("0.5,0.25", "0.75,0.5", "0.75,0.375", "0.25,0.125", "0.5", "")


@register_stateful("wlb-llm", overlaps=SLIMPACK_RUNTIME, role="baseline", trainable=True,
                   description="WLB-LLM: cost-balanced variable-length packing, outlier-delay queues",
                   minimum_in_flight="document", renumbers_samples=True, constraints=INTERLEAVED)
class WlbLlmPlanner(StepPlanner):
    """WLB-LLM (OSDI'25): workload-balanced variable-length packing with outlier delay.

    Reproduces, per global batch:
    - Micro-batch count fixed as in Megatron: M = ceil(new tokens / (context_length * dp)) per
      replica, dp * M micro-batches in all, each capped at S_max tokens, the longest micro-batch
      memory permits (`longest_micro_batch`: at least the context, at most twice it); with virtual
      stages M is rounded up to a multiple of pp (Megatron's interleaved 1F1B needs it), and a
      replica left with fewer non-empty micro-batches is split or merged to one (`meet_interleaved_count`).
    - Multi-level outlier-delay queues: a new document longer than `context_length *
      config.delay_fractions[i]` (and not longer than the previous level's threshold) joins queue i
      instead of being packed (`SlimPackConfig.wlb_delay_fractions`, default 0.5 and 0.25; its
      paper tunes them: `planner.tuning.tune_delay_fractions`). A queue releases documents only once it holds as
      many as there are micro-batches, and then releases exactly one per micro-batch (oldest first; the
      longest released document goes to the micro-batch with the most token room). It keeps
      releasing rounds while it still holds a full round and the previous round fitted; a
      released document that does not fit its micro-batch's token room goes back to the queue.
    - The other documents are packed, those carried over from the previous step before the new
      ones, each group longest-cost first, each document into the micro-batch with the least cost
      that has token room; cost is the profiled quadratic + linear cost (`WorkRates.document`).
      A document that fits no micro-batch is carried over to the next step.
    - Micro-batches are dealt to data-parallel replicas greedily by cost (heaviest first to the
      least-loaded replica that has fewer than M), so replicas are balanced too; classic 1F1B.
    Nothing is dropped: a plan contains exactly the documents it schedules (sample ids 0..k-1,
    each with its source (document, offset) in `Plan.sample_sources`, also for a document delayed
    from an earlier batch); delayed ones stay in `pending`. Without `sources`, the documents are
    numbered in order of arrival over all steps (the first batch's are (i, 0)). At the end of a
    run, `flush()` plans everything still pending as one more step (enough micro-batches for all
    of it, no delay). If a step would otherwise schedule nothing (every new document delayed and
    no queue full), it is planned like `flush()` so that training makes progress.
    `advance()` updates the queues as `plan()` would without building the plan (a resumed run);
    `state_dict()` / `load_state_dict()` save and restore the queues, carried documents and step.
    """

    def __init__(self):
        super().__init__()
        self.step = 0
        self.arrived = 0  # documents given so far (numbers them when no sources are given)
        # The delay thresholds (fractions of the context), set by the first step's config: one queue each.
        self.fractions: tuple[float, ...] | None = None
        self.queues: list[deque[PendingDocument]] = []
        self.carried: list[PendingDocument] = []

    # ---- state ---------------------------------------------------------------------------
    @property
    def pending(self) -> list[PendingDocument]:
        """Documents delayed so far and not yet scheduled."""
        return [d for queue in self.queues for d in queue] + list(self.carried)

    def untrained_lengths(self) -> list[int]:
        return [document.length for document in self.pending]

    def state_dict(self) -> dict:
        """Step counter, documents seen, delay thresholds, delay queues and carried documents (with
        their sources)."""
        return {
            "strategy": "wlb-llm", "step": self.step, "arrived": self.arrived,
            "delay_fractions": None if self.fractions is None else list(self.fractions),
            "queues": [[d.to_list() for d in queue] for queue in self.queues],
            "carried": [d.to_list() for d in self.carried],
        }

    def load_state_dict(self, state: dict) -> None:
        # A state saved before the thresholds were recorded has the default ones.
        fractions = state.get("delay_fractions", list(delay_fractions(DEFAULT_WLB_DELAY_FRACTIONS)))
        queues = state.get("queues", ())
        if state.get("strategy") != "wlb-llm" or (fractions is not None and len(queues) != len(fractions)):
            raise PlanError(f"wlb-llm: not a wlb-llm planner state with one delay queue per threshold: {sorted(state)}")
        self.step = int(state["step"])
        self.arrived = int(state["arrived"])
        self.fractions = None if fractions is None else tuple(float(f) for f in fractions)
        self.queues = [deque(PendingDocument.from_list(d) for d in queue) for queue in queues]
        self.carried = [PendingDocument.from_list(d) for d in state["carried"]]

    def _use_fractions(self, config: SlimPackConfig) -> None:
        """The delay thresholds of `config`, fixed for the run by its first step (a queue each)."""
        fractions = config.delay_fractions
        if self.fractions is None:
            self.fractions, self.queues = fractions, [deque() for _ in fractions]
        elif fractions != self.fractions:
            raise PlanError(f"wlb-llm: the delay thresholds changed within a run (queues of {self.fractions}, now "
                            f"{fractions}): keep wlb_delay_fractions (--slimpack-wlb-delay-fractions) for the "
                            "whole run")

    def _levels(self, lengths: list[int], context_length: int) -> np.ndarray:
        """Each length's delay queue (-1: packed at once), the thresholds computed once."""
        queue = np.full(len(lengths), -1, dtype=np.int64)
        as_array = np.asarray(lengths, dtype=np.int64)
        for level, fraction in enumerate(self.fractions or ()):  # the first level whose threshold it passes
            queue[(queue < 0) & (as_array > context_length * fraction)] = level
        return queue

    # ---- planning ------------------------------------------------------------------------
    def plan(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
             sources=None) -> Plan:
        cost = self.priced(cost)
        micro_batches, per_replica, rates, metadata = self._pack_step(lengths, parallel, cost, config, sources)
        if micro_batches is None:
            return self._plan_pending(parallel, cost, config, rates, metadata)
        return self._finish(micro_batches, per_replica, parallel, cost, config, rates, metadata)

    def advance(self, lengths: list[int], parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig, *,
                sources=None) -> None:
        """The state after planning this batch (queues, carried documents, step), without the plan:
        the packing decides what is carried over, the plan's assembly and schedule are skipped."""
        micro_batches, _, _, _ = self._pack_step(lengths, parallel, self.priced(cost), config, sources)
        if micro_batches is None:
            self._take_pending()
        self.step += 1

    def flush(self, parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig) -> Plan | None:
        """Plan every pending document as one last step (None when nothing is pending)."""
        if not self.pending:
            return None
        cost = self.priced(cost)
        rates = WorkRates.from_cost(cost, parallel, config.context_length)
        return self._plan_pending(parallel, cost, config, rates, {"flush": True})

    def _pack_step(self, lengths, parallel, cost, config, sources):
        """Queue, release and pack one batch; (micro-batches, per replica, rates, metadata), the
        micro-batches None when nothing was scheduled (then everything pending is planned)."""
        if sources is None:  # document i of the run's arrivals, from its first token
            documents, offsets = range(self.arrived, self.arrived + len(lengths)), itertools.repeat(0)
        else:
            sources = check_sources(sources, len(lengths))
            documents, offsets = map(operator.itemgetter(0), sources), map(operator.itemgetter(1), sources)
        self.arrived += len(lengths)
        self._use_fractions(config)
        context = config.context_length
        capacity = longest_micro_batch(cost, parallel, context)
        rates = WorkRates.from_cost(cost, parallel, context)
        per_replica = _micro_batches_per_replica(sum(lengths), context, parallel)
        micro_batches = [MicroBatch([]) for _ in range(per_replica * parallel.dp)]
        arrivals = list(map(tuple.__new__, itertools.repeat(PendingDocument),  # as PendingDocument(...), faster
                            zip(itertools.repeat(self.step), itertools.count(), lengths, documents, offsets)))
        levels = self._levels(lengths, context)
        # Each queue and the fresh list take their documents in arrival order.
        fresh: list[PendingDocument] = list(map(arrivals.__getitem__, np.flatnonzero(levels < 0).tolist()))
        for level, queue in enumerate(self.queues):
            queue.extend(map(arrivals.__getitem__, np.flatnonzero(levels == level).tolist()))
        released = [self._release(queue, micro_batches, rates, capacity) for queue in self.queues]
        carried, self.carried = self.carried, []
        self.carried = pack_by_cost(carried, micro_batches, rates, capacity)  # they waited: first
        self.carried += pack_by_cost(fresh, micro_batches, rates, capacity)
        metadata = {"micro_batches_per_replica": per_replica, "released_per_level": released}
        if not any(mb.documents for mb in micro_batches):
            return None, per_replica, rates, metadata
        return micro_batches, per_replica, rates, metadata

    def _take_pending(self) -> list[PendingDocument]:
        """Every pending document; the queues and the carried list are emptied."""
        documents = self.pending
        self.queues = [deque() for _ in self.queues]
        self.carried = []
        return documents

    def _plan_pending(self, parallel, cost, config, rates, metadata) -> Plan:
        """All pending documents, packed by cost into just enough micro-batches."""
        documents = self._take_pending()
        context = config.context_length
        capacity = longest_micro_batch(cost, parallel, context)
        per_replica = _micro_batches_per_replica(sum(d.length for d in documents), context, parallel)
        while True:
            micro_batches = [MicroBatch([]) for _ in range(per_replica * parallel.dp)]
            if not pack_by_cost(documents, micro_batches, rates, capacity):
                break
            # Greedy packing left some out: more micro-batches per replica (pp more with virtual stages).
            per_replica += parallel.pp if parallel.vpp > 1 else 1
        metadata = {**metadata, "micro_batches_per_replica": per_replica, "released_all_pending": len(documents)}
        return self._finish(micro_batches, per_replica, parallel, cost, config, rates, metadata)

    def _release(self, queue: deque, micro_batches: list[MicroBatch], rates: WorkRates, context: int) -> int:
        """Release rounds of one document per micro-batch while the queue holds a full round."""
        released = 0
        while len(queue) >= len(micro_batches):
            batch = [queue.popleft() for _ in range(len(micro_batches))]
            roomiest = sorted(micro_batches, key=lambda mb: mb.tokens)
            unfit = []
            for document, micro_batch in zip(sorted(batch, key=lambda d: -d.length), roomiest):
                if micro_batch.tokens + document.length <= context:
                    micro_batch.add(document, rates.document(document.length))
                    released += 1
                else:
                    unfit.append(document)
            if unfit:
                queue.extendleft(sorted(unfit, key=lambda d: (d.step, d.position), reverse=True))
                break
        return released

    def _finish(self, micro_batches, per_replica, parallel, cost, config, rates, metadata) -> Plan:
        used = [mb for mb in micro_batches if mb.documents]
        per_rank = _deal_by_cost(used, parallel.dp, per_replica)
        documents = list(itertools.chain.from_iterable(mb.documents for mbs in per_rank for mb in mbs))
        lengths = list(map(_LENGTH, documents))
        samples = samples_of(lengths)  # sample i: documents[i], in micro-batch order
        bounds = list(itertools.accumulate((len(mb.documents) for mbs in per_rank for mb in mbs), initial=0))
        in_order = iter(whole_micropacks(lengths, map(range, bounds, bounds[1:])))
        micropacks = [list(itertools.islice(in_order, len(mbs))) for mbs in per_rank]
        # A replica left short (empty micro-batches: documents delayed).
        capacity = longest_micro_batch(cost, parallel, config.context_length)
        micropacks = meet_interleaved_count(micropacks, parallel, capacity, "wlb-llm")
        pending = self.pending
        metadata = {
            **metadata, "step": self.step,
            "micro_batch_costs_s": [[mb.cost for mb in mbs] for mbs in per_rank],
            "delayed_documents": len(pending), "delayed_tokens": sum(d.length for d in pending),
            "delay_fractions": list(self.fractions or ()),
        }
        self.step += 1
        sources = list(map(tuple.__new__, itertools.repeat(SampleSource), map(_SOURCE, documents)))
        # Its samples are whole input documents, some from earlier batches: any two that overlap are
        # one document drawn twice (an epoch boundary of a small corpus).
        repeated = overlapping_documents(sources, lengths)
        return assemble_plan(micropacks, samples, parallel, cost, config, capacity, metadata, (sources, repeated))


def longest_micro_batch(cost: CostModel, parallel: ParallelConfig, context_length: int) -> int:
    """WLB-LLM's S_max, the longest micro-batch memory permits (its paper packs up to it, not up to
    the context): the largest multiple of an eighth of the context, up to twice the context, of
    which stage 0 holds pp in flight (1F1B) next to the weights and optimizer state; at least the
    context, which the layout search has already checked fits (`minimum_memory_bytes`)."""
    budget = activation_budget(cost, parallel)
    step = max(context_length // 8, 1)
    longest = context_length
    while longest + step <= 2 * context_length and \
            fullest_stage_bytes(cost, parallel, longest + step, (longest + step) ** 2 / 2, longest + step) <= budget:
        longest += step
    return longest


def _micro_batches_per_replica(tokens: int, context_length: int, parallel: ParallelConfig) -> int:
    """WLB-LLM's micro-batch count per replica, Megatron's: ceil(tokens / (context x dp)); with
    virtual stages rounded up to the multiple of pp Megatron's interleaved 1F1B needs."""
    count = max(1, math.ceil(tokens / (context_length * parallel.dp)))
    return math.ceil(count / parallel.pp) * parallel.pp if parallel.vpp > 1 else count


def pack_by_cost(documents: list[PendingDocument], micro_batches: list[MicroBatch], rates: WorkRates,
                 capacity: int) -> list[PendingDocument]:
    """Heaviest document first into the cheapest micro-batch with token room; returns the
    documents that fit nowhere (in their given order). The loop is compiled
    (`compiled.pack_by_cost_targets`: a search packs a ~10^5-document batch per layout)."""
    if not documents:
        return []
    lengths = np.fromiter(map(_LENGTH, documents), dtype=np.int64, count=len(documents))
    as_float = lengths.astype(float)
    costs = rates.total(as_float, as_float * (as_float + 1) / 2)
    tokens = np.fromiter((mb.tokens for mb in micro_batches), dtype=np.int64, count=len(micro_batches))
    loads = np.fromiter((mb.cost for mb in micro_batches), dtype=float, count=len(micro_batches))
    order = np.argsort(-costs, kind="stable")  # heaviest first, ties in the given order
    targets = pack_by_cost_targets(order, lengths, costs, tokens, loads, capacity)
    # Each micro-batch takes its documents in packing order (heaviest first): the placed ones
    # grouped by target, a stable sort keeping that order within a group.
    placed = order[targets[order] >= 0]
    grouped = placed[np.argsort(targets[placed], kind="stable")]
    taken = list(map(documents.__getitem__, grouped.tolist()))
    start = 0
    for micro_batch, count in zip(micro_batches, np.bincount(targets[placed], minlength=len(micro_batches)).tolist()):
        if count:
            micro_batch.documents += taken[start:start + count]
            start += count
    for micro_batch, filled, load in zip(micro_batches, tokens.tolist(), loads.tolist()):
        micro_batch.tokens, micro_batch.cost = filled, load
    return [documents[i] for i in np.flatnonzero(targets < 0).tolist()]


def _deal_by_cost(micro_batches: list[MicroBatch], dp: int, per_replica: int) -> list[list[MicroBatch]]:
    """Heaviest micro-batch first to the least-loaded replica with fewer than `per_replica`."""
    per_rank: list[list[MicroBatch]] = [[] for _ in range(dp)]
    heap = [(0.0, rank) for rank in range(dp)]
    for micro_batch in sorted(micro_batches, key=lambda mb: -mb.cost):
        load, rank = heapq.heappop(heap)
        per_rank[rank].append(micro_batch)
        if len(per_rank[rank]) < per_replica:
            heapq.heappush(heap, (load + micro_batch.cost, rank))
    return per_rank
