"""DP-Merge at run time (runtime/pipeline/merge.py, runtime/attention/context_parallel.py): the replicas of a merge
group run the outlier's MicroPacks with context parallelism; loss and every parameter gradient
equal the single-process whole-document run."""
import random

import pytest
import torch

from conftest import init_megatron, random_plan, random_slicing, run_multiprocess, save_whole_document_reference

VOCAB = 64
HIDDEN = 32
LAYERS = 2


# ---- the token split (no processes) ----------------------------------------------------------
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("length", [1, 3, 7, 8, 9, 16, 37, 64])
def test_split_covers_and_balances(k, length):
    from megatron_slimpack.runtime.attention.context_parallel import split_slice

    shares = split_slice(length, k)
    flat = sorted(j for share in shares for j in share)
    assert flat == list(range(length))
    assert all(share == sorted(share) for share in shares)
    counts = [len(s) for s in shares]
    assert max(counts) - min(counts) <= 1
    if length >= 2 * k:
        # causal cost (keys seen) per rank, with a prefix of 100 tokens: zigzag keeps it balanced
        # to within about one token's cost
        costs = [sum(100 + j + 1 for j in share) for share in shares]
        assert max(costs) - min(costs) <= 100 + length + k
        if length % (2 * k) == 0:
            assert max(costs) == min(costs)


def test_every_member_gets_tokens():
    from megatron_slimpack.plan import MicroPack, Slice
    from megatron_slimpack.runtime.attention.context_parallel import build_layout

    pack = MicroPack([Slice(0, 0, 1), Slice(1, 3, 4), Slice(2, 0, 2)])  # only short slices, 4 tokens
    counts = [len(build_layout(pack, None, 4, r)[1]) for r in range(4)]
    assert counts == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot be split"):
        build_layout(MicroPack([Slice(0, 0, 3)]), None, 4, 0)


@pytest.mark.parametrize("k", [2, 4])
def test_position_runs_through_a_varlen_kernel_match_the_masked_reference(k):
    """Merged attention as every backend runs it (runs of consecutive positions, keys gathered per
    run, one bottom-right causal varlen call; here with the torch kernel) gives the masked
    reference's outputs and gradients, for every member, with prefixes and short slices dealt
    round-robin."""
    from megatron_slimpack.plan import MicroPack, Slice
    from megatron_slimpack.runtime.attention.context_parallel import build_layout, torch_position_kernel
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention
    from megatron_slimpack.runtime.model import tiny_config

    heads, groups, dim = 4, 2, 8
    config = tiny_config(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, num_query_groups=groups)
    attention = SlicedDotProductAttention(config, layer_number=1, attn_mask_type=None, backend="torch").eval()
    pack = MicroPack([Slice(0, 9, 30), Slice(1, 0, 3), Slice(2, 4, 5), Slice(3, 0, 17)])
    gen = torch.Generator().manual_seed(k)
    kv_lengths = [piece.end for piece in pack.slices]  # prefix + slice, key j at position j
    cu_kv = torch.tensor([0] + kv_lengths).cumsum(0).to(torch.int32)
    keys = torch.randn(int(cu_kv[-1]), groups, dim, generator=gen)
    values = torch.randn(int(cu_kv[-1]), groups, dim, generator=gen)
    for rank in range(k):
        layout, _, per_slice = build_layout(pack, None, k, rank)
        cu_q = torch.tensor([0] + per_slice).cumsum(0).to(torch.int32)
        q = torch.randn(int(cu_q[-1]), heads, dim, generator=gen)
        weight = torch.randn(int(cu_q[-1]), heads * dim, generator=gen)
        results = []
        def reference(q, k, v, cu_q, cu_kv, positions):
            out = torch_position_kernel(q, k, v, cu_q, cu_kv, positions, attention.softmax_scale, 0.0)
            return out.reshape(out.shape[0], -1)

        for method in (reference, attention._attend_positions):
            leaves = [t.clone().requires_grad_() for t in (q, keys, values)]
            out = method(*leaves, cu_q, cu_kv, layout.local_positions)
            (out * weight).sum().backward()
            results.append([out] + [leaf.grad for leaf in leaves])
        for reference, runs in zip(*results):
            torch.testing.assert_close(runs, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [2, 4])
def test_member_batches_carry_their_boundaries_and_runs_on_the_host(k):
    """A member's batch holds, as host ints from the plan, the same boundaries as its device
    tensors, and position runs equal to those built by reading the device tensors back."""
    from megatron_slimpack.plan import MicroPack, Slice
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore
    from megatron_slimpack.runtime.attention.context_parallel import build_cp_batch
    from megatron_slimpack.runtime.attention.seq_params import PositionRuns

    pack = MicroPack([Slice(0, 9, 30), Slice(1, 0, 3), Slice(2, 4, 5), Slice(3, 0, 17)])
    source = InMemoryTokenSource({0: torch.arange(40), 1: torch.arange(3), 2: torch.arange(9), 3: torch.arange(17)})
    for rank in range(k):
        params = build_cp_batch(pack, source, KVStore(), group=None, group_size=k, group_rank=rank,
                                pad_to=4).packed_seq_params
        assert params.host_cu_seqlens_q == params.cu_seqlens_q.tolist()
        assert params.host_cu_seqlens_attn_kv == params.cu_seqlens_attn_kv.tolist()
        assert params.cp.full_bounds == [0, 21, 24, 25, 42]
        assert params.cp.host_positions == params.cp.local_positions.tolist()
        read_back = PositionRuns.of(params.slice_cu_seqlens, params.cu_seqlens_attn_kv, params.cp.local_positions)
        for name, value in vars(read_back).items():
            ours = getattr(params.cp.runs, name)
            assert torch.equal(ours, value) if isinstance(value, torch.Tensor) else ours == value, name
        runs = params.cp.runs
        assert (runs.bounds_q, runs.bounds_kv) == (runs.cu_q.tolist(), runs.cu_kv.tolist())


def test_merge_layouts():
    from megatron_slimpack.runtime.pipeline.merge import merge_layouts

    assert merge_layouts(1) == []
    assert merge_layouts(4) == [(0, 1), (2, 3), (0, 1, 2, 3)]
    assert merge_layouts(6) == [(0, 1), (2, 3), (4, 5)]


# ---- CP attention alone: 2 ranks vs single-process sliced attention -------------------------
def _attention_worker(rank, world_size, port):
    import torch.distributed as dist

    from megatron_slimpack.plan import MicroPack, Slice
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, build_batch
    from megatron_slimpack.runtime.attention.context_parallel import build_cp_batch
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention
    from megatron_slimpack.runtime.model import tiny_config

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    heads, groups, dim = 4, 2, 8
    config = tiny_config(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads, num_query_groups=groups)
    attention = SlicedDotProductAttention(config, layer_number=1, attn_mask_type=None, backend="torch")
    lengths = {0: 23, 1: 6, 2: 3}
    source = InMemoryTokenSource({sid: torch.arange(n) for sid, n in lengths.items()})
    # doc 0 in three slices (the later ones read a KV prefix), docs 1 and 2 whole, one short
    packs = [MicroPack([Slice(0, 0, 9), Slice(1, 0, 6)]), MicroPack([Slice(2, 0, 3), Slice(0, 9, 20)]),
             MicroPack([Slice(0, 20, 23)])]
    gen = torch.Generator().manual_seed(11)
    data = {}
    for index, pack in enumerate(packs):
        n = pack.num_tokens
        data[index] = dict(q=torch.randn(n, heads, dim, generator=gen), k=torch.randn(n, groups, dim, generator=gen),
                           v=torch.randn(n, groups, dim, generator=gen), w=torch.randn(n, heads * dim, generator=gen))

    def run(batches, pick):
        leaves, outs = {}, {}
        for index in range(len(packs)):
            leaves[index] = {name: pick(index, data[index][name]).clone().requires_grad_() for name in "qkv"}
            outs[index] = attention(leaves[index]["q"], leaves[index]["k"], leaves[index]["v"],
                                    packed_seq_params=batches[index].packed_seq_params)
        for index in reversed(range(len(packs))):  # one chain: backward in reverse
            (outs[index] * pick(index, data[index]["w"])).sum().backward()
        return outs, leaves

    store = KVStore()
    ref_out, ref_leaves = run([build_batch(p, source, store) for p in packs], lambda i, t: t)
    assert len(store) == 0
    store = KVStore()
    cp_batches = [build_cp_batch(p, source, store, group=group, group_size=world_size, group_rank=rank) for p in packs]
    local = {}
    for index, (pack, batch) in enumerate(zip(packs, cp_batches)):
        # natural pack index of each local token, from (sample, position)
        offset, where = 0, {}
        for piece in pack.slices:
            for j in range(piece.length):
                where[(piece.sample_id, piece.start + j)] = offset + j
            offset += piece.length
        sids = [sid for sid, n in zip(batch.packed_seq_params.sample_ids,
                                      (batch.packed_seq_params.cu_seqlens_q.diff()).tolist()) for _ in range(n)]
        local[index] = torch.tensor([where[(s, int(p))] for s, p in zip(sids, batch.position_ids[0])])
    cp_out, cp_leaves = run(cp_batches, lambda i, t: t[local[i]])
    assert len(store) == 0
    for index in range(len(packs)):
        idx = local[index]
        torch.testing.assert_close(cp_out[index], ref_out[index][idx], rtol=1e-5, atol=1e-6)
        for name in "qkv":
            torch.testing.assert_close(cp_leaves[index][name].grad, ref_leaves[index][name].grad[idx],
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_cp_attention_matches_single_process():
    run_multiprocess(_attention_worker, 2, timeout_s=120)


# ---- end to end: merge groups + own replicas == whole documents -----------------------------
def _config(**overrides):
    from megatron_slimpack.runtime.model import tiny_config

    return tiny_config(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, **overrides)


def _merge_replica(packs, ranks):
    from megatron_slimpack.plan import MicroPack, ReplicaPlan

    replica = ReplicaPlan([MicroPack(p) for p in packs], [], [], [], dp_ranks=list(ranks))
    count = len(packs)
    replica.forward_units = [list(range(count // 2)), list(range(count // 2, count))] if count > 1 else [[0]]
    sequence = replica.backward_sequence()
    replica.backward_units = [sequence[:1], sequence[1:]] if count > 1 else [sequence]
    replica.stage_orders = [[("F", u) for u in range(len(replica.forward_units))]
                            + [("B", v) for v in range(len(replica.backward_units))]]
    return replica


def make_case(dp: int, seed: int = 0, pp: int = 1):
    """Merge groups with long documents (sliced, several per MicroPack) + own short documents;
    with pp > 1 every replica plan (merge groups too) gets generalised 1F1B stage orders."""
    from megatron_slimpack.plan import Plan, Sample, Slice
    from megatron_slimpack.specs import ParallelConfig

    rng = random.Random(seed)
    merges, lengths = [], {}
    # group (0, 1): a long document in three slices sharing MicroPacks with a second one
    lengths.update({100: 45, 101: 13})
    merges.append(_merge_replica([[Slice(100, 0, 17), Slice(101, 0, 6)], [Slice(101, 6, 13), Slice(100, 17, 33)],
                                  [Slice(100, 33, 45)]], (0, 1)))
    if dp == 4:  # and a group of all four, with a short slice dealt round-robin
        lengths.update({200: 40, 201: 3})
        merges.insert(0, _merge_replica([[Slice(200, 0, 22)], [Slice(201, 0, 3), Slice(200, 22, 40)]],
                                        (0, 1, 2, 3)))
    own = []
    for rank in range(dp):
        ids = range(rank * 10, rank * 10 + 3)
        mine = {sid: rng.randint(2, 12) for sid in ids}
        slicings = {sid: random_slicing(rng, n, 3) for sid, n in mine.items()}
        replica = random_plan(rng, slicings, num_micropacks=3).replicas[0]
        replica.dp_ranks = [rank]
        own.append(replica)
        lengths.update(mine)
    if pp > 1:
        from test_schedule import _stage_orders

        for replica in merges + own:
            replica.stage_orders = _stage_orders(rng, replica, pp)
    samples = [Sample(sid, n) for sid, n in sorted(lengths.items())]
    plan = Plan(merges + own, samples, ParallelConfig(dp=dp, pp=pp), 64, "test").validate()
    documents = {sid: torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed * 1000 + sid))
                 for sid, n in lengths.items()}
    return plan, documents


def make_shared_case(dp: int, seed: int = 0, pp: int = 1):
    """Every MicroPack shared by one DP-Merge group of all dp ranks (the planner's base merge,
    `shared_by_groups`): a replica plan made for one replica with dp-fold context parallelism;
    every rank's own replica plan is empty."""
    from megatron_slimpack.plan import Plan
    from megatron_slimpack.planner.strategies import shared_by_groups
    from megatron_slimpack.specs import ParallelConfig

    rng = random.Random(seed)
    while True:  # every MicroPack needs a token per member
        lengths = {sid: rng.randint(6, 20) for sid in range(5)}
        view = random_plan(rng, {sid: random_slicing(rng, n, 3) for sid, n in lengths.items()}, num_micropacks=4)
        if min(m.num_tokens for m in view.replicas[0].micropacks) >= dp:
            break
    if pp > 1:
        from test_schedule import _stage_orders

        view.replicas[0].stage_orders = _stage_orders(rng, view.replicas[0], pp)
    view = Plan(view.replicas, view.samples, ParallelConfig(dp=1, pp=pp, cp=dp), 64, "test").validate()
    plan = shared_by_groups(view, ParallelConfig(dp=dp, pp=pp), dp).validate()
    documents = {sid: torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed * 1000 + sid))
                 for sid, n in lengths.items()}
    return plan, documents


def _merge_worker(rank, world_size, port, path, seed):
    """One stage (pp=1) through the schedule: a forward-only step, then a training step; merge
    groups run first, the KV store ends empty, the schedule's DP reduction gives the whole-document
    gradients."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_slimpack.runtime import (
        InMemoryTokenSource,
        KVStore,
        ScheduleGroups,
        compat,
        slimpack_forward_backward,
    )
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.pipeline.merge import merge_groups

    torch.set_num_threads(1)
    compat.apply()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    dp_rank = parallel_state.get_data_parallel_rank()
    plan, documents = make_case(world_size, seed)
    groups = ScheduleGroups.from_parallel_state(
        merge_groups=merge_groups(plan, dist.get_process_group_ranks(parallel_state.get_data_parallel_group())))
    saved = torch.load(path)
    model = build_gpt_model(_config(), vocab_size=VOCAB, max_sequence_length=64, backend="torch")
    model.load_state_dict(saved["state"])
    source, store = InMemoryTokenSource(documents), KVStore()

    def step(forward_only):
        return slimpack_forward_backward(model=model, plan=plan, token_source=source, groups=groups, kv_store=store,
                                         forward_only=forward_only)

    evaluated = step(forward_only=True)
    assert len(store) == 0 and all(p.grad is None for p in model.parameters())
    trained = step(forward_only=False)
    assert len(store) == 0
    assert [(u.kind, u.index, u.detail) for u in evaluated] == [(u.kind, u.index, u.detail) for u in trained
                                                                if u.kind == "F"]
    assert [u.loss_sum for u in evaluated] == pytest.approx([u.loss_sum for u in trained if u.kind == "F"], rel=1e-6)
    in_merge = [u.detail.startswith("merge group") for u in trained]
    assert in_merge == sorted(in_merge, reverse=True) and not in_merge[-1]  # merge groups first, own last
    assert sum(in_merge) == sum(len(r.stage_orders[0]) for r in plan.replicas_of_rank(dp_rank) if r.is_merge_group)
    assert trained.loss == pytest.approx(saved["loss"], rel=1e-6)
    assert evaluated.loss == pytest.approx(saved["loss"], rel=1e-6)
    worst = 0.0
    for name, p in model.named_parameters():
        expected = saved["grads"][name]
        worst = max(worst, ((p.grad - expected).norm() / expected.norm().clamp_min(1e-30)).item())
    assert worst <= 1e-5, f"rank {rank}: worst relative gradient error {worst:.2e}"


def _reference(plan, documents, path):
    from megatron_slimpack.runtime.pipeline.executor import global_loss_tokens

    save_whole_document_reference(_config(), VOCAB, documents, global_loss_tokens(plan), path)


def _run(tmp_path, dp, seed, timeout_s):
    plan, documents = make_case(dp, seed)
    path = tmp_path / "reference.pt"
    _reference(plan, documents, path)
    run_multiprocess(_merge_worker, dp, str(path), seed, timeout_s=timeout_s)


@pytest.mark.slow
def test_dp2_merge_group_and_own_replicas(tmp_path, megatron_cpu):
    _run(tmp_path, dp=2, seed=1, timeout_s=180)


@pytest.mark.slow
def test_dp4_merges_of_four_and_two_plus_independent_replicas(tmp_path, megatron_cpu):
    _run(tmp_path, dp=4, seed=2, timeout_s=300)


def _groups_worker(rank, world_size, port):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_slimpack.runtime.pipeline.merge import merge_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)  # two DP groups of 2
    dp_ranks = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    groups = merge_groups(2, dp_ranks)  # DP groups exchanged with all_gather_object
    assert list(groups) == [(0, 1)]
    group = groups[(0, 1)]
    assert dist.get_process_group_ranks(group) == dp_ranks
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=group)
    assert x.item() == sum(dp_ranks)


@pytest.mark.slow
def test_merge_groups_with_several_dp_groups():
    run_multiprocess(_groups_worker, 4, timeout_s=120)


def _schedule_worker(rank, world_size, port, path, seed, pp, shared=False, tp=1):
    """The DP-Merge case through the drop-in schedule: merge groups, then the own plan, then the
    data-parallel gradient reduction, all inside `slimpack_forward_backward`; with pp > 1 each
    rank holds one pipeline stage and runs the merge groups' stage orders on it."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_slimpack.runtime import InMemoryTokenSource, ScheduleGroups, slimpack_forward_backward
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.pipeline.merge import merge_groups
    from test_schedule import _global_name, _shard, _unshard

    init_megatron(rank, world_size, tp=tp, pp=pp, port=port)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    plan, documents = (make_shared_case if shared else make_case)(world_size // (pp * tp), seed, pp)
    dp_group = parallel_state.get_data_parallel_group()
    merge = merge_groups(plan, dist.get_process_group_ranks(dp_group))  # every DP group's, on every rank
    saved = torch.load(path)
    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32) if pp > 1 else {}
    if tp > 1:  # with sequence parallelism: members' shares padded to even row counts
        extra.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    model = build_gpt_model(_config(**extra), vocab_size=VOCAB, max_sequence_length=64, backend="torch",
                            pre_process=stage == 0, post_process=stage == pp - 1)
    params = dict(model.named_parameters())
    model.load_state_dict({k: _shard(k, saved["state"][_global_name(k, stage, pp)], params.get(k), tp, tp_rank)
                           for k in model.state_dict()})
    result = slimpack_forward_backward(model=model, plan=plan, token_source=InMemoryTokenSource(documents),
                                       groups=ScheduleGroups.from_parallel_state(merge_groups=merge), timeline=True)
    dp_rank = parallel_state.get_data_parallel_rank()
    merged = [r for r in plan.replicas_of_rank(dp_rank) if r.is_merge_group]
    expected_tasks = [t for r in plan.replicas_of_rank(dp_rank) for t in r.stage_orders[stage]]  # merges first
    assert [(u.kind, u.index) for u in result] == expected_tasks
    assert sum(u.detail.startswith("merge group") for u in result) == sum(
        len(r.stage_orders[stage]) for r in merged) > 0
    if stage == pp - 1:
        assert result.loss == pytest.approx(saved["loss"], rel=1e-6)
    else:
        assert result.loss is None
    if rank == 0:  # the gathered timeline names each task's replica plan, as the simulator does
        from megatron_slimpack.costmodel import CostModel
        from megatron_slimpack.simulator.dag import simulate
        from megatron_slimpack.specs import get_hardware, get_model

        measured = {(r.rank, r.stage, r.replica, r.kind, r.unit) for r in result.timeline.compute_records()}
        report = simulate(plan, CostModel(get_model("tiny"), get_hardware("cpu")), detail=True)
        assert measured == {(t.rank, t.stage, t.replica, t.kind, t.unit) for t in report.tasks if t.kind in "FB"}
    for name, p in model.named_parameters():
        expected = saved["grads"][_global_name(name, stage, pp)]
        grad = _unshard(name, p.grad, p, tp, tp_group)
        error = ((grad - expected).norm() / expected.norm().clamp_min(1e-30)).item()
        assert error <= 1e-5, f"rank {rank} (stage {stage}): {name} relative gradient error {error:.2e}"


def _run_schedule(tmp_path, *, dp, pp, seed, timeout_s, shared=False, tp=1):
    plan, documents = (make_shared_case if shared else make_case)(dp, seed, pp)
    path = tmp_path / "reference.pt"
    _reference(plan, documents, path)
    run_multiprocess(_schedule_worker, dp * pp * tp, str(path), seed, pp, shared, tp, timeout_s=timeout_s)


@pytest.mark.slow
def test_dp2_merge_through_the_schedule(tmp_path, megatron_cpu):
    _run_schedule(tmp_path, dp=2, pp=1, seed=1, timeout_s=180)


@pytest.mark.slow
def test_dp2_pp2_merge_group_pipelined(tmp_path, megatron_cpu):
    _run_schedule(tmp_path, dp=2, pp=2, seed=3, timeout_s=240)


@pytest.mark.slow
def test_dp4_pp2_merges_of_four_and_two_plus_independent_replicas(tmp_path, megatron_cpu):
    _run_schedule(tmp_path, dp=4, pp=2, seed=4, timeout_s=420)


@pytest.mark.slow
def test_dp2_pp2_every_micropack_shared_by_a_merge_group(tmp_path, megatron_cpu):
    """The planner's base merge (no replica runs alone) through the schedule, pipelined."""
    _run_schedule(tmp_path, dp=2, pp=2, seed=5, timeout_s=240, shared=True)


@pytest.mark.slow
def test_dp2_pp2_merge_group_with_tensor_and_sequence_parallelism(tmp_path, megatron_cpu):
    """TP=2 + sequence parallelism x PP=2 x DP=2 (8 processes) with a DP-Merge group: each
    member's share of a merged MicroPack is padded to an even row count (the padding rows stay
    out of the K/V gathered over the merge group)."""
    from megatron_slimpack.runtime.attention.context_parallel import build_layout

    plan, _ = make_case(2, seed=3, pp=2)
    merged = [r for r in plan.replicas if r.is_merge_group]
    shares = [build_layout(mp, None, 2, rank)[1].numel() for r in merged for mp in r.micropacks for rank in (0, 1)]
    assert any(n % 2 for n in shares)  # some share is padded
    _run_schedule(tmp_path, dp=2, pp=2, seed=3, timeout_s=420, tp=2)
