"""Plug SlimPack into Megatron-LM's trainer (docs/design.md section 7).

`install(args=None)` replaces exactly these attributes (the *seams*), remembering the originals;
`uninstall()` puts the originals back and nothing else:

  megatron.training.training.get_forward_backward_func
      -> returns the SlimPack schedule (`slimpack_forward_backward_func`) when --slimpack is on
         and the data iterator is the planner iterator; Megatron's own schedule otherwise
         (evaluation on Megatron's validation iterators keeps working);
  megatron.training.training.build_train_valid_test_data_iterators
      -> calls Megatron's, then replaces the *train* iterator with the planner iterator
         (`MegatronPlannerIterator`: global batches of documents, planned ahead, broadcast);
         with virtual pipeline stages Megatron calls it once per model chunk, and every chunk
         gets the same planner iterator (the schedule reads each step's plan once);
  megatron.training.training.get_model_config
      -> sets `variable_seq_lengths=True` and `calculate_per_token_loss=True` on the model config;
  <the release's model builder module>.GPTModel
      -> builds a `SlimPackGPTModel` whose layer spec has the SlimPack core attention. The module
         is the one the release's `pretrain_gpt.py` builds its model through: `gpt_builders`
         (0.16-0.18, the model provider's builder) or `megatron.training.models.gpt` (0.19+, where
         `GPTModelBuilder` builds the model from `GPTModelConfig` and no provider is called).

`installed_seams()` lists what install() replaced; `used_seams()` what has run with --slimpack on.
Before the first SlimPack step the schedule checks the model it was handed
(`check_sliced_model`): every chunk a `SlimPackGPTModel`, every layer's core attention the
sliced one. A release that built its model some other way stops there with a named error rather
than train without the KV prefix of earlier slices.

With virtual pipeline stages (--num-virtual-stages-per-pipeline-rank) the trainer's list of model
chunks goes to the SlimPack schedule as it is, and the planner plans with `ParallelConfig.vpp`.

Every replacement reads the arguments when it is *called* (`args` given to `install`, else
`megatron.training.get_args()`), so the same `install()` works with both conventions:

* megatron-core 0.16 / 0.17 (`pretrain(..., extra_args_provider=...)` parses arguments inside
  `pretrain`): call `install()` before `pretrain`; arguments are validated on first use;
* 0.18+ (`args = parse_and_validate_args(extra_args_provider=...)` before `pretrain`): call
  `install(args)`; arguments are validated at once.

The real trainers of 0.16.1, 0.17.1, 0.18.2 and 0.19.2 (`../shared/megatron-lm`) train through
these seams on CPU in tests/test_real_megatron.py and tests/test_megatron_releases.py.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, cast

from ..costmodel import CostModel
from ..planner.strategies import new_planner
from ..specs import ModelSpec, ParallelConfig
from ..workload import (
    GlobalBatchSampler,
    LongDocumentsError,
    WorkloadError,
    check_batch_scale,
    corpus_long_document_note,
    load_lengths,
)
from .args import (
    SlimPackArgumentError,
    integration_config_from_args,
    mcore_version,
    recompute_mode_of_args,
    slimpack_config_from_args,
    validate_slimpack_args,
    virtual_stages_of_args,
)
from .data import PlannerIterator, fast_forward, plan_function

TRAINING_MODULE = "megatron.training.training"
# The module whose `GPTModel` the release's trainer constructs its model with (seam 4).
PROVIDER_BUILDER_MODULE = "gpt_builders"  # 0.16-0.18: model_provider -> gpt_builder
CONFIG_BUILDER_MODULE = "megatron.training.models.gpt"  # 0.19+: GPTModelConfig -> GPTModelBuilder
TRAINING_SEAMS = ("get_forward_backward_func", "build_train_valid_test_data_iterators", "get_model_config")


class SlimPackInstallError(RuntimeError):
    pass


@dataclass
class _Installation:
    args: Any
    convention: str
    version: tuple
    swapped: list = field(default_factory=list)  # (module, attribute, original)
    used: set = field(default_factory=set)  # seams that have run with --slimpack on
    checked_models: set = field(default_factory=set)  # ids of the model lists check_sliced_model passed
    validated: bool = False
    planner_iterator: Any = None  # the train iterator of this setup, shared by every model chunk


_state: Optional[_Installation] = None


def convention_for(version: tuple) -> str:
    """'pretrain-extra-args' (0.16/0.17) or 'parse-and-validate' (0.18+)."""
    return "parse-and-validate" if tuple(version[:2]) >= (0, 18) else "pretrain-extra-args"


def is_installed() -> bool:
    return _state is not None


def installed_seams() -> list[str]:
    return [f"{module.__name__}.{name}" for module, name, _ in (_state.swapped if _state else [])]


def used_seams() -> list[str]:
    """The installed seams that have run with --slimpack on, in install order."""
    if _state is None:
        return []
    return [f"{module.__name__}.{name}" for module, name, _ in _state.swapped if name in _state.used]


def _mark_used(name: str) -> None:
    if _state is not None:
        _state.used.add(name)


def _installed() -> _Installation:
    """`_state`, for the helpers that run only while the hooks are installed."""
    return cast(_Installation, _state)


def _swap(module, name: str, replacement) -> None:
    if not hasattr(module, name):
        raise SlimPackInstallError(
            f"{module.__name__} has no attribute {name!r}: this Megatron-LM checkout does not match the "
            f"supported versions (see patches/README.md)")
    _installed().swapped.append((module, name, getattr(module, name)))
    setattr(module, name, replacement)


def _original(name: str):
    for _module, attribute, original in _installed().swapped:
        if attribute == name:
            return original
    raise KeyError(name)


def _args():
    if _state is not None and _state.args is not None:
        args = _state.args
    else:
        from megatron.training import get_args

        args = get_args()
    if _state is not None and not _state.validated:
        validate_slimpack_args(args, _state.version)
        _state.validated = True
    return args


def _enabled() -> bool:
    return bool(getattr(_args(), "slimpack", False))


def install(args=None, *, version: Optional[tuple] = None) -> _Installation:
    """Swap the seams listed in the module docstring. Idempotent per process: a second call raises."""
    global _state
    if _state is not None:
        raise SlimPackInstallError("megatron_slimpack.megatron.hooks.install() was already called; uninstall() first")
    version = tuple(version or mcore_version())
    if args is not None:
        validate_slimpack_args(args, version)
    try:
        training = sys.modules.get(TRAINING_MODULE) or importlib.import_module(TRAINING_MODULE)
    except ImportError as error:
        raise SlimPackInstallError(
            f"cannot import {TRAINING_MODULE} ({error}): install() patches Megatron-LM's trainer; put a Megatron-LM "
            "checkout on PYTHONPATH (the megatron-core wheel does not contain megatron.training)") from error
    _state = _Installation(args, convention_for(version), version, validated=args is not None)
    try:
        _swap(training, "get_forward_backward_func", _get_forward_backward_func)
        _swap(training, "build_train_valid_test_data_iterators", _build_train_valid_test_data_iterators)
        _swap(training, "get_model_config", _get_model_config)
        builders = _model_builder_module(version)
        if builders is not None:
            _swap(builders, "GPTModel", slimpack_gpt_model)
    except BaseException:
        uninstall()
        raise
    return _state


def _model_builder_module(version: tuple):
    """The module whose `GPTModel` this release's trainer builds the model with, or None where the
    script builds it without one (a custom script: `check_sliced_model` then decides)."""
    if tuple(version[:2]) >= (0, 19):
        try:
            return importlib.import_module(CONFIG_BUILDER_MODULE)
        except ImportError as error:
            raise SlimPackInstallError(
                f"megatron-core {'.'.join(map(str, version))} builds GPT models in {CONFIG_BUILDER_MODULE}, which "
                f"cannot be imported ({error}): use the Megatron-LM checkout of the same release") from error
    builders = sys.modules.get(PROVIDER_BUILDER_MODULE)
    return builders if builders is not None and hasattr(builders, "GPTModel") else None


def uninstall() -> None:
    """Restore every attribute install() replaced, in reverse order."""
    global _state
    if _state is None:
        return
    for module, name, original in reversed(_state.swapped):
        setattr(module, name, original)
    _state = None


# ---- seam 1: the schedule ------------------------------------------------------------------
def _get_forward_backward_func(*args, **kwargs):
    enabled = _enabled()  # validates the arguments first, before Megatron's own lookup
    original = _original("get_forward_backward_func")(*args, **kwargs)
    if not enabled:
        return original

    def forward_backward(**call):
        iterator = call.get("data_iterator")
        first = iterator[0] if isinstance(iterator, (list, tuple)) and iterator else iterator
        if not isinstance(first, MegatronPlannerIterator):
            return original(**call)  # e.g. evaluation on Megatron's validation iterator
        return slimpack_forward_backward_func(**call)

    return forward_backward


def slimpack_forward_backward_func(*, data_iterator, model, forward_only: bool = False,
                                   force_all_reduce: Optional[bool] = None, **megatron_schedule_arguments):
    """Megatron's forward_backward_func signature on top of the SlimPack schedule: takes the next
    planned batch from the planner iterator, runs this rank's stage of its replica plan (and of
    the DP-Merge groups it belongs to, whose process groups are created on the first step that
    has one), and returns Megatron's per-token loss records ({'lm loss': [loss_sum, tokens]}) on
    the last stage. Megatron's other schedule arguments (forward_step_func, num_microbatches,
    seq_length, micro_batch_size, decoder_seq_length, collect_non_loss_data, first_val_step, ...)
    describe fixed-size micro-batches that the plan replaces: absorbed here, unread."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime.pipeline.schedule import ScheduleGroups, slimpack_forward_backward

    iterator = data_iterator[0] if isinstance(data_iterator, (list, tuple)) else data_iterator
    chunks = model if isinstance(model, (list, tuple)) else [model]  # every virtual stage's chunk
    check_sliced_model(chunks)
    _mark_used("get_forward_backward_func")
    planned = next(iterator)
    # The schedule owns the gradient reduction (Megatron's no_sync / grad_sync /
    # finalize_model_grads protocol, once per step): nothing is added here.
    result = slimpack_forward_backward(
        model=chunks, forward_only=forward_only, plan=planned.plan,
        token_source=planned.token_source(iterator.corpus),
        groups=ScheduleGroups.from_parallel_state(merge_groups=_merge_process_groups(planned.plan)),
        force_all_reduce=force_all_reduce)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return []
    dp = parallel_state.get_data_parallel_world_size() if dist.is_initialized() else 1
    device = next(chunks[0].parameters()).device
    share = float(result.num_loss_tokens) / dp  # Megatron sums [loss, tokens] over DP, then divides
    return [{"lm loss": torch.tensor([float(result.loss_sum or 0.0), share], device=device)}]


_merge_groups_by_dp: dict = {}


def _merge_process_groups(plan) -> Optional[dict]:
    """DP-Merge process groups (every layout the planner can produce), created on the first step
    whose plan has a merge group. Creating groups is collective over the world; every rank gets
    the same plan, so every rank reaches this in the same step."""
    if not any(r.is_merge_group for r in plan.replicas):
        return None
    if plan.parallel.dp not in _merge_groups_by_dp:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from ..runtime.pipeline.merge import merge_groups

        dp_ranks = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
        _merge_groups_by_dp[plan.parallel.dp] = merge_groups(plan, dp_ranks)
    return _merge_groups_by_dp[plan.parallel.dp]


def check_sliced_model(chunks) -> None:
    """Raise SlimPackInstallError unless every model chunk (DDP / Float16Module wrappers unwrapped)
    is a SlimPackGPTModel whose every transformer layer has SlimPack's sliced core attention:
    without it a document's later slices would train blind to its earlier ones, silently. Checked
    once per model list, before its first step."""
    if _state is not None and id(chunks) in _state.checked_models:
        return
    tp_overlap = _state is not None and bool(getattr(_args(), "slimpack_tp_overlap", False))
    problems = sliced_model_problems(chunks, tp_overlap=tp_overlap)
    if problems:
        version = ".".join(map(str, _state.version if _state else mcore_version()))
        raise SlimPackInstallError(
            f"--slimpack: the model megatron-core {version}'s trainer built does not run SlimPack's sliced attention "
            f"({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''}). Seams installed: "
            f"{', '.join(installed_seams()) or 'none'}; used: {', '.join(used_seams()) or 'none'}. SlimPack stops "
            "here rather than train later slices without their documents' earlier K/V: use a release and "
            "pretrain_gpt.py listed in patches/README.md, with the matching patch applied")
    if _state is not None:
        _state.checked_models.add(id(chunks))


def sliced_model_problems(chunks, *, tp_overlap: bool = False) -> list[str]:
    """What in `chunks` is not SlimPack's model: one line per chunk or layer (empty: all sliced).
    With `tp_overlap` (--slimpack-tp-overlap) under TP > 1, also every layer linear that does not
    run its collectives as rings (runtime/tp_overlap.py)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from ..runtime.attention.core import SlicedAttentionMixin
    from ..runtime.model import SlimPackGPTModel
    from ..runtime.tp_overlap import OverlappedColumnParallelLinear, OverlappedRowParallelLinear

    problems = []
    for index, chunk in enumerate(chunks):
        inner = chunk
        while hasattr(inner, "module"):
            inner = inner.module
        if not isinstance(inner, SlimPackGPTModel):
            problems.append(f"model chunk {index} is a {type(inner).__name__}, not a SlimPackGPTModel")
        for name, layer in inner.named_modules():
            if not isinstance(layer, TransformerLayer):
                continue
            core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
            if not isinstance(core, SlicedAttentionMixin):
                problems.append(f"chunk {index} {name}.self_attention.core_attention is {type(core).__name__}")
            if tp_overlap and inner.config.tensor_model_parallel_size > 1:
                for part, linear_name, kind in _LAYER_LINEARS:
                    linear = type(getattr(getattr(layer, part, None), linear_name, None))
                    wanted = OverlappedColumnParallelLinear if kind == "column" else OverlappedRowParallelLinear
                    if linear is not wanted:
                        problems.append(f"chunk {index} {name}.{part}.{linear_name} is {linear.__name__}, not the "
                                        f"TP overlap's {wanted.__name__}")
    return problems


# The linears of a layer whose collectives --slimpack-tp-overlap runs as rings.
_LAYER_LINEARS = (("self_attention", "linear_qkv", "column"), ("self_attention", "linear_proj", "row"),
                  ("mlp", "linear_fc1", "column"), ("mlp", "linear_fc2", "row"))


# ---- seam 2: the train data iterator -------------------------------------------------------
def _build_train_valid_test_data_iterators(*args, **kwargs):
    train, valid, test = _original("build_train_valid_test_data_iterators")(*args, **kwargs)
    if not _enabled():
        return train, valid, test
    _mark_used("build_train_valid_test_data_iterators")
    # With virtual stages Megatron builds iterators per model chunk (its dataset provider bound to
    # vp_stage=c): chunks after the first share chunk 0's planner iterator rather than plan again.
    provider = args[0] if args else kwargs.get("build_train_valid_test_datasets_provider")
    if getattr(provider, "keywords", {}).get("vp_stage", 0) == 0 or _state.planner_iterator is None:
        _state.planner_iterator = build_planner_iterator(_args())
    return _state.planner_iterator, valid, test


def _rerun_data_iterator():
    # Megatron's rerun state machine asserts that train iterators are RerunDataIterators (0.16+).
    from megatron.core.rerun_state_machine import RerunDataIterator

    return RerunDataIterator


class MegatronPlannerIterator(_rerun_data_iterator()):  # type: ignore[misc]  # Megatron's class, imported lazily
    """The planner iterator plus the corpus its token sources read (see megatron/data.py), as a
    Megatron `RerunDataIterator` (replay of a step's planned batch works as for any iterator).
    `planner_state_dict()` is the sampler position for an exact resume."""

    def __init__(self, planner, corpus, dump_dir: Optional[str] = None):
        super().__init__(planner)
        self.planner = planner
        self.corpus = corpus
        self.dump_dir = Path(dump_dir) if dump_dir else None

    def __iter__(self):
        return self

    def __next__(self):
        planned = super().__next__()
        if self.dump_dir is not None and self.planner.is_source and not getattr(self, "replaying", False):
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            planned.plan.to_json(self.dump_dir / f"plan_step{planned.step:07d}.json")
        return planned

    def planner_state_dict(self) -> dict:
        return self.planner.state_dict()

    def load_planner_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state)

    def close(self) -> None:
        self.planner.close()


class IndexedCorpus:
    """Tokens of the training split of a Megatron indexed dataset (PREFIX.bin/.idx). Each sequence
    of the dataset (one document in preprocess_data.py output without --split-sentences) is a
    document; document i of the corpus is sequence `first + i` of the dataset.

    `split` is Megatron's `--split` string: GPTDataset splits a prefix by sequence index, the
    training split being sequences [round(a * n), round(b * n)) for the first row (a, b) of
    megatron-core's split matrix. The same functions compute it here, so the planner never
    samples a validation or test document. `split=None`: the whole prefix (--train-data-path)."""

    def __init__(self, prefix: str, split: Optional[str] = None):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.dataset = IndexedDataset(prefix)
        lengths = self.dataset.sequence_lengths.astype("int64")
        self.first, self.end = training_range(len(lengths), split)
        if self.end <= self.first:
            raise SlimPackArgumentError(
                f"--split {split!r} leaves no training documents in {prefix} ({len(lengths)} sequences): give the "
                "training split a larger share")
        self.lengths = lengths[self.first:self.end]

    def tokens(self, document: int, start: int, end: int):
        return self.dataset.get(self.first + int(document), offset=int(start), length=int(end - start)).astype("int64")


def training_range(num_sequences: int, split: Optional[str]) -> tuple[int, int]:
    """[first, end) sequence indices of the training split, as megatron-core's GPT dataset builder
    computes them."""
    if split is None:
        return 0, num_sequences
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    begin, end = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]
    return int(round(begin * float(num_sequences))), int(round(end * float(num_sequences)))


class MockCorpus:
    """Deterministic pseudo-random tokens for --mock-data (lengths from the `uniform` source)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size, self.seed = vocab_size, seed
        self.lengths = load_lengths("uniform", seed=seed)

    def tokens(self, document: int, start: int, end: int):
        import numpy as np

        rng = np.random.default_rng([self.seed, int(document)])
        return rng.integers(0, self.vocab_size, size=int(self.lengths[document]))[start:end]


def _training_corpus(args) -> IndexedCorpus:
    """The documents Megatron trains on: `--train-data-path PREFIX` whole, or the training split
    (`--split`) of `--data-path PREFIX`."""
    train_paths = list(getattr(args, "train_data_path", None) or [])
    paths = train_paths or list(getattr(args, "data_path", None) or [])
    if len(paths) != 1:
        flag = "--train-data-path" if train_paths else "--data-path"
        raise SlimPackArgumentError(
            f"--slimpack reads document lengths from one dataset prefix; got {flag} {paths} "
            "(blended datasets are not supported yet: give one prefix)")
    return IndexedCorpus(paths[0], split=None if train_paths else (getattr(args, "split", None) or "969, 30, 1"))


def planned_attention_backend() -> str:
    """The attention kernel the plans are priced with: the one the runtime's 'auto' runs on this
    machine (Transformer Engine, else flash-attn, else the torch kernel), so that what is planned
    is what runs; rates and saved activations differ by backend (costmodel/kernels.py). On a GPU
    the start-up probe may still move a shape class to another fused backend, and logs it."""
    from ..runtime.attention.kernels import resolve_backend  # torch: the trainer has loaded it

    return resolve_backend("auto")


def build_planner_iterator(args) -> MegatronPlannerIterator:
    """The planner iterator for a Megatron run: document lengths of `--data-path` (one prefix) or
    --mock-data, global batches of `--global-batch-size` sequences of `--seq-length` tokens."""
    corpus: MockCorpus | IndexedCorpus
    if getattr(args, "mock_data", False):
        corpus = MockCorpus(getattr(args, "padded_vocab_size", 32000), seed=getattr(args, "seed", 0) or 0)
    else:
        corpus = _training_corpus(args)
    model = ModelSpec(
        "megatron", args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads,
        num_query_groups=args.num_query_groups if getattr(args, "group_query_attention", False) else None,
        vocab_size=getattr(args, "padded_vocab_size", 32000), swiglu=bool(getattr(args, "swiglu", True)),
    )
    options = integration_config_from_args(args)
    cost = CostModel.load(options.cost_model, model, options.hardware, attention_backend=planned_attention_backend())
    recompute = recompute_mode_of_args(args)
    parallel = ParallelConfig(dp=args.data_parallel_size, pp=args.pipeline_model_parallel_size,
                              vpp=virtual_stages_of_args(args), tp=args.tensor_model_parallel_size,
                              recompute=recompute)
    config = slimpack_config_from_args(args)
    planner = new_planner(config.strategy)
    sampler = training_sampler(corpus.lengths, args, config.long_documents)
    # Resuming from a checkpoint (Megatron sets args.iteration when it loads one), as Megatron
    # resumes its own samplers from the consumed samples: the sampler is deterministic, and a
    # stateful strategy (wlb-llm's delay queues) is brought to its state after those batches.
    fast_forward(sampler, planner, parallel, cost, config, int(getattr(args, "iteration", 0) or 0))
    # Planned in a spawned worker process (off this process's GIL; a thread where that process
    # cannot start), from the sampler and planner state after the fast-forward above.
    iterator = PlannerIterator(sampler, plan_function(planner, parallel, cost, config),
                               plan_ahead=options.plan_ahead,
                               backend="process" if options.planner_process else "thread",
                               timeout_s=options.planner_timeout)
    iterator.start()  # the worker starts (imports, first plan) while Megatron finishes its setup
    return MegatronPlannerIterator(iterator, corpus, options.dump_plans)


def training_sampler(lengths, args, long_documents: str) -> GlobalBatchSampler:
    """The run's batch sampler: global batches of --global-batch-size sequences of --seq-length
    tokens. Documents longer than --seq-length are what --slimpack-long-documents says (refused,
    naming the fix, unless split or drop is given; what they become is said once, on rank 0), and
    a batch too large to plan is refused before training starts."""
    mode, context = "--slimpack-long-documents", "--seq-length"
    try:
        sampler = GlobalBatchSampler(lengths, args.seq_length, args.global_batch_size,
                                     seed=getattr(args, "seed", 0) or 0, long_documents=long_documents)
        check_batch_scale(lengths, args.seq_length, args.global_batch_size, long_documents,
                          options=("--global-batch-size", context))
    except LongDocumentsError as error:
        raise SlimPackArgumentError(f"--slimpack: {error.message(mode, context)}") from None
    except WorkloadError as error:
        raise SlimPackArgumentError(f"--slimpack: {error}") from None
    note = corpus_long_document_note(lengths, args.seq_length, long_documents, options=(mode, context))
    if note:
        _print_rank_0(f"SlimPack: training documents: {note}")
    return sampler


def _print_rank_0(line: str) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


# ---- seam 3: the model config --------------------------------------------------------------
def _get_model_config(*args, **kwargs):
    config = _original("get_model_config")(*args, **kwargs)
    if _enabled():
        _mark_used("get_model_config")
        config.variable_seq_lengths = True
        config.calculate_per_token_loss = True
    return config


# ---- seam 4: the layer spec ------------------------------------------------------------------
def slimpack_gpt_model(*args, **kwargs):
    """Stands in for `GPTModel` in the release's builder module: the same constructor (called
    positionally by 0.16-0.18's `gpt_builder`, by keyword by 0.19's `GPTModelBuilder`), a
    SlimPackGPTModel whose layer spec has the sliced core attention (Megatron's GPTModel when
    --slimpack is off)."""
    if not _enabled():
        return _original("GPTModel")(*args, **kwargs)
    from ..runtime.attention.core import with_sliced_core_attention
    from ..runtime.model import SlimPackGPTModel

    config = args[0] if args else kwargs.pop("config")
    spec = args[1] if len(args) > 1 else kwargs.pop("transformer_layer_spec")
    if getattr(config, "apply_rope_fusion", False):
        raise SlimPackArgumentError("--slimpack needs --no-rope-fusion")
    if kwargs.get("mtp_block_spec") is not None:
        raise SlimPackArgumentError("--slimpack does not support --mtp-num-layers: remove the flag")
    _mark_used("GPTModel")
    tp_overlap = bool(getattr(_args(), "slimpack_tp_overlap", False))
    return SlimPackGPTModel(config, with_sliced_core_attention(spec, config=config), *args[2:],
                            tp_overlap=tp_overlap, **kwargs)


__all__ = ["install", "uninstall", "is_installed", "installed_seams", "used_seams", "check_sliced_model",
           "sliced_model_problems", "convention_for", "SlimPackInstallError",
           "slimpack_forward_backward_func", "build_planner_iterator", "MegatronPlannerIterator",
           "slimpack_gpt_model", "TRAINING_SEAMS"]
