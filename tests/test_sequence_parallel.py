"""Sequence parallelism, one process: padded batches, the padding's attention, the norm swap.

The multi-process runs (TP=2 + SP with PP=2, DP=2 + megatron DDP, and DP-Merge) are in
test_schedule.py and test_dp_merge.py; the real trainer's in test_real_megatron.py.
"""
import pytest
import torch

from megatron_slimpack.plan import MicroPack, Slice
from megatron_slimpack.runtime.attention.batch import InMemoryTokenSource, build_batch
from megatron_slimpack.runtime.attention.kv_store import KVStore

DOCUMENTS = {0: list(range(1, 12)), 1: list(range(20, 27))}  # 11 and 7 tokens


def _micropack():
    return MicroPack([Slice(0, 0, 5), Slice(1, 0, 7)])  # 12 tokens; document 0 continues


@pytest.mark.parametrize("pad_to, padding", [(1, 0), (4, 0), (5, 3), (8, 4)])
def test_batches_are_padded_to_a_multiple_with_a_segment_of_their_own(pad_to, padding):
    batch = build_batch(_micropack(), InMemoryTokenSource(DOCUMENTS), KVStore(), pad_to=pad_to)
    params = batch.packed_seq_params
    assert batch.num_tokens == 12 + padding and batch.num_tokens % pad_to == 0
    assert params.padding == padding
    assert params.cu_seqlens_q.tolist() == [0, 5, 12] + ([12 + padding] if padding else [])
    assert params.slice_cu_seqlens.tolist() == [0, 5, 12]
    assert params.sample_ids == [0, 1] and params.cu_seqlens_attn_kv.tolist() == [0, 5, 12]
    assert batch.loss_mask[0, 12:].sum() == 0 and batch.num_loss_tokens == 11  # document 1's last token: none
    from megatron_slimpack.runtime.attention.rope import slice_positions

    assert slice_positions(params).tolist() == list(range(5)) + list(range(7)) + list(range(padding))


def _attention():
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention
    from megatron_slimpack.runtime.model import tiny_config

    config = tiny_config(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    return SlicedDotProductAttention(config, layer_number=1, attn_mask_type=None, backend="torch")


def test_padding_rows_attend_to_nothing_and_change_nothing(megatron_cpu):
    """Real rows' outputs and q/k/v gradients are those of the unpadded batch; padding rows get
    zeros and pass no gradient (the continued slice's K/V is stored the same way)."""
    torch.manual_seed(0)
    module = _attention()
    source = InMemoryTokenSource(DOCUMENTS)
    runs = []
    for pad_to in (1, 8):
        store = KVStore()
        params = build_batch(_micropack(), source, store, pad_to=pad_to).packed_seq_params
        generator = torch.Generator().manual_seed(1)
        q, k, v = (torch.cat([torch.randn(12, heads, 8, generator=generator), torch.randn(params.padding, heads, 8)])
                   .requires_grad_() for heads in (4, 2, 2))  # the same real rows, random padding rows
        out = module(q, k, v, packed_seq_params=params)
        assert len(store) == 1  # document 0's slice is continued later: its K/V is kept
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        runs.append((out, q.grad, k.grad, v.grad))
    (out, *grads), (padded_out, *padded_grads) = runs
    torch.testing.assert_close(padded_out[:12], out)
    assert padded_out[12:].abs().sum() == 0
    for grad, padded in zip(grads, padded_grads):
        torch.testing.assert_close(padded[:12], grad)
        assert padded[12:].abs().sum() == 0


def test_norms_are_swapped_only_under_sequence_parallelism(megatron_cpu):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_slimpack.runtime.attention.core import slimpack_layer_spec
    from megatron_slimpack.runtime.model import tiny_config
    from megatron_slimpack.runtime.norm import SequenceParallelTorchNorm, sequence_parallel_spec

    spec = slimpack_layer_spec("torch", qk_layernorm=True)
    assert sequence_parallel_spec(spec, tiny_config()) is spec
    config = tiny_config(num_layers=2)
    config.sequence_parallel = True  # set after construction: megatron refuses it at tp=1
    block = sequence_parallel_spec(spec, config)
    assert isinstance(block, TransformerBlockSubmodules) and len(block.layer_specs) == 2
    assert block.layer_norm is SequenceParallelTorchNorm
    layer = block.layer_specs[0].submodules
    attention = layer.self_attention.submodules
    assert layer.input_layernorm is SequenceParallelTorchNorm and layer.pre_mlp_layernorm is SequenceParallelTorchNorm
    assert attention.q_layernorm is SequenceParallelTorchNorm and attention.k_layernorm is SequenceParallelTorchNorm
    assert spec.submodules.input_layernorm is WrappedTorchNorm  # the given spec is untouched
    norm = SequenceParallelTorchNorm(config, 32)
    assert isinstance(norm, torch.nn.RMSNorm) and all(p.sequence_parallel for p in norm.parameters())
    config.persist_layer_norm = True
    with pytest.raises(ValueError, match="persist_layer_norm"):
        SequenceParallelTorchNorm(config, 32)


def test_the_simulator_prices_the_padding_the_runtime_adds():
    """Each of a MicroPack's cp shares is padded to a multiple of tp; the simulator's tasks last
    what the padded rows cost (no attention: the pairs are the real tokens')."""
    import megatron_slimpack as ms
    from megatron_slimpack.specs import ParallelConfig

    assert ParallelConfig(tp=4, cp=2).padded_tokens(7) == 8  # shares of at most 4 rows: 4 each
    assert ParallelConfig(tp=4, cp=2).padded_tokens(9) == 16  # shares of at most 5 rows: 8 each
    assert ParallelConfig(tp=4, sequence_parallel=False).padded_tokens(7) == 7
    assert ParallelConfig(tp=1).padded_tokens(7) == 7
    cost = ms.CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ParallelConfig(tp=4)
    plan = ms.plan([4097], parallel=parallel, cost=cost, config=ms.SlimPackConfig(context_length=8192))
    (micropack,) = plan.replicas[0].micropacks
    forward = next(t for t in ms.simulate(plan, cost).tasks if t.kind == "F")
    runtime = cost.with_overlaps(ms.costmodel.SLIMPACK_RUNTIME)  # how slimpack's plans are priced
    priced = runtime.forward_time(4100, micropack.attention_pairs, parallel, last_stage=True)
    assert forward.end - forward.start == pytest.approx(priced, rel=1e-12)
    assert priced > runtime.forward_time(4097, micropack.attention_pairs, parallel, last_stage=True)


@pytest.mark.parametrize("vpp", [1, 2])
def test_the_planner_prices_the_padding_as_the_simulator_does(vpp):
    """The planner's memory of a schedule is the simulator's, padding included: priced unpadded,
    a plan of many small MicroPacks passed the budget by the padding's activations (llama-150b
    128K Wikipedia, tp8 pp16, batch 4: 68.55 GiB simulated, 68.55 usable). Interleaved too: the
    peak of the schedule the plan runs (`InterleavedSchedule.peak_bytes`) is the simulator's."""
    import numpy as np

    import megatron_slimpack as ms
    from megatron_slimpack.planner.orders import interleaved_schedules, peak_in_flight
    from megatron_slimpack.planner.slimpack.memory import activation_budget
    from megatron_slimpack.planner.slimpack.pack_phase import MicroPackCosts, stage_work
    from megatron_slimpack.specs import ParallelConfig

    cost = ms.CostModel.analytic("llama-7b", "h100-sxm")
    parallel = ParallelConfig(tp=8, pp=2, vpp=vpp)
    lengths = [5 + 11 * i for i in range(40)]  # no length a multiple of 8: every MicroPack is padded
    plan = ms.plan(lengths, parallel=parallel, cost=cost,
                   config=ms.SlimPackConfig(context_length=4096, max_micropack_tokens=256))
    replica = plan.replicas[0]
    costs = MicroPackCosts.of(replica.micropacks, cost, parallel)
    real_tokens = np.array([micropack.num_tokens for micropack in replica.micropacks], dtype=float)
    assert (costs.tokens > real_tokens).any() and (costs.tokens % 8 == 0).all()
    work = stage_work(replica.forward_units, replica.backward_units, costs, cost, parallel,
                      activation_budget(cost, parallel))
    simulated = ms.simulate(plan, cost).peak_memory_bytes
    if vpp == 1:
        planned = [cost.static_memory_bytes(parallel) + peak for peak in peak_in_flight(replica.stage_orders, work)]
        assert simulated == pytest.approx(planned, rel=1e-12)
    else:
        (schedule,) = [s for s in interleaved_schedules(replica.forward_units, replica.backward_units, 2, vpp)
                       if s.orders() == replica.stage_orders][:1]
        planned = cost.static_memory_bytes(parallel) + schedule.peak_bytes(work)
        assert max(simulated) == pytest.approx(planned, rel=1e-12)
