"""Activation bytes saved for backward by the runtime (torch backend, fp32, tp=1) vs the cost model.

Measured itemisation (megatron-core 0.16.1 local spec, torch RMSNorm fallback, SwiGLU, torch math
SDPA), elements per layer:
  per token:  10h + 4d + 2 + 5f
    input/pre-MLP RMSNorm: x, x*rstd (2h each) + rstd (1 each); inputs of linear_qkv, linear_proj,
    linear_fc1 (h each); q (h, scaled copy in SDPA); K and V expanded to all heads for GQA (2h);
    RoPE cos and sin for q and k (4d, d = head dim); SwiGLU: fc1 output (2f), two f-sized
    intermediates (2f), fc2 input (f)
  per prefix token (K/V of earlier slices read from the store): 2h (expanded K and V)
  per (query, key) entry of each slice's [len x (start + len)] rectangle: heads (softmax
    probabilities; the math kernel keeps the masked upper triangle too)
Once per model (last stage), per token: final norm 2h+1, output-layer input h, cross-entropy
vocab (fp32), 8+1+4 bytes of labels/masks and 8 bytes of token ids.
"""
import random

import pytest
import torch

from conftest import SavedTensorMeter, random_plan, random_slicing, twin_models

H, HEADS, GROUPS, FFN, VOCAB, LAYERS = 64, 4, 2, 96, 64, 2


def itemised_bytes(micropacks) -> int:
    d, f = H // HEADS, FFN
    total = 0
    for mp in micropacks:
        tokens = mp.num_tokens
        prefix = sum(s.start for s in mp.slices)
        rectangle = sum(s.length * s.end for s in mp.slices)
        per_layer = tokens * (10 * H + 4 * d + 2 + 5 * f) + prefix * 2 * H + rectangle * HEADS
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
        predicted = cost.activation_bytes(mp.num_tokens, mp.attention_pairs, ParallelConfig(), last_stage=True,
                                          prefix_tokens=prefix)
        assert got == pytest.approx(predicted, rel=0.10)
