"""Virtual pipeline stages (interleaved 1F1B): PP=2 x vpp=2 runs give the whole-document gradients.

Each pipeline rank holds two model chunks (one layer each, runtime.model.build_stage_chunks):
chunk c of rank s is virtual stage c * 2 + s, so rank 1's chunk 0 sends its activations back to
rank 0's chunk 1, and ranks 0 and 1 exchange activations and gradients in both directions. Plans
are made as in test_schedule.py / test_dp_merge.py and given Megatron's interleaved 1F1B orders
(conftest.with_virtual_stages). The reference is one stock megatron-core GPTModel running every
document whole in the test process; each worker compares its chunks' gradients with the matching
layers of it.

The same worker runs with options: TP=2 with sequence parallelism (every chunk's weights the
matching TP shard of the reference's, MicroPacks padded to even row counts, the schedule's
fallback summing the norms' partial gradients over TP for every chunk), and activation recompute
(selective and full, megatron-core's CheckpointFunction re-running each chunk's forward in
backward, with its CUDA RNG-state calls pointed at the CPU generator).
"""
import random

import pytest
import torch

from conftest import init_megatron, run_multiprocess, save_whole_document_reference, with_virtual_stages
from test_schedule import _shard

VOCAB = 64
HIDDEN = 32
PP, VPP = 2, 2
LAYERS = 4  # one per virtual stage


RECOMPUTE = {"selective": dict(recompute_granularity="selective"),
             "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             # block-1: the first layer of every chunk (here each chunk's one layer), Megatron's block method
             "block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)}


def _config(**overrides):
    from megatron_slimpack.runtime.model import tiny_config

    return tiny_config(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, **overrides)


# ---- plans ------------------------------------------------------------------------------------
def make_sliced_case(seed: int, asymmetric: bool, micropacks: int = 8):
    """Eight MicroPacks: one document sliced over MicroPacks 0-1, another over 3-4-5 (its last
    slice reads two slices' K/V), the others whole. Units: one MicroPack each (symmetric), or
    asymmetric ones (four forward units, six backward units, grouped differently). With
    `micropacks` = 7, the last (a whole document) is left out."""
    from megatron_slimpack.plan import MicroPack, Plan, ReplicaPlan, Sample, Slice
    from megatron_slimpack.specs import ParallelConfig

    rng = random.Random(seed)
    lengths = {sid: rng.randint(3, 12) for sid in range(9)}
    cut = rng.randint(1, lengths[0] - 1)
    first, second = sorted(rng.sample(range(1, lengths[1]), 2))

    def whole(sid):
        return Slice(sid, 0, lengths[sid])

    packs = [[Slice(0, 0, cut), whole(2)], [whole(3), Slice(0, cut, lengths[0])], [whole(4)],
             [Slice(1, 0, first)], [whole(5), Slice(1, first, second)], [Slice(1, second, lengths[1]), whole(6)],
             [whole(7)], [whole(8)]][:micropacks]
    lengths = {sid: n for sid, n in lengths.items() if sid <= micropacks}  # documents 0-8 or 0-7
    replica = ReplicaPlan([MicroPack(p) for p in packs], [], [], [], dp_ranks=[0])
    assert replica.backward_sequence() == [1, 0, 2, 5, 4, 3, 6, 7][:micropacks]
    if asymmetric:
        replica.forward_units = [[0, 1], [2, 3, 4], [5], [6, 7]]
        replica.backward_units = [[1], [0, 2], [5], [4, 3], [6], [7]]
    else:
        replica.forward_units = [[m] for m in range(micropacks)]
        replica.backward_units = [[m] for m in replica.backward_sequence()]
    replica.stage_orders = [[] for _ in range(PP)]  # replaced by with_virtual_stages
    samples = [Sample(sid, n) for sid, n in lengths.items()]
    plan = Plan([replica], samples, ParallelConfig(pp=PP), 16, "test")
    documents = {sid: torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed * 100 + sid))
                 for sid, n in lengths.items()}
    return with_virtual_stages(plan, VPP), documents


def make_merge_case(seed: int):
    """test_dp_merge's DP=2 case (a DP-Merge group of both ranks with a document in three slices,
    plus each rank's own sliced documents), every replica plan in interleaved orders."""
    from test_dp_merge import make_case

    plan, documents = make_case(2, seed, PP)
    return with_virtual_stages(plan, VPP), documents


def make_short_first_case(seed: int):
    """The sliced case without its last MicroPack: seven one-MicroPack units, no multiple of pp,
    run with the remainder as a short first group (`interleaved_groupings`), the table that holds
    the fewest chunks in flight for such counts."""
    from megatron_slimpack.planner.orders import interleaved_schedules

    plan, documents = make_sliced_case(seed, asymmetric=False, micropacks=7)
    replica = plan.replicas[0]
    # 7 = 3 x 2 + 1: Megatron's groups 2, 2, 3; the other grouping is 1, 2, 2, 2 (one spread unit is Megatron's)
    short_first = interleaved_schedules(replica.forward_units, replica.backward_units, PP, VPP, which="groupings")
    replica.stage_orders = next(s for s in short_first if s.runs_through()).orders()
    return plan.validate(), documents


def make_case(case: str, seed: int):
    if case == "merge":
        return make_merge_case(seed)
    if case == "short-first":
        return make_short_first_case(seed)
    return make_sliced_case(seed, asymmetric=case == "asymmetric")


def _global_name(name: str, stage: int, chunk: int) -> str:
    """A chunk parameter name -> the reference model's (layers are numbered locally per chunk)."""
    prefix = "decoder.layers."
    if not name.startswith(prefix):
        return name
    local, rest = name[len(prefix):].split(".", 1)
    per_chunk = LAYERS // (PP * VPP)
    return f"{prefix}{(chunk * PP + stage) * per_chunk + int(local)}.{rest}"


# ---- the worker ---------------------------------------------------------------------------------
def _cpu_checkpointing() -> list:
    """megatron-core's CheckpointFunction (activation recompute) saves and restores the CUDA RNG
    state, which raises on a CPU-only torch (compat.apply() does not cover it; the real trainer's
    tests/real_megatron/cpu_shim.py does the same). Point both at the CPU generator; returns the
    list that the state reads are counted in (one per checkpointed forward, one per re-run)."""
    from megatron.core.tensor_parallel import random as mp_random

    reads = []

    def get_state(*args, **kwargs):
        reads.append(1)
        return torch.get_rng_state()

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    return reads


class _SyncLog:
    """Megatron DDP hooks with a log: when each chunk's no_sync is entered and left, grad_sync_func
    and finalize calls, on the step's timeline clock."""

    def __init__(self, chunks, timeline):
        self.chunks, self.timeline = chunks, timeline
        self.events: list = []

    def no_sync(self, chunk: int):
        import contextlib

        @contextlib.contextmanager
        def context():
            self.events.append(("enter", chunk, self.timeline.now()))
            with self.chunks[chunk].no_sync():
                yield
            self.events.append(("exit", chunk, self.timeline.now()))
        return context

    def grad_sync(self, chunk: int):
        def func(params):
            assert {id(p) for p in params} == {id(p) for p in self.chunks[chunk].parameters()}
            self.events.append(("grad_sync", chunk, self.timeline.now()))
        return func

    def param_sync(self, chunk: int):
        def func(params):
            assert {id(p) for p in params} == {id(p) for p in self.chunks[chunk].parameters()}
            self.events.append(("param_sync", chunk, self.timeline.now()))
        return func

    def finalize(self, *args, **kwargs):
        from megatron.core.distributed import finalize_model_grads

        self.events.append(("finalize", args[0], self.timeline.now()))
        return finalize_model_grads(*args, **kwargs)

    def check(self, records, with_grad_sync: bool) -> None:
        """Megatron's interleaved protocol: no_sync around every backward but each chunk's last
        (or around all, then grad_sync_func[c] right after chunk c's last), finalize once with all
        chunks; with the sync functions also param_sync_func per chunk before the first forward."""
        backwards = sorted((r for r in records if r.kind == "B"), key=lambda r: r.start)
        last = {r.chunk: r for r in backwards}
        for chunk in range(VPP):
            times = [t for what, c, t in self.events if c == chunk and what in ("enter", "exit")]
            active = list(zip(times[::2], times[1::2] + [float("inf")]))
            for record in backwards:
                inside = any(begin <= record.start and record.end <= end for begin, end in active)
                expected = record is not last[record.chunk] or with_grad_sync
                assert inside == expected, (chunk, record, self.events)
        syncs = [(c, t) for what, c, t in self.events if what == "grad_sync"]
        if with_grad_sync:
            assert sorted(c for c, _ in syncs) == list(range(VPP))
            for chunk, when in syncs:  # right after the chunk's last backward, before the next task
                following = [r.start for r in records if r.kind in "FB" and r.start >= last[chunk].end]
                assert last[chunk].end <= when <= min(following, default=float("inf"))
        else:
            assert not syncs
        finals = [arg for what, arg, _ in self.events if what == "finalize"]
        assert len(finals) == 1 and finals[0] == self.chunks
        # The overlapped parameter all-gather: both chunks launched once, before the step's first forward.
        launches = [(c, t) for what, c, t in self.events if what == "param_sync"]
        if with_grad_sync:
            assert sorted(c for c, _ in launches) == list(range(VPP))
            assert max(t for _, t in launches) <= min(r.start for r in records if r.kind == "F")
        else:
            assert not launches


def _worker(rank, world_size, port, path, case, seed, options):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_slimpack.runtime import InMemoryTokenSource, ScheduleGroups, slimpack_forward_backward
    from megatron_slimpack.runtime.model import build_stage_chunks
    from megatron_slimpack.runtime.pipeline.merge import merge_groups
    from megatron_slimpack.runtime.pipeline.schedule import ScheduleError
    from megatron_slimpack.runtime.pipeline.timing import Timeline

    tp = options.get("tp", 1)
    init_megatron(rank, world_size, tp=tp, pp=PP, port=port)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    plan, documents = make_case(case, seed)
    saved = torch.load(path)
    ddp = options.get("ddp", False)
    extra = dict(RECOMPUTE.get(options.get("recompute"), {}))
    if tp > 1:
        extra.update(tensor_model_parallel_size=tp, sequence_parallel=bool(options.get("sp")))
    config = _config(pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=VPP,
                     pipeline_dtype=torch.float32, calculate_per_token_loss=ddp,
                     deallocate_pipeline_outputs=options.get("deallocate", False), **extra)
    build = dict(vocab_size=VOCAB, max_sequence_length=64, backend="torch")
    chunks = build_stage_chunks(config, vpp=VPP, **build)

    def shard(name, full, param):  # this TP rank's shard of a reference tensor (itself without TP)
        return _shard(name, full, param, tp, tp_rank)

    for chunk, model in enumerate(chunks):
        params = dict(model.named_parameters())
        model.load_state_dict({k: shard(k, saved["state"][_global_name(k, stage, chunk)], params.get(k))
                               for k in model.state_dict()})
    reads = _cpu_checkpointing() if options.get("recompute") else None
    if options.get("recompute") == "selective":  # core attention checkpointed in every chunk's layers
        assert all(layer.self_attention.checkpoint_core_attention for m in chunks for layer in m.decoder.layers)
    if options.get("sp"):  # the norms' weights are partial per TP rank, in every chunk
        assert all(any(getattr(p, "sequence_parallel", False) for p in m.parameters()) for m in chunks)
    merge = merge_groups(plan, dist.get_process_group_ranks(parallel_state.get_data_parallel_group()))
    groups = ScheduleGroups.from_parallel_state(merge_groups=merge)
    source = InMemoryTokenSource(documents)

    if options.get("misbuilt"):  # chunks without vp_stage share layer numbers: their K/V would collide
        from megatron_slimpack.runtime.model import build_gpt_model

        twins = [build_gpt_model(_config(pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32), **build,
                                 pre_process=m.pre_process, post_process=m.post_process) for m in chunks]
        with pytest.raises(ScheduleError, match="both hold layer .* vp_stage=c"):
            slimpack_forward_backward(model=twins, plan=plan, token_source=source, groups=groups)
        with pytest.raises(ScheduleError, match=r"vpp=2\) but model= has 1"):
            slimpack_forward_backward(model=chunks[:1], plan=plan, token_source=source, groups=groups)

    # Plain chunks: the schedule's own fallback sums every chunk's .grad over data parallelism.
    result = slimpack_forward_backward(model=chunks, plan=plan, token_source=source, groups=groups, timeline=True)
    _check_step(result, plan, stage, dp_rank, saved, chunks, rank, main_grad=False, shard=shard)
    if reads is not None:  # each MicroPack checkpointed once in each of the rank's layers, and re-run once
        micropacks = sum(len(r.micropacks) for r in plan.replicas_of_rank(dp_rank))
        assert len(reads) == 2 * micropacks * LAYERS // PP, (len(reads), micropacks)
    if not ddp:
        return
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    for chunk in chunks:  # DDP accumulates .grad into main_grad: start from none
        chunk.zero_grad(set_to_none=True)
    models = [DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=False), chunk)
              for chunk in chunks]
    for with_grad_sync in (False, True):
        timeline = Timeline()
        log = _SyncLog(models, timeline)
        for model in models:
            model.zero_grad_buffer()
        config.no_sync_func = [log.no_sync(c) for c in range(VPP)]
        config.grad_sync_func = [log.grad_sync(c) for c in range(VPP)] if with_grad_sync else None
        config.param_sync_func = [log.param_sync(c) for c in range(VPP)] if with_grad_sync else None
        config.finalize_model_grads_func = log.finalize
        result = slimpack_forward_backward(model=models, plan=plan, token_source=source, groups=groups,
                                           timeline=timeline)
        _check_step(result, plan, stage, dp_rank, saved, chunks, rank, main_grad=True)
        mine = [r for r in timeline.records if (r.rank, r.stage) == (dp_rank, stage) and r.kind in "FB"]
        log.check(mine, with_grad_sync)


def _check_step(result, plan, stage, dp_rank, saved, chunks, rank, main_grad, shard=None):
    """Units on the right chunks in plan order (merge groups first), the loss on the last stage, the
    timeline's chunks as the simulator's, and every chunk's gradients those of whole documents
    (`shard(name, reference, param)`: this TP rank's part of a reference gradient)."""
    expected = [tuple(t) for r in plan.replicas_of_rank(dp_rank) for t in r.stage_orders[stage]]
    assert [(u.kind, u.index, u.chunk) for u in result] == expected
    assert all((u.loss_sum is not None) == (u.kind == "F" and stage == PP - 1 and u.chunk == VPP - 1)
               for u in result)
    if stage == PP - 1:
        assert result.loss == pytest.approx(saved["loss"], rel=1e-6)
    else:
        assert result.loss is None
    if rank == 0:  # gathered timeline: every rank's tasks on their chunks, as the simulator has them
        from megatron_slimpack.costmodel import CostModel
        from megatron_slimpack.simulator.dag import simulate
        from megatron_slimpack.specs import get_hardware, get_model

        measured = {(r.rank, r.stage, r.replica, r.kind, r.unit, r.chunk) for r in result.timeline.compute_records()}
        report = simulate(plan, CostModel(get_model("tiny"), get_hardware("cpu")), detail=True)
        assert measured == {(t.rank, t.stage, t.replica, t.kind, t.unit, t.chunk) for t in report.tasks
                            if t.kind in "FB"}
        transfers = {(r.detail, r.chunk) for r in result.timeline.records if r.kind == "P2P"}
        assert {("F 1->0", 0), ("B 0->1", 1)} <= transfers  # the wrap-around between chunks, both ways
    for chunk, model in enumerate(chunks):
        for name, p in model.named_parameters():
            grad = p.main_grad if main_grad else p.grad
            want = saved["grads"][_global_name(name, stage, chunk)]
            if shard is not None:
                want = shard(name, want, p)
            error = ((grad - want).norm() / want.norm().clamp_min(1e-30)).item()
            assert error <= 1e-5, f"rank {rank} (stage {stage} chunk {chunk}): {name} gradient error {error:.2e}"


def _run(tmp_path, case, seed, dp=1, timeout_s=180, **options):
    from megatron_slimpack.runtime.pipeline.executor import global_loss_tokens

    plan, documents = make_case(case, seed)
    path = tmp_path / "reference.pt"
    save_whole_document_reference(_config(), VOCAB, documents, global_loss_tokens(plan), path)
    run_multiprocess(_worker, PP * dp * options.get("tp", 1), str(path), case, seed, options, timeout_s=timeout_s)


def _interleaves(order) -> bool:
    """Whether a forward follows a backward somewhere (1F1B steady state, not all-forward-first)."""
    kinds = "".join(task[0] for task in order)
    return "BF" in kinds


# ---- multi-process runs ---------------------------------------------------------------------------
@pytest.mark.slow
def test_pp2_vpp2_sliced_documents(tmp_path, megatron_cpu):
    """Symmetric units (one MicroPack each), two sliced documents; wrongly built chunks refused."""
    plan, _ = make_case("symmetric", 1)
    assert all(_interleaves(order) for order in plan.replicas[0].stage_orders)
    _run(tmp_path, "symmetric", 1, misbuilt=True)


@pytest.mark.slow
def test_pp2_vpp2_remainder_as_a_short_first_group(tmp_path, megatron_cpu):
    """Seven units over pp=2: the first group holds one unit, so rank 0 runs its chunk-1 forward
    of unit 0 right after chunk 0's (waiting on rank 1), then groups of two."""
    plan, _ = make_case("short-first", 1)
    forwards = [task for task in plan.replicas[0].stage_orders[0] if task[0] == "F"]
    assert forwards[:3] == [("F", 0, 0), ("F", 0, 1), ("F", 1, 0)]
    _run(tmp_path, "short-first", 1)


@pytest.mark.slow
def test_pp2_vpp2_asymmetric_units(tmp_path, megatron_cpu):
    """Four forward units, six backward units, grouped differently; outputs deallocated once sent."""
    plan, _ = make_case("asymmetric", 2)
    replica = plan.replicas[0]
    assert len(replica.forward_units) != len(replica.backward_units)
    assert any(_interleaves(order) for order in replica.stage_orders)
    _run(tmp_path, "asymmetric", 2, deallocate=True)


@pytest.mark.slow
def test_pp2_vpp2_dp2_merge_group_megatron_ddp(tmp_path, megatron_cpu):
    """PP=2 x vpp=2 x DP=2 (4 processes): a DP-Merge group's interleaved orders, then each rank's own.
    Three steps: plain chunks (the schedule's all-reduce fallback over every chunk), then Megatron
    DDP per chunk with Megatron's interleaved gradient-sync protocol (a no_sync per chunk, then also
    a grad_sync_func and a param_sync_func per chunk) and finalize_model_grads once with both chunks."""
    plan, _ = make_case("merge", 3)
    assert any(r.is_merge_group for r in plan.replicas)
    _run(tmp_path, "merge", 3, dp=2, timeout_s=300, ddp=True)


@pytest.mark.slow
def test_pp2_vpp2_tensor_and_sequence_parallel(tmp_path, megatron_cpu):
    """PP=2 x vpp=2 x TP=2 with sequence parallelism (4 processes), asymmetric units over sliced
    documents: odd-token MicroPacks padded to even row counts (a one-token slice leaves TP rank 1
    only a padding row), each TP rank's share of the rows sent between virtual stages (the
    wrap-around too), and no finalize function: the schedule's fallback sums the sequence-parallel
    norms' partial gradients over TP in every chunk (chunk 1 of stage 1 holds the final norm)."""
    plan, _ = make_case("asymmetric", 2)
    counts = [mp.num_tokens for mp in plan.replicas[0].micropacks]
    assert 1 in counts and any(n % 2 for n in counts if n > 1), counts  # padding is exercised
    _run(tmp_path, "asymmetric", 2, timeout_s=300, tp=2, sp=True)


@pytest.mark.slow
@pytest.mark.parametrize("granularity, case, seed", [("selective", "symmetric", 1), ("full", "asymmetric", 3),
                                                      ("block", "asymmetric", 2)])
def test_pp2_vpp2_activation_recompute(tmp_path, megatron_cpu, granularity, case, seed):
    """PP=2 x vpp=2 under activation recompute: selective (core attention), full (uniform, one
    layer: each chunk's layer) and block-1 (Megatron's block method: the first layer of every
    chunk, counted per chunk), so every chunk's forward re-runs in backward, the KV store's
    side effects idempotent across chunks (layers numbered globally). Full recompute with the
    outputs deallocated once sent."""
    _run(tmp_path, case, seed, recompute=granularity, deallocate=granularity == "full")


# ---- checks that need no processes -----------------------------------------------------------------
@pytest.mark.parametrize("case, seed", [("symmetric", 1), ("asymmetric", 2), ("merge", 3), ("short-first", 1)])
def test_interleaved_programs_are_deadlock_free_and_match_per_peer(case, seed):
    """Every transfer is posted once at each end; between two ranks both ends post them in the same
    order (gloo matches per peer in posting order, NCCL needs it), and both kinds go both ways."""
    from megatron_slimpack.runtime import p2p
    from megatron_slimpack.runtime.pipeline.schedule import check_stage_orders

    plan, _ = make_case(case, seed)
    for replica in plan.replicas:
        check_stage_orders(replica, VPP)
        orders = replica.stage_orders
        times = p2p.transfer_times(orders, VPP)
        programs = [p2p.stage_program(orders, stage, times, VPP) for stage in range(PP)]
        sent = [[t for call in program for t in call.sends] for program in programs]
        received = [[t for call in program for t in call.receives] for program in programs]
        assert sorted(map(repr, (t for s in sent for t in s))) == sorted(map(repr, times))
        for source in range(PP):
            for destination in set(range(PP)) - {source}:
                out = [t for t in sent[source] if t.destination % PP == destination]
                into = [t for t in received[destination] if t.source % PP == source]
                assert out == into  # same transfers, same order at both ends
                assert {t.kind for t in out} == {"F", "B"}


def test_a_deadlocking_interleaved_order_is_refused():
    """Rank 0 runs chunk 0's backward before chunk 1's forward. That gradient comes (through rank 1)
    from chunk 1's backward, which needs rank 0's chunk 1 forward, and rank 1 waits for that forward.
    Every chunk's own order is fine (Plan.validate accepts it), the pipeline is not."""
    from megatron_slimpack.plan import MicroPack, ReplicaPlan, Slice
    from megatron_slimpack.runtime.pipeline.schedule import ScheduleError, check_stage_orders

    good = [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]
    bad = [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]
    replica = ReplicaPlan([MicroPack([Slice(0, 0, 2)])], [[0]], [[0]], [good, good], dp_ranks=[0])
    check_stage_orders(replica, VPP)
    replica.stage_orders = [bad, good]
    with pytest.raises(ScheduleError, match="deadlock: stage 0 waits at B0 chunk 0, stage 1 waits at F0 chunk 1"):
        check_stage_orders(replica, VPP)
    replica.stage_orders = [[task[:2] for task in good]] * 2
    with pytest.raises(ScheduleError, match=r"\(kind, unit, chunk\) with chunk in 0..1 \(vpp=2\)"):
        check_stage_orders(replica, VPP)
    replica.stage_orders = [good, [("F", 0, 0), ("F", 0, 1), ("B", 0, 1)]]
    with pytest.raises(ScheduleError, match="stage 1 chunk 0 must run each forward and backward unit exactly once"):
        check_stage_orders(replica, VPP)


def test_vpp1_transfers_and_messages_unchanged():
    """Without virtual stages a transfer's ends are the pipeline stages and messages read as before."""
    from megatron_slimpack.runtime import p2p

    assert p2p.incoming(("F", 3), 1, 2) == p2p.Transfer("F", 3, 0, 1)
    assert p2p.outgoing(("B", 2), 1, 2) == p2p.Transfer("B", 2, 1, 0)
    # with virtual stages: the last stage's chunk 0 feeds stage 0's chunk 1, gradients come back
    assert p2p.outgoing(("F", 3, 0), 1, 2, vpp=2) == p2p.Transfer("F", 3, 1, 2)
    assert p2p.incoming(("F", 3, 1), 0, 2, vpp=2) == p2p.Transfer("F", 3, 1, 2)
    assert p2p.outgoing(("B", 3, 1), 0, 2, vpp=2) == p2p.Transfer("B", 3, 2, 1)
    assert p2p.incoming(("B", 3, 1), 1, 2, vpp=2) is None  # the loss chunk
    assert p2p.incoming(("F", 3, 0), 0, 2, vpp=2) is None  # the embedding chunk


def test_chunk_count_must_match_the_plan(megatron_cpu):
    from megatron_slimpack.runtime import InMemoryTokenSource
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.pipeline.schedule import ScheduleError, slimpack_forward_backward
    from test_schedule import make_case as plain_case

    plan, documents = plain_case(1, pp=1, dp=1)
    model = build_gpt_model(_config(), vocab_size=VOCAB, max_sequence_length=64, backend="torch")
    with pytest.raises(ScheduleError, match=r"vpp=1\) but model= has 2"):
        slimpack_forward_backward(model=[model, model], plan=plan, token_source=InMemoryTokenSource(documents))


def test_megatron_arguments_for_virtual_stages():
    """--num-virtual-stages-per-pipeline-rank is accepted with pipeline parallelism and a strategy
    whose registry entry plans virtual stages, refused otherwise with the flags named; the
    planner's ParallelConfig gets Megatron's vpp."""
    from types import SimpleNamespace

    from megatron_slimpack.megatron.args import SlimPackArgumentError, validate_slimpack_args, virtual_stages_of_args
    from megatron_slimpack.planner.strategies import strategy_specs, trainable_strategy_names

    def args(**changes):
        return SimpleNamespace(**{**dict(slimpack=True, calculate_per_token_loss=True, pipeline_model_parallel_size=2,
                                         virtual_pipeline_model_parallel_size=2), **changes})

    specs = strategy_specs()
    plans = [n for n in trainable_strategy_names() if specs[n].constraints.vpp is None or 2 in specs[n].constraints.vpp]
    assert plans, "no trainable strategy plans virtual stages"
    validate_slimpack_args(args(slimpack_strategy=plans[0]))
    assert virtual_stages_of_args(args()) == 2 and virtual_stages_of_args(SimpleNamespace()) == 1
    with pytest.raises(SlimPackArgumentError, match="virtual pipeline stages .* need --pipeline-model-parallel-size"):
        validate_slimpack_args(args(slimpack_strategy=plans[0], pipeline_model_parallel_size=1))
    for name in set(trainable_strategy_names()) - set(plans):
        with pytest.raises(SlimPackArgumentError, match=rf"--slimpack-strategy '{name}' does not plan virtual pipeline "
                                                        rf"stages \(vpp=2.*remove --num-virtual-stages-per-pipeline"):
            validate_slimpack_args(args(slimpack_strategy=name))


def test_megatron_fixed_with_virtual_stages_needs_a_multiple_of_pp_per_rank():
    """megatron-fixed runs global-batch-size / dp sequences per rank every step: a count Megatron's
    interleaved 1F1B refuses is said before training, not at the first step."""
    from types import SimpleNamespace

    from megatron_slimpack.megatron.args import SlimPackArgumentError, validate_slimpack_args

    def args(global_batch_size, strategy="megatron-fixed"):
        return SimpleNamespace(slimpack=True, calculate_per_token_loss=True, pipeline_model_parallel_size=4,
                               virtual_pipeline_model_parallel_size=2, data_parallel_size=2,
                               global_batch_size=global_batch_size, slimpack_strategy=strategy)

    with pytest.raises(SlimPackArgumentError, match=r"--global-batch-size 12 / data-parallel size 2 = 6 sequences "
                                                    r"per rank .* multiple of 8"):
        validate_slimpack_args(args(12))
    validate_slimpack_args(args(16))
    validate_slimpack_args(args(12, "sorted"))  # its packer meets the rule every step


def test_parameter_gathers_are_launched_chunk_by_chunk():
    """Megatron's interleaved schedule launches the overlapped parameter all-gather of chunks 0 and 1
    when the step starts and of chunk c + 1 at chunk c's first forward; each chunk once per step,
    with its own parameters; plain 1F1B (one chunk) leaves it to DDP's forward pre-hooks."""
    from types import SimpleNamespace

    from megatron_slimpack.runtime.pipeline.schedule import _ParamSync

    chunks = [torch.nn.Linear(2, 2) for _ in range(4)]
    launched = []

    def launcher(chunk):
        def launch(params):
            assert [id(p) for p in params] == [id(p) for p in chunks[chunk].parameters()]
            launched.append(chunk)
        return launch

    config = SimpleNamespace(param_sync_func=[launcher(c) for c in range(4)])
    sync = _ParamSync(chunks, config)
    sync.start()
    assert launched == [0, 1]
    launched_at = []
    for chunk in (0, 0, 1, 0, 1, 2, 2, 3, 3):  # an interleaved order's forwards
        sync.before_forward(chunk)
        launched_at.append(len(launched))
    assert launched == [0, 1, 2, 3]
    assert launched_at == [2, 2, 3, 3, 3, 4, 4, 4, 4]  # chunk 2 at chunk 1's first forward, 3 at chunk 2's
    plain = _ParamSync(chunks[:1], SimpleNamespace(param_sync_func=launcher(0)))
    plain.start()
    plain.before_forward(0)
    assert launched == [0, 1, 2, 3]
    none = _ParamSync(chunks, SimpleNamespace(param_sync_func=None))
    none.start()
    none.before_forward(3)
