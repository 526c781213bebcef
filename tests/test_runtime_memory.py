"""Activation bytes saved for backward by the runtime (torch backend, fp32, tp=1) vs the cost model.

Measured itemisation (megatron-core 0.16.1 local spec, torch RMSNorm fallback, SwiGLU, torch's
fused CPU flash SDPA), elements per layer:
  per token:  10h + 3kv + 4d + H + 2 + 5f
    input RMSNorm x, rstd, output and linear_qkv's input (3h + 1); RoPE cos and sin for q and k
    (4d, d = head dim); SDPA: rotated q (h), rotated k (kv), the QKV output that v views (h + 2kv),
    its output (h) and log-sum-exp (H heads); linear_proj's input, pre-MLP RMSNorm, linear_fc1's
    input (4h + 1); SwiGLU: fc1 output (2f), two f-sized intermediates (2f), fc2 input (f)
  a MicroPack with a KV prefix concatenates K and V per segment: 2kv per key (prefix or own)
    instead of the rotated k and the QKV output (h + 3kv per token); a prefixed slice's blockwise
    attention (kernels.PrefixCausalAttention) saves its output and fp32 log-sum-exp like SDPA does,
    and no query x key mask
Once per model (last stage), per token: final norm 2h+1, output-layer input h, cross-entropy
vocab (fp32), 8+1+4 bytes of labels/masks and 8 bytes of token ids.
"""
import random

import pytest
import torch

from conftest import SavedTensorMeter, random_plan, random_slicing, twin_models

H, HEADS, GROUPS, FFN, VOCAB, LAYERS = 64, 4, 2, 96, 64, 2


def itemised_bytes(micropacks) -> int:
    d, f, kv = H // HEADS, FFN, H // HEADS * GROUPS
    total = 0
    for mp in micropacks:
        tokens = mp.num_tokens
        prefix = sum(s.start for s in mp.slices)
        per_layer = tokens * (10 * H + 3 * kv + 4 * d + HEADS + 2 + 5 * f)
        if prefix:
            per_layer += 2 * kv * (prefix + tokens) - tokens * (H + 3 * kv)
        total += 4 * LAYERS * per_layer + tokens * (4 * (3 * H + 1 + VOCAB) + 8 + 1 + 4 + 8)
    return total


@pytest.fixture(scope="module")
def measured(megatron_cpu):
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, build_batch, forward_step
    from megatron_slimpack.runtime.model import tiny_config

    rng = random.Random(3)
    lengths = {sid: rng.randint(20, 90) for sid in range(5)}
    plan = random_plan(rng, {sid: random_slicing(rng, n, 3) for sid, n in lengths.items()}, 4)
    documents = {sid: torch.randint(0, VOCAB, (n,)) for sid, n in lengths.items()}
    config = tiny_config(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS,
                         num_query_groups=GROUPS, ffn_hidden_size=FFN)
    model, _ = twin_models(config, vocab_size=VOCAB, max_len=128)
    source, store = InMemoryTokenSource(documents), KVStore()
    micropacks = plan.replicas[0].micropacks
    results = []
    for mp in micropacks:
        with SavedTensorMeter(model) as meter:
            forward_step(model, build_batch(mp, source, store))
        results.append(meter.bytes)
    store.clear()
    return micropacks, results


def test_saved_bytes_match_itemisation(measured):
    micropacks, results = measured
    for mp, got in zip(micropacks, results):
        assert got == pytest.approx(itemised_bytes([mp]), rel=0.01)


def test_saved_bytes_within_10pct_of_cost_model(measured):
    from megatron_slimpack.costmodel import CostModel
    from megatron_slimpack.specs import ModelSpec, ParallelConfig, get_hardware

    spec = ModelSpec("test", LAYERS, H, FFN, HEADS, num_query_groups=GROUPS, vocab_size=VOCAB)
    cost = CostModel(spec, get_hardware("cpu"), dtype_bytes=4, attention_backend="torch")
    micropacks, results = measured
    for mp, got in zip(micropacks, results):
        prefix = sum(s.start for s in mp.slices)
        masked = sum(s.length * s.end for s in mp.slices if s.start > 0)
        predicted = cost.activation_bytes(mp.num_tokens, mp.attention_pairs, ParallelConfig(), last_stage=True,
                                          prefix_tokens=prefix, masked_entries=masked)
        assert got == pytest.approx(predicted, rel=0.10)
