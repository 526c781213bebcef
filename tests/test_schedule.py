"""Pipeline schedule (runtime/schedule.py): PP and DP runs give the whole-document gradients.

The reference (a stock megatron-core GPTModel, every document run whole) is computed once in the
test process; each worker loads the matching weights into its stage's chunk, runs its stage of
the plan, and compares its chunk's gradients with the reference's matching layers.
"""
import random

import pytest
import torch

from conftest import free_port, random_plan, random_slicing, run_multiprocess, whole_document_step

VOCAB = 64
HIDDEN = 32
LAYERS = 2


def _config(**overrides):
    from megatron_slimpack.runtime.model import tiny_config

    return tiny_config(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, **overrides)


def _stage_orders(rng, replica, pp):
    """Generalised 1F1B orders for `pp` stages, with a random activation budget (extra warm-up)."""
    from megatron_slimpack.solver.orders import StageWork, build_stage_orders

    nf, nb = len(replica.forward_units), len(replica.backward_units)
    work = StageWork(
        forward_time=[[1.0] * nf for _ in range(pp)], backward_time=[[2.0] * nb for _ in range(pp)],
        forward_transfer=[0.1] * nf, backward_transfer=[0.1] * nb,
        forward_bytes=[[float(len(u)) for u in replica.forward_units] for _ in range(pp)],
        backward_frees=[[float(len(u)) for u in replica.backward_units] for _ in range(pp)],
        budget=[float(rng.choice([0, 100])) for _ in range(pp)],
    )
    return build_stage_orders(replica.forward_units, replica.backward_units, work)[0]


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
        sub = random_plan(rng, slicings, num_micropacks=max(len(s) for s in slicings.values()) + rng.randint(0, extra_micropacks))
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
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_slimpack.runtime.executor import global_loss_tokens

    torch.manual_seed(0)
    config = _config()
    stock = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization), vocab_size=VOCAB,
                     max_sequence_length=64, position_embedding_type="rope")
    loss = whole_document_step(stock, documents, global_loss_tokens(plan))
    torch.save({"state": stock.state_dict(), "loss": loss,
                "grads": {k: p.grad.detach().clone() for k, p in stock.named_parameters()}}, path)
    return loss


def _global_name(name: str, stage: int, pp: int) -> str:
    """A chunk parameter name -> the reference model's (layers are numbered locally per chunk)."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        local, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{stage * (LAYERS // pp) + int(local)}.{rest}"
    return name


def schedule_worker(rank, world_size, port, pp, seed, path, forward_only, case="random"):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_slimpack.runtime import InMemoryTokenSource, compat
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.schedule import slimpack_forward_backward

    torch.set_num_threads(1)
    compat.apply()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()

    plan, documents = CASES[case](seed, pp, world_size // pp)
    saved = torch.load(path)
    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32) if pp > 1 else {}
    chunk = build_gpt_model(_config(**extra), vocab_size=VOCAB, max_sequence_length=64, backend="torch",
                            pre_process=stage == 0, post_process=stage == pp - 1)
    names = {name: _global_name(name, stage, pp) for name, _ in chunk.named_parameters()}
    chunk.load_state_dict({k: saved["state"][_global_name(k, stage, pp)] for k in chunk.state_dict()})

    result = slimpack_forward_backward(model=[chunk], forward_only=forward_only, plan=plan,
                                       token_source=InMemoryTokenSource(documents), num_microbatches=1,
                                       seq_length=64, micro_batch_size=1, dp_rank=dp_rank)
    order = plan.replicas[dp_rank].stage_orders[stage]
    assert [(u["kind"], u["index"]) for u in result] == [t for t in order if not forward_only or t[0] == "F"]
    if stage == pp - 1:
        assert result.loss == pytest.approx(saved["loss"], rel=1e-6)
    else:
        assert result.loss is None
    if forward_only:
        assert all(p.grad is None for p in chunk.parameters())
        return
    worst = 0.0
    for name, p in chunk.named_parameters():
        expected = saved["grads"][names[name]]
        worst = max(worst, ((p.grad - expected).norm() / expected.norm().clamp_min(1e-30)).item())
    assert worst <= 1e-5, f"rank {rank} (stage {stage}): worst relative gradient error {worst:.2e}"


def _run(tmp_path, megatron_cpu, *, pp, dp, seed, forward_only=False, timeout_s=180, case="random"):
    plan, documents = CASES[case](seed, pp, dp)
    path = tmp_path / "reference.pt"
    reference(plan, documents, path)
    run_multiprocess(schedule_worker, pp * dp, pp, seed, str(path), forward_only, case, timeout_s=timeout_s)


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


# ---- checks that need no processes ----------------------------------------------------------
def test_deadlocking_orders_are_refused():
    from megatron_slimpack.runtime.schedule import ScheduleError, check_stage_orders

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

    from megatron_slimpack.runtime.schedule import ScheduleError, check_same_plan

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    plan, _ = make_case(10 + rank, pp=1, dp=1)
    with pytest.raises(ScheduleError, match="different plans"):
        check_same_plan(plan)


@pytest.mark.slow
def test_plan_mismatch_fails_fast():
    run_multiprocess(_mismatch_worker, 2, timeout_s=60)
