"""Measured on CPU: a TP=2 sequence-parallel MLP stack, megatron-core's linears against the
ring-overlapped ones (runtime/tp_overlap.py), forward + backward, in the same two gloo processes.

Each layer is megatron's local MLP shape: fc1 (ColumnParallelLinear, all-gather before the GEMM)
and fc2 (RowParallelLinear, reduce-scatter after it). The two variants alternate, step by step,
so load on the machine falls on both alike; the table gives the median step time of each and
their ratio for several token counts (MicroPack sizes).

    python benchmarks/tp_overlap_cpu.py --out benchmarks/results/tp_overlap_cpu.md

On CPU, gloo moves the chunks with its own threads on the same cores as the GEMMs, so this
measures what the ring costs and hides here, not what NVLink and SMs would; the simulator prices
the GPU overlap (docs/cost-model.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatron_slimpack.runtime.processes import spawn  # noqa: E402

TP = 2


def _init(rank: int, world_size: int, port: int) -> None:
    """gloo, megatron's TP group over every process, one thread each."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_slimpack.runtime import compat

    torch.set_num_threads(1)
    compat.apply()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    model_parallel_cuda_manual_seed(1234)


def _stack(config, layers: int, overlapped: bool):
    import torch.nn.init as init
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_slimpack.runtime.tp_overlap import OverlappedColumnParallelLinear, OverlappedRowParallelLinear

    column, row = ((OverlappedColumnParallelLinear, OverlappedRowParallelLinear) if overlapped
                   else (ColumnParallelLinear, RowParallelLinear))
    torch.manual_seed(0)
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    return [(column(hidden, ffn, config=config, init_method=init.normal_, bias=False, gather_output=False),
             row(ffn, hidden, config=config, init_method=init.normal_, bias=False, input_is_parallel=True,
                 skip_bias_add=False))
            for _ in range(layers)]


def _step(stack, x: torch.Tensor) -> float:
    started = time.perf_counter()
    hidden = x.clone().requires_grad_()
    out = hidden
    for fc1, fc2 in stack:
        out = fc2(torch.nn.functional.silu(fc1(out)[0]))[0] + out
    out.sum().backward()
    torch.distributed.barrier()
    return time.perf_counter() - started


def worker(rank, world_size, port, args, out_path):
    _init(rank, world_size, port)
    from megatron_slimpack.runtime.model import tiny_config

    config = tiny_config(hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden, num_attention_heads=8,
                         tensor_model_parallel_size=world_size, sequence_parallel=True)
    stacks = {variant: _stack(config, args.layers, variant == "overlapped") for variant in ("megatron", "overlapped")}
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens // world_size, 1, args.hidden, generator=torch.Generator().manual_seed(rank))
        times: dict[str, list[float]] = {variant: [] for variant in stacks}
        for step in range(args.warmup + args.steps):
            for variant, stack in stacks.items():
                seconds = _step(stack, x)
                if step >= args.warmup:
                    times[variant].append(seconds)
        rows.append((tokens, statistics.median(times["megatron"]), statistics.median(times["overlapped"])))
    if rank == 0:
        torch.save(rows, out_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    scratch = Path(args.out or "tp_overlap_cpu.md").with_suffix(".pt")
    started = time.perf_counter()
    spawn(worker, TP, (args, str(scratch)), timeout_s=3600)
    rows = torch.load(scratch)
    scratch.unlink()
    lines = [f"# Measured CPU TP overlap (TP={TP}, sequence parallel, 2 gloo processes x 1 thread)", "",
             f"A stack of {args.layers} MLP layers (hidden {args.hidden}, ffn {4 * args.hidden}, SiLU, fp32): "
             "fc1 megatron-core's ColumnParallelLinear, fc2 its RowParallelLinear, against the ring-overlapped "
             f"classes of runtime/tp_overlap.py; forward + backward, median of {args.steps} steps after "
             f"{args.warmup} warm-up, the two variants alternating step by step in the same processes. "
             f"Total wall time {time.perf_counter() - started:.0f} s.", "",
             "| tokens per MicroPack | megatron (s) | overlapped (s) | overlapped speedup |", "|---:|---:|---:|---:|"]
    lines += [f"| {tokens} | {plain:.4f} | {overlapped:.4f} | {plain / overlapped:.2f}x |"
              for tokens, plain, overlapped in rows]
    lines += ["", f"`python benchmarks/tp_overlap_cpu.py {' '.join(sys.argv[1:])}`. Machine: 2 shared CPU cores; "
              "gloo's transfer threads share them with the GEMMs, so this is not a GPU's overlap."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
