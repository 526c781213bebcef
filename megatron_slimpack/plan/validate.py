"""The rules of a plan (docs/design.md section 2): `check_plan` raises PlanError naming the broken rule
and the culprit. `Plan.validate` runs it; the rules read only the parts in `types.py`."""
from __future__ import annotations

import itertools
import operator
from itertools import chain
from typing import Iterable

import numpy as np

from ..specs import ParallelConfig
from .types import (
    PlanError,
    ReplicaPlan,
    Sample,
    SampleSource,
    backward_sequence,
    last_forward_needed,
    micropack_figures,
    overlaps,
    slice_table,
    task_chunk,
    tasks_of_chunk,
)


def check_plan(replicas: list[ReplicaPlan], samples: list[Sample], sources: list[SampleSource] | None,
               repeated_documents: list[int], parallel: ParallelConfig, context_length: int,
               max_micropack_tokens: int | None) -> None:
    """Check every invariant of a plan made of these parts; raise PlanError naming the broken rule.

    The slice rules (coverage, order, token cap, one replica per sample) are first checked
    with array operations; only a plan that fails them takes the per-slice pass, whose
    message names the rule and the offending sample and MicroPack."""
    ids, sizes = _check_samples(samples, context_length)
    _check_sources(samples, sources, repeated_documents)
    _check_ranks(replicas, parallel.dp)
    table = SliceTable(replicas, ids, sizes, max_micropack_tokens)
    lengths = dict(zip(ids.tolist(), sizes.tolist())) if not table.valid else {}
    for index, replica in enumerate(replicas):
        _check_replica(replica, index, lengths, max_micropack_tokens, parallel,
                       slices_checked=table.valid, table=table.of_replica(index))
    if table.valid and table.one_replica_per_sample():
        return
    seen_in: dict[int, int] = {}
    for index, replica in enumerate(replicas):
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


class SliceTable:
    """Every slice of a plan as arrays (replica, MicroPack, sample, start, end), for the fast
    pass of `check_plan`: `valid` says whether every per-replica slice rule holds."""

    def __init__(self, replicas: list[ReplicaPlan], ids: np.ndarray, lengths: np.ndarray, token_cap: int | None):
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
    documents, pairs = overlaps(document, offset, lengths)
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
        check_slices(replica, where, lengths, None if token_cap is None else token_cap * len(replica.dp_ranks))
    count = len(replica.micropacks)
    _check_segmentation("forward-units", replica.forward_units, list(range(count)), where)
    _check_segmentation("backward-units", replica.backward_units,
                        backward_sequence(replica.micropacks, table), where)
    _check_stage_orders(replica, where, parallel.pp, parallel.vpp)


def check_slices(replica: ReplicaPlan, where: str, lengths: dict[int, int], token_cap: int | None) -> None:
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
    needs_array = last_forward_needed(replica.forward_units, replica.backward_units)
    needs = needs_array.tolist()
    all_forwards, all_backwards = list(range(len(replica.forward_units))), list(range(len(needs)))
    for stage, order in enumerate(replica.stage_orders):
        if _order_holds(order, needs_array, len(all_forwards), vpp):
            continue
        # The checks below, task by task, name what breaks.
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


_KINDS = {"F": 0, "B": 1}


def _order_holds(order: list, needs: np.ndarray, forwards: int, vpp: int) -> bool:
    """Whether a stage order passes every check of `_check_stage_orders`, by array: each task
    (kind, unit[, chunk]) of the right width, every chunk running each forward unit once in
    sequence order, each backward unit once in sequence order, and each backward after the forward
    it needs. False where anything may break (the task-by-task checks then say what)."""
    count = len(order)
    width = 3 if vpp > 1 else 2
    try:
        if any(len(task) != width for task in order):
            return False
        kinds = np.fromiter(map(_KINDS.get, map(operator.itemgetter(0), order), itertools.repeat(-1)),
                            dtype=np.int64, count=count)
        # read as floats: a unit or chunk that is no whole number fails below (as an int64 it
        # would be truncated)
        units = np.fromiter(map(operator.itemgetter(1), order), dtype=float, count=count)
        chunks = (np.fromiter(map(operator.itemgetter(2), order), dtype=float, count=count) if vpp > 1
                  else np.zeros(count))
    except (TypeError, ValueError, OverflowError):
        return False
    if ((kinds < 0).any() or (chunks < 0).any() or (chunks >= vpp).any() or (units != np.floor(units)).any()
            or (chunks != np.floor(chunks)).any()):
        return False
    backwards = len(needs)
    for chunk in range(vpp):
        mine = chunks == chunk
        kind, unit = kinds[mine], units[mine]
        is_forward = kind == 0
        if (not np.array_equal(unit[is_forward], np.arange(forwards))
                or not np.array_equal(unit[~is_forward], np.arange(backwards))):
            return False
        # before each backward: the forwards run so far are 0 .. done - 1 (in sequence order)
        done = np.cumsum(is_forward)[~is_forward]
        if (needs >= done).any():
            return False
    return True


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
