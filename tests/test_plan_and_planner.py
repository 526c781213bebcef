"""Plan invariants, JSON round trip, planner determinism and bad-input errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megatron_slimpack as ms
from megatron_slimpack.config import PlannerTunables
from megatron_slimpack.costmodel import SERIAL, SLIMPACK_RUNTIME
from megatron_slimpack.plan import MicroPack, Plan, PlanError, ReplicaPlan, Sample, Slice, backward_sequence, samples_of
from megatron_slimpack.planner.baselines import wlb_llm
from megatron_slimpack.planner.orders import StageWork, build_stage_orders, replay, segment
from megatron_slimpack.planner.slimpack import dp_phase
from megatron_slimpack.planner.strategies import new_planner, plan_slimpack, strategy_spec
from megatron_slimpack.specs import ParallelConfig, SpecError
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

COST = ms.CostModel.analytic("llama-7b", "h100-sxm")
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def make_plan(lengths, dp=2, pp=2, tp=8, context=65536, strategy="slimpack", **config):
    return ms.plan(
        lengths, parallel=ParallelConfig(dp=dp, pp=pp, tp=tp), cost=COST,
        config=ms.SlimPackConfig(strategy=strategy, context_length=context, **config),
    )


lengths_strategy = st.lists(st.integers(min_value=1, max_value=40000), min_size=4, max_size=60)
layouts = st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 4), (2, 8)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=lengths_strategy, layout=layouts, strategy=st.sampled_from(["slimpack", "slimpack-sym"]))
def test_planner_output_satisfies_every_invariant(lengths, layout, strategy):
    dp, pp = layout
    if len(lengths) < dp:
        lengths = lengths * dp
    plan = make_plan(lengths, dp=dp, pp=pp, context=40000, strategy=strategy, solver_time_limit_s=0.2)
    plan.validate()
    covered = {}
    for replica in plan.replicas:
        for micropack in replica.micropacks:
            assert micropack.num_tokens <= plan.max_micropack_tokens * len(replica.dp_ranks)  # the cap is per device
            for piece in micropack.slices:
                covered[piece.sample_id] = covered.get(piece.sample_id, 0) + piece.length
    assert covered == {i: n for i, n in enumerate(lengths)}
    assert Plan.from_json(plan.to_json()).to_dict() == plan.to_dict()


def test_json_round_trip_is_lossless(tmp_path):
    plan = make_plan([5000, 70000 // 2, 1200, 800, 64000, 10, 3], dp=2, pp=2)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = Plan.from_json(path)
    assert again.to_dict() == plan.to_dict()
    assert again.fingerprint() == plan.fingerprint()
    again.validate()


@pytest.mark.parametrize("strategy", ["slimpack", "megatron-fixed", "wlb-llm"])
def test_pickle_round_trip_is_lossless(strategy):
    """Plans pickle as slice tables (a search shelves them, a comparison's workers hand them back):
    the same plan comes back, NamedTuples, merge groups, idle replicas and sources included."""
    import pickle

    lengths = [30000, 12000, 9000, 700, 650, 64, 2, 40000, 33000, 5000, 1]
    plan = make_plan(lengths, dp=4, pp=2, context=40000, strategy=strategy)
    empty = ReplicaPlan([], [], [], [[], []], [3])
    plan.replicas.append(empty)
    restored = pickle.loads(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
    assert restored == plan and restored.to_dict() == plan.to_dict()
    assert type(restored.samples[0]) is Sample and type(restored.sample_sources[0]) is type(plan.sample_sources[0])
    slices = [piece for replica in restored.replicas for pack in replica.micropacks for piece in pack.slices]
    assert slices and all(type(piece) is Slice and type(piece.start) is int for piece in slices)
    assert restored.replicas[-1] == empty
    assert any(replica.is_merge_group for replica in restored.replicas) == (strategy == "slimpack")


def test_planner_is_deterministic_for_a_fixed_seed():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 30000, size=300).tolist()
    # Under a wall-clock limit alone, load on the machine could stop CP-SAT at a different point.
    first, second = (make_plan(lengths, dp=4, pp=4, seed=7, solver_time_limit_s=60, solver_deterministic_limit=0.5)
                     for _ in range(2))
    assert first.fingerprint() == second.fingerprint()


def test_long_document_is_cost_balanced_sliced_with_shorter_later_slices():
    plan = make_plan([60000] + [500] * 200, dp=1, pp=4, context=65536, max_micropack_tokens=16384)
    pieces = sorted((s for r in plan.replicas for m in r.micropacks for s in m.slices if s.sample_id == 0),
                    key=lambda s: s.start)
    assert len(pieces) >= 4
    assert pieces[0].length > pieces[-1].length  # later slices carry a longer prefix
    assert all(p.length <= 16384 for p in pieces)


def test_slices_of_a_long_document_cost_the_same_seconds_at_their_own_efficiency():
    """Later slices are shorter (longer prefix) and so run at lower GEMM efficiency: balancing
    work alone leaves them up to 13% slower here (4K MicroPacks over 4-way context parallelism:
    a device's GEMMs get about 1K rows); balanced on seconds they are within 1%, and a chain's
    MicroPacks are topped up with sand only as far as their own efficiency allows."""
    import dataclasses

    from megatron_slimpack.planner.slimpack.pack_phase import PackOptions, cut_document, pack_micropacks
    from megatron_slimpack.planner.work import WorkRates

    parallel = ParallelConfig(dp=1, pp=1, tp=8, cp=4)
    rates = WorkRates.from_cost(COST, parallel, 4096)
    assert rates.half_tokens > 0 and rates.size_penalty(1024) > rates.size_penalty(4096) == pytest.approx(1.0)

    def seconds(pieces):
        return np.array([COST.forward_time(p.length, p.attention_pairs, parallel)
                         + COST.backward_time(p.length, p.attention_pairs, parallel) for p in pieces])

    options = PackOptions(4096, 4096)
    balanced = seconds(cut_document(Sample(0, 131072), options, rates))
    work_only = seconds(cut_document(Sample(0, 131072), options, dataclasses.replace(rates, half_tokens=0.0)))
    assert balanced.max() / balanced.min() < 1.01 < 1.1 < work_only.max() / work_only.min()

    micropacks = pack_micropacks(samples_of([131072] + [200] * 400), options, rates)
    chain = [m for m in micropacks if any(s.sample_id == 0 for s in m.slices)]
    packs = np.array([COST.forward_time(m.num_tokens, m.attention_pairs, parallel)
                      + COST.backward_time(m.num_tokens, m.attention_pairs, parallel) for m in chain])
    assert packs.max() / packs.min() < 1.02


def test_a_small_cap_does_not_cut_a_long_document_into_thousands_of_slices():
    """Balancing seconds shortens short slices further (they run less efficiently), which at a
    small cap spiralled into over a thousand slices of a 256K document. The count now starts at
    the work-balanced one and gets at most a few more slices."""
    import dataclasses

    from megatron_slimpack.planner.slimpack.pack_phase import PackOptions, cut_document
    from megatron_slimpack.planner.work import WorkRates

    parallel = ParallelConfig(dp=1, pp=4, tp=8, cp=2)
    rates = WorkRates.from_cost(COST, parallel, 32768)
    work_balanced = cut_document(Sample(0, 262144), PackOptions(4096, 4096),
                                 dataclasses.replace(rates, half_tokens=0.0))
    pieces = cut_document(Sample(0, 262144), PackOptions(4096, 4096), rates)
    assert len(work_balanced) <= len(pieces) <= len(work_balanced) + PlannerTunables().extra_slices
    assert sum(p.length for p in pieces) == 262144 and max(p.length for p in pieces) <= 4096


def test_even_costs_slice_documents_heavier_than_a_typical_micropack():
    """With pipeline parallelism each stage waits on its neighbours' slower unit, so MicroPacks
    should cost about the same. A 16000-token document fits the 16384-token cap whole but costs a
    quarter more than a full pack of short documents (its attention); with `even_costs` it is
    sliced, and no MicroPack costs more than the tolerance over the median."""
    from megatron_slimpack.planner.slimpack.pack_phase import MicroPackCosts, PackOptions, pack_micropacks
    from megatron_slimpack.planner.work import WorkRates

    parallel = ParallelConfig(dp=1, pp=4, tp=8)
    rates = WorkRates.from_cost(COST, parallel, 16384)
    lengths = [65536] + [16000] * 6 + [300] * 1200
    spread = {}
    for even in (False, True):
        micropacks = pack_micropacks(samples_of(lengths), PackOptions(16384, 16384, even_costs=even), rates)
        assert sum(m.num_tokens for m in micropacks) == sum(lengths)
        costs = MicroPackCosts.of(micropacks, COST, parallel)
        seconds = costs.forward[0] + costs.backward[0]
        spread[even] = seconds.max() / np.median(seconds)
        # A piece cut from past a document's start is always its MicroPack's first slice (the replica
        # search looks for sliced documents there only: `ReplicaSearch._sliced_a_whole_fitting_document`).
        assert all(piece.start == 0 for pack in micropacks for piece in pack.slices[1:])
        assert any(pack.slices[0].start > 0 for pack in micropacks)
    assert spread[False] > 1.2
    assert spread[True] <= PlannerTunables().even_cost_tolerance


def test_asymmetric_units_differ_from_symmetric_on_heterogeneous_packs():
    rng = np.random.default_rng(0)
    lengths = [60000, 50000] + rng.integers(100, 3000, size=400).tolist()
    asym = make_plan(lengths, dp=1, pp=4, max_micropack_tokens=8192)
    replica = asym.replicas[0]
    forward_sets = {tuple(sorted(u)) for u in replica.forward_units}
    backward_sets = {tuple(sorted(u)) for u in replica.backward_units}
    if len(replica.forward_units) < len(replica.micropacks):
        assert forward_sets != backward_sets


# ---- validate() names the broken rule ---------------------------------------------------------

def small_replica():
    micropacks = [MicroPack([Slice(0, 0, 4), Slice(1, 0, 3)]), MicroPack([Slice(0, 4, 6)]), MicroPack([Slice(2, 0, 5)])]
    forward = [[0], [1, 2]]
    backward = [[1, 0], [2]]  # chain (0,1) reversed, then chain (2)
    orders = [[("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
    return ReplicaPlan(micropacks, forward, backward, orders, [0])


def small_plan(replica=None):
    return Plan([replica or small_replica()], [Sample(0, 6), Sample(1, 3), Sample(2, 5)],
                ParallelConfig(), context_length=8, strategy="hand", max_micropack_tokens=8)


def test_hand_built_plan_is_valid():
    assert backward_sequence(small_replica().micropacks) == [1, 0, 2]
    small_plan().validate()


def _backward_sequence_reference(micropacks):
    """Chains by a plain graph walk: MicroPacks sharing a sample that is sliced (some slice starts
    past 0) are linked; chains in order of their first MicroPack, each reversed."""
    sliced = {s.sample_id for m in micropacks for s in m.slices if s.start > 0}
    seen, order = set(), []
    for first in range(len(micropacks)):
        if first in seen:
            continue
        chain, frontier = {first}, [first]
        while frontier:
            samples = {s.sample_id for s in micropacks[frontier.pop()].slices} & sliced
            for other, pack in enumerate(micropacks):
                if other not in chain and samples & {s.sample_id for s in pack.slices}:
                    chain.add(other)
                    frontier.append(other)
        seen |= chain
        order += sorted(chain, reverse=True)
    return order


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=4, unique=True), min_size=1, max_size=14))
def test_backward_sequence_reverses_each_chain(packs):
    """Chains are found through any shared sliced sample, also transitively (a pack holding the
    tails of two documents joins their chains)."""
    offsets: dict[int, int] = {}
    micropacks = []
    for pack in packs:
        slices = []
        for sample_id in pack:
            start = offsets.get(sample_id, 0)
            slices.append(Slice(sample_id, start, start + 3))
            offsets[sample_id] = start + 3
        micropacks.append(MicroPack(slices))
    assert backward_sequence(micropacks) == _backward_sequence_reference(micropacks)


@pytest.mark.parametrize("mutate, rule", [
    (lambda r: r.micropacks[1].slices.__setitem__(0, Slice(0, 5, 6)), "coverage"),
    (lambda r: r.micropacks.__setitem__(0, MicroPack([Slice(0, 4, 6), Slice(1, 0, 3)])) or
     r.micropacks.__setitem__(1, MicroPack([Slice(0, 0, 4)])), "slice-order"),
    (lambda r: r.micropacks.__setitem__(1, MicroPack([Slice(0, 4, 5), Slice(0, 5, 6)])), "slice-order"),
    (lambda r: r.forward_units.__setitem__(1, [2, 1]), "forward-units"),
    (lambda r: r.backward_units.__setitem__(0, [0, 1]), "backward-units"),
    (lambda r: r.stage_orders.__setitem__(0, [("F", 0), ("B", 0), ("F", 1), ("B", 1)]), "stage-orders"),
    (lambda r: r.stage_orders.__setitem__(0, [("F", 0), ("F", 1), ("B", 0)]), "stage-orders: .* exactly once"),
    (lambda r: r.stage_orders.__setitem__(0, [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("B", 1)]),
     "stage-orders: .* exactly once"),
    (lambda r: r.stage_orders.__setitem__(0, [("F", 1), ("F", 0), ("B", 0), ("B", 1)]),
     "stage-orders: .* out of their sequence order"),
    (lambda r: r.micropacks[2].slices.__setitem__(0, Slice(9, 0, 5)), "unknown-sample"),
])
def test_validate_names_the_broken_rule(mutate, rule):
    replica = small_replica()
    mutate(replica)
    with pytest.raises(PlanError, match=rule):
        small_plan(replica).validate()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["shift", "drop", "duplicate", "move", "swap", "none"]))
def test_fast_slice_check_agrees_with_the_per_slice_pass(seed, kind):
    """validate()'s array pass must accept exactly the plans the per-slice pass accepts."""
    import random

    import numpy as np

    from megatron_slimpack.plan import _check_slices, _SliceTable

    rng = random.Random(seed)
    plan = make_plan([rng.randint(1, 30000) for _ in range(12)], dp=2, pp=1, context=30000,
                     solver_time_limit_s=0.2)
    packs = [(r, m) for r in plan.replicas for m in r.micropacks]
    replica, pack = rng.choice(packs)
    index = rng.randrange(len(pack.slices))
    piece = pack.slices[index]
    if kind == "shift" and piece.length > 1:
        pack.slices[index] = Slice(piece.sample_id, piece.start + 1, piece.end)
    elif kind == "drop" and len(pack.slices) > 1:
        del pack.slices[index]
    elif kind == "duplicate":
        pack.slices.append(piece)
    elif kind == "move":
        other = plan.replicas[1 - plan.replicas.index(replica)]
        if other.micropacks and len(pack.slices) > 1:
            other.micropacks[0].slices.append(pack.slices.pop(index))
    elif kind == "swap" and len(replica.micropacks) > 1:
        replica.micropacks.reverse()
    lengths = {s.sample_id: s.length for s in plan.samples}
    try:
        for i, r in enumerate(plan.replicas):
            _check_slices(r, f"replica plan {i}", lengths, plan.max_micropack_tokens)
        covered = {s for r in plan.replicas for s in r.sample_ids}
        owners = [s for r in plan.replicas for s in r.sample_ids]
        exact_ok = covered == set(lengths) and len(owners) == len(covered)
    except PlanError:
        exact_ok = False
    ids = np.array(sorted(lengths))
    table = _SliceTable(plan.replicas, ids, np.array([lengths[i] for i in ids.tolist()]), plan.max_micropack_tokens)
    assert (table.valid and table.one_replica_per_sample()) == exact_ok
    if not exact_ok:
        with pytest.raises(PlanError):
            plan.validate()


def test_token_cap_and_ranks_are_checked():
    plan = small_plan()
    plan.max_micropack_tokens = 5
    with pytest.raises(PlanError, match="token-cap"):
        plan.validate()
    plan = small_plan()
    plan.parallel = ParallelConfig(dp=2)
    with pytest.raises(PlanError, match="dp-ranks"):
        plan.validate()


def test_token_cap_is_per_device_so_a_merge_group_holds_its_size_times_the_cap():
    def plan_with_merged_pack(tokens: int) -> Plan:
        merged = ReplicaPlan([MicroPack([Slice(0, 0, tokens)])], [[0]], [[0]], [[("F", 0), ("B", 0)]], [0, 1])
        own = [ReplicaPlan([MicroPack([Slice(rank + 1, 0, 3)])], [[0]], [[0]], [[("F", 0), ("B", 0)]], [rank])
               for rank in (0, 1)]
        return Plan([merged, *own], [Sample(0, tokens), Sample(1, 3), Sample(2, 3)], ParallelConfig(dp=2),
                    context_length=32, strategy="hand", max_micropack_tokens=8)

    plan_with_merged_pack(16).validate()  # two members hold 8 tokens each
    with pytest.raises(PlanError, match="token-cap: replica plan 0 MicroPack 0 has 17 tokens > cap 16"):
        plan_with_merged_pack(17).validate()


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("lengths, message", [
    ([], "empty"), ([10, 0, 5], "0"), ([10, -3], "-3"), ([10, 2.5], "2.5"), ([10, 70000], "context"),
])
def test_bad_lengths_are_refused(lengths, message):
    with pytest.raises(ValueError, match=message):
        make_plan(lengths, dp=1, pp=1)


def test_layout_that_does_not_divide_the_model_is_refused():
    with pytest.raises(SpecError, match="layers"):
        make_plan([100, 200], dp=1, pp=3)
    with pytest.raises(SpecError, match="heads"):
        make_plan([100, 200], dp=1, pp=1, tp=3)


def test_plan_that_cannot_fit_memory_says_what_it_needs_and_which_knob_helps():
    cost = ms.CostModel.analytic("llama-70b", "h100-sxm")
    with pytest.raises(PlanError, match=r"needs? at least .* GiB.*recompute"):
        ms.plan([262144, 100], parallel=ParallelConfig(dp=1, pp=1, tp=1), cost=cost,
                config=ms.SlimPackConfig(context_length=262144))


def test_unknown_presets_and_strategies():
    with pytest.raises(SpecError, match="known"):
        ms.CostModel.analytic("llama-8t", "h100-sxm")
    with pytest.raises(PlanError, match="unknown strategy"):
        make_plan([100, 200], dp=1, pp=1, strategy="magic")


def test_malformed_plan_file_names_the_problem(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format_version": 1, ')
    with pytest.raises(PlanError, match="bad.json"):
        Plan.from_json(path)
    path.write_text(json.dumps({"format_version": 1}))
    with pytest.raises(PlanError, match="malformed"):
        Plan.from_json(path)


# ---- phase 1 and unit segmentation ------------------------------------------------------------------

def test_cp_sat_balances_and_reports_status():
    rng = np.random.default_rng(1)
    costs = rng.lognormal(0, 1.5, size=500)
    # Every document decided by CP-SAT: no sand to level the LPT hint to the mean load.
    result = dp_phase.assign_to_replicas(costs, 4, time_limit_s=1.0, dp_merge=False,
                                         tunables=PlannerTunables(max_model_items=500))
    assert result.solver["status"] in ("OPTIMAL", "FEASIBLE")
    assert result.solver["imbalance"] < 1.01
    assert sorted(i for r in result.replica_samples for i in r) == list(range(500))


def test_a_hint_at_the_load_bound_is_used_without_a_solve(monkeypatch):
    """Where the sand levels the LPT hint to the mean load, no assignment is better and CP-SAT's
    would not be used (only one that beats the hint is): it is not run, and the replicas are the
    ones a solve gives."""
    costs = np.random.default_rng(1).lognormal(0, 1.5, size=3000)
    shortcut = dp_phase.assign_to_replicas(costs, 8, time_limit_s=1.0, dp_merge=False)
    assert shortcut.solver["status"] == "hint-at-bound" and shortcut.solver["source"] == "hint"
    assert shortcut.solver["objective"] == shortcut.solver["bound"] == shortcut.solver["hint"]
    assert shortcut.solver["gap"] == 0.0 and shortcut.solver["imbalance"] < 1.001
    monkeypatch.setattr(dp_phase, "_load_bound", lambda scaled, fixed, sand_total: -1)  # always solve
    solved = dp_phase.assign_to_replicas(costs, 8, time_limit_s=1.0, dp_merge=False)
    assert solved.solver["status"] in ("OPTIMAL", "FEASIBLE") and solved.solver["source"] == "hint"
    assert solved.replica_samples == shortcut.replica_samples


def test_cp_sat_timeout_falls_back_to_lpt_and_says_so():
    costs = np.random.default_rng(2).lognormal(0, 1.0, size=400)
    result = dp_phase.assign_to_replicas(costs, 8, time_limit_s=1e-6, dp_merge=False,
                                         tunables=PlannerTunables(max_model_items=400))
    assert "fallback" in result.solver and "LPT" in result.solver["fallback"]
    assert result.solver["source"] == "hint"
    assert sorted(i for r in result.replica_samples for i in r) == list(range(400))


def test_a_deterministic_budget_stops_cp_sat_reproducibly_and_is_reported():
    """A wall-clock limit makes the plan depend on machine load; a deterministic budget does not."""
    costs = np.random.default_rng(2).lognormal(0, 1.0, size=400)
    runs = [dp_phase.assign_to_replicas(costs, 8, time_limit_s=600, deterministic_limit=1e-4, dp_merge=False,
                                        tunables=PlannerTunables(max_model_items=400))
            for _ in range(2)]
    assert runs[0].replica_samples == runs[1].replica_samples
    assert runs[0].solver["status"] != "OPTIMAL" and "(0.0001 deterministic)" in runs[0].solver["fallback"]


def test_sand_with_long_documents_at_its_head_still_balances():
    # More long documents than CP-SAT decides individually: the sand starts with whole long
    # documents, and only the short ones at its end can close each replica's gap.
    costs = np.array([10.0] * (PlannerTunables().max_model_items + 45) + [0.1] * 1000)
    result = dp_phase.assign_to_replicas(costs, 8, time_limit_s=0.5, dp_merge=False)
    assert result.solver["imbalance"] < 1.001, result.solver
    assert sorted(i for r in result.replica_samples for i in r) == list(range(len(costs)))


def test_sand_is_poured_in_strata_so_every_replica_gets_documents_of_every_size():
    """The light tail of the sand is poured stratum by stratum: each replica gets its share of every
    size and still meets its load. Poured as one contiguous run of the sorted tail, the first
    replica took its largest documents and the last its smallest (medians 26x apart at llama-70b
    64K Wikipedia), and their MicroPacks filled unevenly."""
    tunables = PlannerTunables()
    costs = np.random.default_rng(0).lognormal(0.0, 1.5, 40_000)
    result = dp_phase.assign_to_replicas(costs, 4, time_limit_s=0.5, dp_merge=False)
    assert result.solver["imbalance"] < 1.0001, result.solver
    assert sorted(i for r in result.replica_samples for i in r) == list(range(len(costs)))
    loads = [costs[r].sum() for r in result.replica_samples]
    tail = np.argsort(-costs, kind="stable")[tunables.max_model_items + 4 * tunables.dealt_sand_per_replica:]
    assert max(loads) - min(loads) <= 2 * costs[tail].max()  # within about a tail document
    in_tail = np.zeros(len(costs), dtype=bool)
    in_tail[tail] = True
    medians = [np.median(costs[[i for i in r if in_tail[i]]]) for r in result.replica_samples]
    assert max(medians) / min(medians) < 1.05, medians


def test_micropacks_of_short_documents_are_topped_up_with_the_smallest_ones():
    """Documents over half the cap cannot share a MicroPack: next fit alone leaves each in a pack
    of its own (18 packs here). Topping each pack up with the smallest documents fills them, down
    to the fewest packs the token cap and the cost target allow."""
    import math

    from megatron_slimpack.planner.slimpack.pack_phase import PackOptions, pack_micropacks
    from megatron_slimpack.planner.work import WorkRates

    cap = 4096
    rates = WorkRates.from_cost(COST, ParallelConfig(dp=1, pp=1, tp=8), cap)
    lengths = [2500] * 12 + [300] * 60 + [40] * 100
    micropacks = pack_micropacks(samples_of(lengths), PackOptions(cap, cap), rates)
    as_array = np.array(lengths, dtype=float)
    total_cost = float(rates.total(as_array, as_array * (as_array + 1) / 2).sum())
    fewest = math.ceil(max(sum(lengths) / cap, total_cost / (rates.document(1) * cap)))
    assert len(micropacks) == fewest == 14
    assert sorted(s.sample_id for m in micropacks for s in m.slices) == list(range(len(lengths)))
    assert max(m.num_tokens for m in micropacks) <= cap


def test_outlier_goes_to_a_merge_group():
    costs = np.array([100.0] + [1.0] * 40)
    result = dp_phase.assign_to_replicas(costs, 4, merge_threshold=1.0)
    assert [g.sample_indices for g in result.merge_groups] == [[0]]
    assert len(result.merge_groups[0].dp_ranks) >= 2
    assert all(0 not in r for r in result.replica_samples)


@given(st.lists(st.floats(min_value=0.01, max_value=10), min_size=1, max_size=40), st.integers(1, 12))
def test_segment_is_an_optimal_contiguous_partition(costs, units):
    groups = segment(costs, units)
    assert [i for g in groups for i in g] == list(range(len(costs)))
    assert len(groups) <= units
    worst = max(sum(costs[i] for i in g) for g in groups)
    # no partition into `units` groups can beat the larger of the biggest item and the average
    assert worst >= max(max(costs), sum(costs) / units) - 1e-9
    if len(costs) <= 8 and units <= 3:
        assert worst <= brute_force_bottleneck(costs, units) + 1e-9


def brute_force_bottleneck(costs, units):
    from itertools import combinations
    n = len(costs)
    best = float("inf")
    for k in range(1, min(units, n) + 1):
        for cuts in combinations(range(1, n), k - 1):
            bounds = [0, *cuts, n]
            best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_equal_units_reproduce_1f1b():
    pp, m, forward, backward = 4, 12, 1.0, 2.0
    units = [[i] for i in range(m)]
    work = StageWork([[forward] * m] * pp, [[backward] * m] * pp, [0.0] * m, [0.0] * m,
                     [[1.0] * m] * pp, [[1.0] * m] * pp, [float(pp - s) for s in range(pp)])
    orders = build_stage_orders(units, units, work)
    assert replay(orders, work) == pytest.approx((m + pp - 1) * (forward + backward))
    assert orders[0][:pp + 1] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert orders[-1][:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_chains_of_slices_pipeline_without_bursts():
    """Documents sliced in three (backward units in reverse chain order) with equal durations:
    running each chain's forwards ahead, one per backward, keeps 1F1B's time; running them in a
    burst right before the chain's first backward stalls the neighbouring stages (109 instead of
    81 time units here)."""
    pp, chains, forward, backward = 4, 8, 1.0, 2.0
    m = 3 * chains
    forward_units = [[i] for i in range(m)]
    backward_units = [[3 * c + k] for c in range(chains) for k in (2, 1, 0)]
    work = StageWork([[forward] * m] * pp, [[backward] * m] * pp, [0.0] * m, [0.0] * m,
                     [[1.0] * m] * pp, [[1.0] * m] * pp, [float(pp - s) for s in range(pp)])
    orders = build_stage_orders(forward_units, backward_units, work)
    assert replay(orders, work) == pytest.approx((m + pp - 1) * (forward + backward))
    assert orders[-1][:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]


@settings(max_examples=30, deadline=None)
@given(chain_lengths=st.lists(st.integers(1, 6), min_size=1, max_size=8), pp=st.integers(1, 5),
       lead=st.sampled_from([None, 0, 1, 2, 5]))
def test_a_shortened_chain_lead_still_orders_every_unit_without_deadlock(chain_lengths, pp, lead):
    """Chains of slices back to back (each backward-reversed): whatever the chain lead, every stage
    runs every unit once, in sequence order, after the forwards it needs, and the orders replay."""
    from megatron_slimpack.planner.orders import peak_in_flight, stage_orders
    from megatron_slimpack.runtime.pipeline.schedule import check_stage_orders

    micropacks, forward_units, backward_units = [], [], []
    for sample, length in enumerate(chain_lengths):
        first = len(micropacks)
        micropacks += [MicroPack([Slice(sample, k, k + 1)]) for k in range(length)]
        forward_units += [[first + k] for k in range(length)]
        backward_units += [[first + k] for k in reversed(range(length))]
    m = len(micropacks)
    warmups = [min(pp - stage - 1, m) for stage in range(pp)]
    orders = stage_orders(forward_units, backward_units, warmups, chain_lead=lead)
    check_stage_orders(ReplicaPlan(micropacks, forward_units, backward_units, orders, [0]))
    work = StageWork([[1.0] * m] * pp, [[2.0] * m] * pp, [0.0] * m, [0.0] * m, [[1.0] * m] * pp,
                     [[1.0] * m] * pp, [float(pp)] * pp)
    assert replay(orders, work) >= (m + pp - 1) * 3.0 - 1e-9
    pipelined = stage_orders(forward_units, backward_units, warmups)
    assert max(peak_in_flight(orders, work)) <= max(peak_in_flight(pipelined, work))


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=12), pp=st.integers(1, 6),
       lead=st.sampled_from([None, 0, 1, 3]), seed=st.integers(0, 10_000))
def test_forward_targets_give_the_orders_and_peaks_of_a_plain_walk(sizes, pp, lead, seed):
    """Units of several MicroPacks, backward units over a shuffled sequence, uneven bytes: the
    orders built from `forward_targets` put every forward a backward needs before it, stage s
    stays at least as far ahead as stage s + 1, and `peaks_of_targets` equals walking the orders
    (`peak_in_flight`)."""
    from megatron_slimpack.planner.orders import forward_targets, orders_of_targets, peak_in_flight, peaks_of_targets

    rng = np.random.default_rng(seed)
    count = sum(sizes)
    bounds = np.cumsum([0] + sizes)
    forward_units = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    sequence = rng.permutation(count).tolist()
    cuts = (np.sort(rng.choice(np.arange(1, count), size=int(rng.integers(0, count)), replace=False))
            if count > 1 else [])
    cuts = [0, *map(int, cuts), count]
    backward_units = [sequence[a:b] for a, b in zip(cuts, cuts[1:])]
    warmups = [min(pp - stage - 1 + int(rng.integers(0, 2)), len(forward_units)) for stage in range(pp)]
    targets = forward_targets(forward_units, backward_units, warmups, lead)
    orders = orders_of_targets(targets)

    unit_of = {mp: u for u, members in enumerate(forward_units) for mp in members}
    for stage, order in enumerate(orders):
        run = [unit for kind, unit in order if kind == "F"]
        assert run == list(range(len(run)))
        assert (np.diff(targets[stage]) >= 0).all()  # a count of forwards run: it never goes back
        for b, members in enumerate(backward_units):
            assert max(unit_of[mp] for mp in members) < targets[stage][b]
            if stage + 1 < pp:
                assert targets[stage][b] >= targets[stage + 1][b]
    held = [rng.uniform(0, 4e9, len(forward_units)).tolist(), rng.uniform(0, 4e9, len(forward_units)).tolist()]
    frees = [rng.uniform(0, 4e9, len(backward_units)).tolist(), rng.uniform(0, 4e9, len(backward_units)).tolist()]
    work = StageWork([[1.0] * len(forward_units)] * pp, [[1.0] * len(backward_units)] * pp, [], [],
                     [held[stage == pp - 1] for stage in range(pp)], [frees[stage == pp - 1] for stage in range(pp)],
                     [1e12] * pp)
    assert peaks_of_targets(targets, work) == pytest.approx(peak_in_flight(orders, work), rel=1e-12)


def relaxed_makespan(orders, work):
    """Reference for `replay`: every task ends at max(its stage's previous task, its input) plus
    its duration; relax all tasks in sweeps until nothing changes (longest path by fixed point)."""
    pp = len(orders)
    end = {(stage, kind, unit): 0.0 for stage, order in enumerate(orders) for kind, unit in order}
    for _ in range(sum(map(len, orders)) + 1):
        changed = False
        for stage, order in enumerate(orders):
            previous = 0.0
            for kind, unit in order:
                if kind == "F":
                    ready = end[stage - 1, "F", unit] + work.forward_transfer[unit] if stage else 0.0
                    value = max(previous, ready) + work.forward_time[stage][unit]
                else:
                    ready = end[stage + 1, "B", unit] + work.backward_transfer[unit] if stage < pp - 1 else 0.0
                    value = max(previous, ready) + work.backward_time[stage][unit]
                changed |= value != end[stage, kind, unit]
                end[stage, kind, unit] = previous = value
        if not changed:
            return max(end.values())
    raise AssertionError("no fixed point: the orders deadlock")


@settings(max_examples=40, deadline=None)
@given(chain_lengths=st.lists(st.integers(1, 4), min_size=1, max_size=6), pp=st.integers(1, 5),
       lead=st.sampled_from([None, 0, 2]), seed=st.integers(0, 1000))
def test_replay_matches_a_fixed_point_reference(chain_lengths, pp, lead, seed):
    """Uneven durations and transfers, chains of slices, any chain lead: `replay` (a worklist over
    stages) gives the longest path a plain fixed-point relaxation finds."""
    from megatron_slimpack.planner.orders import stage_orders

    rng = np.random.default_rng(seed)
    forward_units, backward_units = [], []
    for length in chain_lengths:
        first = len(forward_units)
        forward_units += [[first + k] for k in range(length)]
        backward_units += [[first + k] for k in reversed(range(length))]
    m = len(forward_units)
    warmups = [min(pp - stage - 1 + int(rng.integers(0, 2)), m) for stage in range(pp)]
    orders = stage_orders(forward_units, backward_units, warmups, chain_lead=lead)
    work = StageWork(rng.uniform(0.5, 2, (pp, m)).tolist(), rng.uniform(1, 4, (pp, m)).tolist(),
                     rng.uniform(0, 0.3, m).tolist(), rng.uniform(0, 0.3, m).tolist(),
                     [[1.0] * m] * pp, [[1.0] * m] * pp, [float(pp)] * pp)
    assert replay(orders, work) == pytest.approx(relaxed_makespan(orders, work), rel=1e-12)
    # The compiled replay of the targets these orders come from: the same to the last bit.
    from megatron_slimpack.planner.orders import forward_targets, orders_of_targets, replay_targets

    targets = forward_targets(forward_units, backward_units, warmups, chain_lead=lead)
    assert orders_of_targets(targets) == orders
    assert replay_targets(targets, work) == replay(orders, work)


def test_a_replay_of_targets_that_wait_in_a_circle_is_refused():
    """Stage 0 runs B0 before F0, which stage 1 needs before its B0: a circular wait."""
    from megatron_slimpack.planner.orders import orders_of_targets, replay_targets

    targets = np.array([[0], [1]])
    assert orders_of_targets(targets) == [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    work = StageWork([[1.0], [1.0]], [[2.0], [2.0]], [0.1], [0.1], [[1.0]] * 2, [[1.0]] * 2, [2.0] * 2)
    with pytest.raises(RuntimeError, match="deadlock"):
        replay_targets(targets, work)


def test_a_chain_run_up_that_does_not_fit_is_shortened_until_it_does():
    """Two long documents sliced into chains with little between them: running the second chain's
    forwards ahead holds them while the first drains. Given a budget between the leanest and the
    fully pipelined peak, the candidate keeps the fastest shortened orders that fit."""
    from megatron_slimpack.planner.slimpack.pack_phase import (
        MicroPackCosts,
        PackOptions,
        UnitCandidate,
        pack_micropacks,
    )
    from megatron_slimpack.planner.work import WorkRates

    parallel = ParallelConfig(dp=1, pp=4, tp=8, recompute="selective")
    rates = WorkRates.from_cost(COST, parallel, 4096)
    lengths = [16384, 16384] + [1024] * 8
    micropacks = pack_micropacks(samples_of(lengths), PackOptions(4096, 4096), rates)
    costs = MicroPackCosts.of(micropacks, COST, parallel)
    candidate = UnitCandidate.of(micropacks, costs, len(micropacks), False, COST, parallel, float("inf"))
    pipelined, leanest = candidate.order([0]), candidate.order([0], budget_bytes=0.0)
    assert leanest.peak_activation_bytes < pipelined.peak_activation_bytes  # the run-up costs memory here
    assert leanest.makespan_s > pipelined.makespan_s  # ... and the burst costs time
    budget = (leanest.peak_activation_bytes + pipelined.peak_activation_bytes) / 2
    fitted = candidate.order([0], budget_bytes=budget)
    assert fitted.peak_activation_bytes <= budget
    assert pipelined.makespan_s <= fitted.makespan_s <= leanest.makespan_s


def test_micropack_sizes_to_try_include_three_quarter_steps():
    from megatron_slimpack.planner.slimpack.ladder import SizeLadder

    config = ms.SlimPackConfig(context_length=131072)
    assert SizeLadder.below_cap(18432, config).micropack_tokens == (18432, 13824, 9216, 6912, 4608, 3456, 2304)
    assert SizeLadder.below_cap(2048, config).micropack_tokens == (2048, 1536, 1024)
    assert SizeLadder.below_cap(18432, config.with_(slice_tokens=8192)).micropack_tokens == (8192,)


def test_document_too_long_for_one_replica_goes_to_a_memory_driven_merge_group():
    cost = ms.CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ParallelConfig(dp=8, pp=1, tp=8)
    lengths = [262144] + [2000] * 300
    plan = ms.plan(lengths, parallel=parallel, cost=cost, config=ms.SlimPackConfig(context_length=262144))
    merged = [r for r in plan.replicas if r.is_merge_group]
    assert len(merged) == 1 and len(merged[0].dp_ranks) >= 2
    assert merged[0].sample_ids == [0]
    report = ms.simulate(plan, cost)
    assert report.fits_memory
    with pytest.raises(PlanError, match="DP-Merge is off"):
        ms.plan(lengths, parallel=parallel, cost=cost,
                config=ms.SlimPackConfig(context_length=262144, dp_merge=False))


def test_planner_keeps_pipelined_units_within_memory():
    """1F1B keeps pp - s forward units in flight per stage: few large units are fast on paper but
    hold many MicroPacks at once. The planner must only pick unit counts whose stage orders fit."""
    from megatron_slimpack.planner.slimpack.memory import activation_budget
    from megatron_slimpack.planner.slimpack.pack_phase import MicroPackCosts, UnitCandidate

    parallel = ParallelConfig(dp=2, pp=2, tp=2, recompute="selective")
    rng = np.random.default_rng(5)
    lengths = [int(x) for x in np.clip(rng.lognormal(8.5, 1.3, 700), 64, 65536)]
    plan = ms.plan(lengths, parallel=parallel, cost=COST, config=ms.SlimPackConfig(context_length=65536))
    report = ms.simulate(plan, COST)
    budget = activation_budget(COST, parallel)
    assert max(report.peak_memory_bytes) <= COST.memory_budget_bytes()
    for replica in plan.replicas:
        costs = MicroPackCosts.of(replica.micropacks, COST, parallel)
        fewest = UnitCandidate.of(replica.micropacks, costs, 2 * parallel.pp, False, COST, parallel, budget)
        assert fewest.order(replica.dp_ranks).peak_activation_bytes > budget  # the check had to bite
        assert len(replica.forward_units) > 2 * parallel.pp


def test_replica_that_cannot_fit_memory_names_the_need_and_the_knobs():
    from megatron_slimpack.planner.outcomes import DoesNotFit
    from megatron_slimpack.planner.slimpack.replica import plan_replica
    from megatron_slimpack.planner.work import WorkRates

    parallel = ParallelConfig(dp=1, pp=2, tp=8)
    samples = [Sample(i, 8192) for i in range(8)]
    config = ms.SlimPackConfig(context_length=65536)
    rates = WorkRates.from_cost(COST, parallel, 8192)
    with pytest.raises(PlanError, match=r"memory: replica \[0\] does not fit: .* activation recompute") as caught:
        plan_replica(samples, COST, parallel, config, rates, 8192, [0], False, budget=1e6)
    assert isinstance(caught.value, DoesNotFit)
    assert caught.value.sample_ids == tuple(range(8)) and caught.value.group_ranks == 1
    assert caught.value.bytes_available == COST.memory_budget_bytes() < caught.value.bytes_needed


def test_pack_figures_count_continued_prefix_and_masked_entries():
    from megatron_slimpack.plan import pack_figures

    micropacks = [MicroPack([Slice(0, 0, 5), Slice(1, 0, 3)]), MicroPack([Slice(0, 5, 9), Slice(2, 0, 4)]),
                  MicroPack([Slice(0, 9, 12)])]
    figures = pack_figures(micropacks)
    assert figures.tokens.tolist() == [8.0, 8.0, 3.0]
    assert figures.pairs.tolist() == [15 + 6, 4 * 5 + 10 + 10, 3 * 9 + 6]
    assert figures.continued.tolist() == [5.0, 4.0, 0.0]
    assert figures.prefix.tolist() == [0.0, 5.0, 9.0]
    assert figures.masked.tolist() == [0.0, 4 * 9, 3 * 12]


def test_token_cap_grows_past_a_power_of_two_into_the_memory_left():
    from megatron_slimpack.planner.slimpack.memory import activation_budget, auto_token_cap, fullest_stage_bytes

    parallel = ParallelConfig(dp=64, pp=1, tp=2, recompute="selective")
    cap = auto_token_cap(COST, parallel, ms.SlimPackConfig(context_length=65536))
    power = 1 << (cap.bit_length() - 1)
    step = power // 8

    def need(tokens: int) -> float:
        return fullest_stage_bytes(COST, parallel, tokens, tokens * tokens / 2, tokens)

    assert power < cap < 2 * power and (cap - power) % step == 0  # 7B tp2 on an H100: 32K and some eighths
    assert need(cap) <= activation_budget(COST, parallel) < need(cap + step)


LLAMA_13B = ms.CostModel.analytic("llama-13b", "h100-sxm")
# Llama 3 70B: stage 0 of tp8 pp2 cp4 just holds two 64K MicroPacks (99.6% of what is left after
# weights and optimizer state), and two with their logits would not fit.
LLAMA3_70B = ms.CostModel.analytic("llama3-70b", "h100-sxm")
TIGHT_PP2 = ParallelConfig(dp=8, pp=2, tp=8, cp=4, recompute="none")


def test_token_cap_counts_logits_only_on_the_last_stage():
    """1F1B holds pp MicroPacks on stage 0 and one, with its logits, on the last stage. Charging
    every one of the pp the logits would cap Llama 3 70B tp8 pp2 cp4 below 64K tokens, the
    sequences Megatron's own packing runs there within memory (the simulator agrees)."""
    from megatron_slimpack.planner.slimpack.memory import activation_budget, auto_token_cap
    from megatron_slimpack.planner.strategies import new_planner
    from megatron_slimpack.simulator.dag import simulate

    context = 65536
    config = ms.SlimPackConfig(context_length=context, strategy="megatron-fixed")
    budget = activation_budget(LLAMA3_70B, TIGHT_PP2)
    assert 2 * LLAMA3_70B.activation_bytes(context, context ** 2 / 2, TIGHT_PP2, last_stage=True) > budget
    assert auto_token_cap(LLAMA3_70B, TIGHT_PP2, config) == context
    plan = new_planner("megatron-fixed").plan([context] * 64, TIGHT_PP2, LLAMA3_70B, config).validate()
    assert max(simulate(plan, LLAMA3_70B, detail=False).peak_memory_bytes) <= LLAMA3_70B.memory_budget_bytes()


def test_where_even_cost_chains_do_not_fit_memory_the_plain_packing_is_planned():
    """Packing to even costs slices documents that fit a MicroPack, and a chain holds all its
    MicroPacks until its backward: with 64K MicroPacks on a tight pp2 layout no schedule of that
    packing fits, and without the plain packing the planner fell to half-size MicroPacks (about 3%
    slower here: smaller MicroPacks cost only their GEMMs' efficiency and per-pack overheads)."""
    from megatron_slimpack.planner.slimpack.ladder import SizeLadder
    from megatron_slimpack.planner.slimpack.memory import activation_budget, auto_token_cap
    from megatron_slimpack.planner.slimpack.pack_phase import PackOptions, SortedSamples, pack_micropacks
    from megatron_slimpack.planner.slimpack.replica import ReplicaSearch, plan_replica
    from megatron_slimpack.planner.work import WorkRates
    from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

    context = 65536
    config = ms.SlimPackConfig(context_length=context, max_micropack_tokens=context)
    lengths = GlobalBatchSampler(load_lengths("github", seed=0), context, 256, seed=0,
                                 long_documents="split").next_batch().lengths
    cap = auto_token_cap(LLAMA3_70B, TIGHT_PP2, config)
    rates = WorkRates.from_cost(LLAMA3_70B, TIGHT_PP2, cap)
    samples = samples_of(lengths)
    budget = activation_budget(LLAMA3_70B, TIGHT_PP2)
    even = pack_micropacks(SortedSamples(samples, rates), PackOptions(cap, cap, even_costs=True), rates)
    assert any(piece.length < lengths[piece.sample_id]
               for pack in even for piece in pack.slices)  # sliced to even costs
    search = ReplicaSearch(SortedSamples(samples, rates), rates, LLAMA3_70B, TIGHT_PP2, False, [0], budget)
    assert not search.consider(even, cap) and search.best is None
    replica, outcome = plan_replica(samples, LLAMA3_70B, TIGHT_PP2, config, rates, cap, [0], False)
    assert outcome.micropack_tokens == cap == context
    assert all(piece.length == lengths[piece.sample_id] for pack in replica.micropacks for piece in pack.slices)
    ladder = SizeLadder.below_cap(cap, config)
    halved = SizeLadder(tuple(tokens for tokens in ladder.micropack_tokens if tokens <= cap // 2))
    _, halved_outcome = plan_replica(samples, LLAMA3_70B, TIGHT_PP2, config, rates, cap, [0], False, ladder=halved)
    assert outcome.makespan_s < 0.98 * halved_outcome.makespan_s


def test_only_documents_longer_than_a_micropack_are_merged_for_memory():
    """A document within the token cap is one MicroPack like any other (no KV cache): if the cap
    fits memory, so does it. Only longer ones, whose slices are all in flight, may need a group."""
    from megatron_slimpack.planner.slimpack.memory import auto_token_cap, merge_group_sizes

    parallel = ParallelConfig(dp=64, pp=1, tp=2, recompute="selective")
    config = ms.SlimPackConfig(context_length=65536)
    cap = auto_token_cap(COST, parallel, config)
    assert cap < 65536  # the case is only interesting when the cap is memory-bound
    sizes = merge_group_sizes([cap, cap - 1, cap // 2, 65536], COST, parallel, [cap], dp_merge=True)
    assert sizes.tolist()[:3] == [1, 1, 1]
    assert sizes[3] > 1


def best_without_base_merge(lengths, parallel, cost, config):
    """What the search plans before any base-merge fallback: every sizing at base merge 1, the
    fastest prediction kept (a PlannedBatch)."""
    import itertools

    from megatron_slimpack.planner.slimpack.search import SlimPackSearch

    search = SlimPackSearch(lengths, parallel, cost, config)
    first = itertools.takewhile(lambda attempt: attempt.base_merge == 1, search.attempts())
    return search.best_at(1, [attempt.sizing for attempt in first])


def merge_nothing_for_memory(monkeypatch):
    """Replace the per-document merge group estimate by one that merges nothing."""
    from megatron_slimpack.planner.slimpack import memory, search

    def ones(lengths, *_):
        return np.ones(len(lengths), dtype=int)

    monkeypatch.setattr(memory, "merge_group_sizes", ones)  # behind largest_merged_micropack
    monkeypatch.setattr(search, "merge_group_sizes", ones)


def test_a_replica_that_does_not_fit_gets_a_larger_merge_group_and_is_planned_again(monkeypatch):
    """Merge groups are sized by a per-document estimate; when a replica's real schedule still
    does not fit, its sliced documents get twice the group. Here the estimate is replaced by one
    that merges nothing (and merging for balance is off), so only the retry can make the 64K
    document fit."""
    from megatron_slimpack.planner.outcomes import DoesNotFit
    from megatron_slimpack.planner.slimpack import search
    from megatron_slimpack.planner.slimpack.ladder import SizeLadder
    from megatron_slimpack.planner.slimpack.memory import auto_token_cap, merge_group_sizes
    from megatron_slimpack.planner.strategies import plan_slimpack
    from megatron_slimpack.simulator.dag import simulate

    parallel = ParallelConfig(dp=4, pp=1, tp=2, recompute="selective")
    config = ms.SlimPackConfig(context_length=65536, strategy="slimpack", merge_threshold=1e9)
    lengths = [65536] + [2048] * 24
    ladder = SizeLadder.below_cap(auto_token_cap(COST, parallel, config), config)
    assert merge_group_sizes(lengths, COST, parallel, list(ladder.micropack_tokens), dp_merge=True)[0] > 1
    merge_nothing_for_memory(monkeypatch)

    plan = plan_slimpack(lengths, parallel, COST, config).validate()
    holder = next(r for r in plan.replicas if any(s.sample_id == 0 for m in r.micropacks for s in m.slices))
    assert len(holder.dp_ranks) >= 2
    assert max(simulate(plan, COST).peak_memory_bytes) <= COST.memory_budget_bytes()

    monkeypatch.setattr(search, "grown_groups", lambda *_: None)  # no retry: the replica does not fit
    with pytest.raises(DoesNotFit, match="does not fit") as caught:
        best_without_base_merge(lengths, parallel, COST, config)
    assert 0 in caught.value.sample_ids and caught.value.group_ranks == 1
    assert caught.value.bytes_needed > caught.value.bytes_available == COST.memory_budget_bytes()


def test_replicas_that_do_not_fit_are_grown_in_one_replanning(monkeypatch):
    """Two 64K documents land on two replicas and need groups of four: both failures are collected
    in each planning and both documents' groups grown before the batch is planned again (1, 2,
    then 4 replicas: three plannings, where one failure per planning took five)."""
    from megatron_slimpack.planner.slimpack.search import SlimPackSearch

    parallel = ParallelConfig(dp=4, pp=1, tp=2, recompute="selective")
    config = ms.SlimPackConfig(context_length=65536, strategy="slimpack", merge_threshold=1e9)
    lengths = [65536, 65536] + [2048] * 48
    merge_nothing_for_memory(monkeypatch)
    plannings = []
    plan_groups = SlimPackSearch.plan_groups
    monkeypatch.setattr(SlimPackSearch, "plan_groups", lambda *args: plannings.append(1) or plan_groups(*args))
    plan = best_without_base_merge(lengths, parallel, COST, config).plan.validate()
    assert len(plannings) == 3
    for document in (0, 1):
        holder = next(r for r in plan.replicas if any(s.sample_id == document for m in r.micropacks for s in m.slices))
        assert len(holder.dp_ranks) == 4


def test_where_no_group_holds_a_document_next_to_cap_sized_micropacks_the_largest_size_that_does_is_planned(
        monkeypatch):
    """The second merge sizing searches the largest MicroPack size (in size_granule steps) next to
    which every document fits a group, whatever the ladder of sizes, and plans with it as the cap."""
    from megatron_slimpack.planner.outcomes import DoesNotFit
    from megatron_slimpack.planner.slimpack.ladder import SizeLadder
    from megatron_slimpack.planner.slimpack.memory import largest_merged_micropack, merge_group_sizes
    from megatron_slimpack.planner.slimpack.search import SlimPackSearch

    cost, parallel = (ms.CostModel.analytic("llama-70b", "h100-sxm"),
                      ParallelConfig(dp=4, pp=8, tp=8, recompute="selective"))
    config = ms.SlimPackConfig(context_length=131072, max_micropack_tokens=20480, solver_time_limit_s=60,
                               solver_deterministic_limit=0.1)
    tunables, ladder = config.tunables, SizeLadder.below_cap(20480, config)
    lengths = [131072] + [int(x) for x in np.random.default_rng(4).lognormal(8, 1.3, 300).clip(16, 16384)]
    with pytest.raises(DoesNotFit, match="131072-token document") as caught:
        merge_group_sizes(lengths, cost, parallel, [20480], True)
    assert caught.value.sample_ids == (0,) and caught.value.bytes_needed > caught.value.bytes_available
    largest, groups = largest_merged_micropack(lengths, cost, parallel, ladder, True)
    assert largest % tunables.size_granule == 0 and tunables.min_micropack_tokens < largest < 20480
    assert largest not in ladder.micropack_tokens
    assert np.array_equal(groups, merge_group_sizes(lengths, cost, parallel, [largest], True))
    with pytest.raises(DoesNotFit, match="131072-token document"):
        merge_group_sizes(lengths, cost, parallel, [largest + tunables.size_granule], True)
    planned = []
    plan_sizing = SlimPackSearch.plan_sizing
    monkeypatch.setattr(SlimPackSearch, "plan_sizing",
                        lambda self, view, sizing, *rest, **options: planned.append(sizing)
                        or plan_sizing(self, view, sizing, *rest, **options))
    best_without_base_merge(lengths, parallel, cost, config).plan.validate()
    for_smallest = merge_group_sizes(lengths, cost, parallel, list(ladder.micropack_tokens), True)
    assert [sizing.token_cap for sizing in planned] == [20480, largest]
    assert np.array_equal(planned[0].group_ranks, for_smallest) and np.array_equal(planned[1].group_ranks, groups)
    assert groups[0] > for_smallest[0]
    planned.clear()  # a slice size the user set is kept: one sizing, at the cap
    best_without_base_merge(lengths, parallel, cost, config.with_(slice_tokens=4096)).plan.validate()
    assert [sizing.token_cap for sizing in planned] == [20480]


def test_the_heaviest_replica_bisects_between_a_size_that_does_not_fit_and_one_that_does():
    """MicroPack sizes are tried largest first on a ladder a quarter to a third apart; where one
    does not fit and the next does, the sizes between are bisected, and the largest that fits (here
    next to a 128K document's chain) beats the ladder's. The device is a stand-in whose GEMMs want
    large MicroPacks (one saturating curve, half efficiency at 32K tokens): on the published H100
    rates a MicroPack's size barely changes its efficiency, and smaller ones, with shorter
    pipeline bubbles, win whatever fits."""
    from dataclasses import replace

    from megatron_slimpack.planner.slimpack.ladder import SizeLadder
    from megatron_slimpack.planner.slimpack.memory import activation_budget, auto_token_cap
    from megatron_slimpack.planner.slimpack.pack_phase import SortedSamples
    from megatron_slimpack.planner.slimpack.replica import ReplicaSearch, plan_replica
    from megatron_slimpack.planner.work import WorkRates

    parallel = ParallelConfig(dp=1, pp=8, tp=4, recompute="selective")
    cost = ms.CostModel.analytic("llama-13b", replace(LLAMA_13B.hardware, kernels="generic",
                                                      half_efficiency_tokens=32768))
    context = 131072
    config = ms.SlimPackConfig(context_length=context)
    lengths = [context] + [int(x) for x in np.random.default_rng(6).lognormal(8, 1.3, 200).clip(16, 8192)]
    samples, cap = samples_of(lengths), auto_token_cap(cost, parallel, config)
    rates = WorkRates.from_cost(cost, parallel, cap)
    ladder = SizeLadder.below_cap(cap, config).micropack_tokens

    def fits(size):
        search = ReplicaSearch(SortedSamples(samples, rates), rates, cost, parallel, False, [0],
                               activation_budget(cost, parallel))
        return search.try_size(size)

    first_fit = next(index for index, size in enumerate(ladder) if fits(size))
    assert first_fit > 0
    too_large, below = ladder[first_fit - 1], ladder[first_fit]
    _, outcome = plan_replica(samples, cost, parallel, config, rates, cap, [0], False)
    assert below < outcome.micropack_tokens < too_large
    assert outcome.micropack_tokens % config.tunables.size_granule == 0
    # Sizes a ladder step apart are not bisected with refine_fraction 1: the ladder alone.
    rungs_only = config.with_(tunables=PlannerTunables(refine_fraction=1))
    _, rung_outcome = plan_replica(samples, cost, parallel, rungs_only, rates, cap, [0], False)
    assert rung_outcome.micropack_tokens in ladder and outcome.makespan_s < rung_outcome.makespan_s


def test_a_plan_shared_by_merge_groups_simulates_like_its_context_parallel_view():
    """`shared_by_groups` turns a plan for dp/k replicas with k-fold context parallelism into the
    DP-Merge groups the runtime runs on dp replicas: same time, same memory in the simulator."""
    from megatron_slimpack.planner.strategies import plan_slimpack, shared_by_groups
    from megatron_slimpack.simulator.dag import simulate

    config = ms.SlimPackConfig(context_length=65536, strategy="slimpack")
    lengths = [65536, 40000, 9000] + [3000] * 60
    view = plan_slimpack(lengths, ParallelConfig(dp=2, pp=2, tp=2, cp=2, recompute="selective"), COST, config)
    shared = shared_by_groups(view, ParallelConfig(dp=4, pp=2, tp=2, recompute="selective"), 2).validate()
    assert shared.metadata["base_merge"] == 2
    assert all(len(r.dp_ranks) >= 2 or not r.micropacks for r in shared.replicas)
    expected, got = simulate(view, COST), simulate(shared, COST)
    assert got.iteration_time_s == pytest.approx(expected.iteration_time_s, rel=1e-9)
    assert max(got.peak_memory_bytes) == pytest.approx(max(expected.peak_memory_bytes), rel=1e-9)


def test_slimpack_shares_every_micropack_when_no_replica_fits_alone(monkeypatch):
    """Where no plan of the layout fits (here: forced for base merge 1), SlimPack plans dp/2
    replicas with 2-fold context parallelism and runs them as DP-Merge groups of two. Only a
    DoesNotFit falls back: any other planning error is raised as it is."""
    from megatron_slimpack.planner.outcomes import DoesNotFit
    from megatron_slimpack.planner.slimpack.search import SlimPackSearch
    from megatron_slimpack.planner.strategies import plan_slimpack

    best_at = SlimPackSearch.best_at

    def fits_only_shared(self, base_merge, sizings):
        if base_merge == 1:
            raise DoesNotFit("memory: nothing fits (forced by the test)")
        return best_at(self, base_merge, sizings)

    monkeypatch.setattr(SlimPackSearch, "best_at", fits_only_shared)
    config = ms.SlimPackConfig(context_length=65536, strategy="slimpack")
    parallel = ParallelConfig(dp=4, pp=1, tp=2, recompute="selective")
    plan = plan_slimpack([30000, 20000] + [3000] * 40, parallel, COST, config).validate()
    assert plan.parallel == parallel and plan.metadata["base_merge"] == 2
    assert sorted(tuple(r.dp_ranks) for r in plan.replicas if r.micropacks) == [(0, 1), (2, 3)]
    with pytest.raises(DoesNotFit, match="forced by the test"):  # dp=1 cannot share: the first error
        plan_slimpack([3000] * 10, parallel.with_(dp=1), COST, config)

    def fails_otherwise(self, base_merge, sizings):
        raise PlanError("not about memory (forced by the test)")

    monkeypatch.setattr(SlimPackSearch, "best_at", fails_otherwise)
    with pytest.raises(PlanError, match="not about memory"):
        plan_slimpack([30000, 20000] + [3000] * 40, parallel, COST, config)


def test_base_merge_asked_for_shares_every_micropack():
    from megatron_slimpack.planner.strategies import plan_slimpack

    config = ms.SlimPackConfig(context_length=65536, strategy="slimpack", base_merge=2)
    parallel = ParallelConfig(dp=4, pp=2, tp=2, recompute="selective")
    plan = plan_slimpack([30000, 20000] + [3000] * 40, parallel, COST, config).validate()
    assert plan.metadata["base_merge"] == 2
    assert all(len(r.dp_ranks) >= 2 for r in plan.replicas if r.micropacks)
    with pytest.raises(PlanError, match="base_merge 2 needs DP-Merge"):
        plan_slimpack([3000] * 10, parallel, COST, config.with_(dp_merge=False))
    with pytest.raises(PlanError, match="divisible"):
        plan_slimpack([3000] * 10, parallel.with_(dp=3), COST, config)


@pytest.mark.parametrize("cp", [1, 2])
def test_packing_bound_never_exceeds_the_replica_schedule(cp):
    """The planner skips a MicroPack size whose packing bound is above its best schedule so far:
    the bound must hold for every size, with or without context parallelism."""
    from megatron_slimpack.planner.slimpack.ladder import SizeLadder
    from megatron_slimpack.planner.slimpack.pack_phase import SortedSamples
    from megatron_slimpack.planner.slimpack.replica import packing_bound_s, plan_replica
    from megatron_slimpack.planner.work import WorkRates

    parallel = ParallelConfig(dp=1, pp=4, tp=4, cp=cp, recompute="selective")
    lengths = [int(x) for x in np.random.default_rng(5).lognormal(8, 1.4, 150).clip(16, 32768)]
    samples, config = samples_of(lengths), ms.SlimPackConfig(context_length=32768)
    rates = WorkRates.from_cost(COST, parallel, 8192)
    for size in (8192, 4096, 2048):
        _, outcome = plan_replica(samples, COST, parallel, config, rates, 8192, [0], False, ladder=SizeLadder((size,)))
        bound = packing_bound_s(SortedSamples(samples, rates), size, COST, parallel)
        assert outcome.micropack_tokens == size and 0 < bound <= outcome.makespan_s


@pytest.mark.parametrize("model, layout, context, short_max, groups, faster", [
    ("llama-7b", dict(dp=4, pp=4, tp=2, recompute="none"), 32768, 8192, (1, 2), 0),
    ("llama-7b", dict(dp=4, pp=2, tp=2, recompute="none"), 65536, 8192, (2, 4), 1),
])
def test_merge_groups_are_sized_both_ways_and_the_faster_plan_kept(model, layout, context, short_max, groups, faster):
    """A context-long document fits a small merge group only next to small MicroPacks, or a larger
    group next to the largest ones. Neither wins everywhere (with pp4 keeping it closer wins; with
    pp2 the small MicroPacks cost the replica more than the larger group idles), so the planner
    plans both and keeps the plan its own prediction (the busiest rank's makespans) says is faster."""
    from megatron_slimpack.planner.slimpack.memory import auto_token_cap
    from megatron_slimpack.planner.slimpack.search import Sizing, SlimPackSearch

    cost, parallel = ms.CostModel.analytic(model, "h100-sxm"), ParallelConfig(**layout)
    # A deterministic CP-SAT budget: the three plannings below must see the same solver results.
    config = ms.SlimPackConfig(context_length=context, strategy="slimpack", solver_time_limit_s=60,
                               solver_deterministic_limit=0.1)
    rng = np.random.default_rng(3)
    lengths = [context] + [int(x) for x in rng.lognormal(8, 1.3, 150).clip(16, short_max)]
    cap = auto_token_cap(cost, parallel, config)
    search = SlimPackSearch(lengths, parallel, cost, config)
    sized = [search.size_groups(sizing, parallel, cap)
             for sizing in (Sizing.SMALLEST_GROUPS, Sizing.LARGEST_MICROPACKS)]
    assert sized[0].token_cap == cap
    assert (sized[0].group_ranks[0], sized[1].group_ranks[0]) == groups
    both = [search.plan_sizing(parallel, sizing).predicted_iteration_s for sizing in sized]
    chosen = best_without_base_merge(lengths, parallel, cost, config)
    chosen.plan.validate()
    assert chosen.predicted_iteration_s == min(both) == both[faster] < both[1 - faster]
    # The metadata reports the outcomes the prediction is made of.
    assert chosen.plan.metadata["replicas"] == [outcome.to_dict() for outcome in chosen.outcomes]


def test_cli_plan_passes_the_deterministic_budget_to_cp_sat(tmp_path, capsys):
    from megatron_slimpack import cli

    # Few enough documents for CP-SAT to decide each (no sand levels the hint to the bound: it runs).
    argv = ["plan", "--workload", "longtail:n=3000", "--context-length", "16384", "--global-batch-size", "8",
            "--tp", "2", "--pp", "2", "--dp", "4", "--solver-time-limit", "60", "--solver-deterministic-limit", "1e-6",
            "--json", "--out", str(tmp_path / "plan.json")]
    assert cli.main(argv) == 0
    phase1 = json.loads(capsys.readouterr().out)[0]["metadata"]["phase1"]
    assert phase1["status"] == "UNKNOWN" and "(1e-06 deterministic)" in phase1["fallback"]
    Plan.from_json(tmp_path / "plan.json").validate()


def test_a_batch_keeps_its_samples_and_whole_slices_until_another_comes():
    """`samples_of` and `whole_slices_of` of one batch, asked for again (a search plans it on many
    layouts), give the same tuples; the samples list is the caller's own; another batch replaces them."""
    from megatron_slimpack.plan import default_sources, whole_slices_of

    lengths = [5, 3, 8]
    samples = samples_of(lengths)
    samples.append(Sample(3, 1))  # the caller's own list
    assert samples_of(list(lengths)) == [Sample(0, 5), Sample(1, 3), Sample(2, 8)]
    whole = whole_slices_of(lengths)
    assert whole == [Slice(0, 0, 5), Slice(1, 0, 3), Slice(2, 0, 8)] and whole_slices_of([5, 3, 8]) is whole
    assert whole_slices_of([4, 4]) == [Slice(0, 0, 4), Slice(1, 0, 4)]
    assert samples_of([4, 4]) == [Sample(0, 4), Sample(1, 4)]
    sources = default_sources(2)
    sources.clear()
    assert default_sources(2) == [(0, 0), (1, 0)] and default_sources(3)[2] == (2, 0)


def test_a_strategy_plans_with_the_cost_its_run_is_priced_at():
    """The communication a strategy's run hides (its `overlaps`) is not what its planner trades
    against compute: SlimPack's TP collectives run as rings, so its packing balances the priced
    cost, and the plan differs from one balanced against serial communication."""
    assert strategy_spec("slimpack").new_planner().overlaps == SLIMPACK_RUNTIME
    wikipedia = load_lengths(f"file:{SHARED_DATA / 'wikipedia_lengths.txt'}")
    lengths = GlobalBatchSampler(wikipedia, 65536, 64, seed=0, long_documents="split").next_batch().lengths
    parallel = ParallelConfig(dp=4, pp=4, tp=8)
    config = ms.SlimPackConfig(strategy="slimpack-nomerge", context_length=65536, solver_time_limit_s=120.0,
                               solver_deterministic_limit=0.5)
    planned = ms.plan(lengths, parallel=parallel, cost=COST, config=config)
    priced = plan_slimpack(lengths, parallel, COST.with_overlaps(SLIMPACK_RUNTIME), config, dp_merge=False)
    serial = plan_slimpack(lengths, parallel, COST.with_overlaps(SERIAL), config, dp_merge=False)
    assert planned.fingerprint() == priced.fingerprint() != serial.fingerprint()


def test_a_stateful_planner_prices_the_cost_in_every_method(monkeypatch):
    """WLB-LLM keeps queues across batches; its plan, advance and flush each balance the cost
    priced with its strategy's overlaps."""
    seen = []
    original = wlb_llm.WorkRates.from_cost
    monkeypatch.setattr(wlb_llm.WorkRates, "from_cost",
                        lambda cost, *args: seen.append(cost.overlaps) or original(cost, *args))
    planner, parallel = new_planner("wlb-llm"), ParallelConfig(dp=2, tp=8)
    config = ms.SlimPackConfig(strategy="wlb-llm", context_length=100, wlb_delay_fractions="0.5,0.25")
    planner.advance([60, 30, 30, 30, 20], parallel, COST, config)  # 60 and a 30 wait in the queues
    planner.plan([70, 10, 10], parallel, COST, config)  # 70 releases the 60; the 30 still waits
    assert planner.flush(parallel, COST, config) is not None
    assert len(seen) >= 3 and set(seen) == {SLIMPACK_RUNTIME}
    assert wlb_llm.WlbLlmPlanner().overlaps == SLIMPACK_RUNTIME  # made directly, as the delay tuning does
