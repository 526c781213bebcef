"""`slimpack selftest`: a one-command check of this node (a user's first minutes on a cluster).

    slimpack selftest [--json] [--quick] [--profile PATH] [--device cpu|cuda]

Sections of the report (report.py runs them in this order):
  1. environment: torch / CUDA / cuDNN / transformer-engine / flash-attn / megatron-core versions,
     the device, and the attention backend `resolve_backend("auto")` picks and why (environment.py);
  2. attention: every available backend's sliced THD attention (slices with a KV prefix: bottom-right
     causal, GQA; bf16 on a GPU, fp32 on the CPU), forward and q/k/v gradients, against an explicit
     fp32 masked softmax (kernels.py);
  3. dp_merge: DP-Merge's context-parallel attention in one process: every member's share of a
     merged MicroPack (zigzag chunks and short slices dealt round-robin) through `PositionRuns` and
     the backend's kernel, assembled, against the unmerged call (kernels.py);
  4. training: a few steps of a small megatron-core GPT through `slimpack_forward_backward` (pp=1)
     on the layer spec the runtime picks, documents sliced vs the same documents whole (training.py);
  5. overhead: sliced vs whole-document attention time, the slicing overhead ratio (kernels.py);
  6. profile (with --profile PATH): a quick `slimpack profile` written as a cost-model JSON.

Without a GPU it says so, runs what it can on the CPU (torch backend, fp32) and marks the GPU-only
checks skipped with the reason. Exit 0 when every check that ran passed, 1 otherwise. With --json
the report is one JSON document on stdout; logs go to stderr.

This module stays light (no torch import) because cli.py imports it to build its parser.
"""
from __future__ import annotations


def add_selftest_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="the report as one JSON document on stdout (logs: stderr)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to run the checks (default: cuda when a GPU is visible, else cpu)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer steps and repeats")
    parser.add_argument("--profile", metavar="PATH", default=None,
                        help="also profile this device (small grid) and write the cost-model JSON here")


def selftest_main(args) -> int:
    from .report import main_from_args

    return main_from_args(args)
