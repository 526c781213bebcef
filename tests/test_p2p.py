"""Pipeline point-to-point programs (runtime/pipeline/p2p.py): every stage posts its transfers in one
global order, so no pipeline deadlocks even where every send blocks until its receive is posted
(NCCL). Multi-process runs of the programs are in test_schedule.py and test_real_megatron.py."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_slimpack.runtime import p2p


def one_f_one_b(pp: int, units: int) -> list[list[tuple]]:
    orders = []
    for stage in range(pp):
        warmup = min(pp - stage, units)
        order, forward, backward = [("F", u) for u in range(warmup)], warmup, 0
        while backward < units:
            order.append(("B", backward))
            backward += 1
            if forward < units:
                order.append(("F", forward))
                forward += 1
        orders.append(order)
    return orders


def naive_program(tasks, stage, pp):
    """Each receive alone before its task, each send alone after it (the executor before p2p.py)."""
    calls = []
    for position, task in enumerate(tasks):
        if (receive := p2p.incoming(task, stage, pp)) is not None:
            calls.append(p2p.P2PCall(position, (), (receive,)))
        if (send := p2p.outgoing(task, stage, pp)) is not None:
            calls.append(p2p.P2PCall(position + 1, (send,), ()))
    return calls


@pytest.mark.parametrize("pp, units", [(2, 1), (2, 5), (3, 7), (4, 12), (8, 8), (8, 20)])
def test_1f1b_is_deadlock_free_and_lone_sends_are_not(pp, units):
    orders = one_f_one_b(pp, units)
    p2p.check_deadlock_free(orders)
    if units > 1:  # steady state: neighbours send to each other at once
        waits = p2p.find_deadlock([naive_program(order, stage, pp) for stage, order in enumerate(orders)])
        assert "waits in send" in waits


def test_every_transfer_is_posted_once_at_both_ends_in_one_order():
    orders = one_f_one_b(4, 9)
    times = p2p.transfer_times(orders)
    for stage in range(4):
        program = p2p.stage_program(orders, stage, times)
        posted = [t for call in program for t in sorted((*call.sends, *call.receives), key=times.get)]
        assert len(posted) == len(set(posted))
        assert [times[t] for t in posted] == sorted(times[t] for t in posted)  # within a call: one group
        for call in program:  # a receive is posted before its consumer, a send after its producer
            assert all(orders[stage].index((t.kind, t.unit)) >= call.before for t in call.receives)
            assert all(orders[stage].index((t.kind, t.unit)) < call.before for t in call.sends)
    assert sum(len(call.sends) for s in range(4) for call in p2p.stage_program(orders, s, times)) == len(times)


def test_orders_that_cannot_run_at_all_are_refused():
    orders = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]  # stage 0 waits for a gradient of its own forward
    with pytest.raises(p2p.P2PDeadlock, match="stage 0 waits at B0, stage 1 waits at F0"):
        p2p.check_deadlock_free(orders)


def chain_orders(chain_lengths, pp, lead):
    from megatron_slimpack.planner.orders import stage_orders

    forward_units, backward_units, count = [], [], 0
    for length in chain_lengths:
        forward_units += [[count + k] for k in range(length)]
        backward_units += [[count + k] for k in reversed(range(length))]
        count += length
    return stage_orders(forward_units, backward_units, [min(pp - s - 1, count) for s in range(pp)], chain_lead=lead)


def test_a_chain_that_pairing_sends_with_the_next_receive_would_deadlock():
    """Sliced documents: stage 0 runs every forward first. Sending each task's tensor with the next
    task's receive (Megatron's pairing) deadlocks here; the global order does not."""
    orders = chain_orders([3, 1], 2, None)
    p2p.check_deadlock_free(orders)


@settings(max_examples=60, deadline=None)
@given(chain_lengths=st.lists(st.integers(1, 6), min_size=1, max_size=8), pp=st.integers(1, 6),
       lead=st.sampled_from([None, 0, 1, 2, 5]))
def test_planner_chain_orders_are_deadlock_free(chain_lengths, pp, lead):
    p2p.check_deadlock_free(chain_orders(chain_lengths, pp, lead))


@pytest.mark.parametrize("name", ["llama-7b-256K-256gpus-wikipedia", "llama-70b-128K-github-tp4pp8cp4dp2",
                                  "llama-150b-64K-wikipedia-tp8pp8cp2dp2", "slimpipe-llama-7b-64K-wikipedia"])
def test_paper_layout_plans_are_deadlock_free(name):
    """Every replica plan the planner emits on the golden paper layouts (test_golden_plans.py)."""
    import megatron_slimpack as ms
    from megatron_slimpack.workload import GlobalBatchSampler, load_lengths
    from test_golden_plans import case_list

    case = case_list()[name]
    batch = GlobalBatchSampler(load_lengths(case["workload"]), case["context"], case["sequences"], seed=0,
                               long_documents="split").next_batch()
    config = ms.SlimPackConfig(strategy=case.get("strategy", "slimpack"), context_length=case["context"],
                               solver_time_limit_s=120.0, solver_deterministic_limit=0.5)
    plan = ms.plan(batch.lengths, parallel=ms.ParallelConfig(**case["parallel"]),
                   cost=ms.CostModel.analytic(case["model"], "h100-sxm"), config=config)
    assert plan.parallel.pp > 1
    for replica in plan.replicas:
        p2p.check_deadlock_free(replica.stage_orders)
