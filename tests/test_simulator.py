"""The DAG simulator: closed forms on hand-built plans, invariants on random plans, outputs."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_slimpack import CostModel, ParallelConfig, SlimPackConfig
from megatron_slimpack import plan as plan_batch
from megatron_slimpack.costmodel import overlaps_of
from megatron_slimpack.plan import MicroPack, Plan, ReplicaPlan, Sample, Slice, backward_sequence
from megatron_slimpack.simulator import SimulationError, SimulationReport, busiest_device_s, dag, score, simulate
from megatron_slimpack.simulator.compiled import program_successors
from megatron_slimpack.simulator.report import (
    ComparisonRow,
    chrome_trace,
    comparison_table,
    csv_table,
    markdown_table,
    write_chrome_trace,
    write_gantt,
)


# ---- building plans by hand --------------------------------------------------------------------
class FixedCost:
    """Every MicroPack costs `forward` / `backward` seconds on every stage (divided by CP, so a
    merge group of k runs it k times faster); one byte of activation per MicroPack; no
    communication unless asked."""

    class hardware:
        peak_flops = 1e12

    def __init__(self, forward=1.0, backward=2.0, p2p=0.0, dp_reduce=0.0, kv=0.0):
        self.forward, self.backward, self.p2p, self.dp_reduce, self.kv = forward, backward, p2p, dp_reduce, kv

    def forward_time(self, tokens, pairs, parallel, last_stage=False):
        return self.forward / parallel.cp

    def backward_time(self, tokens, pairs, parallel, last_stage=False):
        return self.backward / parallel.cp

    def p2p_time(self, tokens, parallel):
        return self.p2p

    def merge_comm_time(self, tokens, group_size, parallel, backward):
        return 0.0

    def dp_reduce_time(self, parallel):
        return self.dp_reduce

    def static_memory_bytes(self, parallel, context_length=0):
        return 100.0

    def activation_bytes(self, tokens, pairs, parallel, last_stage=False, prefix_tokens=0.0, masked_entries=0.0):
        return 1.0

    def kv_cache_bytes(self, tokens, parallel):
        return self.kv

    def recompute_peak_bytes(self, tokens, pairs, parallel):
        return 0.0

    def model_flops(self, tokens, pairs):
        return 6.0 * tokens


def generalized_1f1b(num_forward: int, backward_units: list[list[int]], forward_unit_of: dict[int, int],
                     forward_units: list[list[int]], pp: int) -> list[list[tuple[str, int]]]:
    """Stage s keeps at most pp - s MicroPacks in flight when it can run a backward: the
    memory-driven 1F1B rule. The same rule on every stage cannot deadlock."""
    needs = [max(forward_unit_of[mp] for mp in unit) for unit in backward_units]
    orders = []
    for stage in range(pp):
        limit, order, f, b, in_flight = pp - stage, [], 0, 0, 0
        while f < num_forward or b < len(backward_units):
            backward_ready = b < len(backward_units) and needs[b] < f
            if backward_ready and (in_flight >= limit or f == num_forward):
                order.append(("B", b))
                in_flight -= len(backward_units[b])
                b += 1
            else:
                order.append(("F", f))
                in_flight += len(forward_units[f])
                f += 1
        orders.append(order)
    return orders


def segment(sequence: list[int], rng: random.Random, max_size: int) -> list[list[int]]:
    units, i = [], 0
    while i < len(sequence):
        size = rng.randint(1, max_size)
        units.append(sequence[i:i + size])
        i += size
    return units


def build_replica(micropacks: list[MicroPack], dp_ranks: list[int], pp: int, rng: random.Random | None = None,
                  max_unit: int = 1) -> ReplicaPlan:
    rng = rng or random.Random(0)
    forward_units = segment(list(range(len(micropacks))), rng, max_unit)
    backward_units = segment(backward_sequence(micropacks), rng, max_unit)
    forward_unit_of = {mp: u for u, unit in enumerate(forward_units) for mp in unit}
    orders = generalized_1f1b(len(forward_units), backward_units, forward_unit_of, forward_units, pp)
    return ReplicaPlan(micropacks, forward_units, backward_units, orders, dp_ranks)


def random_micropacks(rng: random.Random, first_id: int, count: int, max_len: int, long_share: float = 0.2):
    """MicroPacks of short documents, with some long documents sliced across consecutive packs."""
    packs: list[list[Slice]] = [[] for _ in range(count)]
    samples, sample_id = [], first_id
    for index in range(count):
        while len(packs[index]) < 2 or (rng.random() < 0.5 and len(packs[index]) < 6):
            if rng.random() < long_share:
                pieces = rng.randint(1, min(4, count - index))
                if any(sample_id in [s.sample_id for s in packs[index + j]] for j in range(pieces)):
                    break
                bounds = sorted(rng.sample(range(1, max_len * pieces), pieces - 1)) if pieces > 1 else []
                edges = [0] + bounds + [max_len * pieces]
                for j in range(pieces):
                    packs[index + j].append(Slice(sample_id, edges[j], edges[j + 1]))
                samples.append(Sample(sample_id, max_len * pieces))
            else:
                length = rng.randint(1, max_len)
                packs[index].append(Slice(sample_id, 0, length))
                samples.append(Sample(sample_id, length))
            sample_id += 1
    return [MicroPack(p) for p in packs], samples, sample_id


def random_plan(seed: int, dp: int, pp: int, micropacks_per_replica: int, max_unit: int = 3,
                merge: bool = False, max_len: int = 4096, tp: int = 1) -> Plan:
    rng = random.Random(seed)
    replicas, samples, next_id = [], [], 0
    if merge and dp > 1:
        packs, merged_samples, next_id = random_micropacks(rng, next_id, 2, max_len)
        replicas.append(build_replica(packs, [0, 1], pp, rng, max_unit))
        samples += merged_samples
    for rank in range(dp):
        count = max(1, micropacks_per_replica + rng.randint(-2, 2))
        packs, own, next_id = random_micropacks(rng, next_id, count, max_len)
        replicas.append(build_replica(packs, [rank], pp, rng, max_unit))
        samples += own
    context = max(s.length for s in samples)
    return Plan(replicas, samples, ParallelConfig(dp=dp, pp=pp, tp=tp), context, "test")


def equal_units_plan(m: int, pp: int, dp: int = 1) -> Plan:
    """m single-MicroPack units of one short document each, standard 1F1B orders, per rank."""
    replicas, samples = [], []
    for rank in range(dp):
        ids = range(rank * m, (rank + 1) * m)
        packs = [MicroPack([Slice(i, 0, 8)]) for i in ids]
        replicas.append(build_replica(packs, [rank], pp))
        samples += [Sample(i, 8) for i in ids]
    return Plan(replicas, samples, ParallelConfig(dp=dp, pp=pp), 8, "test").validate()


TINY = CostModel.analytic("tiny", "cpu")
LLAMA = CostModel.analytic("llama-7b", "h100-sxm")


# ---- closed forms ------------------------------------------------------------------------------
@pytest.mark.parametrize("m,pp", [(8, 4), (4, 4), (5, 2), (3, 1)])
def test_1f1b_time_and_in_flight_peak(m, pp):
    plan = equal_units_plan(m, pp)
    report = simulate(plan, FixedCost(forward=1.0, backward=2.0))
    assert report.iteration_time_s == pytest.approx((m + pp - 1) * 3.0)
    # One activation byte per MicroPack over a static 100: stage s holds at most pp - s.
    assert report.peak_memory_bytes == [100.0 + min(m, pp - s) for s in range(pp)]
    assert report.lower_bound_s <= report.iteration_time_s + 1e-9
    assert report.stage_busy_s == pytest.approx([3.0 * m] * pp)
    assert report.bubble_ratio == pytest.approx(1 - m / (m + pp - 1))


def test_1f1b_stage_orders_are_the_textbook_ones():
    orders = equal_units_plan(4, 3).replicas[0].stage_orders
    assert orders[0] == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert orders[2] == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]


def test_p2p_adds_latency_on_the_critical_path():
    plan = equal_units_plan(1, 3)
    report = simulate(plan, FixedCost(forward=1.0, backward=2.0, p2p=0.5))
    # F on 3 stages, B on 3 stages, 4 transfers.
    assert report.iteration_time_s == pytest.approx(3 * 3.0 + 4 * 0.5)
    assert sum(1 for t in report.tasks if t.kind == "P2P") == 4
    assert report.critical_path_s == pytest.approx(report.iteration_time_s)


def test_sends_on_one_link_queue_in_issue_order():
    plan = equal_units_plan(2, 2)
    report = simulate(plan, FixedCost(forward=0.1, backward=0.1, p2p=1.0))
    sends = [(t.unit, t.start, t.end) for t in report.tasks if t.kind == "P2P" and t.detail == "F 0->1"]
    assert sends == [(0, pytest.approx(0.1), pytest.approx(1.1)), (1, pytest.approx(1.1), pytest.approx(2.1))]
    second = next(t for t in report.tasks if (t.stage, t.kind, t.unit) == (1, "F", 1))
    assert second.start == pytest.approx(2.1)


def test_package_level_simulate_is_the_simulator():
    import megatron_slimpack

    plan = equal_units_plan(3, 2)
    assert megatron_slimpack.simulate(plan, FixedCost()).to_dict() == simulate(plan, FixedCost()).to_dict()


def test_dp_imbalance_of_two_replicas_with_different_work():
    packs = [[MicroPack([Slice(0, 0, 4)]), MicroPack([Slice(1, 0, 4)])], [MicroPack([Slice(2, 0, 4)])]]
    replicas = [build_replica(p, [rank], 1) for rank, p in enumerate(packs)]
    plan = Plan(replicas, [Sample(i, 4) for i in range(3)], ParallelConfig(dp=2), 4, "test").validate()
    report = simulate(plan, FixedCost(forward=1.0, backward=2.0))
    assert report.device_busy_s == [[6.0], [3.0]]
    assert report.dp_imbalance == pytest.approx(6.0 / 4.5)
    assert report.iteration_time_s == pytest.approx(6.0)
    assert report.pp_imbalance == pytest.approx(1.0)


def test_dp_reduction_overlaps_the_last_backward_bucket_by_bucket():
    plan = equal_units_plan(1, 1, dp=2)
    cost = FixedCost(forward=1.0, backward=2.0, dp_reduce=1.0)
    # The last backward runs [1, 3]; 4 buckets ready at 1.5, 2, 2.5, 3, each reduced in 0.25 s.
    report = simulate(plan, cost, dp_buckets=4)
    assert report.iteration_time_s == pytest.approx(3.25)
    assert report.dp_reduce_exposed_s == pytest.approx([0.25])
    assert report.dp_reduce_overlap_s == pytest.approx([0.75])
    dp_bars = [t for t in report.tasks if t.kind == "DP"]
    assert [(t.rank, t.start, t.end) for t in dp_bars] == [(0, 1.5, 3.25), (1, 1.5, 3.25)]
    # One bucket: nothing overlaps.
    assert simulate(plan, cost, dp_buckets=1).iteration_time_s == pytest.approx(4.0)


def test_dp_reduction_overlaps_only_the_last_micropack_of_a_wide_unit():
    """A last backward unit of two MicroPacks: the runtime runs the first inside no_sync, so only
    the second's backward ([3, 5]) makes gradients ready for the overlapped reduction."""
    packs = {rank: [MicroPack([Slice(2 * rank + i, 0, 8)]) for i in range(2)] for rank in range(2)}
    replicas = [ReplicaPlan(packs[rank], [[0], [1]], [[0, 1]], [[("F", 0), ("F", 1), ("B", 0)]], [rank])
                for rank in range(2)]
    plan = Plan(replicas, [Sample(i, 8) for i in range(4)], ParallelConfig(dp=2), 8, "test").validate()
    # Forwards [0, 2], the unit's backward [2, 6]: its last MicroPack [4, 6]; 4 buckets ready at
    # 4.5, 5, 5.5, 6, each reduced in 0.25 s.
    report = simulate(plan, FixedCost(forward=1.0, backward=2.0, dp_reduce=1.0), dp_buckets=4)
    assert report.iteration_time_s == pytest.approx(6.25)
    assert report.dp_reduce_exposed_s == pytest.approx([0.25])
    assert [(t.start, t.end) for t in report.tasks if t.kind == "DP"] == [(4.5, 6.25)] * 2
    # A longer reduction (0.75 s a bucket) queues behind the later-ready buckets: 7.5 s, where
    # buckets spread over the whole unit ([2, 6]) would have ended at 6.75.
    slow = simulate(plan, FixedCost(forward=1.0, backward=2.0, dp_reduce=3.0), dp_buckets=4)
    assert slow.iteration_time_s == pytest.approx(7.5)


def test_merge_group_occupies_both_ranks_before_their_own_work():
    merged = build_replica([MicroPack([Slice(0, 0, 8)]), MicroPack([Slice(0, 8, 16)])], [0, 1], 2)
    own = [build_replica([MicroPack([Slice(1 + r, 0, 4)])], [r], 2) for r in range(2)]
    samples = [Sample(0, 16), Sample(1, 4), Sample(2, 4)]
    plan = Plan([own[1], merged, own[0]], samples, ParallelConfig(dp=2, pp=2), 16, "test").validate()
    report = simulate(plan, FixedCost(forward=1.0, backward=2.0))
    merged_bars = [t for t in report.tasks if t.replica == 1 and t.kind in "FB"]
    assert {t.rank for t in merged_bars} == {0, 1}
    by_task = {}
    for t in merged_bars:
        by_task.setdefault((t.stage, t.kind, t.unit), set()).add((t.start, t.end))
    assert all(len(spans) == 1 for spans in by_task.values())  # same interval on both ranks
    # cp doubles in the group, so each merged task takes half the time.
    assert all(t.end - t.start == pytest.approx(0.5 if t.kind == "F" else 1.0) for t in merged_bars)
    merged_end = max(t.end for t in merged_bars if t.stage == 0)
    own_start = min(t.start for t in report.tasks if t.replica != 1 and t.kind == "F" and t.stage == 0)
    assert own_start >= merged_end


# ---- deadlocks ---------------------------------------------------------------------------------
def test_deadlocking_orders_are_named():
    plan = equal_units_plan(2, 2)
    plan.replicas[0].stage_orders = [
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)],  # waits for B0 before sending F1 ...
        [("F", 0), ("F", 1), ("B", 0), ("B", 1)],  # ... which needs F1 before running B0
    ]
    plan.validate()  # each order is fine on its own
    with pytest.raises(SimulationError) as error:
        simulate(plan, FixedCost())
    message = str(error.value)
    assert message.startswith("deadlock: ")
    assert "stage 0 B0 waits for stage 1 B0, which runs after stage 1 F1 in program order" in message
    assert "stage 1 F1 waits for stage 0 F1, which runs after stage 0 B0 in program order" in message
    assert isinstance(error.value, ValueError) and len(error.value.cycle) == 2


def test_backward_before_its_forward_is_a_deadlock():
    plan = equal_units_plan(1, 1)
    plan.replicas[0].stage_orders = [[("B", 0), ("F", 0)]]
    with pytest.raises(SimulationError, match="stage 0 B0 waits for stage 0 F0, which runs after stage 0 B0"):
        simulate(plan, FixedCost())


def test_unknown_or_missing_tasks_are_rejected():
    plan = equal_units_plan(2, 1)
    plan.replicas[0].stage_orders = [[("F", 0), ("F", 1), ("B", 0)]]
    with pytest.raises(SimulationError, match="exactly once"):
        simulate(plan, FixedCost())
    plan.replicas[0].stage_orders = [[("F", 0), ("F", 5), ("B", 0), ("B", 1)]]
    with pytest.raises(SimulationError, match="unknown task F5"):
        simulate(plan, FixedCost())


# ---- invariants on random plans ----------------------------------------------------------------
def test_json_round_trip_simulates_identically():
    plan = random_plan(3, dp=2, pp=2, micropacks_per_replica=6, merge=True).validate()
    again = Plan.from_json(plan.to_json())
    assert simulate(plan, LLAMA).to_dict() == simulate(again, LLAMA).to_dict()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), dp=st.integers(1, 3), pp=st.integers(1, 3), count=st.integers(1, 6),
       max_unit=st.integers(1, 3), merge=st.booleans())
def test_lower_bound_never_exceeds_simulated_time(seed, dp, pp, count, max_unit, merge):
    plan = random_plan(seed, dp, pp, count, max_unit, merge).validate()
    report = simulate(plan, TINY, detail=False)
    assert 0 < report.lower_bound_s <= report.iteration_time_s * (1 + 1e-9)
    # the busiest device's compute, without scheduling: what the report's device times say
    assert busiest_device_s(plan, TINY) == pytest.approx(max(map(max, report.device_busy_s)), rel=1e-12)
    assert 0 <= report.bubble_ratio < 1 and report.dp_imbalance >= 1 and report.pp_imbalance >= 1
    assert score(plan, TINY) == report.iteration_time_s


def test_memory_returns_to_static_level_and_kv_is_counted():
    plan = random_plan(7, dp=2, pp=3, micropacks_per_replica=8, merge=True).validate()
    report = simulate(plan, LLAMA)
    static = LLAMA.static_memory_bytes(plan.parallel)
    assert len(report.memory_timeline) == 6
    for timeline in report.memory_timeline:
        assert timeline.points[-1][1] == pytest.approx(static, rel=1e-12)
        assert timeline.peak_bytes == max(b for _, b in timeline.points)
        assert [t for t, _ in timeline.points] == sorted(t for t, _ in timeline.points)
    for stage in range(3):
        assert report.peak_memory_bytes[stage] == max(m.peak_bytes for m in report.memory_timeline if m.stage == stage)
    # The same plan with KV caches counted on top holds more at its peak.
    plain = simulate(plan, FixedCost(), detail=False).peak_memory_bytes
    with_kv = simulate(plan, FixedCost(kv=10.0), detail=False).peak_memory_bytes
    assert all(k > p for k, p in zip(with_kv, plain))


def test_report_fields_are_consistent():
    plan = random_plan(11, dp=2, pp=2, micropacks_per_replica=5).validate()
    report = simulate(plan, LLAMA)
    assert report.tokens_per_s == pytest.approx(plan.num_tokens / report.iteration_time_s)
    flops = sum(LLAMA.model_flops(s.length, s.attention_pairs) for r in plan.replicas for m in r.micropacks
                for s in m.slices)
    assert report.mfu == pytest.approx(flops / (report.iteration_time_s * 2 * 2 * LLAMA.hardware.peak_flops))
    assert 0 < report.mfu < LLAMA.hardware.max_efficiency
    for busy, idle in zip(report.stage_busy_s, report.stage_idle_s):
        assert busy + idle == pytest.approx(report.iteration_time_s)
    assert report.dp_reduce_time_s > 0 and all(o >= 0 for o in report.dp_reduce_overlap_s)
    data = json.loads(json.dumps(report.to_dict()))
    assert SimulationReport.from_dict(data).to_dict() == data


# ---- outputs -----------------------------------------------------------------------------------
def test_gantt_png_and_chrome_trace_are_written(tmp_path):
    plan = random_plan(5, dp=2, pp=2, micropacks_per_replica=4, merge=True).validate()
    report = simulate(plan, LLAMA)
    png = write_gantt(report, tmp_path / "gantt.png", title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(png).shape[0] > 100
    trace = json.loads(write_chrome_trace(report, tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(report.tasks)
    assert {e["pid"] for e in spans} == {0, 1}
    forward = next(e for e in spans if e["cat"] == "F")
    assert forward["tid"] in (0, 1) and forward["name"].startswith("F")
    assert trace["otherData"]["iteration_s"] == report.iteration_time_s


def test_chrome_trace_accepts_measured_records():
    measured = [{"rank": 0, "stage": 1, "kind": "F", "unit": 3, "start": 0.5, "end": 0.75},
                {"rank": 0, "stage": 1, "kind": "P2P", "start": 0.75, "end": 0.8, "name": "send F3"}]
    events = [e for e in chrome_trace(measured)["traceEvents"] if e["ph"] == "X"]
    assert events[0] == {"name": "F3", "cat": "F", "ph": "X", "ts": 500000.0, "dur": 250000.0, "pid": 0, "tid": 1,
                         "args": {"unit": 3}}
    assert events[1]["name"] == "send F3" and events[1]["tid"] != 1


def test_tables():
    plan = random_plan(2, dp=2, pp=2, micropacks_per_replica=4).validate()
    fast, slow = simulate(plan, LLAMA), simulate(plan, CostModel.analytic("llama-7b", "a100"))
    text = markdown_table({"h100": fast, "a100": slow})
    assert text.count("\n") == 4 and "| h100 |" in text
    assert csv_table([("h100", fast)]).splitlines()[0].startswith("name,layout,iteration_s")
    rows = [ComparisonRow("slimpack", "tp1 pp2", fast, 0.12, slow), ("megatron", "tp1 pp2", slow, None, slow)]
    table = comparison_table(rows)
    assert f"{slow.iteration_time_s / fast.iteration_time_s:.2f}x" in table and "1.00x" in table
    csv_text = comparison_table(rows, fmt="csv")
    assert csv_text.splitlines()[0].endswith("planning_s,speedup")
    with pytest.raises(ValueError):
        comparison_table(rows, fmt="html")


# ---- the compiled list scheduler ---------------------------------------------------------------
def python_list_schedule(graph):
    """`dag._run`'s loop in plain Python: the reference `compiled.list_schedule` must match."""
    n, vstages = graph.num_tasks, graph.vstages
    missing = [(1 + (s < vstages - 1)) if b else int(s > 0) for s, b in zip(graph.stage_of, graph.is_backward)]
    program_next = [[] for _ in range(n)]
    for program in graph.programs:
        for before, after in zip(program, program[1:]):
            program_next[before].append(after)
            missing[after] += 1
    releases = []  # per task: the same-stage backward units a forward unit releases, as id offsets
    for rc in graph.replicas:
        own = [[] for _ in range(rc.num_forward)]
        for unit, needed in enumerate(rc.needs_forward):
            own[needed].append(rc.num_forward - needed + unit)
        releases += (own + [[]] * rc.num_backward) * graph.vstages
    ready_at, chain_ready = [0.0] * n, [0.0] * n
    start, end, chain_end = [0.0] * n, [0.0] * n, [0.0] * n
    link_free = [0.0] * (2 * graph.dp * graph.pp)
    transfers = []
    releasable = [t for t in range(n) if not missing[t]]
    while releasable:
        task = releasable.pop()
        start[task] = ready_at[task]
        finished = end[task] = ready_at[task] + graph.duration[task]
        chain = chain_end[task] = chain_ready[task] + graph.duration[task]
        arrivals = [(after, finished, None) for after in program_next[task]]
        arrivals += [(task + offset, finished, chain) for offset in releases[task]]
        offset = graph.send_offset[task]
        if offset:
            seconds, link = graph.send_seconds[task], offset < 0
            stage = graph.stage_of[task] % graph.pp
            devices = [rank * graph.pp + stage for rank in graph.replicas[graph.replica_of[task]].ranks]
            sent = max([finished] + [link_free[2 * device + link] for device in devices])
            for device in devices:
                link_free[2 * device + link] = sent + seconds
            if seconds > 0:
                transfers.append((task, sent, sent + seconds))
            arrivals.append((task + offset, sent + seconds, chain + seconds))
        for after, arrived, chain_arrived in arrivals:
            ready_at[after] = max(ready_at[after], arrived)
            if chain_arrived is not None:
                chain_ready[after] = max(chain_ready[after], chain_arrived)
            missing[after] -= 1
            if not missing[after]:
                releasable.append(after)
    return start, end, chain_end, transfers


def interleaved_plan() -> tuple[Plan, CostModel]:
    """A SlimPack plan over pp=2 x vpp=2 with two replicas (sliced documents, p2p each way)."""
    cost = CostModel.analytic("tiny", "cpu")
    rng = random.Random(5)
    lengths = [rng.randint(20, 900) for _ in range(60)]
    config = SlimPackConfig(context_length=1024, solver_deterministic_limit=0.2)
    return plan_batch(lengths, parallel=ParallelConfig(dp=2, pp=2, vpp=2), cost=cost, config=config), cost


@pytest.mark.parametrize("case", ["merge", "pipeline", "interleaved"])
def test_compiled_list_schedule_is_the_python_loop(case):
    """Same start, end and chain end of every task and the same transfers, to the last bit, on
    plans with a DP-Merge group (a task on two devices), a deep pipeline, virtual stages."""
    if case == "interleaved":
        plan, cost = interleaved_plan()
        assert plan.parallel.vpp == 2
    else:
        plan = (random_plan(11, dp=3, pp=2, micropacks_per_replica=9, merge=True) if case == "merge"
                else random_plan(4, dp=2, pp=4, micropacks_per_replica=40, max_unit=2))
        cost = LLAMA
    graph = dag._Graph(plan.validate(), cost.with_overlaps(overlaps_of(plan.strategy)))
    schedule = dag._run(graph)
    start, end, chain_end, transfers = python_list_schedule(graph)
    assert transfers
    assert (schedule.start.tolist(), schedule.end.tolist(), schedule.chain_end.tolist()) == (start, end, chain_end)
    assert list(zip(schedule.sent_by.tolist(), schedule.sent_at.tolist(), schedule.arrived_at.tolist())) == transfers


@given(st.lists(st.lists(st.integers(0, 30), max_size=12), min_size=1, max_size=6))
def test_program_successors_are_the_stable_sort_of_the_programs(programs):
    """The counting sort lists each task's program successors as a stable sort by task does, also
    where a task is on several devices' programs (a DP-Merge group's)."""
    before = np.array([t for p in programs for t in p[:-1]], dtype=np.int64)
    after = np.array([t for p in programs for t in p[1:]], dtype=np.int64)
    starts, successors = program_successors(before, after, 31)
    assert starts.tolist() == dag._csr_starts(np.bincount(before, minlength=31)).tolist()
    assert successors.tolist() == after[np.argsort(before, kind="stable")].tolist()


# ---- speed -------------------------------------------------------------------------------------
def test_big_plan_simulates():
    """4 replicas x 4 stages x ~200 forward and ~200 backward units (the planner's loop). Its speed
    is measured in benchmarks/planner.py, not asserted here."""
    plan = random_plan(1, dp=4, pp=4, micropacks_per_replica=300, max_unit=2, max_len=8192, tp=8)
    units = sum(len(r.forward_units) + len(r.backward_units) for r in plan.replicas)
    assert units > 4 * 300
    report = simulate(plan, LLAMA, detail=False)
    assert 0 < report.lower_bound_s <= report.iteration_time_s * (1 + 1e-9)
