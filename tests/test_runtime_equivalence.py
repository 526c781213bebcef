"""Sliced execution gives the gradients of running every document whole (docs/design.md section 3)."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_grads_close, grads_of, random_plan, random_slicing, twin_models, whole_document_step

VOCAB = 64


def run_both(plan, documents, *, gqa: bool, position_embedding_type: str, num_layers: int = 2):
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, slimpack_forward_backward
    from megatron_slimpack.runtime.model import tiny_config

    config = tiny_config(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                         num_query_groups=2 if gqa else None)
    sliced, stock = twin_models(config, vocab_size=VOCAB, max_len=128, position_embedding_type=position_embedding_type)
    store = KVStore()
    result = slimpack_forward_backward(model=sliced, plan=plan, token_source=InMemoryTokenSource(documents),
                                       kv_store=store)
    assert len(store) == 0, "KV store must be empty after a step"
    assert result.num_loss_tokens == sum(len(d) - 1 for d in documents.values())
    reference_loss = whole_document_step(stock, documents, result.num_loss_tokens)
    assert result.loss == pytest.approx(reference_loss, rel=1e-6)
    assert_grads_close(grads_of(sliced), grads_of(stock), rtol=1e-5)
    return result


def random_case(seed: int, num_docs: int, max_len: int, max_slices: int):
    rng = random.Random(seed)
    lengths = {sid: rng.randint(1, max_len) for sid in range(num_docs)}
    documents = {sid: torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed + sid))
                 for sid, n in lengths.items()}
    slicings = {sid: random_slicing(rng, n, max_slices) for sid, n in lengths.items()}
    plan = random_plan(rng, slicings, num_micropacks=max(len(s) for s in slicings.values()) + rng.randint(0, 2))
    return plan, documents


@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), gqa=st.booleans(), rope=st.booleans())
def test_random_plans_match_whole_documents(megatron_cpu, seed, gqa, rope):
    plan, documents = random_case(seed, num_docs=4, max_len=40, max_slices=5)
    run_both(plan, documents, gqa=gqa, position_embedding_type="rope" if rope else "learned_absolute")


def test_edge_slicings(megatron_cpu):
    """A one-token slice, a one-token document, a document in ten slices, mixed MicroPacks."""
    from megatron_slimpack.plan import MicroPack, Plan, ReplicaPlan, Sample, Slice
    from megatron_slimpack.specs import ParallelConfig

    ten = [(i * 5, i * 5 + 5) for i in range(9)] + [(45, 47)]  # 47 tokens in ten slices
    packs = [[Slice(0, *ten[i])] for i in range(10)]
    packs[0].append(Slice(1, 0, 1))            # a one-token slice ...
    packs[3].append(Slice(1, 1, 20))
    packs[4].append(Slice(2, 0, 1))            # ... and a one-token document
    packs[9].insert(0, Slice(1, 20, 21))       # a one-token continuation, first in its pack
    micropacks = [MicroPack(p) for p in packs]
    replica = ReplicaPlan(micropacks, [[0, 1, 2], [3], [4, 5, 6, 7, 8, 9]], [], [], dp_ranks=[0])
    sequence = replica.backward_sequence()
    replica.backward_units = [sequence[:3], sequence[3:4], sequence[4:]]
    replica.stage_orders = [[("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]]
    plan = Plan([replica], [Sample(0, 47), Sample(1, 21), Sample(2, 1)], ParallelConfig(), 64, "test").validate()
    documents = {sid: torch.randint(0, VOCAB, (n,)) for sid, n in plan.sample_lengths().items()}
    result = run_both(plan, documents, gqa=True, position_embedding_type="rope", num_layers=1)
    assert [u.kind for u in result] == ["F", "F", "F", "B", "B", "B"]
    assert sum(u.loss_sum for u in result if u.kind == "F") == pytest.approx(result.loss_sum, rel=1e-12)
    assert all(u.loss_sum is None for u in result if u.kind == "B")


def test_forward_only_leaves_store_empty(megatron_cpu):
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, slimpack_forward_backward
    from megatron_slimpack.runtime.model import tiny_config

    plan, documents = random_case(7, num_docs=3, max_len=30, max_slices=3)
    sliced, _ = twin_models(tiny_config(num_layers=1, hidden_size=32, num_attention_heads=4),
                            vocab_size=VOCAB, max_len=64)
    store = KVStore()
    result = slimpack_forward_backward(model=sliced, plan=plan, token_source=InMemoryTokenSource(documents),
                                       kv_store=store, forward_only=True)
    assert len(store) == 0 and all(p.grad is None for p in sliced.parameters())
    assert [u.kind for u in result] == ["F"] * len(plan.replicas[0].forward_units)


def test_wrong_order_is_a_clear_error(megatron_cpu):
    from megatron_slimpack.plan import MicroPack, Slice
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, build_batch, forward_step
    from megatron_slimpack.runtime.model import tiny_config

    sliced, _ = twin_models(tiny_config(num_layers=1, hidden_size=32, num_attention_heads=4),
                            vocab_size=VOCAB, max_len=64)
    source = InMemoryTokenSource({0: torch.arange(10)})
    with pytest.raises(RuntimeError, match="earlier slices must run forward first"):
        forward_step(sliced, build_batch(MicroPack([Slice(0, 5, 10)]), source, KVStore()))
