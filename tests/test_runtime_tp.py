"""Tensor parallelism (megatron-core's own layers, gloo): sliced == whole documents on each rank."""
import random

import pytest
import torch

from conftest import (
    assert_grads_close,
    grads_of,
    init_megatron,
    random_plan,
    random_slicing,
    run_multiprocess,
    twin_models,
    whole_document_step,
)


def tp_worker(rank, world_size, port, seed):
    init_megatron(rank, world_size, tp=world_size, port=port)
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, slimpack_forward_backward
    from megatron_slimpack.runtime.model import tiny_config

    rng = random.Random(seed)  # same plan and documents on every rank
    lengths = {sid: rng.randint(1, 30) for sid in range(3)}
    plan = random_plan(rng, {sid: random_slicing(rng, n, 4) for sid, n in lengths.items()}, 4)
    documents = {sid: torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(sid))
                 for sid, n in lengths.items()}
    config = tiny_config(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                         tensor_model_parallel_size=world_size)
    sliced, stock = twin_models(config, vocab_size=64, max_len=64)
    store = KVStore()
    result = slimpack_forward_backward(model=sliced, plan=plan, token_source=InMemoryTokenSource(documents),
                                       kv_store=store)
    assert len(store) == 0
    reference = whole_document_step(stock, documents, result.num_loss_tokens)
    assert result.loss == pytest.approx(reference, rel=1e-6)
    assert_grads_close(grads_of(sliced), grads_of(stock), rtol=1e-5)


@pytest.mark.slow
def test_tensor_parallel_two_ranks():
    run_multiprocess(tp_worker, 2, 11, timeout_s=150)
