"""Megatron DDP with overlap_grad_reduce=True over several steps on one wrapped model.

megatron-core's DDP counts each parameter's gradient-ready hook calls made outside `no_sync`;
the first step's counts become the expected ones, and from the second step on a bucket's reduce
is launched the moment its counts reach them. The schedule must therefore let every parameter's
hook fire outside `no_sync` the same number of times in every step, whatever the size of the
last backward unit, which SlimPack re-plans every step. The plans here change that size up and
down (3, 3, 5, 2 MicroPacks); buckets are small so that several exist, and the gradients of every
step are compared with the whole-document reference, and across data-parallel replicas bit for
bit.
"""
import random

import pytest
import torch

from conftest import init_megatron, random_plan, random_segmentation, random_slicing, run_multiprocess
from test_schedule import VOCAB, _config, _global_name, _stage_orders, reference

# Per step: (MicroPacks in every replica's last backward unit, DP ranks whose own replica plan is empty).
CHANGING_LAST_UNIT = ((3, ()), (3, ()), (5, ()), (2, ()))
A_RANK_IDLE = ((3, ()), (3, (1,)), (2, ()))
BUCKET_PARAMS = 2500  # a few parameters per bucket: several buckets on the first stage

# Megatron DDP set-ups, as the trainer makes them from its flags.
VARIANTS = {
    "overlap": dict(),                                      # --overlap-grad-reduce --no-align-grad-reduce
    "aligned": dict(align_grad_reduce=True),                # ... with align (grad_sync_func = start_grad_sync)
    "distributed-optimizer": dict(use_distributed_optimizer=True),  # ... --use-distributed-optimizer
}


def plan_with_last_unit(seed: int, size: int, pp: int, dp: int, idle_ranks=()):
    """A validated plan whose replicas' last backward unit holds `size` MicroPacks (random
    slicings, asymmetric units, 1F1B stage orders) + its documents; the replicas of `idle_ranks`
    are empty."""
    from megatron_slimpack.plan import Plan, ReplicaPlan
    from megatron_slimpack.specs import ParallelConfig

    rng = random.Random(seed)
    replicas, samples, documents = [], [], {}
    for rank in range(dp):
        if rank in idle_ranks:
            replicas.append(ReplicaPlan([], [], [], [[] for _ in range(pp)], dp_ranks=[rank]))
            continue
        ids = range(rank * 100, rank * 100 + size + 2)
        while True:
            lengths = {sid: rng.randint(2, 14) for sid in ids}
            sub = random_plan(rng, {sid: random_slicing(rng, n, 3) for sid, n in lengths.items()},
                              num_micropacks=size + 2)
            if len(sub.replicas[0].micropacks) > size:
                break
        replica = sub.replicas[0]
        sequence = replica.backward_sequence()
        replica.backward_units = random_segmentation(rng, sequence[:-size]) + [sequence[-size:]]
        replica.dp_ranks = [rank]
        replica.stage_orders = _stage_orders(rng, replica, pp)
        replicas.append(replica)
        samples += sub.samples
        documents.update({sid: torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed * 1000 + sid))
                          for sid, n in lengths.items()})
    plan = Plan(replicas, samples, ParallelConfig(dp=dp, pp=pp), 16, "test").validate()
    assert [len(r.backward_units[-1]) for r in plan.replicas if r.micropacks] == [size] * (dp - len(idle_ranks))
    return plan, documents


def _wrapped_stage(saved_state: dict, pp: int, stage: int, variant: dict):
    """This stage's model chunk with the reference's weights, wrapped in Megatron DDP (overlapped
    reduce, small buckets) and the config hooks Megatron's trainer installs for it."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_slimpack.runtime.model import build_gpt_model

    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32) if pp > 1 else {}
    config = _config(calculate_per_token_loss=True, **extra)
    chunk = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=64, backend="torch",
                            pre_process=stage == 0, post_process=stage == pp - 1)
    chunk.load_state_dict({name: saved_state[_global_name(name, stage, pp)] for name in chunk.state_dict()})
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=BUCKET_PARAMS,
        use_distributed_optimizer=variant.get("use_distributed_optimizer", False))
    model = DistributedDataParallel(config, ddp_config, chunk)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if variant.get("align_grad_reduce"):
        config.grad_sync_func = model.start_grad_sync
    return model, chunk


def _gather_sharded_grads(model, dp_group) -> None:
    """With the distributed optimizer each rank holds its shard of every bucket's reduced
    gradient: gather the shards so that every `main_grad` is the whole reduced gradient."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    size, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    for buffer in model.buffers:
        for bucket in buffer.buckets:
            shards = shard_buffer(bucket.grad_data, size)
            gathered = [torch.empty_like(shards[rank]) for _ in range(size)]
            dist.all_gather(gathered, shards[rank].clone(), group=dp_group)
            for shard, part in zip(shards, gathered):
                shard.copy_(part)


def _assert_replicas_identical(grads: dict, dp_group, where: str) -> None:
    import torch.distributed as dist

    flat = torch.cat([grads[name].flatten() for name in sorted(grads)])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size(dp_group))]
    dist.all_gather(everyone, flat, group=dp_group)
    assert all(torch.equal(flat, other) for other in everyone), f"{where}: DP replicas' gradients differ"


def overlap_worker(rank, world_size, port, pp, steps, seeds, paths, variant_names):
    from megatron.core import parallel_state

    from megatron_slimpack.runtime import InMemoryTokenSource
    from megatron_slimpack.runtime.pipeline.schedule import slimpack_forward_backward

    init_megatron(rank, world_size, pp=pp, port=port)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    dp = world_size // pp
    references = [torch.load(path) for path in paths]
    for name in variant_names:
        variant = VARIANTS[name]
        model, chunk = _wrapped_stage(references[0]["state"], pp, stage, variant)
        for step, ((size, idle), seed, saved) in enumerate(zip(steps, seeds, references)):
            where = f"{name}, step {step} (last unit {size}, idle ranks {idle}), rank {rank} (stage {stage})"
            plan, documents = plan_with_last_unit(seed, size, pp, dp, idle)
            model.zero_grad_buffer()
            result = slimpack_forward_backward(model=[model], plan=plan, token_source=InMemoryTokenSource(documents))
            if stage == pp - 1:
                assert result.loss == pytest.approx(saved["loss"], rel=1e-6), where
            if variant.get("use_distributed_optimizer"):
                _gather_sharded_grads(model, dp_group)
            grads = {n: p.main_grad.detach().clone() for n, p in chunk.named_parameters()}
            worst = max(((grad - saved["grads"][_global_name(n, stage, pp)]).norm()
                         / saved["grads"][_global_name(n, stage, pp)].norm().clamp_min(1e-30)).item()
                        for n, grad in grads.items())
            assert worst <= 1e-5, f"{where}: worst relative gradient error {worst:.2e}"
            _assert_replicas_identical(grads, dp_group, where)


def _run(tmp_path, megatron_cpu, *, pp: int, dp: int, variant_names, steps=CHANGING_LAST_UNIT,
         timeout_s: float = 240):
    seeds = [40 + step for step in range(len(steps))]
    paths = []
    for step, ((size, idle), seed) in enumerate(zip(steps, seeds)):
        plan, documents = plan_with_last_unit(seed, size, pp, dp, idle)
        paths.append(str(tmp_path / f"reference{step}.pt"))
        reference(plan, documents, paths[-1])
    states = [torch.load(path)["state"] for path in paths]
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in s  # one model, several steps
               if isinstance(s[k], torch.Tensor))
    run_multiprocess(overlap_worker, pp * dp, pp, steps, seeds, paths, variant_names, timeout_s=timeout_s)


@pytest.mark.slow
def test_data_parallel_overlapped_reduce_over_changing_units(tmp_path, megatron_cpu):
    _run(tmp_path, megatron_cpu, pp=1, dp=2, variant_names=["overlap", "aligned", "distributed-optimizer"])


@pytest.mark.slow
def test_pipeline_and_data_parallel_overlapped_reduce_over_changing_units(tmp_path, megatron_cpu):
    _run(tmp_path, megatron_cpu, pp=2, dp=2, variant_names=["overlap", "aligned", "distributed-optimizer"])


@pytest.mark.slow
def test_a_rank_without_backward_launches_its_reduce(tmp_path, megatron_cpu):
    """A step in which one replica plan is empty: that rank's hooks fire nothing outside no_sync,
    so the schedule launches its (zero) gradients' reduce, in bucket order as the hooks would."""
    _run(tmp_path, megatron_cpu, pp=1, dp=2, variant_names=["overlap", "distributed-optimizer"], steps=A_RANK_IDLE)
