"""The cost model's terms: kernel tables against their published rows, Megatron's recompute and
the memory terms against values worked out by hand for one layer, communication overlaps, and
`slimpack cost`."""
from __future__ import annotations

import json

import pytest

from megatron_slimpack.apps.cli import main as cli_main
from megatron_slimpack.costmodel import FIXED_SHAPE, SERIAL, SLIMPACK_RUNTIME, CostModel, fit_report
from megatron_slimpack.costmodel.kernels import ATTENTION_TABLES, AttentionRate, GemmRate
from megatron_slimpack.specs import ParallelConfig

LLAMA = CostModel.analytic("llama-7b", "h100-sxm", attention_backend="te")


def causal(length: int) -> float:
    return length * (length + 1) / 2


def test_every_published_kernel_row_is_predicted_within_ten_percent():
    rows = fit_report()
    assert len(rows) == sum(len(t.sizes) for t in ATTENTION_TABLES) + 3
    worst = max(rows, key=lambda row: abs(row["error"]))
    assert abs(worst["error"]) < 0.10, worst


def test_attention_is_priced_per_document_not_per_pack():
    """A pack of 32 documents of 512 tokens costs 32 of one such document, and runs at the
    512-token rate of the table (315 TFLOP/s for cuDNN), far below a 16K document's."""
    parallel = ParallelConfig()
    one = LLAMA.attention_time(512, causal(512), parallel, backward=False)
    pack = LLAMA.attention_time(32 * 512, 32 * causal(512), parallel, backward=False)
    assert pack == pytest.approx(32 * one)
    share = LLAMA.hardware.sustained_compute_share
    rate = 4 * 4096 * causal(512) / one / 1e12 / share
    assert rate == pytest.approx(315, rel=0.10)
    long_rate = 4 * 4096 * causal(16384) / LLAMA.attention_time(16384, causal(16384), parallel, False) / 1e12 / share
    assert long_rate == pytest.approx(539, rel=0.10)


def test_attention_backward_costs_more_than_two_and_a_half_forwards_for_short_documents():
    parallel = ParallelConfig()
    for length, low, high in ((512, 2.5, 3.0), (16384, 2.4, 2.7)):
        ratio = (LLAMA.attention_time(length, causal(length), parallel, True)
                 / LLAMA.attention_time(length, causal(length), parallel, False))
        assert low < ratio < high, (length, ratio)


def test_backends_are_priced_from_their_own_tables():
    flash = CostModel.analytic("llama-7b", "h100-sxm", attention_backend="flash")
    parallel = ParallelConfig()
    ratio = (flash.attention_time(16384, causal(16384), parallel, False)
             / LLAMA.attention_time(16384, causal(16384), parallel, False))
    assert ratio == pytest.approx(539 / 335, rel=0.05)  # cuDNN vs flash-attn 2 at 16K


def test_the_torch_backend_is_priced_from_its_measured_h100_table():
    """On a GPU the runtime's torch kernel is PyTorch's varlen flash attention, priced from this
    project's H100 measurement (117 TFLOP/s forward at 512 tokens, 288 at 16K), not as flash-attn 2."""
    torch_cost = CostModel.analytic("llama-7b", "h100-sxm", attention_backend="torch")
    flash = CostModel.analytic("llama-7b", "h100-sxm", attention_backend="flash")
    parallel = ParallelConfig()
    share = LLAMA.hardware.sustained_compute_share
    for length, measured in ((512, 117.4), (16384, 288.3)):
        seconds = torch_cost.attention_time(length, causal(length), parallel, False)
        assert 4 * 4096 * causal(length) / seconds / 1e12 / share == pytest.approx(measured, rel=0.10)
        assert seconds > flash.attention_time(length, causal(length), parallel, False)


def test_attention_fit_recovers_a_curve_of_its_own_form():
    truth = AttentionRate(600e12, 400.0)
    sizes = (512, 1024, 4096, 16384)
    table = ATTENTION_TABLES[0].__class__("attention", "x", "forward", True, 128, sizes,
                                          tuple(truth.tflops(s) for s in sizes), "synthetic")
    fitted = AttentionRate.fit(table)
    assert fitted.peak_flops == pytest.approx(600e12, rel=1e-6)
    assert fitted.half_length == pytest.approx(400.0, rel=1e-5)


def test_gemm_time_by_shape():
    gemm = GemmRate(800e12, 128.0)
    # 2mnk / (peak * f(m) f(n) f(k)), f(d) = d / (d + 128)
    expected = 2 * 1024 * 4096 * 512 / (800e12 * (1024 / 1152) * (4096 / 4224) * (512 / 640))
    assert gemm.seconds(1024, 4096, 512) == pytest.approx(expected)
    # a weight cut thin by tensor parallelism runs slower per FLOP
    assert gemm.tflops(4096, 512, 4096) < gemm.tflops(4096, 4096, 4096)


def test_selective_recompute_reruns_core_attention_and_full_recompute_the_layer():
    tokens, pairs = 8192.0, causal(8192)
    none = ParallelConfig()
    plain = LLAMA.layer_time(tokens, pairs, none, backward=True)
    attention_forward = LLAMA.attention_time(tokens, pairs, none, backward=False)
    selective = LLAMA.layer_time(tokens, pairs, none.with_(recompute="selective"), backward=True)
    full = LLAMA.layer_time(tokens, pairs, none.with_(recompute="full"), backward=True)
    assert selective - plain == pytest.approx(attention_forward)
    assert full - plain == pytest.approx(LLAMA.layer_time(tokens, pairs, none, backward=False))


def test_mlp_recompute_of_one_layer_by_hand():
    """`--recompute-modules core_attn mlp` (selective-mlp) on llama-7b, tp 2, bf16, fused attention:
    backward re-runs core attention and the MLP (fc1 4096 -> 2 x 11008 / 2, SwiGLU reading 2f and
    writing f, fc2 11008 / 2 -> 4096) and the MLP's two TP collectives; the MLP's checkpoint keeps
    its input and frees fc1's output (2f) and SwiGLU's (f), which one layer's backward holds again."""
    h, f, tokens, pairs = 4096, 11008, 8192.0, causal(8192)
    tp2 = ParallelConfig(tp=2)
    mlp_mode = tp2.with_(recompute="selective-mlp")
    gemm, share = LLAMA.kernels.gemm, LLAMA.hardware.sustained_compute_share
    mlp_forward = ((gemm.seconds(tokens, 2 * f / 2, h) + gemm.seconds(tokens, h, f / 2)) / share
                   + 3 * f * tokens * 2 / 2 / (LLAMA.hardware.memory_bandwidth * 0.8))
    assert LLAMA.mlp_forward_time(tokens, tp2) == pytest.approx(mlp_forward)
    plain = LLAMA.layer_time(tokens, pairs, tp2, backward=True)
    attention_forward = LLAMA.attention_time(tokens, pairs, tp2, backward=False)
    assert LLAMA.layer_time(tokens, pairs, mlp_mode, backward=True) - plain == pytest.approx(attention_forward
                                                                                            + mlp_forward)
    one_collective = LLAMA.tp_comm_time(tokens, tp2, backward=False) / 4
    assert LLAMA.tp_comm_time(tokens, mlp_mode, backward=True) == pytest.approx(8 * one_collective)
    layers = LLAMA.layers_per_stage(tp2)
    freed = (LLAMA.activation_bytes(tokens, pairs, tp2.with_(recompute="selective"))
             - LLAMA.activation_bytes(tokens, pairs, mlp_mode)) / layers
    assert freed == pytest.approx(tokens * (2 * f + f) * 2 / 2)
    assert LLAMA.recompute_peak_bytes(tokens, pairs, mlp_mode) == pytest.approx(tokens * (2 * f + f) * 2 / 2)
    # it sits between selective and full in both time and memory
    times = [LLAMA.layer_time(tokens, pairs, tp2.with_(recompute=mode), backward=True)
             for mode in ("selective", "selective-mlp", "full")]
    memory = [LLAMA.activation_bytes(tokens, pairs, tp2.with_(recompute=mode))
              for mode in ("selective", "selective-mlp", "full")]
    assert times == sorted(times) and memory == sorted(memory, reverse=True)


def test_block_recompute_of_a_chunk_by_hand():
    """block-3 on llama-7b pp 2 (16 layers a stage), tp 2: the first 3 layers of the chunk re-run
    their forward and keep only their inputs (h per token, bf16, the SP shard), the other 13 keep
    everything and re-run nothing; the chunk's stage time and activations are those 16 layers'
    sums, its TP collectives 3 layers' recomputed forward ones more, and a recomputed layer's
    backward holds one layer's activations again, as with full recompute."""
    h, tokens, pairs, prefix = 4096, 8192.0, causal(8192), 2048.0
    plain = ParallelConfig(tp=2, pp=2)
    block, full = plain.with_(recompute="block-3"), plain.with_(recompute="full")
    layers = LLAMA.layers_per_stage(plain)
    assert layers == 16
    forward = LLAMA.layer_time(tokens, pairs, plain, backward=False)
    backward = LLAMA.layer_time(tokens, pairs, plain, backward=True)
    assert layers * LLAMA.layer_time(tokens, pairs, block, backward=True) == pytest.approx(
        3 * (backward + forward) + 13 * backward)
    assert LLAMA.layer_time(tokens, pairs, block, backward=False) == pytest.approx(forward)
    forward_collectives = LLAMA.tp_comm_time(tokens, plain, backward=False)
    assert layers * LLAMA.tp_comm_time(tokens, block, backward=True) == pytest.approx(
        layers * LLAMA.tp_comm_time(tokens, plain, backward=True) + 3 * forward_collectives)
    kept = LLAMA.activation_bytes(tokens, pairs, plain, prefix_tokens=prefix) / layers
    assert LLAMA.activation_bytes(tokens, pairs, block, prefix_tokens=prefix) == pytest.approx(
        3 * tokens * h * 2 / 2 + 13 * kept)
    assert LLAMA.recompute_peak_bytes(tokens, pairs, block) == LLAMA.recompute_peak_bytes(tokens, pairs, full)
    stage = [LLAMA.backward_time(tokens, pairs, plain.with_(recompute=mode))
             for mode in ("none", "block-1", "block-8", "block-15", "full")]
    memory = [LLAMA.activation_bytes(tokens, pairs, plain.with_(recompute=mode))
              for mode in ("none", "block-1", "block-8", "block-15", "full")]
    assert stage == sorted(stage) and memory == sorted(memory, reverse=True)


def test_activation_terms_of_one_layer_by_hand():
    """llama-7b (h 4096, kv 4096, f 11008), bf16, fused attention: per token, the norm inputs and
    rstd (2h + 2), QKV output (h + 2kv), rotated q and k (h + kv), attention output (h), MLP input
    after norm (h), fc1 output (2f) and SwiGLU output (f); a prefix token adds its concatenated K
    and V (2kv)."""
    h, kv, f = 4096, 4096, 11008
    per_token = 2 * ((2 * h + 2) + (h + 2 * kv) + (h + kv) + h + h + 2 * f + f)
    parallel = ParallelConfig()
    one_layer = LLAMA.activation_bytes(1000.0, 0.0, parallel, prefix_tokens=300.0) / LLAMA.layers_per_stage(parallel)
    assert one_layer == pytest.approx(1000 * per_token + 300 * 2 * 2 * kv)
    # selective recompute frees what only the kernel saved (the prefix concatenation), nothing else
    selective = LLAMA.activation_bytes(1000.0, 0.0, parallel.with_(recompute="selective"), prefix_tokens=300.0)
    assert selective / LLAMA.layers_per_stage(parallel) == pytest.approx(1000 * per_token)
    # a slice's K/V kept for later slices: bf16 leaves and their fp32 gradient accumulators
    assert LLAMA.kv_cache_bytes(1000.0, parallel) == pytest.approx(32 * 2 * 1000 * kv * (2 + 4))
    # full recompute keeps each layer's input only
    full = LLAMA.activation_bytes(1000.0, 0.0, parallel.with_(recompute="full"))
    assert full / LLAMA.layers_per_stage(parallel) == pytest.approx(1000 * h * 2)


def test_rope_tables_fit_in_the_memory_the_budget_leaves_unused():
    """megatron's RoPE tables (fp32, power-of-two sizes up to the context, at most twice the
    largest) stay within the share of device memory no plan is given, at every context the grid
    plans, for every model preset on every GPU preset."""
    from megatron_slimpack.specs import HARDWARE, MODELS

    assert LLAMA.rope_table_bytes(131072) == 2 * 131072 * 128 * 4
    assert LLAMA.rope_table_bytes(100_000) == 2 * 131072 * 128 * 4
    for hardware in ("h100-sxm", "h200", "a100"):
        reserve = HARDWARE[hardware].memory_bytes * (1 - HARDWARE[hardware].usable_memory_fraction)
        for model in MODELS:
            cost = CostModel.analytic(model, hardware)
            assert cost.rope_table_bytes(256 * 1024) < 0.1 * reserve, (model, hardware)


def test_tp_communication_counts_megatrons_sequence_parallel_collectives():
    parallel = ParallelConfig(tp=2)
    forward = LLAMA.tp_comm_time(8192.0, parallel, backward=False)
    backward = LLAMA.tp_comm_time(8192.0, parallel, backward=True)
    latency = LLAMA.hardware.link_latency_s
    assert (backward - 6 * latency) / (forward - 4 * latency) == pytest.approx(6 / 4)
    one = 8192 * 4096 * 2 * (1 / 2) / LLAMA.hardware.intra_node_bandwidth
    assert forward == pytest.approx(4 * (one + latency))


def test_tp_overlap_hides_tp_communication_for_fixed_shape_strategies_only():
    parallel = ParallelConfig(tp=2)
    tokens, pairs = 8192.0, causal(8192)
    serial = LLAMA.stage_time(tokens, pairs, parallel, backward=False)
    overlapped = LLAMA.with_overlaps(FIXED_SHAPE).stage_time(tokens, pairs, parallel, backward=False)
    layers = LLAMA.layers_per_stage(parallel)
    # the modelled amount: all of it here, the GEMMs outlast the collectives
    assert serial - overlapped == pytest.approx(layers * LLAMA.tp_comm_time(tokens, parallel, False))
    assert LLAMA.with_overlaps(SERIAL) is LLAMA


def test_simulator_prices_each_strategy_with_its_declared_overlaps():
    import dataclasses

    import megatron_slimpack as ms

    lengths = [8192] * 16
    parallel = ParallelConfig(dp=2, tp=2)
    fixed = ms.plan(lengths, parallel=parallel, cost=LLAMA,
                    config=ms.SlimPackConfig(strategy="megatron-fixed", context_length=8192))
    with_overlap = ms.simulate(fixed, LLAMA).iteration_time_s
    # the same plan under a name that declares no overlaps is priced serially
    serial = ms.simulate(dataclasses.replace(fixed, strategy="hand-built"), LLAMA).iteration_time_s
    assert with_overlap < serial
    # SlimPack's price is its runtime's (TP rings, K/V gathered), whatever overlaps the caller's model carries
    slim = ms.plan(lengths, parallel=parallel, cost=LLAMA,
                   config=ms.SlimPackConfig(strategy="slimpack", context_length=8192))
    priced = ms.simulate(slim, LLAMA).iteration_time_s
    assert priced == ms.simulate(slim, LLAMA.with_overlaps(FIXED_SHAPE)).iteration_time_s
    assert priced == ms.simulate(slim, LLAMA, overlaps=SLIMPACK_RUNTIME).iteration_time_s
    assert priced < ms.simulate(slim, LLAMA, overlaps=SERIAL).iteration_time_s


def test_slimpack_cost_json(capsys):
    code = cli_main(["cost", "--model", "llama-7b", "--hardware", "h100-sxm", "--attention-backend", "te",
                     "--doc-length", "512", "--pack-tokens", "16384", "--tp", "1", "--json"])
    assert code == 0
    figures = json.loads(capsys.readouterr().out)
    for key in ("attention_forward_tflops", "attention_backward_tflops", "gemm_tflops", "layer_forward_ms",
                "layer_backward_ms"):
        assert figures[key] > 0, key
    assert figures["attention_forward_tflops"] == pytest.approx(315, rel=0.10)  # the cuDNN row at 512
    assert figures["attention_backward_tflops"] == pytest.approx(305, rel=0.10)
    assert figures["layer_backward_ms"] > 2 * figures["layer_forward_ms"] * 0.9
