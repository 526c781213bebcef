"""Virtual pipeline stages (Megatron's interleaved 1F1B) in the plan, the simulator and the layout
search: Megatron's own order, the closed-form bubble, memory of the in-flight chunks, the
micro-batch rule, and which strategies search vpp."""
import random
from typing import Callable

import pytest
from megatron.core.pipeline_parallel.schedules import get_schedule_table

from megatron_slimpack.config import SlimPackConfig
from megatron_slimpack.costmodel import CostModel
from megatron_slimpack.plan import MicroPack, Plan, PlanError, Sample, Slice
from megatron_slimpack.plan.types import last_forward_needed, tasks_of_chunk
from megatron_slimpack.plan.validate import _check_chunk_order, _order_holds
from megatron_slimpack.planner import orders as orders_module
from megatron_slimpack.planner.baselines import meet_interleaved_count, schedule_1f1b
from megatron_slimpack.planner.layouts import enumerate_layouts
from megatron_slimpack.planner.orders import interleaved_microbatch_error, interleaved_orders
from megatron_slimpack.planner.strategies import new_planner
from megatron_slimpack.simulator import simulate
from megatron_slimpack.specs import ParallelConfig, SpecError
from test_simulator import FixedCost, build_replica, random_micropacks


class ChunkCost(FixedCost):
    """FixedCost per chunk: a stage's forward/backward split evenly over its vpp chunks."""

    def forward_time(self, tokens, pairs, parallel, last_stage=False):
        return self.forward / parallel.vpp / parallel.cp

    def backward_time(self, tokens, pairs, parallel, last_stage=False):
        return self.backward / parallel.vpp / parallel.cp


def megatron_order(m: int, pp: int, vpp: int, stage: int) -> list[tuple]:
    """forward_backward_pipelining_with_interleaving's task order on one rank, from megatron-core's
    own schedule table and warm-up rule (core 0.16.1)."""
    table = get_schedule_table(m, vpp, pp)
    total = m * vpp
    warmup = min(total, (pp - stage - 1) * 2 + (vpp - 1) * pp)
    forwards = [("F", unit, chunk) for unit, chunk in table]
    backwards = [("B", unit, vpp - 1 - chunk) for unit, chunk in table]
    order = forwards[:warmup]
    for k in range(total - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[total - warmup:]


def interleaved_plan(m: int, pp: int, vpp: int) -> Plan:
    packs = [MicroPack([Slice(i, 0, 8)]) for i in range(m)]
    replica = schedule_1f1b(packs, ParallelConfig(pp=pp, vpp=vpp), [0])
    return Plan([replica], [Sample(i, 8) for i in range(m)], ParallelConfig(pp=pp, vpp=vpp), 8, "test").validate()


@pytest.mark.parametrize("pp,vpp", [(2, 2), (4, 2), (4, 3), (8, 4)])
def test_orders_are_megatrons_interleaved_schedule(pp, vpp):
    for m in (pp, 2 * pp, 3 * pp):
        units = [[i] for i in range(m)]
        orders = interleaved_orders(units, units, pp, vpp)
        assert orders == [megatron_order(m, pp, vpp, stage) for stage in range(pp)]


@pytest.mark.parametrize("m,pp,vpp", [(8, 4, 2), (8, 4, 4), (4, 2, 2), (12, 4, 3), (16, 8, 2)])
def test_interleaved_bubble_is_the_closed_form(m, pp, vpp):
    """Uniform micro-batches, no p2p: (m + (pp - 1) / vpp) (f + b); rank 0 holds its warm-up's
    2 (pp - 1) + (vpp - 1) pp chunk activations and one more."""
    report = simulate(interleaved_plan(m, pp, vpp), ChunkCost(forward=1.0, backward=2.0))
    assert report.iteration_time_s == pytest.approx((m + (pp - 1) / vpp) * 3.0)
    assert report.bubble_ratio == pytest.approx((pp - 1) / (vpp * m + pp - 1))
    plain = simulate(interleaved_plan(m, pp, 1), ChunkCost(forward=1.0, backward=2.0))
    assert plain.bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1))  # vpp times the interleaved one's idle time
    in_flight = [min(m * vpp, 2 * (pp - 1 - s) + (vpp - 1) * pp + 1) for s in range(pp)]
    assert report.peak_memory_bytes == [100.0 + n for n in in_flight]


def test_chunk_boundaries_add_transfers_and_chunks_are_recorded():
    m, pp, vpp = 4, 2, 2
    report = simulate(interleaved_plan(m, pp, vpp), ChunkCost(p2p=0.1))
    transfers = [r for r in report.tasks if r.kind == "P2P"]
    # every virtual-stage boundary, both ways: (pp * vpp - 1) * 2 per micro-batch
    assert len(transfers) == (pp * vpp - 1) * 2 * m
    assert {r.detail for r in transfers} == {"F 0->1", "F 1->0", "B 1->0", "B 0->1"}
    assert {(r.stage, r.chunk) for r in report.tasks if r.kind == "F"} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    slower = simulate(interleaved_plan(m, pp, 1), ChunkCost(p2p=0.1))
    assert len([r for r in slower.tasks if r.kind == "P2P"]) == (pp - 1) * 2 * m


def test_sliced_and_asymmetric_units_interleave_and_run_through(monkeypatch):
    """Long documents sliced over consecutive MicroPacks, units of several MicroPacks that differ
    forward and backward, unit counts that are no multiple of pp: every backward stays after its
    forward on its chunk and no rank waits in a circle (the simulator would raise). Where a
    backward's own need would make ranks wait in a circle, one lead for all is used (counted: it
    happens here)."""
    lifted = []
    original = orders_module.InterleavedSchedule.runs_through
    monkeypatch.setattr(orders_module.InterleavedSchedule, "runs_through",
                        lambda self: original(self) or lifted.append(1))
    for seed in range(10):
        rng = random.Random(seed)
        packs, samples, _ = random_micropacks(rng, 0, 9 + seed, 512, long_share=0.5)
        replica = build_replica(packs, [0], 2, rng, max_unit=1 + seed % 3)
        for pp, vpp in ((2, 2), (4, 2), (2, 3), (3, 2)):
            replica.stage_orders = interleaved_orders(replica.forward_units, replica.backward_units, pp, vpp)
            plan = Plan([replica], samples, ParallelConfig(pp=pp, vpp=vpp), 2048, "test").validate()
            report = simulate(plan, ChunkCost())
            assert report.lower_bound_s <= report.iteration_time_s + 1e-9
    assert lifted


@pytest.mark.parametrize("seed, accumulated, full, per_rank", [(50, 14, 19, 13), (54, 16, 19, 13),
                                                               (114, 21, 27, 21)])
def test_per_rank_targets_run_a_long_documents_chain_without_the_full_lead(seed, accumulated, full, per_rank):
    """Sliced documents over pp=4 x vpp=2, one MicroPack per unit (a multiple of pp): adding each
    backward's need on top of every rank's warm-up lead waits in a circle (where the chain's need
    stays flat, rank 0 keeps its lead and asks for a chunk the last rank only runs after a backward
    that needs rank 0's), so Megatron's table runs with the full lead for all. The per-rank targets
    (the lead on the steady state only, then each rank's needs) run through, holding what the
    need alone asks."""
    from megatron_slimpack.planner.orders import interleaved_schedules

    rng = random.Random(seed)
    packs, _, _ = random_micropacks(rng, 0, 12 + seed % 10, 512, long_share=0.5)
    replica = build_replica(packs, [0], 2, rng, max_unit=1)
    units = (replica.forward_units, replica.backward_units)
    assert len(units[0]) % 4 == 0
    needs_first, lead_for_all = interleaved_schedules(*units, 4, 2, which="megatron")
    assert not needs_first.runs_through() and lead_for_all.runs_through()
    assert (_chunks_in_flight(needs_first), _chunks_in_flight(lead_for_all)) == (accumulated, full)
    (leaner,) = interleaved_schedules(*units, 4, 2, which="per-rank")
    assert leaner.runs_through() and _chunks_in_flight(leaner) == per_rank
    assert (leaner.targets <= needs_first.targets).all()


@pytest.mark.parametrize("groups, vpp", [((4, 4, 5), 2), ((3, 4, 4), 3), ((2,), 5), ((8, 9, 9, 9), 1)])
def test_task_tables_follow_the_interleaved_table(groups, vpp):
    """The cached, vectorised tables follow the interleaved order written plainly (each group of
    units through chunk 0, then chunk 1, ...; backwards with chunks reversed), and `positions`
    finds every task."""
    from megatron_slimpack.planner.orders import task_table

    def interleaved_table(group_sizes: list[int], vpp: int) -> list[tuple[int, int]]:
        table, first = [], 0
        for size in group_sizes:
            table += [(unit, chunk) for chunk in range(vpp) for unit in range(first, first + size)]
            first += size
        return table

    for kind in "FB":
        table = task_table(kind, groups, vpp)
        assert table.tasks == [(kind, unit, chunk if kind == "F" else vpp - 1 - chunk)
                               for unit, chunk in interleaved_table(list(groups), vpp)]
        assert table.positions[table.chunks, table.units].tolist() == list(range(len(table.tasks)))


def test_a_timed_walk_runs_through_exactly_where_the_untimed_one_does():
    """`InterleavedCandidate.of` walks a schedule within budget once, with its times, instead of
    checking it runs through and then timing it: the walk's progress must not depend on the
    times. Every schedule of random sliced, asymmetric units (some wait in a circle), with random
    per-unit times and transfers."""
    from megatron_slimpack.planner.orders import StageWork, interleaved_schedules

    circular = 0
    for seed in range(12):
        rng = random.Random(seed)
        packs, _, _ = random_micropacks(rng, 0, 9 + seed, 512, long_share=0.5)
        replica = build_replica(packs, [0], 2, rng, max_unit=1 + seed % 3)
        for pp, vpp in ((2, 2), (4, 2), (3, 3)):
            forwards, backwards = len(replica.forward_units), len(replica.backward_units)
            work = StageWork([[rng.random() for _ in range(forwards)] for _ in range(pp)],
                             [[rng.random() for _ in range(backwards)] for _ in range(pp)],
                             [rng.random() / 10 for _ in range(forwards)],
                             [rng.random() / 10 for _ in range(backwards)],
                             [[1.0] * forwards] * pp, [[1.0] * backwards] * pp, [float("inf")] * pp)
            for schedule in interleaved_schedules(replica.forward_units, replica.backward_units, pp, vpp):
                walked = schedule.walked_s(work)
                assert (walked is not None) == schedule.runs_through()
                circular += walked is None
                if walked is not None:
                    assert walked == schedule.makespan_s(work) > 0
    assert circular  # the cases include circular waits


def test_a_long_documents_run_up_does_not_stall_the_interleaved_pipeline():
    """A 4-slice chain among single MicroPacks: the first backward on the last chunk needs the
    chain's last forward. Interleaving still beats plain 1F1B's fill by about (pp - 1) / vpp."""
    chain = [MicroPack([Slice(0, 8 * i, 8 * i + 8)]) for i in range(4)]
    packs = chain + [MicroPack([Slice(i, 0, 8)]) for i in range(1, 13)]
    samples = [Sample(0, 32)] + [Sample(i, 8) for i in range(1, 13)]
    times = {}
    for vpp in (1, 2):
        replica = schedule_1f1b(packs, ParallelConfig(pp=4, vpp=vpp), [0])
        plan = Plan([replica], samples, ParallelConfig(pp=4, vpp=vpp), 32, "test").validate()
        times[vpp] = simulate(plan, ChunkCost()).iteration_time_s
    assert times[2] < times[1]
    assert times[2] <= (16 + 3 / 2) * 3.0 + 1e-9 < times[1] + 1e-9


def _chunks_in_flight(schedule) -> int:
    """The most chunk activations a rank holds at once (forwards run before a backward, minus the
    backwards before it), one-MicroPack units of equal size."""
    import numpy as np

    targets = np.asarray(schedule.targets)
    return int((targets - np.arange(targets.shape[1])[None, :]).max())


@pytest.mark.parametrize("m,pp,vpp,megatrons,leanest", [(9, 2, 2, 6, 5), (9, 2, 4, 12, 9), (19, 4, 2, 14, 11),
                                                         (39, 8, 6, 90, 55), (22, 4, 4, 24, 19)])
def test_a_remainder_shorter_than_pp_is_run_as_a_short_first_group(m, pp, vpp, megatrons, leanest):
    """Units that are no multiple of pp: Megatron's table joins the remainder to the last group, a
    group longer than pp, whose chunk-1 forwards come later than the last rank's backwards need
    them; every rank then holds (vpp - 1) * remainder chunks more (llama-13b 256K tp2 pp2 vpp2:
    whole-document replicas at the cap held 50.5-55.5 GiB for 49.2 GiB). The remainder as a short
    first group runs through and holds what a multiple of pp does (the closed form above)."""
    from megatron_slimpack.planner.orders import interleaved_schedules

    units = [[i] for i in range(m)]
    schedules = interleaved_schedules(units, units, pp, vpp)
    running = [s for s in schedules if s.runs_through()]
    for schedule in schedules:  # every table runs each (unit, chunk) once
        assert sorted(t[1:] for t in schedule.forwards) == [(u, c) for u in range(m) for c in range(vpp)]
    megatron = [s for s in running if s.grouping == 0]
    assert min(map(_chunks_in_flight, megatron)) == megatrons
    assert min(map(_chunks_in_flight, running)) == leanest == 2 * (pp - 1) + (vpp - 1) * pp + 1
    assert interleaved_orders(units, units, pp, vpp) == megatron[0].orders()  # the first that runs: Megatron's
    multiple = interleaved_schedules(units[: m - m % pp], units[: m - m % pp], pp, vpp)
    assert {s.grouping for s in multiple} == {0}  # a multiple of pp: Megatron's table only


def test_the_planner_takes_the_first_schedule_within_its_budget():
    """`InterleavedCandidate.of`: Megatron's schedules by default, over budget or not; asked for
    the leaner ones, the first within the budget that runs through, or where none is, the
    leanest, for the search to drop."""
    from megatron_slimpack.plan import last_forward_needed
    from megatron_slimpack.planner.orders import StageWork
    from megatron_slimpack.planner.slimpack.pack_phase import InterleavedCandidate

    m, pp = 9, 2
    units = [[i] for i in range(m)]
    ones = [[1.0] * m for _ in range(pp)]
    work = StageWork(ones, ones, [0.0] * m, [0.0] * m, ones, ones, [1e9] * pp)

    class Candidate:  # the part of a UnitCandidate that `of` reads
        unit_counts = (m, m)
        needs = last_forward_needed(units, units)
        vpp = 2

    Candidate.work = work
    for budget in (None, 6.0, 5.0):
        megatron = InterleavedCandidate.of(Candidate, [0], budget_bytes=budget)
        assert megatron.schedule.grouping == 0 and megatron.peak_activation_bytes == 6.0
    lean = InterleavedCandidate.of(Candidate, [0], budget_bytes=5.0, which="groupings")
    assert lean.peak_activation_bytes == 5.0 and lean.schedule.runs_through()
    over = InterleavedCandidate.of(Candidate, [0], budget_bytes=4.0, which="groupings")
    assert over.peak_activation_bytes == 5.0  # over budget: dropped by the search for memory


def test_whole_documents_at_the_cap_fit_their_interleaved_replicas(monkeypatch):
    """llama-7b 256K tp4 pp2 vpp2 dp16, the paper grid's first Wikipedia batch, documents kept
    whole (`slice_tokens` = the context): `auto_token_cap` sizes MicroPacks (45056 tokens) for the
    chunks a multiple of pp keeps in flight. Replicas with an odd count of them do not all fit
    Megatron's interleaved table alone: some need a leaner grouping. Every replica fits at base
    merge 1, and since some needed a leaner grouping, the sizing was planned without them too
    (there it fails: nothing sliced to merge)."""
    from pathlib import Path

    from megatron_slimpack.planner.slimpack.search import SlimPackSearch
    from megatron_slimpack.planner.strategies import plan_global_batch
    from megatron_slimpack.simulator import simulate as simulate_plan
    from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

    plannings = []
    plan_sizing = SlimPackSearch.plan_sizing

    def recorded(self, view, sizing, leaner_level=2, cut_short=False):
        plannings.append((view.dp, leaner_level))
        return plan_sizing(self, view, sizing, leaner_level, cut_short)

    monkeypatch.setattr(SlimPackSearch, "plan_sizing", recorded)

    context = 256 * 1024
    wikipedia = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikipedia_lengths.txt"
    batch = GlobalBatchSampler(load_lengths(f"file:{wikipedia}", seed=0), context, 512, seed=0,
                               long_documents="split").next_batch()
    cost = CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ParallelConfig(dp=16, pp=2, vpp=2, tp=4, recompute="selective")
    plan = plan_global_batch(batch.lengths, parallel=parallel, cost=cost,
                             config=SlimPackConfig(context_length=context, slice_tokens=context))
    assert "base_merge" not in plan.metadata and plan.metadata["token_cap"] == 45056
    assert plannings == [(16, 2), (16, 0)]  # replicas needed the other groupings (level 1), then none
    singles = [r for r in plan.metadata["replicas"] if len(r["dp_ranks"]) == 1]
    assert len(singles) == 16 and any(r["units"] % 2 for r in singles)
    assert max(simulate_plan(plan, cost).peak_memory_bytes) <= cost.memory_budget_bytes()


def test_far_apart_unit_counts_are_refused_and_skipped_by_the_planner():
    """A candidate the SlimPack planner met at llama-70b tp8 pp8 vpp2: 16 forward units, 22
    backward units, 8 two-slice documents. Neither order runs without a circular wait: a PlanError
    naming the counts; the planner skips such a candidate and plans with another (test below)."""
    forward_units = [[0], [1, 2], [3], [4, 5], [6], [7, 8]] + [[i, i + 1] for i in range(9, 29, 2)]
    backward_units = [[0], [2, 1], [3], [5, 4], [6], [7], [9], [8], [10], [11], [13], [12], [14], [16, 15],
                      [17, 18], [20, 19], [21, 22], [24, 23], [25], [27], [26], [28]]
    with pytest.raises(PlanError, match="16 forward and 22 backward units over pp=8 x vpp=2"):
        interleaved_orders(forward_units, backward_units, 8, 2)


def test_slimpack_plans_interleaved_and_beats_plain_1f1b_on_a_long_tail():
    """llama-70b tp8 pp8 dp2, 300 documents up to 64K (two long ones sliced): SlimPack's plan with
    vpp 2 validates, and the simulator prices it below plain 1F1B's (bubble cut by interleaving)."""
    import numpy as np

    from megatron_slimpack.config import SlimPackConfig
    from megatron_slimpack.planner.strategies import plan_slimpack

    rng = np.random.default_rng(0)
    lengths = [int(n) for n in np.minimum(rng.lognormal(8, 1.5, 300).astype(int) + 16, 65536)]
    lengths[:2] = [65536, 50000]
    cost = CostModel.analytic("llama-70b", "h100-sxm")
    config = SlimPackConfig(context_length=65536)
    reports = {}
    for vpp in (1, 2):
        plan = plan_slimpack(lengths, ParallelConfig(tp=8, pp=8, vpp=vpp, dp=2, recompute="selective"), cost, config)
        plan.validate()
        assert all(len(task) == (3 if vpp > 1 else 2) for r in plan.replicas for task in r.stage_orders[0])
        reports[vpp] = simulate(plan, cost, detail=False)
    assert reports[2].iteration_time_s < reports[1].iteration_time_s
    assert reports[2].bubble_ratio < reports[1].bubble_ratio
    assert max(reports[2].peak_memory_bytes) <= cost.memory_budget_bytes()


def test_plan_json_keeps_chunks_and_plain_plans_are_unchanged():
    plan = interleaved_plan(4, 2, 2)
    again = Plan.from_json(plan.to_json())
    assert again.replicas[0].stage_orders == plan.replicas[0].stage_orders
    assert again.parallel.vpp == 2 and again.fingerprint() == plan.fingerprint()
    plain = interleaved_plan(4, 2, 1)
    assert "vpp" not in plain.to_dict()["parallel"]
    assert all(len(task) == 2 for task in plain.replicas[0].stage_orders[0])


def test_validation_names_chunk_errors():
    plan = interleaved_plan(4, 2, 2)
    order = plan.replicas[0].stage_orders[1]
    order[order.index(("F", 1, 1))] = ("F", 1, 2)
    with pytest.raises(PlanError, match="chunk outside 0..1"):
        plan.validate()
    plan = interleaved_plan(4, 2, 2)
    plan.replicas[0].stage_orders[0] = [task[:2] for task in plan.replicas[0].stage_orders[0]]
    with pytest.raises(PlanError, match=r"\[kind, unit, chunk\]"):
        plan.validate()
    plan = interleaved_plan(4, 2, 2)
    order = plan.replicas[0].stage_orders[0]
    first_backward = next(i for i, task in enumerate(order) if task[0] == "B")
    order.insert(0, order.pop(first_backward))
    with pytest.raises(PlanError, match="chunk 1 runs backward unit 0 before forward unit 0"):
        plan.validate()
    with pytest.raises(SpecError, match="needs pipeline parallelism"):
        ParallelConfig(vpp=2)


def test_megatrons_micro_batch_rule_refuses_a_step():
    packs = [MicroPack([Slice(i, 0, 8)]) for i in range(6)]
    with pytest.raises(PlanError, match="multiple of 4"):
        schedule_1f1b(packs, ParallelConfig(pp=4, vpp=2), [0])
    with pytest.raises(PlanError, match="at least pp"):
        schedule_1f1b(packs[:3], ParallelConfig(pp=4, vpp=2), [0])
    assert schedule_1f1b(packs[:4], ParallelConfig(pp=4, vpp=2), [0]).stage_orders[0][0] == ("F", 0, 0)


def test_layout_search_offers_vpp_where_the_schedule_interleaves():
    """Megatron's schedules and SlimPack's runtime interleave; SlimPipe keeps its slice-level 1F1B."""
    cost = CostModel.analytic("llama-70b", "h100-sxm")
    for strategy in ("megatron-fixed", "slimpack"):
        layouts = enumerate_layouts(cost, 64, strategy)
        assert {p.vpp for p in layouts if p.pp == 8} == {1, 2, 5}  # 80 layers: 10 per stage
        assert {p.vpp for p in layouts if p.pp == 1} == {1}
    assert {p.vpp for p in enumerate_layouts(cost, 64, "slimpipe")} == {1}


def test_cost_model_prices_a_chunk():
    cost = CostModel.analytic("llama-70b", "h100-sxm")
    plain, interleaved = ParallelConfig(pp=8, tp=8, dp=2), ParallelConfig(pp=8, vpp=2, tp=8, dp=2)
    assert cost.layers_per_stage(interleaved) * 2 == cost.layers_per_stage(plain)
    assert cost.static_memory_bytes(interleaved) == cost.static_memory_bytes(plain)
    assert cost.activation_bytes(8192, 8192 ** 2 / 2, interleaved) == pytest.approx(
        cost.activation_bytes(8192, 8192 ** 2 / 2, plain) / 2)


def _packs(*documents_per_pack: tuple[int, ...]) -> list[MicroPack]:
    """MicroPacks of whole documents: each argument is one pack's document lengths."""
    ids = iter(range(1000))
    return [MicroPack([Slice(next(ids), 0, length) for length in lengths]) for lengths in documents_per_pack]


def _documents(micropacks: list[MicroPack]) -> list[tuple]:
    return sorted((s.sample_id, s.start, s.length) for micropack in micropacks for s in micropack.slices)


def test_variable_counts_are_split_or_merged_to_megatrons_multiple():
    interleaved = ParallelConfig(pp=4, vpp=2)
    # 3 packs, 5 documents: the heaviest packs of two documents are split up to 4.
    packs = _packs((300, 200), (250,), (100, 90, 80))
    [split] = meet_interleaved_count([packs], interleaved, 512, "bfd")
    assert len(split) == 4 and _documents(split) == _documents(packs)
    assert max(p.num_tokens for p in split) < max(p.num_tokens for p in packs)
    # 5 single documents: nothing to split, the two smallest merge pairwise down to 4.
    singles = _packs((400,), (30,), (200,), (20,), (300,))
    [merged] = meet_interleaved_count([singles], interleaved, 512, "wlb-llm")
    assert len(merged) == 4 and _documents(merged) == _documents(singles)
    assert sorted(p.num_tokens for p in merged) == [50, 200, 300, 400]
    # 3 long single documents: neither way reaches a multiple of 4.
    with pytest.raises(PlanError, match=r"wlb-llm, data-parallel rank 1: 3 micro-batches .* pp=4"):
        meet_interleaved_count([_packs((1,), (1,), (1,), (1,)), _packs((400,), (300,), (200,))],
                               interleaved, 512, "wlb-llm")
    # Plain 1F1B takes any count; a rank with nothing to run stays empty.
    assert meet_interleaved_count([packs, []], ParallelConfig(pp=4), 512, "bfd") == [packs, []]
    assert meet_interleaved_count([[]], interleaved, 512, "bfd") == [[]]


@pytest.mark.parametrize("strategy", ["bfd", "sorted", "wlb-llm"])
def test_variable_count_packers_plan_every_step_megatron_interleaves(strategy):
    """Their micro-batch counts vary from batch to batch; with virtual stages every step must be one
    Megatron's interleaved 1F1B takes, or training stops mid-run (sorted did on the real trainer's
    own batches)."""
    cost = CostModel.analytic("llama-7b", "h100-sxm")
    rng = random.Random(3)
    refused_plain = 0
    config = SlimPackConfig(context_length=512, strategy=strategy)
    for pp, dp in ((2, 1), (4, 2)):
        layouts = {"plain": ParallelConfig(pp=pp, dp=dp), "interleaved": ParallelConfig(pp=pp, dp=dp, vpp=2)}
        planners = {name: new_planner(strategy) for name in layouts}
        trained = {name: [] for name in layouts}  # every document's length, over all steps
        for _ in range(6):
            lengths = [rng.randint(5, 512) for _ in range(rng.randint(20, 60))]
            plans = {name: planners[name].plan(lengths, layouts[name], cost, config).validate() for name in layouts}
            refused_plain += any(interleaved_microbatch_error(len(r.micropacks), pp)
                                 for r in plans["plain"].replicas if r.micropacks)
            assert all(len(r.micropacks) % pp == 0 for r in plans["interleaved"].replicas)
            assert simulate(plans["interleaved"], cost).iteration_time_s > 0
            for name, plan in plans.items():
                trained[name] += [s.length for s in plan.samples]
        for name in layouts:  # wlb-llm's delayed documents come in a last step
            flush = getattr(planners[name], "flush", lambda *args: None)
            last = flush(layouts[name], cost, config)
            trained[name] += [s.length for s in last.samples] if last else []
        assert sorted(trained["interleaved"]) == sorted(trained["plain"])
    assert refused_plain, "no batch needed a split or a merge: the test would prove nothing"


def _swapped(order: list, i: int, j: int) -> None:
    order[i], order[j] = order[j], order[i]


def _changed(position: int, delta) -> Callable:
    def change(order: list, i: int, j: int) -> None:
        task = list(order[i])
        task[position] += delta
        order[i] = tuple(task)
    return change


# What a broken stage order may look like: two tasks swapped, a unit or chunk changed (a unit by no
# whole number too), a task dropped or run twice.
ORDER_MUTATIONS = [_swapped, _changed(1, 1), _changed(2, 1), _changed(1, 0.5),
                   lambda order, i, j: order.pop(i), lambda order, i, j: order.insert(i, order[j])]


@pytest.mark.parametrize("seed", range(4))
def test_the_array_check_of_a_stage_order_agrees_with_the_task_by_task_checks(seed):
    """`validate._order_holds` passes exactly the orders the task-by-task checks pass: Megatron's
    interleaved orders and their perturbations (`ORDER_MUTATIONS`)."""
    rng = random.Random(seed)
    pp, vpp = rng.choice([(2, 2), (4, 2), (2, 3)])
    units = [[i] for i in range(rng.choice([4, 6, 8]))]
    needs = last_forward_needed(units, units)
    everyone = list(range(len(units)))

    def task_by_task(order) -> bool:
        if any(len(task) != 3 or not 0 <= task[2] < vpp for task in order):
            return False
        try:
            for chunk in range(vpp):
                _check_chunk_order(tasks_of_chunk(order, chunk), "", needs.tolist(), everyone, everyone)
        except PlanError:
            return False
        return True

    for order in interleaved_orders(units, units, pp, vpp):
        assert _order_holds(order, needs, len(units), vpp) and task_by_task(order)
        for _ in range(60):
            mutated = list(order)
            rng.choice(ORDER_MUTATIONS)(mutated, rng.randrange(len(order)), rng.randrange(len(order)))
            assert _order_holds(mutated, needs, len(units), vpp) == task_by_task(mutated)
