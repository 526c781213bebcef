"""CPU throughput of sliced execution vs running each document whole (same model, same tokens).

    python benchmarks/slicing_overhead.py [--slices 512 256 128 64] [--repeats 3]

Documents are cut into slices of at most S tokens; MicroPack k holds the k-th slice of every
document (so MicroPacks mix documents and later slices read a KV prefix); one forward unit and
one backward unit per MicroPack, all forwards then all backwards. "whole" is the same runtime with
one slice per document (one MicroPack); "stock" runs each document through a stock megatron-core
GPTModel (local spec, its own attention), same weights. Prints training tokens/s (forward +
backward) and the ratio to whole. With the torch reference kernel, slicing can be faster than
whole: the math kernel computes each slice's [len x (start + len)] score rectangle, whose total
shrinks as slices get shorter, while per-MicroPack overheads grow.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_slimpack.plan import MicroPack, Plan, ReplicaPlan, Sample, Slice  # noqa: E402
from megatron_slimpack.specs import ParallelConfig, get_model  # noqa: E402


def sliced_plan(lengths: list[int], slice_tokens: int) -> Plan:
    rounds = max(-(-n // slice_tokens) for n in lengths)
    packs = [[Slice(sid, k * slice_tokens, min(n, (k + 1) * slice_tokens))
              for sid, n in enumerate(lengths) if k * slice_tokens < n] for k in range(rounds)]
    micropacks = [MicroPack(p) for p in packs]
    replica = ReplicaPlan(micropacks, [[i] for i in range(len(micropacks))], [], [], dp_ranks=[0])
    replica.backward_units = [[i] for i in replica.backward_sequence()]
    replica.stage_orders = [[("F", i) for i in range(len(micropacks))] + [("B", i) for i in range(len(micropacks))]]
    samples = [Sample(sid, n) for sid, n in enumerate(lengths)]
    return Plan([replica], samples, ParallelConfig(), max(lengths), "bench").validate()


def setup_megatron() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_slimpack.runtime import compat

    compat.apply()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        parallel_state.initialize_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 512, 256, 256])
    parser.add_argument("--slices", type=int, nargs="+", default=[512, 256, 128, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup_megatron()
    from megatron_slimpack.runtime import InMemoryTokenSource, slimpack_forward_backward
    from megatron_slimpack.runtime.model import build_gpt_model, tiny_config

    spec = get_model("tiny")  # 4 layers, hidden 128, 4 heads / 2 KV groups
    config = tiny_config(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                         num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
                         ffn_hidden_size=spec.ffn_hidden_size)
    torch.manual_seed(0)
    model = build_gpt_model(config, vocab_size=spec.vocab_size, max_sequence_length=max(args.lengths), backend="torch")
    documents = {sid: torch.randint(0, spec.vocab_size, (n,)) for sid, n in enumerate(args.lengths)}
    source = InMemoryTokenSource(documents)
    tokens = sum(args.lengths)

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    stock = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=spec.vocab_size,
                     max_sequence_length=max(args.lengths), position_embedding_type="rope")
    stock.load_state_dict(model.state_dict())

    def run_stock():
        for ids in documents.values():
            loss = stock(ids[None, :-1], torch.arange(len(ids) - 1)[None, :], None, labels=ids[None, 1:])
            (loss.sum() / tokens).backward()

    def tokens_per_s(step) -> float:
        best = float("inf")
        for _ in range(args.repeats + 1):  # the first run warms up
            model.zero_grad(set_to_none=True)
            stock.zero_grad(set_to_none=True)
            began = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - began)
        return tokens / best

    def run_plan(plan: Plan):
        return lambda: slimpack_forward_backward(model=model, plan=plan, token_source=source)

    whole = tokens_per_s(run_plan(sliced_plan(args.lengths, max(args.lengths))))
    stock_rate = tokens_per_s(run_stock)
    print(f"model {spec.name} ({spec.num_layers} layers, h={spec.hidden_size}), documents {args.lengths}, "
          f"{args.threads} thread(s), best of {args.repeats}")
    print(f"{'slice tokens':>12} {'MicroPacks':>10} {'tokens/s':>10} {'vs whole':>9}")
    print(f"{'stock':>12} {'-':>10} {stock_rate:>10.0f} {stock_rate / whole:>9.2f}")
    print(f"{'whole':>12} {1:>10} {whole:>10.0f} {1.0:>9.2f}")
    for size in args.slices:
        plan = sliced_plan(args.lengths, size)
        rate = tokens_per_s(run_plan(plan))
        print(f"{size:>12} {len(plan.replicas[0].micropacks):>10} {rate:>10.0f} {rate / whole:>9.2f}")


if __name__ == "__main__":
    main()
