"""The SlimPack search's pieces: DoesNotFit, the size ladder, the attempts' order, the tunables,
the typed outcomes, and CP-SAT's current API."""
from __future__ import annotations

import dataclasses
import json
import pickle
import warnings

import numpy as np
import pytest

import megatron_slimpack as ms
from megatron_slimpack.config import PlannerTunables
from megatron_slimpack.plan import PlanError, ReplicaPlan, Sample
from megatron_slimpack.planner.outcomes import DoesNotFit, PlannedBatch, ReplicaOutcome, ReplicasDoNotFit
from megatron_slimpack.planner.slimpack.ladder import SizeLadder
from megatron_slimpack.planner.slimpack.search import Attempt, GroupSizing, Sizing, SlimPackSearch
from megatron_slimpack.specs import ParallelConfig

COST = ms.CostModel.analytic("llama-7b", "h100-sxm")
K = 1024


# ---- DoesNotFit ------------------------------------------------------------------------------

def test_does_not_fit_carries_its_fields_and_is_a_plan_error():
    error = DoesNotFit("memory: too large", sample_ids=[3, np.int64(5)], group_ranks=2, bytes_needed=9.0,
                       bytes_available=8.0)
    assert isinstance(error, PlanError) and str(error) == "memory: too large"
    assert (error.sample_ids, error.group_ranks, error.bytes_needed, error.bytes_available) == ((3, 5), 2, 9.0, 8.0)
    again = pickle.loads(pickle.dumps(error))  # e.g. from a worker process
    assert type(again) is DoesNotFit and str(again) == str(error) and again.__dict__ == error.__dict__
    other = DoesNotFit("memory: other", sample_ids=[7], group_ranks=4)
    both = ReplicasDoNotFit([error, other])
    assert isinstance(both, DoesNotFit) and str(both) == str(error) and both.failures == [error, other]
    assert (both.sample_ids, both.group_ranks, both.bytes_needed) == ((3, 5), 2, 9.0)
    assert pickle.loads(pickle.dumps(both)).failures[1].sample_ids == (7,)


def test_a_plan_whose_micropacks_cannot_fit_raises_does_not_fit_with_the_shortfall():
    """llama-7b unsharded at 128K: not even 1024-token MicroPacks fit next to the weights, on one
    replica or shared by two (the base-merge fallback); the first failure is raised."""
    parallel = ParallelConfig(dp=2, pp=1, tp=1, recompute="none")
    with pytest.raises(DoesNotFit, match="memory: weights, optimizer state and 1 MicroPacks of 1024") as caught:
        ms.plan([4096] * 8, parallel=parallel, cost=COST, config=ms.SlimPackConfig(context_length=128 * K))
    error = caught.value
    assert error.sample_ids == () and error.group_ranks == 1
    assert error.bytes_available == COST.memory_budget_bytes() < error.bytes_needed
    assert "tp1 pp1 cp1 dp2" in str(error)  # the layout itself, not the base-merge view tried after it


def test_a_document_that_fits_no_merge_group_raises_does_not_fit_naming_it():
    parallel = ParallelConfig(dp=4, pp=1, tp=2, recompute="selective")
    lengths = [2048] * 10 + [65536] + [2048] * 10
    config = ms.SlimPackConfig(context_length=65536, dp_merge=False)
    with pytest.raises(DoesNotFit, match="a 65536-token document .*DP-Merge is off") as caught:
        ms.plan(lengths, parallel=parallel, cost=COST, config=config)
    assert caught.value.sample_ids == (10,)
    assert caught.value.bytes_needed > caught.value.bytes_available == COST.memory_budget_bytes()


def test_the_layout_search_counts_a_does_not_fit_as_a_planner_rejection():
    from megatron_slimpack.planner.layouts import _plan_and_simulate, _Run
    from megatron_slimpack.planner.strategies import new_planner

    run = _Run(ParallelConfig(dp=2, pp=1, tp=1, recompute="none"), ms.SlimPackConfig(context_length=128 * K),
               new_planner("slimpack"))
    rejection = _plan_and_simulate(run, [4096] * 8, COST, 0)
    assert rejection.kind == "planner" and "MicroPacks of 1024 tokens" in rejection.reason


# ---- the size ladder -------------------------------------------------------------------------

def test_the_ladder_below_a_cap_and_from_a_chosen_size():
    config = ms.SlimPackConfig(context_length=128 * K)
    ladder = SizeLadder.below_cap(18432, config)
    assert ladder.micropack_tokens == (18432, 13824, 9216, 6912, 4608, 3456, 2304)
    assert (ladder.largest, ladder.smallest) == (18432, 2304)
    assert ladder.starting_at(10000).micropack_tokens == (10000, 9216, 6912, 4608, 3456, 2304)
    smaller_floor = config.with_(tunables=PlannerTunables(min_micropack_tokens=512))
    assert SizeLadder.below_cap(2048, smaller_floor).micropack_tokens == (2048, 1536, 1024, 768, 512)
    assert SizeLadder.below_cap(2048, config).micropack_tokens == (2048, 1536, 1024)


def test_first_fit_stops_at_the_first_size_that_fits():
    ladder = SizeLadder((8192, 6144, 4096, 3072))
    asked = []
    assert ladder.first_fit(lambda tokens: asked.append(tokens) or tokens <= 6144) == 6144
    assert asked == [8192, 6144]
    assert ladder.first_fit(lambda tokens: False) is None


def test_largest_fitting_bisects_in_granule_steps():
    ladder = SizeLadder((8192,), PlannerTunables(size_granule=256))
    asked = []

    def fits(tokens):
        asked.append(tokens)
        return tokens <= 5000

    assert ladder.largest_fitting(fits, 1024, 8192) == 4864  # the largest multiple of 256 up to 5000
    assert all(tokens % 256 == 0 for tokens in asked) and len(asked) <= 5
    asked.clear()
    within_a_sixteenth = ladder.largest_fitting(fits, 1024, 8192, fraction=16)
    assert 5000 - 5000 / 16 <= within_a_sixteenth + 256 and within_a_sixteenth <= 4864
    assert ladder.largest_fitting(fits, 4864, 5000) == 4864  # already within a granule: nothing asked


def test_try_all_tries_every_size_and_bisects_only_where_a_misfit_sits_above_a_fit():
    ladder = SizeLadder((8192, 6144, 4096, 3072), PlannerTunables(size_granule=256, refine_fraction=16))
    asked = []

    def try_size(tokens):
        asked.append(tokens)
        return tokens <= 5000 or tokens == 8192  # 8192 "fits" (say: it cannot beat the best), 6144 does not

    ladder.try_all(try_size)
    rungs = [tokens for tokens in asked if tokens in ladder.micropack_tokens]
    assert rungs == [8192, 6144, 4096, 3072]
    bisected = asked[asked.index(4096) + 1:asked.index(3072)]
    assert bisected and all(4096 < tokens < 6144 for tokens in bisected)
    asked.clear()
    SizeLadder(ladder.micropack_tokens, PlannerTunables(refine_fraction=1)).try_all(try_size)
    assert asked == [8192, 6144, 4096, 3072]  # rungs a step apart are not bisected with fraction 1


# ---- the attempts' order ---------------------------------------------------------------------

def attempts_of(dp: int, **config) -> list[tuple[int, str]]:
    search = SlimPackSearch([4096] * 8, ParallelConfig(dp=dp, pp=1, tp=8), COST, ms.SlimPackConfig(**config))
    return [(attempt.base_merge, attempt.sizing.value) for attempt in search.attempts()]


def test_attempts_double_the_base_merge_after_both_sizings():
    both = ["smallest-groups", "largest-micropacks"]
    assert attempts_of(8) == [(base, sizing) for base in (1, 2, 4, 8) for sizing in both]
    assert attempts_of(6) == [(base, sizing) for base in (1, 2) for sizing in both]  # 4 does not divide 6
    assert attempts_of(4, base_merge=2) == [(base, sizing) for base in (2, 4) for sizing in both]
    assert attempts_of(4, slice_tokens=4096) == [(base, "smallest-groups") for base in (1, 2, 4)]
    assert attempts_of(4, dp_merge=False) == [(1, sizing) for sizing in both]  # no DP-Merge: no base merge either
    assert isinstance(next(SlimPackSearch([1], ParallelConfig(dp=1, pp=1, tp=8), COST,
                                          ms.SlimPackConfig()).attempts()), Attempt)


def test_the_search_stops_at_the_first_base_merge_that_fits(monkeypatch):
    tried = []
    best_at = SlimPackSearch.best_at

    def recording(self, base_merge, sizings):
        tried.append((base_merge, sizings))
        return best_at(self, base_merge, sizings)

    monkeypatch.setattr(SlimPackSearch, "best_at", recording)
    ms.plan([3000] * 40, parallel=ParallelConfig(dp=4, pp=1, tp=8), cost=COST,
            config=ms.SlimPackConfig(context_length=8192))
    assert tried == [(1, [Sizing.SMALLEST_GROUPS, Sizing.LARGEST_MICROPACKS])]


def test_a_base_merge_argument_that_cannot_be_used_is_refused():
    with pytest.raises(PlanError, match="base_merge 4 needs DP-Merge and a data-parallel size divisible"):
        SlimPackSearch([1], ParallelConfig(dp=6, pp=1, tp=8), COST, ms.SlimPackConfig(base_merge=4))


# ---- tunables --------------------------------------------------------------------------------

def test_tunables_are_frozen_validated_and_part_of_the_config():
    tunables = PlannerTunables()
    with pytest.raises(dataclasses.FrozenInstanceError):
        tunables.max_model_items = 10
    for bad in (dict(max_model_items=0), dict(size_granule=-256), dict(refine_fraction=2.5),
                dict(replayed_candidates=True), dict(extra_slices=-1), dict(even_cost_tolerance=0.9),
                dict(even_cost_tolerance=float("nan"))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PlannerTunables(**bad)
    assert PlannerTunables(extra_slices=0).extra_slices == 0
    config = ms.SlimPackConfig()
    assert config.tunables == tunables and config.with_(seed=1).tunables == tunables
    as_dict = json.loads(json.dumps(config.to_dict()))
    assert as_dict["tunables"] == dataclasses.asdict(tunables)
    assert {key: value for key, value in as_dict.items() if key != "tunables"} == {
        "strategy": "slimpack", "context_length": 65536, "max_micropack_tokens": None, "slice_tokens": None,
        "dp_merge": True, "fixed_grouping_floor": True, "base_merge": 1, "merge_threshold": 1.25,
        "solver_time_limit_s": 0.5,
        "solver_deterministic_limit": None, "seed": 0, "long_documents": "error", "wlb_delay_fractions": "0.5,0.25",
        "solver_workers": 1}


def test_the_config_tunables_reach_phase_one():
    lengths = [int(x) for x in np.random.default_rng(0).integers(100, 8000, size=60)]
    parallel = ParallelConfig(dp=2, pp=1, tp=8)
    config = ms.SlimPackConfig(context_length=8192, tunables=PlannerTunables(max_model_items=8))
    plan = ms.plan(lengths, parallel=parallel, cost=COST, config=config)
    assert plan.metadata["phase1"]["heavy_items"] == 8
    assert ms.plan(lengths, parallel=parallel, cost=COST, config=config.with_(tunables=PlannerTunables())
                   ).metadata["phase1"]["heavy_items"] == 60


# ---- typed outcomes --------------------------------------------------------------------------

def test_the_predicted_iteration_is_the_busiest_rank_over_its_outcomes():
    from megatron_slimpack.plan import Plan

    outcomes = [ReplicaOutcome((0, 1), 2.0, 8192, 8), ReplicaOutcome((0,), 1.5, 4096, 4), ReplicaOutcome((1,), 0.0)]
    plan = Plan([], [Sample(0, 1)], ParallelConfig(dp=2, pp=1, tp=8), 8192, "slimpack", 8192, {})
    assert PlannedBatch(plan, outcomes).predicted_iteration_s == 3.5
    assert outcomes[1].to_dict() == {"dp_ranks": [0], "makespan_s": 1.5, "micropack_tokens": 4096, "units": 4}
    assert outcomes[2].to_dict() == {"dp_ranks": [1], "makespan_s": 0.0}
    assert sorted(outcomes, key=lambda outcome: outcome.sort_key) == outcomes


# ---- CP-SAT's current API --------------------------------------------------------------------

def test_phase_one_uses_no_deprecated_cp_sat_names(monkeypatch):
    from ortools.sat.python import cp_model

    from megatron_slimpack.planner.slimpack.dp_phase import assign_to_replicas

    monkeypatch.setattr(cp_model, "enable_warnings", True)  # OR-Tools warns about CamelCase names only then
    costs = np.random.default_rng(1).lognormal(0, 1.5, size=300)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        result = assign_to_replicas(costs, 4, time_limit_s=1.0, dp_merge=False,
                                    tunables=PlannerTunables(max_model_items=300))  # no sand: CP-SAT runs
    assert result.solver["status"] in ("OPTIMAL", "FEASIBLE") and result.solver["source"] in ("hint", "cp-sat")
    assert "objective" in result.solver and "bound" in result.solver


def cyclic_garbage_of(work) -> list[str]:
    """The type names of what `work()` leaves for the cyclic collector (only it could free them),
    run with the collector paused as a layout search runs plannings."""
    import gc

    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        work()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return [type(item).__name__ for item in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()  # what the saved garbage held
        if was_enabled:
            gc.enable()


def test_phase_one_leaves_no_cp_sat_model_for_the_cyclic_collector():
    """A layout search pauses the cyclic collector for hundreds of plannings; a CP-SAT model kept
    alive by a reference cycle (OR-Tools' camelCase aliases) stayed until the search ended, with its
    C++ proto, and a llama-13b 256K search grew past 19 GiB. Refcounting alone must free it."""
    from megatron_slimpack.planner.slimpack.dp_phase import assign_to_replicas

    costs = np.random.default_rng(1).lognormal(0, 1.5, size=300)
    left = cyclic_garbage_of(lambda: assign_to_replicas(costs, 4, time_limit_s=1.0, dp_merge=False))
    assert [name for name in left if "CpModel" in name] == []


def test_a_planning_whose_attempts_fail_leaves_nothing_for_the_cyclic_collector():
    """The search keeps the first failure of its attempts (and each replica's); kept with its
    traceback, the catching frame and the plans in it formed a cycle, which lived to the end of a
    layout search (the collector is paused there). This batch's planning fails some attempts and
    then succeeds: refcounting alone must free all of it (it left 1789 objects before)."""
    context = 64 * K
    lengths = [int(x) for x in np.minimum(np.random.default_rng(0).lognormal(7.5, 1.8, size=60), context).clip(100)]
    lengths[:2] = [context, context - 5]
    arguments = dict(parallel=ParallelConfig(dp=4, pp=2, tp=2, recompute="selective"),
                     cost=ms.CostModel.analytic("llama-13b", "h100-sxm"),
                     config=ms.SlimPackConfig(context_length=context))
    ms.plan(lengths, **arguments)  # first-call caches (imports, lazily built tables) out of the count
    planned = []
    left = cyclic_garbage_of(lambda: planned.append(len(ms.plan(lengths, **arguments).replicas)))
    assert planned[0] > 0 and left == [], sorted(set(left))


def test_a_failed_replica_grows_the_groups_of_its_sliced_documents_only():
    """Documents longer than the smallest MicroPack (sliced) get twice their replica's group; a
    replica with nothing sliced gets nothing: its MicroPacks alone do not fit."""
    from megatron_slimpack.planner.slimpack.search import grown_groups

    lengths = [30000, 9000, 4000, 20000]
    groups = np.array([1, 1, 1, 2])
    failure = DoesNotFit("replica [0] does not fit", sample_ids=[0, 1, 2], group_ranks=1)
    grown = grown_groups(failure, groups, lengths, smallest_micropack=8192, largest_group=8)
    assert grown.tolist() == [2, 2, 1, 2] and groups.tolist() == [1, 1, 1, 2]
    whole = DoesNotFit("replica [0] does not fit", sample_ids=[1, 2], group_ranks=1)
    assert grown_groups(whole, groups, lengths, smallest_micropack=10000, largest_group=8) is None
    assert grown_groups(failure, groups, lengths, smallest_micropack=8192, largest_group=1) is None


def test_sliced_grown_doubles_every_sliced_document_within_the_largest_group():
    """`grown_groups` as if every replica and merge group had failed: a document longer than the
    smallest MicroPack times its group gets twice the group, where that still divides the largest."""
    from megatron_slimpack.planner.slimpack.search import sliced_grown

    lengths = [100, 5000, 9000, 20000, 3000]
    groups = np.array([1, 1, 2, 4, 2])
    grown = sliced_grown(groups, lengths, smallest_micropack=4096, largest_group=4)
    assert grown.tolist() == [1, 2, 4, 4, 2] and groups.tolist() == [1, 1, 2, 4, 2]


def test_the_smallest_groups_first_planning_stops_at_a_heaviest_replica_that_does_not_fit(monkeypatch):
    """llama-7b 128K, long-tailed lengths, tp1 pp4 vpp4 dp8: the smallest groups' first planning
    searches the heaviest replica first; it does not fit, so no other replica or merge group is
    searched and the next planning starts with every sliced document in twice its group. The
    largest-micropacks sizing plans without cutting short."""
    from megatron_slimpack.planner.slimpack import search as search_module
    from megatron_slimpack.planner.slimpack.memory import auto_token_cap
    from megatron_slimpack.planner.slimpack.replica import ReplicaSearch
    from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

    context = 128 * K
    lengths = GlobalBatchSampler(load_lengths("longtail", seed=1), context, 64, seed=1,
                                 long_documents="split").next_batch().lengths
    parallel = ParallelConfig(dp=8, pp=4, vpp=4, tp=1)
    config = ms.SlimPackConfig(context_length=context, solver_deterministic_limit=0.2)
    plannings, searched = [], []
    plan_groups, finish = SlimPackSearch.plan_groups, ReplicaSearch.finish

    def recorded(self, view, token_cap, group_ranks, leaner_level=2, cut_short=False):
        plannings.append([group_ranks.copy(), cut_short, "planned"])
        searched.clear()
        try:
            return plan_groups(self, view, token_cap, group_ranks, leaner_level, cut_short)
        except search_module.PlanningCutShort:
            plannings[-1][2] = f"cut short after {len(searched)} search"
            raise

    def counted(self, samples):
        searched.append(len(samples))
        return finish(self, samples)

    monkeypatch.setattr(SlimPackSearch, "plan_groups", recorded)
    monkeypatch.setattr(ReplicaSearch, "finish", counted)
    search = SlimPackSearch(lengths, parallel, COST, config)
    search.plan()
    (first, cut, outcome), (second, cut_again, _) = plannings[:2]
    assert cut and outcome == "cut short after 1 search" and not cut_again
    smallest = SizeLadder.below_cap(auto_token_cap(COST, parallel, config), config).smallest
    assert second.tolist() == search_module.sliced_grown(first, lengths, smallest, parallel.dp).tolist()
    assert (second > first).sum() > 100
    assert any(not cut_short for _, cut_short, _ in plannings[2:])  # the largest micropacks'


def test_a_sizing_whose_replicas_fail_with_nothing_sliced_is_given_up_after_one_planning(monkeypatch):
    """Documents kept whole (`slice_tokens` = the context) in a layout whose MicroPacks do not fit:
    growing the failed replica's longest document planned the batch again and again (600+
    plannings at llama-13b 256K tp2 pp2 vpp2 dp32), as phase 1 moved other documents into its
    place. Now the first planning's failure is the sizing's answer."""
    context = 64 * K
    lengths = [int(x) for x in np.random.default_rng(1).integers(1000, context, size=40)]
    config = ms.SlimPackConfig(context_length=context, slice_tokens=context)
    search = SlimPackSearch(lengths, ParallelConfig(dp=8, pp=2, vpp=2, tp=2, recompute="selective"),
                            ms.CostModel.analytic("llama-13b", "h100-sxm"), config)
    plannings = []

    def failing(view, token_cap, group_ranks, leaner_level=2, cut_short=False):
        plannings.append(1)
        raise ReplicasDoNotFit([DoesNotFit("replica [3] does not fit", sample_ids=[5, 6, 7],
                                           group_ranks=int(group_ranks[[5, 6, 7]].max()))])

    monkeypatch.setattr(search, "plan_groups", failing)
    with pytest.raises(DoesNotFit, match=r"replica \[3\]"):
        search.plan_sizing(search.parallel, GroupSizing(context, np.ones(len(lengths), dtype=int)))
    assert len(plannings) == 1


def test_a_planning_without_dp_merge_ends_at_its_first_failure_with_the_same_error(monkeypatch):
    """Without DP-Merge no failed replica's group can grow, so the sizing fails with the first
    failure whatever the other replicas do: the planning stops there (llama-7b 128K, long-tailed
    lengths, tp2 pp16 dp4: two replica searches instead of eight), with the error of planning
    every replica."""
    from megatron_slimpack.planner.slimpack import search as search_module
    from megatron_slimpack.planner.slimpack.replica import ReplicaSearch
    from megatron_slimpack.planner.strategies import get_strategy
    from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

    context = 128 * K
    lengths = GlobalBatchSampler(load_lengths("longtail", seed=0), context, 128, seed=0,
                                 long_documents="split").next_batch().lengths
    config = ms.SlimPackConfig(strategy="slimpack-nomerge", context_length=context, solver_deterministic_limit=0.2)
    parallel = ParallelConfig(tp=2, pp=16, dp=4)
    searches, finish = [], ReplicaSearch.finish

    def counted(self, samples):
        searches.append(len(samples))
        return finish(self, samples)

    monkeypatch.setattr(ReplicaSearch, "finish", counted)
    outcomes = []
    for stops in (True, False):
        if not stops:
            monkeypatch.setattr(search_module._BatchPlanning, "_stop_if_final", lambda self: None)
        searches.clear()
        with pytest.raises(DoesNotFit) as error:
            get_strategy("slimpack-nomerge")(lengths, parallel, COST, config)
        outcomes.append((str(error.value), len(searches)))
    (stopped, stopped_searches), (planned, planned_searches) = outcomes
    assert stopped == planned and "does not fit" in stopped
    assert stopped_searches < planned_searches


# ---- shortcuts that keep what the search finds -----------------------------------------------

def test_a_walk_is_try_all_or_first_fit_one_call_at_a_time():
    ladder = SizeLadder((8192, 6144, 4096, 3072), PlannerTunables(size_granule=256, refine_fraction=16))

    def recorder(asked):
        return lambda tokens: asked.append(tokens) or tokens <= 5000 or tokens == 8192

    whole, stepped, yielded = [], [], []
    ladder.try_all(recorder(whole))
    for tokens in ladder.walk(recorder(stepped)):
        yielded.append(tokens)
        assert stepped[-1] == tokens  # each size yielded right after it was tried
    assert stepped == whole == yielded and len(whole) > 4  # bisected between 6144 and 4096
    first, walked = [], []
    assert ladder.first_fit(recorder(first)) == 8192
    assert list(ladder.walk(recorder(walked), first_fit=True)) == walked == first == [8192]
    assert list(ladder.walk(lambda tokens: tokens < 5000, first_fit=True)) == [8192, 6144, 4096]


def _one_interleaved_replica():
    """llama-13b, tp2 pp2 vpp2 dp4 at 64K, twelve documents of 500 tokens to the cap: (cost,
    parallel, config, cap, rates, samples) of one replica's search."""
    from megatron_slimpack.plan import samples_of
    from megatron_slimpack.planner.slimpack.memory import auto_token_cap
    from megatron_slimpack.planner.work import WorkRates

    parallel = ParallelConfig(dp=4, pp=2, vpp=2, tp=2)
    config = ms.SlimPackConfig(context_length=64 * K)
    cost = ms.CostModel.analytic("llama-13b", "h100-sxm")
    cap = auto_token_cap(cost, parallel, config)
    rates = WorkRates.from_cost(cost, parallel, cap)
    samples = samples_of([int(x) for x in np.random.default_rng(2).integers(500, cap, size=12)])
    return cost, parallel, config, cap, rates, samples


def test_a_replica_search_checked_to_fit_then_finished_is_the_full_search():
    """`fits` runs the search until a schedule fits and `finish` goes on: the same plan as
    `plan_replica`; where nothing fits, `fits` is False and `finish` raises the same failure."""
    from megatron_slimpack.planner.slimpack.replica import plan_replica, replica_search

    cost, parallel, config, cap, rates, samples = _one_interleaved_replica()
    replica, outcome = plan_replica(samples, cost, parallel, config, rates, cap, [3], False)
    search = replica_search(samples, cost, parallel, config, rates, cap, [3], False)
    assert search.fits() and search.best is not None
    paused_at = search.best[1]
    again, again_outcome = search.finish(samples)
    assert again_outcome == outcome and again.micropacks == replica.micropacks
    assert (again.forward_units, again.backward_units, again.stage_orders) == (
        replica.forward_units, replica.backward_units, replica.stage_orders)
    assert paused_at.makespan_s >= outcome.makespan_s
    with pytest.raises(DoesNotFit) as full:
        plan_replica(samples, cost, parallel, config, rates, cap, [3], False, budget=1e6)
    failing = replica_search(samples, cost, parallel, config, rates, cap, [3], False, budget=1e6)
    assert not failing.fits()
    with pytest.raises(DoesNotFit) as finished:
        failing.finish(samples)
    assert str(finished.value) == str(full.value) and finished.value.sample_ids == full.value.sample_ids



def test_sizes_a_failing_replica_tried_are_not_tried_again_by_another_walk(monkeypatch):
    """A replica that fits nowhere records each size it tried (`SizesWithoutFit`); a later search
    of it at the same or a lower leaner level, from another ladder, skips those sizes and fails
    with the same leanest need; at a higher level it tries them again (a leaner schedule may fit)."""
    from megatron_slimpack.planner.slimpack.replica import ReplicaSearch, SizesWithoutFit, replica_search

    cost, parallel, config, cap, rates, samples = _one_interleaved_replica()
    tried: list[int] = []
    try_packings = ReplicaSearch._try_packings

    def counted(self, micropack_tokens):
        tried.append(micropack_tokens)
        return try_packings(self, micropack_tokens)

    monkeypatch.setattr(ReplicaSearch, "_try_packings", counted)
    sizes = SizesWithoutFit()

    def failure(ladder=None, leaner_level=2, record=sizes):
        with pytest.raises(DoesNotFit) as raised:
            replica_search(samples, cost, parallel, config, rates, cap, [3], False, ladder, budget=1e6,
                           first_fit=ladder is not None, leaner_level=leaner_level,
                           sizes_without_fit=record).finish(samples)
        return str(raised.value)

    failure()
    walked = list(tried)
    assert len(walked) == len(SizeLadder.below_cap(cap, config).micropack_tokens) > 2
    tried.clear()
    shorter = SizeLadder(tuple(walked[1:]))
    recorded = failure(shorter, leaner_level=1)
    assert len(tried) < len(walked) - 1  # sizes skipped (one whose replays were all skipped is tried again)
    tried.clear()
    assert recorded == failure(shorter, leaner_level=1, record=SizesWithoutFit())  # the same failure
    assert tried == walked[1:]  # a fresh record tries every size
    tried.clear()
    lower = SizesWithoutFit()
    lower.record(walked[0], 0, (1e12, walked[0]))  # known at level 0 only: no stand-in for level 2
    failure(record=lower)
    assert tried == walked


def test_a_known_failure_stands_for_its_level_and_those_below():
    from megatron_slimpack.planner.slimpack.search import KnownSearches

    known = KnownSearches()
    samples = [Sample(0, 9000), Sample(4, 100)]
    key = known.key(samples, ParallelConfig(dp=4, pp=2, vpp=2), 8192, [1], None)
    failure = DoesNotFit("replica [1] does not fit", sample_ids=[0, 4])
    failures: list[DoesNotFit] = []
    known.record(key, 1, failure, failures)
    assert failures == [failure]
    failures.clear()
    assert not known.failed(key, 2, failures) and failures == []  # a deeper level may fit
    assert known.failed(key, 1, failures) and known.failed(key, 0, failures)
    assert [str(f) for f in failures] == [str(failure)] * 2 and failures[0] is not failures[1] is not failure
    assert failures[0].__traceback__ is None
    other = known.key(samples, ParallelConfig(dp=4, pp=2, vpp=2), 8192, [1], None, SizeLadder((8192, 4096)))
    assert not known.failed(other, 0, failures)  # a first-fit search from a ladder is another input


def test_a_known_fit_stands_from_its_highest_fitting_level_to_the_level_searched():
    from megatron_slimpack.planner.slimpack.search import KnownSearches

    known = KnownSearches()
    key = known.key([Sample(0, 9000)], ParallelConfig(dp=4, pp=2, vpp=2), 8192, [1], None)
    result = (ReplicaPlan([], [], [], [[], []], [1]), ReplicaOutcome((1,), 1.0, 8192, 4))
    known.record_fit(key, 2, {0, 1}, result)  # searched at level 2; a level-1 schedule fit
    assert [known.result(key, level) is result for level in (0, 1, 2)] == [False, True, True]
    assert [known.fits(key, level) for level in (0, 1, 2)] == [False, True, True]
    known.record_fit(key, 0, {0})  # only its first fit known at level 0
    assert known.fits(key, 0) and known.result(key, 0) is None
    known.forget_fits()
    assert not known.fits(key, 1) and known.result(key, 1) is None


def test_skipping_known_failures_and_pausing_merge_groups_plans_the_same(monkeypatch):
    """llama-7b 128K, long-tailed lengths, tp1 pp4 vpp4 dp8: the plannings of an interleaved layout
    retry with grown groups and lower leaner levels. The search with its shortcuts (failures known
    from a deeper level not searched again, fits known from a deeper level used without a search,
    merge groups only checked to fit while the planning may still fail) gives the same plan,
    metadata included, as without them, and took each."""
    from megatron_slimpack.planner.slimpack import search as search_module
    from megatron_slimpack.planner.slimpack.replica import ReplicaSearch
    from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

    context = 128 * K
    lengths = GlobalBatchSampler(load_lengths("longtail", seed=1), context, 64, seed=1,
                                 long_documents="split").next_batch().lengths
    parallel = ParallelConfig(dp=8, pp=4, vpp=4, tp=1)
    config = ms.SlimPackConfig(context_length=context, solver_deterministic_limit=0.2)
    known_hits, fit_hits, sizes_left_after_a_fit = [], [], []
    known = search_module.KnownSearches
    failed, known_result = known.failed, known.result
    fits, finish = ReplicaSearch.fits, ReplicaSearch.finish

    def counted_failed(self, key, leaner_level, failures):
        known_hits.append(failed(self, key, leaner_level, failures))
        return known_hits[-1]

    def counted_result(self, key, leaner_level):
        fit_hits.append(known_result(self, key, leaner_level) is not None)
        return known_result(self, key, leaner_level)

    def marked_fits(self):
        self.paused = fits(self)
        return self.paused

    def counted_finish(self, samples):
        if getattr(self, "paused", False):  # the sizes the full search tries after the first fit
            sizes_left_after_a_fit.append(sum(1 for _ in self._walk))
        return finish(self, samples)

    plan_sizing = SlimPackSearch.plan_sizing
    # every planning searched whole, so that the shortcuts above have failures and fits to reuse
    monkeypatch.setattr(SlimPackSearch, "plan_sizing",
                        lambda self, view, sizing, leaner_level=2, cut_short=False: plan_sizing(
                            self, view, sizing, leaner_level))
    monkeypatch.setattr(known, "failed", counted_failed)
    monkeypatch.setattr(known, "result", counted_result)
    monkeypatch.setattr(ReplicaSearch, "fits", marked_fits)
    monkeypatch.setattr(ReplicaSearch, "finish", counted_finish)
    shortcut = SlimPackSearch(lengths, parallel, COST, config).plan()
    assert any(known_hits) and any(fit_hits) and any(sizes_left_after_a_fit)

    def full_search(self):  # the walk to its end, as plan_replica, before the own replicas are planned
        for _ in self._walk:
            pass
        return self.best is not None

    monkeypatch.setattr(known, "failed", lambda self, key, level, failures: False)
    monkeypatch.setattr(known, "fits", lambda self, key, level: False)
    monkeypatch.setattr(known, "result", lambda self, key, level: None)
    monkeypatch.setattr(ReplicaSearch, "fits", full_search)
    full = SlimPackSearch(lengths, parallel, COST, config).plan()

    def without_solver_time(metadata):  # CP-SAT's wall time differs run to run
        return {**metadata, "phase1": {k: v for k, v in metadata["phase1"].items() if k != "time_s"}}

    assert shortcut.fingerprint() == full.fingerprint()
    assert without_solver_time(shortcut.metadata) == without_solver_time(full.metadata)
