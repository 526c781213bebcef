"""`slimpack cost`: what the cost model predicts for one layer and one pack, so it can be read and questioned.

A pack of `--pack-tokens` tokens made of whole documents of `--doc-length` tokens (the last one
shorter where they do not divide) on one device of the layout: the layer's GEMM and attention
rates, each part's milliseconds forward and backward, the communication and how much of it the
strategy's overlaps hide, and the activation bytes it holds. TFLOP/s figures are the kernel
rates of the published tables (or of a kernel profile's measured ones: `--cost-model FILE`, from
`slimpack profile --kernels`); the milliseconds include `sustained_compute_share`.
"""
from __future__ import annotations

import argparse
import json

from ..costmodel import CostModel, read_kernel_profile
from ..planner.strategies import strategy_spec
from ..specs import HARDWARE, ParallelConfig
from .cli_options import RECOMPUTE_HELP, add_model_option, positive_int, recompute_mode

BACKENDS = ("te", "flash", "flash3", "torch")


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_option(parser, "llama-7b", "model preset (default: llama-7b)")
    parser.add_argument("--hardware", default="h100-sxm", choices=list(HARDWARE), metavar="HARDWARE",
                        help=f"hardware preset (default: h100-sxm); one of: {', '.join(HARDWARE)}")
    parser.add_argument("--cost-model", default="analytic", metavar="{analytic,PATH}",
                        help="'analytic' (the published kernel tables of --hardware) or a kernel profile written by "
                             "`slimpack profile --kernels`, whose measured tables replace the ones they measure")
    parser.add_argument("--attention-backend", default="te", choices=BACKENDS,
                        help="attention kernel priced: te (cuDNN fused, Transformer Engine), flash (flash-attn 2), "
                             "flash3 (published rates only: the runtime has no FA3 path), torch (default: te)")
    parser.add_argument("--doc-length", type=positive_int, default=4096, help="tokens per document (default 4096)")
    parser.add_argument("--pack-tokens", type=positive_int, default=None,
                        help="tokens in the pack (default: one document)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor parallel size")
    parser.add_argument("--cp", type=positive_int, default=1, help="context parallel size")
    parser.add_argument("--recompute", default="none", type=recompute_mode, metavar="MODE", help=RECOMPUTE_HELP)
    parser.add_argument("--strategy", default="slimpack",
                        help="whose overlaps price the communication (default slimpack: TP rings, blocking CP)")
    parser.add_argument("--json", action="store_true", help="the figures as one JSON document")


def pack_figures(doc_length: int, pack_tokens: int) -> tuple[float, float]:
    """(tokens, causal attention pairs) of `pack_tokens` tokens of whole documents of `doc_length`."""
    whole, rest = divmod(pack_tokens, doc_length)
    pairs = whole * doc_length * (doc_length + 1) / 2 + rest * (rest + 1) / 2
    return float(pack_tokens), pairs


def significant(value: float) -> float:
    """Four significant digits: an H100's 319.5 TFLOP/s and a CPU's 0.02874 alike."""
    return float(f"{value:.4g}")


def cost_figures(cost: CostModel, parallel: ParallelConfig, doc_length: int, pack_tokens: int) -> dict:
    tokens, pairs = pack_figures(doc_length, pack_tokens)
    local = tokens / parallel.cp
    # Kernel rates as the published tables state them (burst); the times below include the
    # share of them a device sustains through training.
    tera = 1e12 * cost.hardware.sustained_compute_share
    gemm_flops = 2.0 * local * cost.model.params_per_layer / parallel.tp
    attention_flops = 4.0 * pairs / parallel.cp * cost.model.hidden_size / parallel.tp
    figures: dict = {"model": cost.model.name, "hardware": cost.hardware.name,
                     "attention_backend": cost.attention_backend, "kernels": cost.kernels.name,
                     "doc_length": doc_length, "pack_tokens": pack_tokens, "layout": parallel.describe(),
                     "sustained_compute_share": cost.hardware.sustained_compute_share,
                     "overlaps": cost.overlaps.to_dict()}
    for backward in (False, True):
        key = "backward" if backward else "forward"
        gemm = cost.gemm_time(local, parallel) * (2.0 if backward else 1.0)
        attention = cost.attention_time(tokens, pairs, parallel, backward)
        attention_flops_pass = attention_flops * (2.5 if backward else 1.0)
        figures[f"attention_{key}_tflops"] = significant(attention_flops_pass / attention / tera)
        figures[f"gemm_{key}_ms"] = round(gemm * 1e3, 4)
        figures[f"attention_{key}_ms"] = round(attention * 1e3, 4)
        figures[f"elementwise_{key}_ms"] = round(cost.elementwise_time(local, parallel, backward) * 1e3, 4)
        figures[f"tp_comm_{key}_ms"] = round(cost.tp_comm_time(tokens, parallel, backward) * 1e3, 4)
        figures[f"tp_comm_{key}_exposed_ms"] = round(float(cost.exposed_tp_comm_time(tokens, parallel, backward))
                                                     * 1e3, 4)
        figures[f"cp_comm_{key}_exposed_ms"] = round(
            float(cost.exposed_cp_comm_time(tokens, pairs, parallel, backward)) * 1e3, 4)
        layer = cost.stage_time(tokens, pairs, parallel, backward=backward) - cost.hardware.kernel_overhead_s
        figures[f"layer_{key}_ms"] = round(layer / cost.layers_per_stage(parallel) * 1e3, 4)
    figures["gemm_tflops"] = significant(gemm_flops / (figures["gemm_forward_ms"] / 1e3) / tera)
    figures["recompute_ms"] = round(cost._recompute_time(tokens, pairs, parallel) * 1e3, 4)
    figures["activation_bytes_per_layer"] = round(float(cost.activation_bytes(tokens, pairs, parallel))
                                                  / cost.layers_per_stage(parallel))
    return figures


def cost_main(args) -> int:
    parallel = ParallelConfig(tp=args.tp, cp=args.cp, recompute=args.recompute)
    if args.cost_model != "analytic":
        read_kernel_profile(args.cost_model)  # a model profile prices whole layers, not the parts shown here
    cost = CostModel.load(args.cost_model, args.model, args.hardware, attention_backend=args.attention_backend)
    parallel.check_model(cost.model)
    spec = strategy_spec(args.strategy)  # a clear error for an unknown name; registers every strategy
    cost = cost.with_overlaps(spec.overlaps)
    figures = cost_figures(cost, parallel, args.doc_length, args.pack_tokens or args.doc_length)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    width = max(map(len, figures))
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")
    return 0
