"""`--slimpack` and `--slimpack-*` flags for Megatron-LM's argument parser (design.md section 7).

Megatron-LM 0.16/0.17: `pretrain(..., extra_args_provider=add_slimpack_args)`; 0.18+:
`parse_and_validate_args(extra_args_provider=add_slimpack_args, ...)`. Both call the provider
with Megatron's `argparse.ArgumentParser` and expect it back. `with_slimpack_args(other)`
chains another provider (e.g. ModelOpt's `add_modelopt_args`, which `pretrain_gpt.py` passes).

`validate_slimpack_args(args)` checks the combination with Megatron's own flags and raises
`SlimPackArgumentError` (a ValueError) with a message that names the flag to change.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

# megatron-core versions whose trainer seams (design.md section 7) hooks.py knows.
SUPPORTED_MCORE = ((0, 16), (0, 17), (0, 18), (0, 19))
# The strategies the Megatron integration trains with (each tested through the real trainer,
# tests/test_real_megatron.py); the others are simulated for comparison only.
STRATEGY_CHOICES = ("slimpack", "slimpack-sym", "slimpack-nomerge", "megatron-fixed", "bfd", "sorted",
                    "wlb-llm", "slimpipe")


class SlimPackArgumentError(ValueError):
    """A --slimpack flag combination that cannot run; the message names the fix."""


def add_slimpack_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the SlimPack argument group to Megatron's parser (an `extra_args_provider`)."""
    group = parser.add_argument_group(title="slimpack", description="SlimPack fine-grained asymmetric packing")
    group.add_argument("--slimpack", action="store_true",
                       help="Plan every global batch with SlimPack and run it with the SlimPack pipeline schedule. "
                            "Requires --calculate-per-token-loss.")
    group.add_argument("--slimpack-strategy", default="slimpack",
                       help="Planning strategy (default slimpack; ablations slimpack-sym, slimpack-nomerge; "
                            "baselines megatron-fixed, bfd, sorted, wlb-llm, slimpipe).")
    group.add_argument("--slimpack-slice-tokens", type=int, default=None,
                       help="Target slice size of long documents in tokens (default: the planner tries several).")
    group.add_argument("--slimpack-max-micropack-tokens", type=int, default=None,
                       help="Token cap of one MicroPack (default: the largest that fits memory, at most --seq-length).")
    group.add_argument("--slimpack-solver-time-limit", type=float, default=0.5,
                       help="CP-SAT time limit in seconds for the DP phase of each step (default 0.5).")
    group.add_argument("--slimpack-solver-deterministic-limit", type=float, default=None, metavar="UNITS",
                       help="Also stop CP-SAT after this much deterministic time (its work units, about seconds), "
                            "so a rerun plans the same batches the same way under any machine load (default: "
                            "the wall-clock limit only).")
    group.add_argument("--slimpack-plan-ahead", type=int, default=1,
                       help="Global batches planned ahead in a background thread (default 1; 0 plans inline).")
    group.add_argument("--slimpack-dp-merge", dest="slimpack_dp_merge", action="store_true", default=True,
                       help="Let outlier documents be shared by a DP-Merge group (default).")
    group.add_argument("--no-slimpack-dp-merge", dest="slimpack_dp_merge", action="store_false",
                       help="Disable DP-Merge.")
    group.add_argument("--slimpack-base-merge", type=int, default=1, metavar="K",
                       help="Share every MicroPack by a DP-Merge group of K data-parallel replicas (context "
                            "parallelism inside the group; keep --context-parallel-size 1). This is what a SlimPack "
                            "layout with cp K from `slimpack compare` runs as. Default 1: only outliers are shared.")
    group.add_argument("--slimpack-cost-model", default="analytic", metavar="{analytic,PATH}",
                       help="'analytic' or a profile JSON written by `slimpack profile` (default analytic).")
    group.add_argument("--slimpack-hardware", default="h100-sxm",
                       help="Hardware preset for the analytic cost model (default h100-sxm).")
    group.add_argument("--slimpack-dump-plans", default=None, metavar="DIR",
                       help="Write each step's plan JSON to DIR (rank 0).")
    return parser


def with_slimpack_args(other: Optional[Callable] = None) -> Callable:
    """An extra_args_provider that adds another provider's flags and then SlimPack's."""
    def provider(parser):
        if other is not None:
            parser = other(parser) or parser
        return add_slimpack_args(parser)

    return provider


def mcore_version() -> tuple[int, int, int]:
    try:
        from megatron.core.package_info import __version__ as text
    except ImportError:  # pragma: no cover - very old megatron-core
        import megatron.core

        text = getattr(megatron.core, "__version__", "0.0.0")
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def check_mcore_version(version: Optional[tuple] = None) -> tuple:
    version = tuple(version or mcore_version())
    if tuple(version[:2]) not in SUPPORTED_MCORE:
        known = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_MCORE)
        raise SlimPackArgumentError(
            f"--slimpack: megatron-core {'.'.join(map(str, version))} is not supported (supported: {known}); "
            "install a supported megatron-core or run without --slimpack"
        )
    return version


def validate_slimpack_args(args, version: Optional[tuple] = None) -> None:
    """Raise SlimPackArgumentError for a combination SlimPack cannot run. No-op without --slimpack."""
    if not getattr(args, "slimpack", False):
        return
    check_mcore_version(version)
    problems = []
    if not getattr(args, "calculate_per_token_loss", False):
        problems.append("--slimpack needs --calculate-per-token-loss (the loss is divided once by the global "
                        "batch's token count, never per micro-batch)")
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp not in (None, 1) or getattr(args, "num_layers_per_virtual_pipeline_stage", None):
        problems.append("--slimpack does not support the interleaved (virtual) pipeline schedule: remove "
                        "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        problems.append("--slimpack cannot be combined with --context-parallel-size > 1: SlimPack slices long "
                        "documents instead (and shares outliers through DP-Merge); use --context-parallel-size 1, "
                        "and --slimpack-base-merge K to share every MicroPack by K data-parallel replicas")
    if getattr(args, "hybrid_context_parallel", False):
        problems.append("--slimpack cannot be combined with --hybrid-context-parallel")
    if getattr(args, "sequence_parallel", False) and (getattr(args, "tensor_model_parallel_size", 1) or 1) > 1:
        problems.append("--slimpack does not support --sequence-parallel yet (MicroPacks are not padded to a "
                        "multiple of the TP size): remove --sequence-parallel")
    if getattr(args, "apply_rope_fusion", False):
        problems.append("--slimpack needs --no-rope-fusion: the fused THD RoPE restarts positions at 0 per slice")
    if (getattr(args, "micro_batch_size", 1) or 1) != 1:
        problems.append("--slimpack needs --micro-batch-size 1 (a MicroPack is one packed THD sequence)")
    strategy = getattr(args, "slimpack_strategy", "slimpack")
    if strategy not in STRATEGY_CHOICES:
        from ..solver.strategies import strategy_names

        why = ("is simulated for comparison only: the SlimPack runtime does not run it"
               if strategy in strategy_names() else "is unknown")
        problems.append(f"--slimpack-strategy {strategy!r} {why}; choose one of {', '.join(STRATEGY_CHOICES)}")
    base_merge = getattr(args, "slimpack_base_merge", 1) or 1
    dp = getattr(args, "data_parallel_size", None)
    if base_merge < 1 or base_merge & (base_merge - 1):
        problems.append(f"--slimpack-base-merge must be a power of two >= 1, got {base_merge}")
    elif base_merge > 1 and dp and dp % base_merge:
        problems.append(f"--slimpack-base-merge {base_merge} must divide the data-parallel size {dp}")
    elif base_merge > 1 and not getattr(args, "slimpack_dp_merge", True):
        problems.append("--slimpack-base-merge > 1 shares MicroPacks through DP-Merge: remove --no-slimpack-dp-merge")
    for flag in ("slimpack_slice_tokens", "slimpack_max_micropack_tokens"):
        value = getattr(args, flag, None)
        if value is not None and value <= 0:
            problems.append(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    seq_length = getattr(args, "seq_length", None)
    cap = getattr(args, "slimpack_max_micropack_tokens", None)
    if cap is not None and seq_length and cap > seq_length:
        problems.append(f"--slimpack-max-micropack-tokens {cap} exceeds --seq-length {seq_length}")
    if (getattr(args, "slimpack_solver_time_limit", 0.5) or 0) <= 0:
        problems.append("--slimpack-solver-time-limit must be > 0 seconds")
    deterministic = getattr(args, "slimpack_solver_deterministic_limit", None)
    if deterministic is not None and deterministic <= 0:
        problems.append(f"--slimpack-solver-deterministic-limit must be > 0, got {deterministic}")
    if (getattr(args, "slimpack_plan_ahead", 1) or 0) < 0:
        problems.append("--slimpack-plan-ahead must be >= 0")
    cost = getattr(args, "slimpack_cost_model", "analytic")
    if cost != "analytic":
        from pathlib import Path

        if not Path(cost).is_file():
            problems.append(f"--slimpack-cost-model {cost!r} is neither 'analytic' nor an existing profile JSON "
                            "(create one with `slimpack profile`)")
    if problems:
        raise SlimPackArgumentError("invalid SlimPack arguments:\n  - " + "\n  - ".join(problems))


def slimpack_config_from_args(args):
    """The planner's `SlimPackConfig` from parsed Megatron arguments."""
    from ..config import SlimPackConfig

    return SlimPackConfig(
        strategy=args.slimpack_strategy, context_length=args.seq_length,
        max_micropack_tokens=args.slimpack_max_micropack_tokens, slice_tokens=args.slimpack_slice_tokens,
        dp_merge=args.slimpack_dp_merge, base_merge=getattr(args, "slimpack_base_merge", 1) or 1,
        solver_time_limit_s=args.slimpack_solver_time_limit,
        solver_deterministic_limit=getattr(args, "slimpack_solver_deterministic_limit", None),
        seed=getattr(args, "seed", 0) or 0,
    )


__all__ = ["add_slimpack_args", "with_slimpack_args", "validate_slimpack_args", "SlimPackArgumentError",
           "slimpack_config_from_args", "mcore_version", "check_mcore_version", "SUPPORTED_MCORE"]
