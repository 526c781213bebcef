"""`--slimpack` and `--slimpack-*` flags for Megatron-LM's argument parser (docs/design.md section 7).

Megatron-LM 0.16/0.17: `pretrain(..., extra_args_provider=add_slimpack_args)`; 0.18+:
`parse_and_validate_args(extra_args_provider=add_slimpack_args, ...)`. Both call the provider
with Megatron's `argparse.ArgumentParser` and expect it back. `with_slimpack_args(other)`
chains another provider (e.g. ModelOpt's `add_modelopt_args`, which `pretrain_gpt.py` passes).

The `--slimpack-<name>` flags are generated from the fields of `SlimPackConfig` and
`MegatronIntegrationConfig` (config.py: type, default, help); `slimpack_config_from_args` and
`integration_config_from_args` read them back, `context_length` and `seed` from Megatron's
`--seq-length` and `--seed`. `validate_slimpack_args(args)` checks the combination with
Megatron's own flags, and the configs' own checks (`__post_init__`), and raises
`SlimPackArgumentError` (a ValueError) with one line per problem naming the flag to change.

Virtual pipeline stages (`--num-virtual-stages-per-pipeline-rank` /
`--num-layers-per-virtual-pipeline-stage`, Megatron's interleaved 1F1B): the SlimPack schedule
runs the trainer's model chunks (runtime/pipeline/schedule.py), so they are accepted with pipeline
parallelism and a strategy that plans them (its registry's `LayoutConstraints.vpp`);
`virtual_stages_of_args` is the vpp the planner's `ParallelConfig` gets.
"""
from __future__ import annotations

import argparse
import os
import re
import warnings
from pathlib import Path
from typing import Callable, Optional

from ..config import (
    MEGATRON,
    ConfigError,
    MegatronIntegrationConfig,
    SlimPackConfig,
    add_options,
    from_options,
    option_fields,
    option_name,
)
from ..errors import SlimPackError
from ..planner.strategies import strategy_help, strategy_names, strategy_specs, trainable_strategy_names
from ..specs import SELECTIVE_MODULES

# megatron-core versions whose trainer seams (docs/design.md section 7) hooks.py knows, and the newest
# release trained through its real trainer by the tests (tests/test_megatron_releases.py).
SUPPORTED_MCORE = ((0, 16), (0, 17), (0, 18), (0, 19))
NEWEST_TESTED_MCORE = (0, 19, 2)
# The dataclasses whose fields are the --slimpack-* flags (`config.add_options`).
FLAG_CONFIGS = (SlimPackConfig, MegatronIntegrationConfig)


def __getattr__(name: str):
    # STRATEGY_CHOICES: the strategies the Megatron integration trains with (each tested through the
    # real trainer, tests/test_real_megatron.py), from the registry's `trainable` facts; the others are
    # simulated for comparison only. Computed on each use, from the registry as it stands then.
    if name == "STRATEGY_CHOICES":
        return trainable_strategy_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SlimPackArgumentError(SlimPackError):
    """A --slimpack flag combination that cannot run; the message names the fix."""


def add_slimpack_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the SlimPack argument group to Megatron's parser (an `extra_args_provider`): `--slimpack`
    and one `--slimpack-<name>` flag per field of `SlimPackConfig` and `MegatronIntegrationConfig`
    (type, default and help from the field; `--seq-length` and `--seed` are Megatron's own)."""
    simulated = [name for name in strategy_names() if name not in trainable_strategy_names()]
    group = parser.add_argument_group(title="slimpack", description="SlimPack fine-grained asymmetric packing")
    group.add_argument("--slimpack", action="store_true",
                       help="Plan every global batch with SlimPack and run it with the SlimPack pipeline schedule. "
                            "Requires --calculate-per-token-loss.")
    add_options(group, SlimPackConfig, MEGATRON, help_extra={
        "strategy": f"One of: {strategy_help(trainable_only=True)}"
                    + (f" ({', '.join(simulated)}: simulated for comparison only)." if simulated else "."),
        "base_merge": "Keep --context-parallel-size 1: a layout with cp K from `slimpack compare` runs as "
                      "--slimpack-base-merge K (K-fold context parallelism by DP-Merge groups, for every "
                      "strategy the SlimPack runtime trains).",
    })
    add_options(group, MegatronIntegrationConfig, MEGATRON)
    return parser


def with_slimpack_args(other: Optional[Callable] = None) -> Callable:
    """An extra_args_provider that adds another provider's flags and then SlimPack's."""
    def provider(parser):
        if other is not None:
            parser = other(parser) or parser
        return add_slimpack_args(parser)

    return provider


def mcore_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the installed megatron-core."""
    try:
        from megatron.core.package_info import __version__ as text
    except ImportError:  # pragma: no cover - very old megatron-core
        import megatron.core

        text = getattr(megatron.core, "__version__", "0.0.0")
    return parse_version(text)


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.19.2' -> (0, 19, 2); the leading digits of each part count, so a pre-release or the
    '+<git hash>' megatron-core appends inside a git work tree ('0.19.2+a7fe95f') is ignored."""
    parts = []
    for piece in re.split(r"[.+]", str(text))[:3]:
        digits = re.match(r"\d*", piece).group()  # type: ignore[union-attr]  # \d* matches every string
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def check_mcore_version(version: Optional[tuple] = None, *, allow_untested: bool = False) -> tuple:
    """The version, or SlimPackArgumentError: older than the oldest supported release, or newer
    than the newest tested one without --slimpack-allow-untested-megatron."""
    version = tuple(version or mcore_version())
    text = ".".join(map(str, version))
    known = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_MCORE)
    newest = ".".join(map(str, NEWEST_TESTED_MCORE))
    if tuple(version[:2]) < SUPPORTED_MCORE[0]:
        raise SlimPackArgumentError(
            f"--slimpack: megatron-core {text} is not supported (supported: {known}); install a supported "
            "megatron-core or run without --slimpack")
    if tuple(version[:3]) > NEWEST_TESTED_MCORE and not allow_untested:
        raise SlimPackArgumentError(
            f"--slimpack: megatron-core {text} is newer than {newest}, the newest release SlimPack is tested with "
            f"(supported: {known}); install megatron-core<={newest}, or add --slimpack-allow-untested-megatron to "
            "try it (the run stops before its first step if the model lacks SlimPack's sliced attention)")
    return version


def validate_slimpack_args(args, version: Optional[tuple] = None) -> None:
    """Raise SlimPackArgumentError for a combination SlimPack cannot run. Without --slimpack only
    warn about --slimpack-* flags given (they do nothing then)."""
    if not getattr(args, "slimpack", False):
        given = flags_set_without_slimpack(args)
        if given:
            warnings.warn(f"{', '.join(given)} given without --slimpack: ignored (add --slimpack to train with "
                          "SlimPack)", stacklevel=2)
        return
    check_mcore_version(version, allow_untested=bool(getattr(args, "slimpack_allow_untested_megatron", False)))
    problems = []
    if not getattr(args, "calculate_per_token_loss", False):
        problems.append("--slimpack needs --calculate-per-token-loss (the loss is divided once by the global "
                        "batch's token count, never per micro-batch)")
    strategy = getattr(args, "slimpack_strategy", SlimPackConfig.strategy)
    problems += _virtual_stage_problems(args, strategy)
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        problems.append("--slimpack cannot be combined with --context-parallel-size > 1: SlimPack slices long "
                        "documents instead (and shares outliers through DP-Merge); use --context-parallel-size 1, "
                        "and --slimpack-base-merge K to share every MicroPack by K data-parallel replicas")
    if getattr(args, "hybrid_context_parallel", False):
        problems.append("--slimpack cannot be combined with --hybrid-context-parallel")
    if getattr(args, "apply_rope_fusion", False):
        problems.append("--slimpack needs --no-rope-fusion: the fused THD RoPE restarts positions at 0 per slice")
    problems += _fixed_shape_problems(args)
    problems += _tp_overlap_problems(args)
    problems += _recompute_problems(args)
    problems += _attention_option_problems(args)
    if (getattr(args, "micro_batch_size", 1) or 1) != 1:
        problems.append("--slimpack needs --micro-batch-size 1 (a MicroPack is one packed THD sequence)")
    for flag in ("fp8", "fp4"):
        if getattr(args, flag, None):
            problems.append(f"--slimpack does not support --{flag}-format yet (Transformer Engine's low-precision "
                            "GEMMs need token counts divisible by 16 and MicroPacks are not padded): remove it")
    if getattr(args, "mtp_num_layers", None):
        problems.append("--slimpack does not support --mtp-num-layers: multi-token prediction layers would run "
                        "Megatron's attention on packed slices without their KV prefix; remove the flag")
    for flag in ("qk_clip", "log_max_attention_logit"):
        if getattr(args, flag, False):
            problems.append(f"--slimpack does not support --{flag.replace('_', '-')}: the sliced core attention "
                            "does not record attention logits; remove the flag")
    trainable = trainable_strategy_names()
    if strategy not in trainable:
        why = ("is simulated for comparison only: the SlimPack runtime does not run it"
               if strategy in strategy_specs() else "is unknown")
        problems.append(f"--slimpack-strategy {strategy!r} {why}; choose one of {', '.join(trainable)}")
    config = _checked(slimpack_config_from_args, SlimPackConfig, args, problems)
    _checked(integration_config_from_args, MegatronIntegrationConfig, args, problems)
    dump = getattr(args, "slimpack_dump_plans", None)
    if dump and (unwritable := _unwritable(dump)):
        problems.append(f"--slimpack-dump-plans {dump}: {unwritable}; name a directory this process can write (it is "
                        "created if missing)")
    if config is not None and config.base_merge > 1:
        dp = getattr(args, "data_parallel_size", None)
        if dp and dp % config.base_merge:
            problems.append(f"--slimpack-base-merge {config.base_merge} must divide the data-parallel size {dp}")
        elif not config.dp_merge:
            problems.append("--slimpack-base-merge > 1 shares MicroPacks through DP-Merge: remove "
                            "--no-slimpack-dp-merge")
    if problems:
        raise SlimPackArgumentError("invalid SlimPack arguments:\n  - " + "\n  - ".join(problems))


_GRAPH_FIX = ("use --cuda-graph-impl none (the default) and remove --enable-cuda-graph / "
              "--external-cuda-graph")


def recompute_mode_of_args(args) -> str:
    """The planner's recompute mode (`specs.RECOMPUTE_MODES`) of Megatron's recompute flags, as
    `_recompute_problems` accepts them."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "full":
        layers, chunk = getattr(args, "recompute_num_layers", None) or 1, _chunk_layers(args)
        partial = getattr(args, "recompute_method", None) == "block" and chunk is not None and layers < chunk
        return f"block-{layers}" if partial else "full"
    if granularity != "selective":
        return "none"
    modules = _priced_modules(args)
    if not modules:
        return "none"
    return next((mode for mode, wanted in SELECTIVE_MODULES.items() if sorted(wanted) == modules), "selective")


def _priced_modules(args) -> list[str]:
    """`--recompute-modules` (sorted; Megatron's default core_attn) less `layernorm` on Transformer
    Engine's layer spec: there both norms are fused into the next linear layer (`input_layernorm`
    and `pre_mlp_layernorm` are IdentityOp, tests/real_megatron/te_spec.py checks it per release),
    so megatron-core's TransformerLayer skips the module and the layer runs as without it."""
    modules = sorted(getattr(args, "recompute_modules", None) or SELECTIVE_MODULES["selective"])
    if _on_te_layers(args):
        modules = [module for module in modules if module != "layernorm"]
    return modules


def _on_te_layers(args) -> bool:
    """Whether the model is built with Transformer Engine's layer spec (Megatron's default)."""
    return getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"


def _chunk_layers(args) -> int | None:
    """Layers of one model chunk (a pipeline stage's, or one of its virtual stages')."""
    num_layers = getattr(args, "num_layers", None)
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    return num_layers // (pp * virtual_stages_of_args(args)) if num_layers else None


def _recompute_problems(args) -> list[str]:
    """Recompute the planner prices exactly: selective with `--recompute-modules` core_attn (the
    default) or core_attn mlp (with layernorm too, or layernorm alone, on Transformer Engine's layer
    spec, where Megatron skips it: `_priced_modules`), full recompute of every layer on its own, and
    full recompute of the first N layers of every chunk (`--recompute-method block`: block-N). Other
    module sets or groups of layers recomputed together (`--recompute-method uniform
    --recompute-num-layers` > 1) would be priced as something else: the plans could hold more
    memory than the device has, or run slower than planned."""
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "selective":
        modules = list(getattr(args, "recompute_modules", None) or SELECTIVE_MODULES["selective"])
        if "layernorm" in modules and not _on_te_layers(args):
            return ["--slimpack takes --recompute-modules layernorm only with --transformer-impl "
                    "transformer_engine, whose layers fuse the norms into the next linear layer (Megatron skips "
                    f"the module there); with --transformer-impl {args.transformer_impl} the norms would be "
                    "recomputed, which the planner does not price, and megatron-core's output-discarding "
                    "checkpoint fails without Transformer Engine installed (CheckpointWithoutOutput reads "
                    "fp8=False as fp8 on): remove layernorm from --recompute-modules"]
        priced = _priced_modules(args)
        if priced and priced not in [sorted(wanted) for wanted in SELECTIVE_MODULES.values()]:
            accepted = " or ".join(f"'{' '.join(wanted)}'" for wanted in SELECTIVE_MODULES.values())
            return [f"--slimpack plans selective recompute with --recompute-modules {accepted} (layernorm may "
                    f"be added on Transformer Engine's layer spec, where it re-runs nothing); "
                    f"'{' '.join(modules)}' is not priced by its planner: use one of those"]
    if granularity == "full":
        method, layers = getattr(args, "recompute_method", None), getattr(args, "recompute_num_layers", None) or 1
        if method == "block" and _chunk_layers(args) is None:
            return ["--slimpack prices --recompute-method block per model chunk and needs --num-layers to know "
                    "a chunk's layers: use --num-layers with the model's layer count"]
        if method != "block" and not (method == "uniform" and layers == 1):
            return [f"--slimpack plans full recompute of every layer on its own (--recompute-method uniform "
                    f"--recompute-num-layers 1) or of the first N layers of every chunk (--recompute-method block "
                    f"--recompute-num-layers N); --recompute-method {method} --recompute-num-layers {layers} "
                    "recomputes groups of layers together: use one of those"]
    return []


def _fixed_shape_problems(args) -> list[str]:
    """Megatron features built once for one activation shape (--seq-length x --micro-batch-size
    tokens): every MicroPack has its own token count, so they would fail or read past buffers."""
    problems = []
    if getattr(args, "tp_comm_overlap", False):
        problems.append("--slimpack cannot be combined with --tp-comm-overlap: Transformer Engine's userbuffers are "
                        "allocated once for --seq-length x --micro-batch-size tokens and MicroPacks vary in size; "
                        "remove --tp-comm-overlap and use --slimpack-tp-overlap (with --sequence-parallel and "
                        "--transformer-impl local), which hides the same collectives for any MicroPack size")
    for flag in ("enable_cuda_graph", "external_cuda_graph"):
        if getattr(args, flag, False):
            problems.append(f"--slimpack cannot be combined with --{flag.replace('_', '-')}: a CUDA graph replays "
                            f"fixed tensor shapes and every MicroPack has its own token count; {_GRAPH_FIX}")
    impl = getattr(args, "cuda_graph_impl", None) or "none"
    if impl != "none":
        problems.append(f"--slimpack cannot be combined with --cuda-graph-impl {impl}: a CUDA graph replays fixed "
                        f"tensor shapes and every MicroPack has its own token count; {_GRAPH_FIX}")
    return problems


def _tp_overlap_problems(args) -> list[str]:
    """--slimpack-tp-overlap swaps megatron-core's local sequence-parallel linears (runtime/tp_overlap.py)."""
    if not getattr(args, "slimpack_tp_overlap", False) or (getattr(args, "tensor_model_parallel_size", 1) or 1) == 1:
        return []
    problems = []
    if not getattr(args, "sequence_parallel", False):
        problems.append("--slimpack-tp-overlap hides sequence parallelism's all-gathers and reduce-scatters: add "
                        "--sequence-parallel, or remove --slimpack-tp-overlap")
    impl = getattr(args, "transformer_impl", "transformer_engine")
    if impl != "local":
        problems.append(f"--slimpack-tp-overlap runs on megatron-core's local linears, not --transformer-impl {impl}'s "
                        "(Transformer Engine's fuse the norm and overlap only one fixed shape): use "
                        "--transformer-impl local, or remove --slimpack-tp-overlap")
    return problems


def _attention_option_problems(args) -> list[str]:
    """Megatron attention options the sliced core attention does not honour on every backend
    (TE, flash-attn, torch) with a KV prefix; and the settings deterministic mode needs."""
    problems = []
    if getattr(args, "window_size", None) is not None:
        problems.append(f"--slimpack does not support --window-size {args.window_size}: the sliced core attention "
                        "computes full causal attention over a slice's KV prefix on every backend; remove "
                        "--window-size (and --window-attn-skip-freq)")
    softmax_type = getattr(args, "softmax_type", None) or "vanilla"
    if softmax_type != "vanilla":
        problems.append(f"--slimpack does not support --softmax-type {softmax_type}: the flash-attn and torch kernels "
                        "of the sliced core attention compute the vanilla softmax only; use --softmax-type vanilla")
    backend = getattr(args, "attention_backend", None)
    backend = getattr(backend, "name", backend)
    if backend == "unfused":
        problems.append("--slimpack does not run --attention-backend unfused: Transformer Engine's unfused attention "
                        "allocates the full query x key score matrix of a MicroPack's slices and their KV prefix; "
                        "use --attention-backend auto, flash or fused")
    if getattr(args, "deterministic_mode", False) and _transformer_engine_installed() and \
            os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") != "0":
        problems.append("--deterministic-mode with Transformer Engine needs NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 in the "
                        "environment (TE's fused attention reads it; flash-attn gets deterministic=True from the "
                        "flag): export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or remove --deterministic-mode")
    return problems


def _transformer_engine_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def virtual_stages_of_args(args) -> int:
    """Model chunks per pipeline rank (vpp): Megatron's `virtual_pipeline_model_parallel_size`, which
    its own argument validation derives from --num-virtual-stages-per-pipeline-rank or
    --num-layers-per-virtual-pipeline-stage (None there: 1, plain 1F1B)."""
    return getattr(args, "virtual_pipeline_model_parallel_size", None) or 1


_VIRTUAL_FLAGS = "--num-virtual-stages-per-pipeline-rank / --num-layers-per-virtual-pipeline-stage"


def _virtual_stage_problems(args, strategy: str) -> list[str]:
    """Virtual stages need pipeline parallelism and a strategy that plans interleaved orders."""
    vpp = virtual_stages_of_args(args)
    asked = vpp > 1 or any(getattr(args, name, None) for name in (
        "num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage"))
    if not asked:
        return []
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) < 2:
        return [f"virtual pipeline stages ({_VIRTUAL_FLAGS}) need --pipeline-model-parallel-size > 1"]
    specs = strategy_specs()
    if vpp > 1 and strategy in specs and specs[strategy].fixed_sequences_per_rank:
        return _fixed_count_problems(args, strategy)
    if vpp == 1 or strategy not in specs or _plans_virtual_stages(specs[strategy], vpp):
        return []  # (an unknown strategy has its own problem line)
    planning = [name for name in trainable_strategy_names() if _plans_virtual_stages(specs[name], vpp)]
    return [f"--slimpack-strategy {strategy!r} does not plan virtual pipeline stages (vpp={vpp}, interleaved 1F1B): "
            f"choose one that does ({', '.join(planning) or 'none yet'}) or remove {_VIRTUAL_FLAGS}"]


def _fixed_count_problems(args, strategy: str) -> list[str]:
    """A fixed-count strategy (megatron-fixed) runs exactly global-batch-size / dp sequences per rank
    and step (the sampler fills every batch to within one sequence); Megatron's interleaved 1F1B
    needs a multiple of pp. Said up front rather than at the first step. (The variable-count
    packers meet the rule every step: `planner.baselines.meet_interleaved_count`.)"""
    dp, pp = getattr(args, "data_parallel_size", None), args.pipeline_model_parallel_size
    per_rank = args.global_batch_size // dp if dp and getattr(args, "global_batch_size", None) else None
    if per_rank is None or per_rank % pp == 0:
        return []
    return [f"--slimpack-strategy {strategy!r} with virtual pipeline stages runs --global-batch-size "
            f"{args.global_batch_size} / data-parallel size {dp} = {per_rank} sequences per rank and step, and "
            f"Megatron's interleaved 1F1B needs a multiple of --pipeline-model-parallel-size {pp}: choose a global "
            f"batch size that is a multiple of {dp * pp}"]


def _plans_virtual_stages(spec, vpp: int) -> bool:
    """Whether a strategy plans `vpp` chunks per rank (the registry's layout facts)."""
    return spec.constraints.vpp is None or vpp in spec.constraints.vpp


def flags_set_without_slimpack(args) -> list[str]:
    """The --slimpack-* flags whose values differ from their defaults (as the user spelled them)."""
    given = []
    for cls in FLAG_CONFIGS:
        for item in option_fields(cls, MEGATRON):
            value = getattr(args, MEGATRON.dest(item), item.default)
            if value != item.default:
                flag = MEGATRON.flag(item)
                given.append("--no-" + flag[2:] if value is False else flag)
    return given


def _unwritable(path: str) -> Optional[str]:
    """Why plans cannot be written into directory `path` (None: they can). Checks only; creates nothing."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        return "exists and is not a directory"
    existing = next(p for p in [target, *target.parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def _checked(build, cls, args, problems: list):
    """`build(args)`, or None with each of its config problems added to `problems` under its flag's name."""
    try:
        return build(args)
    except ConfigError as error:
        problems.extend(error.messages(lambda name: option_name(cls, name, MEGATRON)))
        return None


def slimpack_config_from_args(args) -> SlimPackConfig:
    """The planner's `SlimPackConfig` from parsed Megatron arguments: every --slimpack-* flag of a
    field, `context_length` from --seq-length and `seed` from --seed (a missing one: the default)."""
    return from_options(SlimPackConfig, args, MEGATRON)


def integration_config_from_args(args) -> MegatronIntegrationConfig:
    """--slimpack-plan-ahead, --slimpack-cost-model, --slimpack-hardware and --slimpack-dump-plans."""
    return from_options(MegatronIntegrationConfig, args, MEGATRON)


__all__ = ["add_slimpack_args", "with_slimpack_args", "validate_slimpack_args", "SlimPackArgumentError",
           "slimpack_config_from_args", "integration_config_from_args", "mcore_version", "check_mcore_version",
           "virtual_stages_of_args",
           "SUPPORTED_MCORE", "FLAG_CONFIGS"]
