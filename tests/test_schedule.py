"""Pipeline schedule (runtime/pipeline/schedule.py): PP and DP runs give the whole-document gradients.

The reference (a stock megatron-core GPTModel, every document run whole) is computed once in the
test process; each worker loads the matching weights into its stage's chunk, runs its stage of
the plan, and compares its chunk's gradients with the reference's matching layers.
"""
import random

import pytest
import torch

from conftest import init_megatron, random_plan, random_slicing, run_multiprocess, save_whole_document_reference

VOCAB = 64
HIDDEN = 32
LAYERS = 2


def _config(**overrides):
    from megatron_slimpack.runtime.model import tiny_config

    return tiny_config(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, **overrides)


def _stage_orders(rng, replica, pp):
    """Generalised 1F1B orders for `pp` stages, with a random activation budget (extra warm-up)."""
    from megatron_slimpack.planner.orders import StageWork, build_stage_orders

    nf, nb = len(replica.forward_units), len(replica.backward_units)
    work = StageWork(
        forward_time=[[1.0] * nf for _ in range(pp)], backward_time=[[2.0] * nb for _ in range(pp)],
        forward_transfer=[0.1] * nf, backward_transfer=[0.1] * nb,
        forward_bytes=[[float(len(u)) for u in replica.forward_units] for _ in range(pp)],
        backward_frees=[[float(len(u)) for u in replica.backward_units] for _ in range(pp)],
        budget=[float(rng.choice([0, 100])) for _ in range(pp)],
    )
    return build_stage_orders(replica.forward_units, replica.backward_units, work)


def make_case(seed: int, pp: int, dp: int, num_docs: int = 3, max_len: int = 24, max_slices: int = 4,
              extra_micropacks: int = 1):
    """A validated plan (dp replicas, pp stages, random slicings and asymmetric units) + documents."""
    from megatron_slimpack.plan import Plan
    from megatron_slimpack.specs import ParallelConfig

    rng = random.Random(seed)
    replicas, samples, documents = [], [], {}
    for rank in range(dp):
        ids = range(rank * num_docs, (rank + 1) * num_docs)
        lengths = {sid: rng.randint(2, max_len) for sid in ids}
        slicings = {sid: random_slicing(rng, n, max_slices) for sid, n in lengths.items()}
        sub = random_plan(rng, slicings,
                          num_micropacks=max(len(s) for s in slicings.values()) + rng.randint(0, extra_micropacks))
        replica = sub.replicas[0]
        replica.dp_ranks = [rank]
        replica.stage_orders = _stage_orders(rng, replica, pp)
        replicas.append(replica)
        samples += sub.samples
        documents.update({sid: torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed * 100 + sid))
                          for sid, n in lengths.items()})
    plan = Plan(replicas, samples, ParallelConfig(dp=dp, pp=pp), max_len, "test").validate()
    return plan, documents


def make_interleaved_case(seed: int, pp: int, dp: int):
    """Six MicroPacks, one document sliced across the first two, the others whole: the stage
    orders interleave forwards and backwards (1F1B steady state), with asymmetric units."""
    from megatron_slimpack.plan import MicroPack, Plan, ReplicaPlan, Sample, Slice
    from megatron_slimpack.specs import ParallelConfig

    rng = random.Random(seed)
    replicas, samples, documents = [], [], {}
    for rank in range(dp):
        base = rank * 10
        lengths = {base + i: rng.randint(3, 12) for i in range(7)}
        split = rng.randint(1, lengths[base] - 1)
        packs = [[Slice(base, 0, split), Slice(base + 1, 0, lengths[base + 1])],
                 [Slice(base + 2, 0, lengths[base + 2]), Slice(base, split, lengths[base])]]
        packs += [[Slice(base + i, 0, lengths[base + i])] for i in range(3, 7)]
        replica = ReplicaPlan([MicroPack(p) for p in packs], [[0, 1], [2], [3, 4], [5]],
                              [[1], [0, 2], [3, 4], [5]], [], dp_ranks=[rank])
        assert [m for u in replica.backward_units for m in u] == replica.backward_sequence()
        replica.stage_orders = _stage_orders(random.Random(0), replica, pp)
        replicas.append(replica)
        samples += [Sample(sid, n) for sid, n in lengths.items()]
        documents.update({sid: torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed * 100 + sid))
                          for sid, n in lengths.items()})
    plan = Plan(replicas, samples, ParallelConfig(dp=dp, pp=pp), 16, "test").validate()
    return plan, documents


CASES = {"random": make_case, "interleaved": make_interleaved_case}


def reference(plan, documents, path):
    """Whole-document step on a stock model (single process); saves weights, grads and loss."""
    from megatron_slimpack.runtime.pipeline.executor import global_loss_tokens

    return save_whole_document_reference(_config(), VOCAB, documents, global_loss_tokens(plan), path)


def _global_name(name: str, stage: int, pp: int) -> str:
    """A chunk parameter name -> the reference model's (layers are numbered locally per chunk)."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        local, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{stage * (LAYERS // pp) + int(local)}.{rest}"
    return name


def _shard(name: str, full: torch.Tensor, param, tp: int, tp_rank: int) -> torch.Tensor:
    """The tp_rank shard of a full (tp=1) parameter, megatron's layout (SwiGLU fc1: [gate; up] per rank)."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):
        return torch.cat([half.chunk(tp, dim)[tp_rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(tp, dim)[tp_rank]


def _unshard(name: str, shard: torch.Tensor, param, tp: int, group) -> torch.Tensor:
    """All-gather a TP shard back into the full (tp=1) layout."""
    import torch.distributed as dist

    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    dim = param.partition_dim
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(parts, dim)


def _with_units(plan, variant: str):
    """Same MicroPacks, other units: "fine" (one unit per MicroPack) or "coarse" (a single huge unit)."""
    import copy

    plan = copy.deepcopy(plan)
    for replica in plan.replicas:
        count = len(replica.micropacks)
        if variant == "fine":
            replica.forward_units = [[m] for m in range(count)]
            replica.backward_units = [[m] for m in replica.backward_sequence()]
            replica.stage_orders = _stage_orders(random.Random(0), replica, plan.parallel.pp)
        else:
            replica.forward_units = [list(range(count))]
            replica.backward_units = [replica.backward_sequence()]
            replica.stage_orders = [[("F", 0), ("B", 0)] for _ in range(plan.parallel.pp)]
    return plan.validate()


def schedule_worker(rank, world_size, port, pp, seed, path, forward_only, case="random", options=None):
    from megatron.core import parallel_state

    from megatron_slimpack.runtime import InMemoryTokenSource
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.pipeline.schedule import slimpack_forward_backward

    options = options or {}
    tp = options.get("tp", 1)
    init_megatron(rank, world_size, tp=tp, pp=pp, port=port)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()

    base_plan, documents = CASES[case](seed, pp, world_size // (pp * tp))
    saved = torch.load(path)
    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32) if pp > 1 else {}
    if tp > 1:
        extra["tensor_model_parallel_size"] = tp
        extra["sequence_parallel"] = bool(options.get("sp"))
    if options.get("ddp"):
        extra["calculate_per_token_loss"] = True
    if options.get("deallocate"):
        extra["deallocate_pipeline_outputs"] = True
    config = _config(**extra)
    chunk = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=64, backend="torch",
                            pre_process=stage == 0, post_process=stage == pp - 1,
                            tp_overlap=bool(options.get("tp_overlap")))
    if options.get("tp_overlap"):
        from megatron_slimpack.runtime.tp_overlap import (
            OverlappedColumnParallelLinear,
            OverlappedRowParallelLinear,
            Ring,
        )

        kinds = {type(module) for module in chunk.decoder.modules()}
        assert {OverlappedColumnParallelLinear, OverlappedRowParallelLinear} <= kinds
        pass_on = Ring.pass_on

        def counted_pass_on(ring, outgoing):
            calls["ring_passes"] += 1
            return pass_on(ring, outgoing)

        Ring.pass_on = counted_pass_on  # this worker process's own class
    names = {name: _global_name(name, stage, pp) for name, _ in chunk.named_parameters()}
    params = dict(chunk.named_parameters())
    chunk.load_state_dict({k: _shard(k, saved["state"][_global_name(k, stage, pp)], params.get(k), tp, tp_rank)
                           for k in chunk.state_dict()})
    model = chunk
    calls = {"no_sync": 0, "finalize": 0, "ring_passes": 0}
    if options.get("ddp"):
        import contextlib

        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=False), chunk)

        @contextlib.contextmanager
        def counted_no_sync():
            calls["no_sync"] += 1
            with model.no_sync():
                yield

        def counted_finalize(*args, **kwargs):
            calls["finalize"] += 1
            return finalize_model_grads(*args, **kwargs)

        config.no_sync_func = counted_no_sync
        config.finalize_model_grads_func = counted_finalize

    for variant in options.get("variants", [None]):
        plan = base_plan if variant is None else _with_units(base_plan, variant)
        if options.get("ddp"):
            model.zero_grad_buffer()
        else:
            chunk.zero_grad(set_to_none=True)
        result = slimpack_forward_backward(model=[model], forward_only=forward_only, plan=plan,
                                           token_source=InMemoryTokenSource(documents),
                                           timeline=bool(options.get("trace")))
        order = plan.replicas[dp_rank].stage_orders[stage]
        assert [(u.kind, u.index) for u in result] == [t for t in order if not forward_only or t[0] == "F"]
        assert all((u.loss_sum is not None) == (u.kind == "F" and stage == pp - 1) for u in result)
        if stage == pp - 1:
            assert result.loss == pytest.approx(saved["loss"], rel=1e-6)
        else:
            assert result.loss is None
        if options.get("trace") and rank == 0:
            timeline = result.timeline
            computed = [r for r in timeline.records if r.kind in ("F", "B")]
            for r_dp in range(plan.parallel.dp):
                for s in range(pp):
                    mine = sorted((r for r in computed if r.rank == r_dp and r.stage == s), key=lambda r: r.start)
                    assert [(r.kind, r.unit) for r in mine] == plan.replicas[r_dp].stage_orders[s]
            assert all(0 <= r.start <= r.end for r in timeline.records)
            timeline.write_chrome_trace(options["trace"], {"plan": plan.fingerprint()})
            timeline.write_gantt(options["trace"] + ".png")
        if forward_only:
            assert all(p.grad is None for p in chunk.parameters())
            return
        worst = 0.0
        for name, p in chunk.named_parameters():
            grad = p.main_grad if options.get("ddp") else p.grad
            grad = _unshard(name, grad, p, tp, parallel_state.get_tensor_model_parallel_group())
            expected = saved["grads"][names[name]]
            worst = max(worst, ((grad - expected).norm() / expected.norm().clamp_min(1e-30)).item())
        assert worst <= 1e-5, f"rank {rank} (stage {stage}, {variant}): worst relative gradient error {worst:.2e}"
    assert (calls.pop("ring_passes") > 0) == bool(options.get("tp_overlap"))  # the layers ran the rings
    if options.get("ddp"):
        steps = len(options.get("variants", [None]))
        assert calls == {"no_sync": steps, "finalize": steps}, calls  # once per step, as megatron's schedules


def _run(tmp_path, megatron_cpu, *, pp, dp, seed, forward_only=False, timeout_s=180, case="random", options=None):
    tp = (options or {}).get("tp", 1)
    plan, documents = CASES[case](seed, pp, dp)
    path = tmp_path / "reference.pt"
    reference(plan, documents, path)
    run_multiprocess(schedule_worker, pp * dp * tp, pp, seed, str(path), forward_only, case, options,
                     timeout_s=timeout_s)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [3, 8])
def test_pipeline_two_stages(tmp_path, megatron_cpu, seed):
    _run(tmp_path, megatron_cpu, pp=2, dp=1, seed=seed)


@pytest.mark.slow
def test_pipeline_interleaved_1f1b(tmp_path, megatron_cpu):
    plan, _ = make_interleaved_case(2, pp=2, dp=1)
    orders = ["".join(kind for kind, _ in order) for order in plan.replicas[0].stage_orders]
    assert "BF" in orders[0] and "BF" in orders[1], orders  # forwards and backwards interleave
    _run(tmp_path, megatron_cpu, pp=2, dp=1, seed=2, case="interleaved")


@pytest.mark.slow
def test_pipeline_forward_only(tmp_path, megatron_cpu):
    _run(tmp_path, megatron_cpu, pp=2, dp=1, seed=5, forward_only=True)


@pytest.mark.slow
def test_data_parallel_two_replicas(tmp_path, megatron_cpu):
    _run(tmp_path, megatron_cpu, pp=1, dp=2, seed=4)


@pytest.mark.slow
def test_pipeline_and_data_parallel(tmp_path, megatron_cpu):
    _run(tmp_path, megatron_cpu, pp=2, dp=2, seed=6, timeout_s=240, case="interleaved")


@pytest.mark.slow
def test_pipeline_data_parallel_megatron_ddp_with_trace(tmp_path, megatron_cpu):
    """PP=2 x DP=2 with megatron-core DistributedDataParallel (no_sync + finalize_model_grads),
    deallocated pipeline outputs, and a measured timeline written as a Chrome trace."""
    import json

    trace = str(tmp_path / "trace.json")
    _run(tmp_path, megatron_cpu, pp=2, dp=2, seed=7, timeout_s=240, case="interleaved",
         options={"ddp": True, "deallocate": True, "trace": trace})
    events = json.loads(open(trace).read())["traceEvents"]
    bars = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in bars} >= {"F", "B", "RECV", "P2P", "DP"}
    assert {e["pid"] for e in bars} == {0, 1}
    assert (tmp_path / "trace.json.png").stat().st_size > 0


@pytest.mark.slow
def test_many_small_units_and_one_huge_unit(tmp_path, megatron_cpu):
    _run(tmp_path, megatron_cpu, pp=2, dp=1, seed=12, options={"variants": ["fine", "coarse"]})


@pytest.mark.slow
def test_tensor_and_pipeline_parallel(tmp_path, megatron_cpu):
    """TP=2 x PP=2 (4 processes, no sequence parallelism): gathered gradients == whole documents."""
    _run(tmp_path, megatron_cpu, pp=2, dp=1, seed=3, timeout_s=240, options={"tp": 2})


@pytest.mark.slow
def test_tensor_sequence_and_pipeline_parallel(tmp_path, megatron_cpu):
    """TP=2 + sequence parallelism x PP=2: MicroPacks padded to even row counts, TP shards of the
    rows sent between stages, norm gradients summed over TP by the schedule's fallback."""
    plan, _ = make_case(3, pp=2, dp=1)
    assert any(mp.num_tokens % 2 for mp in plan.replicas[0].micropacks)  # padding is exercised
    _run(tmp_path, megatron_cpu, pp=2, dp=1, seed=3, timeout_s=240, options={"tp": 2, "sp": True})


@pytest.mark.slow
@pytest.mark.parametrize("tp_overlap", [False, True])
def test_tensor_sequence_and_data_parallel_megatron_ddp(tmp_path, megatron_cpu, tp_overlap):
    """TP=2 + sequence parallelism x DP=2 with megatron-core DDP: finalize_model_grads sums the
    norms' partial gradients over TP (they are marked sequence_parallel); with the TP overlap
    (runtime/tp_overlap.py) the layers' collectives run as rings behind their GEMMs."""
    _run(tmp_path, megatron_cpu, pp=1, dp=2, seed=6, timeout_s=240, case="interleaved",
         options={"tp": 2, "sp": True, "ddp": True, "tp_overlap": tp_overlap})


@pytest.mark.slow
def test_tensor_parallel_overlap_with_pipeline_parallel(tmp_path, megatron_cpu):
    """TP=2 + sequence parallelism with the TP overlap x PP=2, MicroPacks padded to even row
    counts: gathered gradients == whole documents."""
    _run(tmp_path, megatron_cpu, pp=2, dp=1, seed=3, timeout_s=240, options={"tp": 2, "sp": True, "tp_overlap": True})


def test_one_stage_call_reports_units(megatron_cpu):
    """pp=1 through the one executor: groups from parallel_state, one UnitReport per task of the
    stage order."""
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, ScheduleGroups, UnitReport
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.pipeline.schedule import slimpack_forward_backward

    plan, documents = make_case(2, pp=1, dp=1)
    model = build_gpt_model(_config(), vocab_size=VOCAB, max_sequence_length=64, backend="torch")
    store = KVStore()
    result = slimpack_forward_backward(model=[model], forward_only=False, force_all_reduce=False, plan=plan,
                                       token_source=InMemoryTokenSource(documents), kv_store=store)
    replica = plan.replicas[0]
    assert all(isinstance(u, UnitReport) for u in result)
    assert [(u.kind, u.index) for u in result] == replica.stage_orders[0]
    assert [u.micropacks for u in result if u.kind == "B"] == replica.backward_units
    assert sum(u.tokens for u in result if u.kind == "F") == plan.num_tokens
    assert result.loss_sum == pytest.approx(sum(u.loss_sum for u in result if u.kind == "F"))
    assert result.loss == pytest.approx(result.loss_sum / result.num_loss_tokens)
    assert len(store) == 0 and all(u.detail == "" for u in result)
    groups = ScheduleGroups.from_parallel_state()
    assert (groups.pp_size, groups.pp_rank, groups.dp_size, groups.dp_rank, groups.tp_rank) == (1, 0, 1, 0, 0)


def test_unknown_keywords_are_refused(megatron_cpu):
    """The schedule's signature is its own (keyword-only, no **kwargs): a process-group keyword
    that belongs in groups=ScheduleGroups(...), or one of Megatron's micro-batch arguments (the
    trainer's adapter absorbs those), is a TypeError, never a silent default."""
    from megatron_slimpack.runtime import InMemoryTokenSource
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.pipeline.schedule import slimpack_forward_backward

    plan, documents = make_case(1, pp=1, dp=1)
    model = build_gpt_model(_config(), vocab_size=VOCAB, max_sequence_length=64, backend="torch")
    for keyword in ("dp_rank", "num_microbatches"):
        with pytest.raises(TypeError, match=keyword):
            slimpack_forward_backward(model=model, plan=plan, token_source=InMemoryTokenSource(documents),
                                      **{keyword: 0})


def test_merge_groups_are_required(megatron_cpu):
    """A rank that belongs to a DP-Merge group needs the merge process groups, before anything runs."""
    from megatron_slimpack.runtime import InMemoryTokenSource, ScheduleGroups
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.pipeline.schedule import ScheduleError, slimpack_forward_backward
    from test_dp_merge import make_case as merge_case

    plan, documents = merge_case(2)
    model = build_gpt_model(_config(), vocab_size=VOCAB, max_sequence_length=64, backend="torch")
    with pytest.raises(ScheduleError, match="DP-Merge groups"):
        slimpack_forward_backward(model=model, plan=plan, token_source=InMemoryTokenSource(documents),
                                  groups=ScheduleGroups(dp_rank=1))
    assert all(p.grad is None for p in model.parameters())


# ---- checks that need no processes ----------------------------------------------------------
def test_deadlocking_orders_are_refused():
    from megatron_slimpack.runtime.pipeline.schedule import ScheduleError, check_stage_orders

    plan, _ = make_case(1, pp=2, dp=1)
    replica = plan.replicas[0]
    check_stage_orders(replica)  # the 1F1B orders are fine
    from megatron_slimpack.plan import MicroPack, ReplicaPlan, Slice

    bad = ReplicaPlan([MicroPack([Slice(0, 0, 2)]), MicroPack([Slice(1, 0, 2)])], [[0], [1]], [[0], [1]], [
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)],   # stage 0 waits for stage 1's B0 ...
        [("F", 0), ("F", 1), ("B", 0), ("B", 1)],   # ... which first needs stage 0's F1
    ], dp_ranks=[0])
    with pytest.raises(ScheduleError, match="deadlock"):
        check_stage_orders(bad)


def _mismatch_worker(rank, world_size, port):
    import torch.distributed as dist

    from megatron_slimpack.runtime.pipeline.schedule import ScheduleError, check_same_plan

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    plan, _ = make_case(10 + rank, pp=1, dp=1)
    with pytest.raises(ScheduleError, match="different plans"):
        check_same_plan(plan)


@pytest.mark.slow
def test_plan_mismatch_fails_fast():
    run_multiprocess(_mismatch_worker, 2, timeout_s=60)
