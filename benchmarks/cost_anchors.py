"""The cost model against published H100 figures: kernels, then whole training runs.

    python benchmarks/cost_anchors.py            # the tables docs/cost-model.md quotes
    python benchmarks/cost_anchors.py --json
    python benchmarks/cost_anchors.py --fit      # the sustained compute share these runs imply

Kernels: every row of `costmodel/kernels.py`'s published tables next to the fitted curve.
End to end: Megatron-LM's weak-scaling runs (README "Model table": Megatron-Core r0.8.0, GPT with
a GELU MLP of 4h, vocabulary 131072, sequence 4096, 48-way data parallelism on H100s, with
`--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap`) simulated as `megatron-fixed`
plans of the same layout and batch (plain 1F1B: the README states no interleaving; the
distributed optimizer; no recompute). Per-GPU TFLOP/s are counted as Megatron counts them
(attention over the full s x s score matrix, forward x 3): `megatron_model_flops`.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import megatron_slimpack as ms
from megatron_slimpack.costmodel import fit_report
from megatron_slimpack.specs import ModelSpec, ParallelConfig, get_hardware

SEQUENCE = 4096
DP = 48
VOCAB = 131072
# (name, heads, hidden, layers, tp, pp, global batch, published TFLOP/s per GPU)
MEGATRON_WEAK_SCALING = (
    ("1.7B", 16, 2048, 24, 1, 1, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 3072, 459.9),
)
SOURCE = ("Megatron-LM README, 'Model table' (images/model_table.png): weak scaling on H100, Megatron-Core r0.8.0, "
          "sequence 4096, vocabulary 131072")


def megatron_model_flops(model: ModelSpec, sequences: int, sequence: int) -> float:
    """Megatron's FLOP count of a step: 2 x weights per token and 4 x s x h of attention per
    token and layer (the full score matrix), plus the logits, forward x 3."""
    per_token = model.num_layers * (2 * model.params_per_layer + 4 * sequence * model.hidden_size)
    per_token += 2 * model.hidden_size * model.vocab_size
    return 3.0 * sequences * sequence * per_token


def end_to_end(hardware) -> list[dict]:
    rows = []
    for name, heads, hidden, layers, tp, pp, batch, published in MEGATRON_WEAK_SCALING:
        model = ModelSpec(f"gpt-{name.lower()}", layers, hidden, 4 * hidden, heads, vocab_size=VOCAB, swiglu=False)
        cost = ms.CostModel.analytic(model, hardware)
        parallel = ParallelConfig(dp=DP, tp=tp, pp=pp)
        config = ms.SlimPackConfig(strategy="megatron-fixed", context_length=SEQUENCE)
        plan = ms.plan([SEQUENCE] * batch, parallel=parallel, cost=cost, config=config)
        report = ms.simulate(plan, cost)
        gpus = parallel.world_size
        predicted = megatron_model_flops(model, batch, SEQUENCE) / report.iteration_time_s / gpus / 1e12
        rows.append({"model": name, "layout": parallel.describe(), "gpus": gpus, "batch": batch,
                     "step_s": round(report.iteration_time_s, 4), "published_tflops": published,
                     "model_tflops": round(predicted, 1), "ratio": round(predicted / published, 3)})
    return rows


def fit_sustained_share(hardware_name: str) -> float:
    """The share minimising the squared log error over the end-to-end rows (fixed point: the
    predicted rate scales nearly in proportion to the compute share)."""
    hardware = replace(get_hardware(hardware_name), sustained_compute_share=1.0)
    share = 1.0
    for _ in range(6):
        rows = end_to_end(replace(hardware, sustained_compute_share=share))
        mean_log = sum(math.log(row["ratio"]) for row in rows) / len(rows)
        share *= math.exp(-mean_log)
    return share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fit", action="store_true", help="print the sustained compute share these runs imply")
    args = parser.parse_args()
    if args.fit:
        print(f"sustained_compute_share for {args.hardware}: {fit_sustained_share(args.hardware):.3f}")
        return
    kernels = fit_report()
    runs = end_to_end(get_hardware(args.hardware))
    if args.json:
        print(json.dumps({"kernels": kernels, "end_to_end": runs, "end_to_end_source": SOURCE}, indent=2))
        return
    print("kernel                         size  published  model   error")
    for row in kernels:
        label = f"{row['kernel']} {row['backend']} {row['direction']}"
        print(f"{label:<30} {row['size']:>5}  {row['published_tflops']:>9.1f}  {row['model_tflops']:>6.1f}  "
              f"{row['error']:+.1%}")
    print(f"\nend to end ({SOURCE})")
    print("model  layout                 step_s  published  model   ratio")
    for row in runs:
        print(f"{row['model']:<6} {row['layout']:<22} {row['step_s']:>6.3f}  {row['published_tflops']:>9.1f}  "
              f"{row['model_tflops']:>6.1f}  {row['ratio']:.3f}")
    worst = max(abs(row["ratio"] - 1) for row in runs)
    print(f"largest end-to-end error: {worst:.1%}")


if __name__ == "__main__":
    main()
