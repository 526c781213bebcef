"""The ring-overlapped TP linears (runtime/tp_overlap.py) give megatron-core's sequence-parallel
linears' outputs and gradients, on gloo with several processes; the spec swap and its refusals."""
import copy
import dataclasses
import functools

import pytest
import torch

from conftest import init_megatron, run_multiprocess

ROWS_PER_RANK = 5  # odd: chunks are not powers of two


def _pair(kind: str, config, overlapped_cls, plain_cls, *, bias: bool, skip_bias_add: bool):
    """(megatron's linear, the overlapped one) with the same weights."""
    import torch.nn.init as init

    kwargs = dict(config=config, init_method=init.normal_, bias=bias, skip_bias_add=skip_bias_add)
    if kind == "column":
        kwargs.update(input_size=12, output_size=6 * config.tensor_model_parallel_size, gather_output=False)
    else:
        kwargs.update(input_size=6 * config.tensor_model_parallel_size, output_size=12, input_is_parallel=True)
    torch.manual_seed(7)
    plain = plain_cls(**kwargs)
    overlapped = overlapped_cls(**kwargs)
    overlapped.load_state_dict(plain.state_dict())
    return plain, overlapped


def _check(plain, overlapped, x, *, fused: bool):
    from megatron_slimpack.runtime.tp_overlap import Ring

    calls = []
    pass_on = Ring.pass_on
    Ring.pass_on = lambda self, outgoing: calls.append(len(outgoing)) or pass_on(self, outgoing)
    try:
        runs = []
        for module in (plain, overlapped):
            inputs = x.clone().requires_grad_()
            output, output_bias = module(inputs)
            if output_bias is not None:
                output = output + output_bias
            grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
            grad = grad.to(output.dtype)
            output.backward(grad)
            weight_grad = module.weight.main_grad.clone() if module is overlapped and fused else module.weight.grad
            runs.append((output.detach(), inputs.grad, weight_grad,
                         module.bias.grad if module.bias is not None else None))
    finally:
        Ring.pass_on = pass_on
    assert calls, "the overlapped linear ran megatron's path, not the ring"
    (output, input_grad, weight_grad, bias_grad), expected = runs[1], runs[0]
    # the weight gradient is megatron's own GEMM over the same gathered rows: the same bits
    assert torch.equal(weight_grad, expected[2])
    tolerance = dict(rtol=1e-5, atol=1e-6) if x.dtype == torch.float32 else {}  # bf16: sums in another order
    for got, wanted in zip((output, input_grad, bias_grad), (expected[0], expected[1], expected[3])):
        if wanted is None:
            assert got is None
        else:
            torch.testing.assert_close(got, wanted, **tolerance)
    if fused:
        assert overlapped.weight.grad_added_to_main_grad


def linears_worker(rank, world_size, port):
    init_megatron(rank, world_size, tp=world_size, port=port)
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_slimpack.runtime.model import tiny_config
    from megatron_slimpack.runtime.tp_overlap import OverlappedColumnParallelLinear, OverlappedRowParallelLinear

    config = tiny_config(num_attention_heads=6, hidden_size=48, tensor_model_parallel_size=world_size,
                         sequence_parallel=True)
    generator = torch.Generator().manual_seed(100 + rank)
    for bias, skip_bias_add, fused, dtype in [(False, False, False, torch.float32), (True, False, False, torch.float32),
                                              (True, True, False, torch.float32), (False, False, True, torch.float32),
                                              (True, False, False, torch.bfloat16)]:
        column, row = (tuple(module.to(dtype) for module in _pair(kind, config, overlapped, plain, bias=bias,
                                                                  skip_bias_add=skip_bias_add))
                       for kind, overlapped, plain in [("column", OverlappedColumnParallelLinear, ColumnParallelLinear),
                                                       ("row", OverlappedRowParallelLinear, RowParallelLinear)])
        for (plain, overlapped), rows, width in [(column, ROWS_PER_RANK, 12),
                                                 (row, ROWS_PER_RANK * world_size, 6)]:
            if fused:  # megatron's DDP gives every weight a main_grad; fusion accumulates into it
                overlapped.gradient_accumulation_fusion = True
                overlapped.weight.main_grad = torch.zeros_like(overlapped.weight)
                overlapped.weight.grad_added_to_main_grad = False
            _check(plain, overlapped, torch.randn(rows, 1, width, generator=generator).to(dtype), fused=fused)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_overlapped_linears_are_megatrons_sequence_parallel_linears(world_size):
    """Outputs, input, weight and bias gradients equal megatron's collective-then-GEMM linears
    (bias added or returned, gradient-accumulation fusion into main_grad, fp32 and bf16), the
    weight gradients bit for bit, with the ring in use."""
    run_multiprocess(linears_worker, world_size, timeout_s=120)


def _mlp_of(*args, **kwargs):
    """Stands in for megatron-core 0.18+'s `MLP.as_mlp_submodule` in a spec."""


def test_the_spec_swaps_local_linears_only_when_asked(megatron_cpu):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_slimpack.runtime.attention.core import slimpack_layer_spec
    from megatron_slimpack.runtime.model import tiny_config
    from megatron_slimpack.runtime.norm import sequence_parallel_spec
    from megatron_slimpack.runtime.tp_overlap import OverlappedColumnParallelLinear, OverlappedRowParallelLinear

    spec = slimpack_layer_spec("torch")
    config = tiny_config(num_layers=2)
    config.sequence_parallel, config.tensor_model_parallel_size = True, 2  # set after construction (tp=1 here)

    def linears(block):
        return [(layer.submodules.self_attention.submodules.linear_qkv,
                 layer.submodules.self_attention.submodules.linear_proj,
                 layer.submodules.mlp.submodules.linear_fc1, layer.submodules.mlp.submodules.linear_fc2)
                for layer in block.layer_specs]

    plain = sequence_parallel_spec(spec, config)
    assert linears(plain) == 2 * [(ColumnParallelLinear, RowParallelLinear, ColumnParallelLinear, RowParallelLinear)]
    overlapped = sequence_parallel_spec(spec, config, tp_overlap=True)
    assert linears(overlapped) == 2 * [(OverlappedColumnParallelLinear, OverlappedRowParallelLinear,
                                        OverlappedColumnParallelLinear, OverlappedRowParallelLinear)]
    assert linears(sequence_parallel_spec(spec, config)) == linears(plain)  # the given spec is not changed
    # megatron-core 0.18+ gives the MLP as a partial of MLP.as_mlp_submodule with its submodules
    mlp = spec.submodules.mlp
    as_partial = copy.copy(spec)
    as_partial.submodules = dataclasses.replace(spec.submodules, mlp=functools.partial(
        _mlp_of, submodules=mlp.submodules))
    swapped = sequence_parallel_spec(as_partial, config, tp_overlap=True).layer_specs[0].submodules.mlp
    assert swapped.func is _mlp_of and swapped.keywords["submodules"].linear_fc1 is OverlappedColumnParallelLinear
    assert swapped.keywords["submodules"].linear_fc2 is OverlappedRowParallelLinear
    assert as_partial.submodules.mlp.keywords["submodules"].linear_fc1 is ColumnParallelLinear  # not changed


def test_the_overlap_needs_sequence_parallelism_and_local_linears(megatron_cpu):
    from megatron_slimpack.runtime.attention.core import slimpack_layer_spec
    from megatron_slimpack.runtime.model import tiny_config
    from megatron_slimpack.runtime.norm import sequence_parallel_spec

    config = tiny_config(num_layers=2)
    config.tensor_model_parallel_size = 2
    with pytest.raises(ValueError, match="--sequence-parallel"):
        sequence_parallel_spec(slimpack_layer_spec("torch"), config, tp_overlap=True)
    config.sequence_parallel = True
    te_like = slimpack_layer_spec("torch")
    for name in ("linear_qkv", "linear_proj"):  # linears the swap does not know, as TE's are
        setattr(te_like.submodules.self_attention.submodules, name, torch.nn.Identity)
    for name in ("linear_fc1", "linear_fc2"):
        setattr(te_like.submodules.mlp.submodules, name, torch.nn.Identity)
    with pytest.raises(ValueError, match="--transformer-impl local"):
        sequence_parallel_spec(te_like, config, tp_overlap=True)


def test_a_run_asking_for_the_overlap_stops_on_a_model_without_it(megatron_cpu):
    """hooks.check_sliced_model's list: with --slimpack-tp-overlap under TP > 1, every layer linear
    that would run megatron's blocking collectives is named (a release building its layers another
    way would otherwise train slower than planned, silently)."""
    from megatron_slimpack.megatron.hooks import sliced_model_problems
    from megatron_slimpack.runtime.model import build_gpt_model, tiny_config

    models = {}
    for tp_overlap in (False, True):
        config = tiny_config(num_layers=2)
        config.sequence_parallel, config.tensor_model_parallel_size = True, 2  # one process: set after checks
        models[tp_overlap] = build_gpt_model(config, vocab_size=64, max_sequence_length=64, backend="torch",
                                             tp_overlap=tp_overlap)
    assert sliced_model_problems([models[True]], tp_overlap=True) == []
    assert sliced_model_problems([models[False]], tp_overlap=False) == []
    problems = sliced_model_problems([models[False]], tp_overlap=True)
    assert len(problems) == 2 * 4  # two layers, four linears each
    assert problems[0] == ("chunk 0 decoder.layers.0.self_attention.linear_qkv is ColumnParallelLinear, not the "
                           "TP overlap's OverlappedColumnParallelLinear")
