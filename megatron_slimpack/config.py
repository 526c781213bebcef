"""The planner's knobs, declared once: `SlimPackConfig` (what the planner plans for) and
`MegatronIntegrationConfig` (how the Megatron integration runs it).

Each field is declared once, with its default, its type and its option metadata (`Option`, in
`dataclasses.field(metadata=...)`: help text, flag name, metavar, and why it is not an option on
a surface where it is not one). From that:

- `add_options(parser, cls, MEGATRON)` generates Megatron's `--slimpack-<name>` flags (the
  `extra_args_provider` of `megatron/args.py`) and `add_options(parser, cls, CLI)` the `slimpack`
  command's `--<name>` options, each with the field's type, default and help;
- `from_options(cls, args, surface)` reads them back (on MEGATRON, `context_length` and `seed`
  come from Megatron's own `--seq-length` and `--seed`);
- `__post_init__` validates every entry point (Python API, CLI, Megatron flags) and raises
  `ConfigError` (a ValueError) with one message per problem, each naming the field; the flag
  paths render the same problems with their option names (`ConfigError.messages`).
"""
from __future__ import annotations

import math
import numbers
import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterable, Optional

from .errors import SlimPackError
from .specs import HARDWARE
from .workload.sampler import DEFAULT_LONG_DOCUMENTS, LONG_DOCUMENT_MODES

# ==== option metadata ===========================================================================

OPTION = "slimpack_option"  # the key of an `Option` in a field's metadata


@dataclass(frozen=True)
class Option:
    """How a config field appears on the command lines. `cli` / `megatron`: None where it is an
    option there, else why it is not one."""

    help: str = ""
    flag: Optional[str] = None        # the option's name after the surface's prefix (default: the field's, dashed)
    metavar: Optional[str] = None
    none_means: Optional[str] = None  # what a None default means (help text)
    cli: Optional[str] = None
    megatron: Optional[str] = None
    # The Megatron argument (its `args` attribute) the value is read from instead of a flag of its own.
    megatron_source: Optional[str] = None
    choices: Optional[tuple] = None   # the values the option takes (argparse refuses others, help lists them)

    def __post_init__(self) -> None:
        if self.megatron_source and not self.megatron:
            object.__setattr__(self, "megatron",
                               f"read from Megatron's own --{self.megatron_source.replace('_', '-')}")

    def why_not(self, surface: "Surface") -> Optional[str]:
        return self.cli if surface is CLI else self.megatron


def option(help: str, **settings) -> dict:
    """`field(metadata=option(...))` for a field that is a command-line option."""
    return {OPTION: Option(help, **settings)}


def not_an_option(why: str) -> dict:
    """`field(metadata=not_an_option(why))` for a field that is deliberately no option anywhere."""
    return {OPTION: Option(cli=why, megatron=why)}


@dataclass(frozen=True)
class Surface:
    """A command line the options are generated for."""

    name: str
    prefix: str      # "--" or "--slimpack-"
    dest_prefix: str  # the argparse dest: dest_prefix + the flag's name (CLI: the field's name)

    def flag(self, item: Field) -> str:
        return self.prefix + _flag_name(item)

    def dest(self, item: Field) -> str:
        if self is CLI:
            return item.name
        return self.dest_prefix + _flag_name(item).replace("-", "_")


CLI = Surface("cli", "--", "")
MEGATRON = Surface("megatron", "--slimpack-", "slimpack_")


def option_of(item: Field) -> Option:
    found = item.metadata.get(OPTION)
    if found is None:
        raise TypeError(f"config field {item.name!r} declares no Option (use option(...) or not_an_option(...))")
    return found


def _flag_name(item: Field) -> str:
    return option_of(item).flag or item.name.replace("_", "-")


def _value_type(cls: type, item: Field) -> tuple[type, bool]:
    """(int/float/str/bool, whether None is allowed) of a field's annotation."""
    hint = typing.get_type_hints(cls)[item.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
    if hint not in (int, float, str, bool):
        raise TypeError(f"{cls.__name__}.{item.name}: a command-line option needs an int, float, str or bool "
                        f"field, not {hint!r}")
    return hint, optional


def option_fields(cls: type, surface: Surface) -> list[Field]:
    """The fields of `cls` that are options on `surface`."""
    return [item for item in fields(cls) if option_of(item).why_not(surface) is None]


def not_options(cls: type, surface: Surface) -> dict[str, str]:
    """field -> why it is not an option on `surface`."""
    return {item.name: reason for item in fields(cls)
            if (reason := option_of(item).why_not(surface)) is not None}


def option_name(cls: type, name: str, surface: Surface) -> str:
    """How `surface` spells field `name` of `cls` in a message: its flag, or the Megatron flag it
    is read from; a field that is no option there is named as in Python."""
    item = {item.name: item for item in fields(cls)}[name]
    meta = option_of(item)
    if meta.why_not(surface) is None:
        return surface.flag(item)
    if surface is MEGATRON and meta.megatron_source:
        return "--" + meta.megatron_source.replace("_", "-")
    return f"{cls.__name__}.{name}"


def add_options(parser, cls: type, surface: Surface, *, only: Optional[Iterable[str]] = None,
                exclude: Iterable[str] = (), help_extra: Optional[dict[str, str]] = None) -> list[str]:
    """Add `cls`'s options on `surface` to `parser` (an ArgumentParser or argument group); returns
    the fields added. `only` / `exclude`: field names; `help_extra`: text added to a field's help."""
    only = None if only is None else set(only)
    exclude, help_extra = set(exclude), help_extra or {}
    added = []
    for item in option_fields(cls, surface):
        if (only is not None and item.name not in only) or item.name in exclude:
            continue
        if item.default is MISSING:
            raise TypeError(f"{cls.__name__}.{item.name}: a command-line option needs a plain default")
        meta, default = option_of(item), item.default
        kind, _ = _value_type(cls, item)
        text = " ".join(part for part in (meta.help, help_extra.get(item.name, "")) if part)
        flag, dest = surface.flag(item), surface.dest(item)
        if kind is bool:
            negative = "--no-" + flag[2:]  # --no-dp-merge, --no-slimpack-dp-merge
            parser.add_argument(flag, dest=dest, action="store_true", default=default,
                                help=f"{text}{' (default)' if default else ''}")
            parser.add_argument(negative, dest=dest, action="store_false",
                                help=f"The opposite of {flag}{' (default)' if not default else ''}.")
        else:
            shown = meta.none_means if default is None else default
            metavar = meta.metavar or (_flag_name(item).upper().replace("-", "_")
                                       if surface is CLI and not meta.choices else None)
            parser.add_argument(flag, dest=dest, type=kind, default=default, metavar=metavar, choices=meta.choices,
                                help=f"{text} (default: {shown})".replace("%", "%%"))
        added.append(item.name)
    return added


def from_options(cls: type, args, surface: Surface, **overrides):
    """An instance of `cls` from parsed `args`: every option on `surface` (an attribute missing
    from `args`, or None for a field that cannot be None, leaves the field's default), the
    Megatron arguments fields are read from, then `overrides`."""
    values = {}
    for item in fields(cls):
        if item.name in overrides:
            continue
        meta = option_of(item)
        if meta.why_not(surface) is None:
            attribute = surface.dest(item)
        elif surface is MEGATRON and meta.megatron_source:
            attribute = meta.megatron_source
        else:
            continue
        value = getattr(args, attribute, MISSING)
        if value is MISSING or (value is None and not _value_type(cls, item)[1]):
            continue
        values[item.name] = value
    return cls(**values, **overrides)


# ==== validation ================================================================================

Namer = Callable[[str], str]
Problems = list  # [(field, message)]


class ConfigError(SlimPackError):
    """Values a config dataclass refuses. `problems`: [(field, message)], one per problem, each
    message naming the field as Python spells it (`SlimPackConfig.base_merge`); `messages(name)`
    renders the same problems with other names (a flag path: `option_name`)."""

    def __init__(self, owner: type, values: dict, check: Callable[[dict, Namer], Problems]):
        self.owner, self.values, self._check = owner, values, check
        self.problems = check(values, lambda name: f"{owner.__name__}.{name}")
        super().__init__("invalid " + owner.__name__ + ": " + "; ".join(message for _, message in self.problems))

    def messages(self, name: Namer) -> list[str]:
        return [message for _, message in self._check(self.values, name)]

    def __reduce__(self):
        # Rebuilt from what made it, so it crosses processes (a benchmark's worker pool); the
        # default would call __init__ with the message only.
        return ConfigError, (self.owner, self.values, self._check)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(problems: Problems, values: dict, n: Namer, name: str, least: int, *, optional: bool = False) -> bool:
    """True when values[name] is fine and an integer (not None)."""
    value = values[name]
    if value is None and optional:
        return False
    if _is_int(value) and value >= least:
        return True
    what = "a positive integer" if least == 1 else f"an integer >= {least}"
    problems.append((name, f"{n(name)} must be {what}, got {value!r}"))
    return False


def _positive(problems: Problems, values: dict, n: Namer, name: str, unit: str = "", *, optional: bool = False) -> None:
    value = values[name]
    if value is None and optional:
        return
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        problems.append((name, f"{n(name)} must be > 0{unit} and finite{' if given' if optional else ''}, "
                               f"got {value!r}"))


def _normalized_integers(instance) -> None:
    """numpy and other Integral values stored as int (so `to_dict()` stays JSON)."""
    for item in fields(instance):
        value = getattr(instance, item.name)
        if _is_int(value) and type(value) is not int:
            object.__setattr__(instance, item.name, int(value))


def _validate(instance, check: Callable[[dict, Namer], Problems]) -> None:
    values = {item.name: getattr(instance, item.name) for item in fields(instance)}
    if check(values, str):
        raise ConfigError(type(instance), values, check)
    _normalized_integers(instance)


# ==== the planner's configuration ===============================================================


@dataclass(frozen=True)
class PlannerTunables:
    """How hard the SlimPack planner searches, not what it plans for: the defaults are the values
    the benchmarks and tests/golden/plans.json were planned with."""

    # Phase 1: the heaviest documents CP-SAT decides one by one; the rest is sand poured after it.
    max_model_items: int = 160
    # Phase 1: integer resolution of costs inside CP-SAT (seconds times this).
    cost_scale: int = 1_000_000
    # Phase 1: sand documents per replica dealt one at a time (the heavy head of the sand); the
    # rest is poured in contiguous runs.
    dealt_sand_per_replica: int = 256
    # The smallest MicroPack (tokens) the planner tries.
    min_micropack_tokens: int = 1024
    # Unit candidates of one packing, best quick estimates first, that get a full replay.
    replayed_candidates: int = 3
    # MicroPack sizes found by bisection are multiples of this many tokens.
    size_granule: int = 256
    # The heaviest replica's bisection between two ladder sizes stops within 1/this of the size
    # that fits (1: no bisection between sizes a ladder step apart).
    refine_fraction: int = 16
    # With a pipeline, a slice may cost this much more than a typical full MicroPack.
    even_cost_tolerance: float = 1.1
    # Slices added at most to balance seconds or meet an even cost (each try costs a cut).
    extra_slices: int = 8
    # Reweighting rounds that balance a document's slices on seconds rather than work.
    balancing_rounds: int = 3

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            least = 0 if item.name == "extra_slices" else 1
            if item.type in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"PlannerTunables.{item.name} must be an integer >= {least}, got {value!r}")
            elif not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
                raise ValueError(f"PlannerTunables.{item.name} must be a finite number >= 1, got {value!r}")


DEFAULT_WLB_DELAY_FRACTIONS = "0.5,0.25"  # WLB-LLM's two queues: over half the context, over a quarter


def delay_fractions(text: str) -> tuple[float, ...]:
    """WLB-LLM's delay thresholds from `wlb_delay_fractions` ("0.5,0.25"; "" for none): fractions of
    the context in (0, 1], strictly decreasing. ValueError names what is wrong."""
    if not isinstance(text, str):
        raise ValueError(f"must be a comma-separated string of fractions such as '0.5,0.25', got {text!r}")
    if not text.strip():
        return ()
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"must be comma-separated numbers such as '0.5,0.25', got {text!r}") from None
    if not all(0.0 < value <= 1.0 for value in values):
        raise ValueError(f"must hold fractions of the context in (0, 1], got {text!r}")
    if any(later >= earlier for earlier, later in zip(values, values[1:])):
        raise ValueError(f"must be strictly decreasing (queue 0 holds the longest documents), got {text!r}")
    return values


@dataclass(frozen=True)
class SlimPackConfig:
    """What the planner plans for. Every field but `tunables` is validated here, whatever the
    entry point (Python API, `slimpack` CLI, Megatron flags); see the module docstring."""

    strategy: str = field(default="slimpack", metadata=option(
        "Planning strategy."))
    context_length: int = field(default=65536, metadata=option(
        "Tokens of one sequence of the global batch (the longest document).", megatron_source="seq_length"))
    # Token cap of one MicroPack; None: the largest that fits memory (cost model), at most the context.
    max_micropack_tokens: int | None = field(default=None, metadata=option(
        "Token cap of one MicroPack, at most the context length.",
        none_means="the largest that fits memory, at most the context length"))
    # Target slice size for long documents; None: the planner tries several and simulates each.
    slice_tokens: int | None = field(default=None, metadata=option(
        "Target slice size of long documents in tokens, at most the context length.",
        none_means="the planner tries several"))
    dp_merge: bool = field(default=True, metadata=option(
        "Let outlier documents be shared by a DP-Merge group."))
    fixed_grouping_floor: bool = field(default=True, metadata=option(
        "Where the simulator prices Megatron's fixed-length grouping of a batch (cut documents keeping "
        "their K/V prefix) faster than SlimPack's own plan, train that grouping; off: always SlimPack's "
        "own plan (ablations, tests of its schedules)."))
    # Every MicroPack shared by a DP-Merge group of this many replicas (planned as that much
    # context parallelism over dp / base_merge replicas); 1: only outliers are shared (and every
    # MicroPack only where no other plan fits memory).
    base_merge: int = field(default=1, metadata=option(
        "Share every MicroPack by a DP-Merge group of K data-parallel replicas, K a power of two (context "
        "parallelism inside the group); 1: only outliers are shared.", metavar="K"))
    # A sample whose cost exceeds this multiple of the mean replica load is shared by a merge group.
    merge_threshold: float = field(default=1.25, metadata=not_an_option(
        "a planner policy tuned with the layout search on the paper grid; set it from Python"))
    solver_time_limit_s: float = field(default=0.5, metadata=option(
        "CP-SAT time limit in seconds for the DP phase of each step.", flag="solver-time-limit"))
    # CP-SAT's deterministic-time budget (its work units, about seconds): with one worker the plan is
    # then the same on any machine under any load, which a wall-clock limit alone cannot promise.
    # None: the wall-clock limit only. Whichever limit is hit first stops the search.
    solver_deterministic_limit: float | None = field(default=None, metadata=option(
        "Also stop CP-SAT after this much deterministic time (its work units, about seconds), so a rerun plans "
        "the same batches the same way under any machine load.", metavar="UNITS",
        none_means="the wall-clock limit only"))
    seed: int = field(default=0, metadata=option(
        "Seed of the batch sampler and the planner's random choices.", megatron_source="seed"))
    # What the batch sampler makes of a document longer than the context (`GlobalBatchSampler`):
    # never decided silently, so by default such a corpus is refused with the count and the fix.
    long_documents: str = field(default=DEFAULT_LONG_DOCUMENTS, metadata=option(
        "A document longer than the context length: 'error' refuses the corpus before the first batch (naming how "
        "many, the longest and the fix), 'split' cuts it into pieces of the context length, each a sample of its "
        "own, 'drop' leaves it out (counted).", choices=LONG_DOCUMENT_MODES))
    # WLB-LLM's outlier-delay queues (its strategy only): the thresholds, as fractions of the context.
    wlb_delay_fractions: str = field(default=DEFAULT_WLB_DELAY_FRACTIONS, metadata=option(
        "WLB-LLM's outlier-delay queues (strategy wlb-llm): thresholds as fractions of the context length, "
        "largest first, comma-separated; a document longer than the context x the i-th fraction (and not longer "
        "than the one before) waits in queue i until the queue holds one per micro-batch; '' delays none.",
        metavar="F1,F2"))
    solver_workers: int = field(default=1, metadata=not_an_option(
        "one CP-SAT worker keeps plans reproducible and leaves the cores to training; set it from Python"))
    # The search's effort knobs (not exposed as flags).
    tunables: PlannerTunables = field(default_factory=PlannerTunables, metadata=not_an_option(
        "the search's effort knobs (PlannerTunables), not what it plans for"))

    def __post_init__(self) -> None:
        _validate(self, self.find_problems)

    @staticmethod
    def find_problems(values: dict, n: Namer = str) -> Problems:
        """[(field, message)] for every bad value in `values` (field -> value); `n` names a field."""
        problems: Problems = []
        strategy = values["strategy"]
        if not isinstance(strategy, str) or not strategy:
            problems.append(("strategy", f"{n('strategy')} must be a strategy name, got {strategy!r}"))
        context = values["context_length"] if _integer(problems, values, n, "context_length", 1) else None
        for name in ("max_micropack_tokens", "slice_tokens"):
            if _integer(problems, values, n, name, 1, optional=True) and context and values[name] > context:
                problems.append((name, f"{n(name)} {values[name]} exceeds {n('context_length')} {context}"))
        for flag in ("dp_merge", "fixed_grouping_floor"):
            if not isinstance(values[flag], bool):
                problems.append((flag, f"{n(flag)} must be True or False, got {values[flag]!r}"))
        base_merge = values["base_merge"]
        if not (_is_int(base_merge) and base_merge >= 1 and base_merge & (base_merge - 1) == 0):
            problems.append(("base_merge", f"{n('base_merge')} must be a power of two >= 1, got {base_merge!r}"))
        _positive(problems, values, n, "merge_threshold")
        _positive(problems, values, n, "solver_time_limit_s", " seconds")
        _positive(problems, values, n, "solver_deterministic_limit", optional=True)
        _integer(problems, values, n, "seed", 0)
        if not isinstance(values["long_documents"], str) or values["long_documents"] not in LONG_DOCUMENT_MODES:
            problems.append(("long_documents", f"{n('long_documents')} must be one of "
                                               f"{', '.join(LONG_DOCUMENT_MODES)}, got {values['long_documents']!r}"))
        try:
            delay_fractions(values["wlb_delay_fractions"])
        except ValueError as error:
            problems.append(("wlb_delay_fractions", f"{n('wlb_delay_fractions')} {error}"))
        _integer(problems, values, n, "solver_workers", 1)
        if not isinstance(values["tunables"], PlannerTunables):
            problems.append(("tunables", f"{n('tunables')} must be a PlannerTunables, got {values['tunables']!r}"))
        return problems

    @property
    def delay_fractions(self) -> tuple[float, ...]:
        """`wlb_delay_fractions` as numbers, largest first."""
        return delay_fractions(self.wlb_delay_fractions)

    def with_(self, **changes) -> "SlimPackConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MegatronIntegrationConfig:
    """How the Megatron integration runs the planner (not planner configuration): its
    `--slimpack-*` flags besides `SlimPackConfig`'s. The cost model's two also serve the CLI."""

    plan_ahead: int = field(default=1, metadata=option(
        "Global batches planned ahead in a background worker (see --slimpack-planner-process); 0 plans inline.",
        cli="the CLI plans its batches in turn"))
    planner_process: bool = field(default=True, metadata=option(
        "Plan ahead in a spawned worker process, off the training process's GIL (a thread where the process "
        "cannot start); --no-slimpack-planner-process plans in a thread of the training process.",
        cli="the CLI plans its batches in turn"))
    planner_timeout: float = field(default=600.0, metadata=option(
        "Seconds a training step waits for its plan from the planner worker (process or thread) before every rank "
        "stops with an error naming the worker: a hung worker never hangs the job. Keep it well above the slowest "
        "plan's time (the planner log's per-step seconds).", metavar="SECONDS",
        cli="the CLI plans its batches in turn"))
    cost_model: str = field(default="analytic", metadata=option(
        "'analytic', a profile JSON written by `slimpack profile` (this device's model coefficients), or one "
        "written by `slimpack profile --kernels` (this device's kernel speeds in the analytic model of --hardware).",
        metavar="{analytic,PATH}"))
    hardware: str = field(default="h100-sxm", metadata=option(
        "Hardware preset for the analytic cost model."))
    dump_plans: str | None = field(default=None, metadata=option(
        "Write each step's plan JSON to DIR (rank 0).", metavar="DIR", none_means="no plans written",
        cli="`slimpack plan --out` writes the plans"))
    tp_overlap: bool = field(default=False, metadata=option(
        "Hide the layers' sequence-parallel collectives behind their GEMMs: each all-gather and reduce-scatter runs "
        "as a ring of TP-size chunks, each chunk's GEMM computed while the next travels (Transformer Engine's "
        "--tp-comm-overlap does the same for one fixed shape; these buffers follow each MicroPack's size). Needs "
        "--sequence-parallel and --transformer-impl local where --tensor-model-parallel-size > 1; `slimpack compare` "
        "prices the SlimPack runtime's strategies with it.",
        cli="`slimpack compare` prices the SlimPack runtime with it"))
    allow_untested_megatron: bool = field(default=False, metadata=option(
        "Train with a megatron-core newer than the newest release SlimPack is tested with (see patches/README.md). "
        "Without it such a release is refused: a release that builds its model another way could leave the sliced "
        "attention out (the run still stops before its first step if the built model lacks it).",
        cli="the CLI does not train"))

    def __post_init__(self) -> None:
        _validate(self, self.find_problems)

    @staticmethod
    def find_problems(values: dict, n: Namer = str) -> Problems:
        problems: Problems = []
        _integer(problems, values, n, "plan_ahead", 0)
        timeout = values["planner_timeout"]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            problems.append(("planner_timeout", f"{n('planner_timeout')} must be a number of seconds > 0, got "
                                                f"{timeout!r}"))
        for name in ("planner_process", "tp_overlap", "allow_untested_megatron"):
            if not isinstance(values[name], bool):
                problems.append((name, f"{n(name)} must be True or False, got {values[name]!r}"))
        cost = values["cost_model"]
        if not isinstance(cost, str) or (cost != "analytic" and not Path(cost).is_file()):
            problems.append(("cost_model", f"{n('cost_model')} {cost!r} is neither 'analytic' nor an existing "
                                           "profile JSON (create one with `slimpack profile`)"))
        elif values["hardware"] not in HARDWARE:  # the analytic model's device, a kernel profile's too
            problems.append(("hardware", f"{n('hardware')} {values['hardware']!r} is not a hardware preset "
                                         f"(known: {', '.join(HARDWARE)})"))
        dump = values["dump_plans"]
        if dump is not None and (not isinstance(dump, str) or not dump):
            problems.append(("dump_plans", f"{n('dump_plans')} must be a directory or None, got {dump!r}"))
        return problems

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["SlimPackConfig", "delay_fractions", "DEFAULT_WLB_DELAY_FRACTIONS", "PlannerTunables",
           "MegatronIntegrationConfig", "ConfigError", "Option", "option",
           "not_an_option", "Surface", "CLI", "MEGATRON", "add_options", "from_options", "option_fields",
           "not_options", "option_name"]
