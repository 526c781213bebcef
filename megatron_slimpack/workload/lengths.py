"""Length sources: document lengths from a spec string (`load_lengths`), their registry,
the synthetic generators, file and Megatron-dataset readers, and the input check the planner
uses (`check_lengths`). The `text` source is registered by corpus.py."""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, NoReturn

import numpy as np

from ..errors import SlimPackError

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class WorkloadError(SlimPackError):
    """A length source, length list or sampler setting that cannot be used; the message names the
    problem and the fix."""


# ==== input validation (used by the planner) ==============================================


def check_lengths(lengths, context_length: int | None = None) -> list[int]:
    """Return `lengths` as a list of Python ints, or raise WorkloadError.

    Rejects an empty batch, zero or negative lengths and anything that is not an integer
    (bools, strings, floats with a fractional part; 3.0 is accepted as 3). With
    `context_length`, a length above it is an error too: the planner never cuts a document;
    `GlobalBatchSampler(..., long_documents="split")` does, before planning, where asked to.
    """
    array = as_length_array(lengths, what="lengths")
    if context_length is not None:
        context_length = positive_int(context_length, "context_length")
        too_long = np.flatnonzero(array > context_length)
        if too_long.size:
            index = int(too_long[0])
            raise WorkloadError(
                f"lengths[{index}] = {int(array[index])} exceeds the context length {context_length} "
                f"({too_long.size} document(s) do). The planner plans samples of at most the context length: "
                "draw global batches with GlobalBatchSampler(lengths, context_length, global_batch_size, "
                "long_documents='split') (or global_batches(spec, context_length, global_batch_size, steps, "
                "long_documents='split')), which cuts such documents into pieces of the context length, or "
                "long_documents='drop', which leaves them out, and plan each batch's `lengths`"
            )
    return array.tolist()


def as_length_array(lengths, what: str) -> np.ndarray:
    """Validate document lengths and return them as an int64 array (vectorized for arrays)."""
    if isinstance(lengths, (str, bytes)):
        raise WorkloadError(f"{what} must be a sequence of positive integers, got the string {lengths!r}")
    if not hasattr(lengths, "__iter__"):
        raise WorkloadError(f"{what} must be a sequence of positive integers, got {type(lengths).__name__}")
    array = lengths if isinstance(lengths, np.ndarray) else None
    if array is None and isinstance(lengths, list) and all(type(value) is int for value in lengths):
        array = np.array(lengths, dtype=np.int64)  # the common case, without a per-item check
    if array is None or array.dtype.kind not in "iuf":
        array = np.array([_one_length(value, index, what) for index, value in enumerate(lengths)], dtype=np.int64)
    if array.ndim != 1:
        raise WorkloadError(f"{what} must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        raise WorkloadError(f"empty batch: {what} has no document lengths; give at least one positive integer")
    if array.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(array) | (array != np.round(array)))
        if bad.size:
            index = int(bad[0])
            raise WorkloadError(f"{what}[{index}] = {array[index]!r} is not an integer; lengths count tokens")
    array = array.astype(np.int64, copy=False)
    bad = np.flatnonzero(array <= 0)
    if bad.size:
        index = int(bad[0])
        raise WorkloadError(
            f"{what}[{index}] = {int(array[index])}: document lengths must be positive integers "
            f"({bad.size} are not); remove empty documents"
        )
    return array


def _one_length(value, index: int, what: str) -> int:
    # bool is an Integral in Python, but True as a length is always a bug upstream.
    if isinstance(value, (bool, np.bool_)):
        raise WorkloadError(f"{what}[{index}] = {value!r} is a bool, not a length")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(math.trunc(value))  # numbers.Real guarantees __trunc__, not __int__; the value is whole
    raise WorkloadError(
        f"{what}[{index}] = {value!r} ({type(value).__name__}) is not an integer; lengths are positive token counts"
    )


def positive_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value <= 0:
        raise WorkloadError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


# ==== the source registry =================================================================

Loader = Callable[[str, int, "int | None"], np.ndarray]  # (argument, seed, count) -> lengths


@dataclass(frozen=True)
class LengthSource:
    """A named way of producing document lengths from a spec `name[:argument]`."""

    name: str
    usage: str
    summary: str
    load: Loader


_SOURCES: dict[str, LengthSource] = {}


def register_source(name: str, usage: str, summary: str, load: Loader) -> None:
    """Add a length source (a plugin point: `load(argument, seed, count)` returns lengths)."""
    _SOURCES[name] = LengthSource(name, usage, summary, load)


def describe_sources() -> str:
    """Help text listing every spec form, for `--help` and error messages."""
    lines = ["Length sources (spec forms):"]
    for source in _SOURCES.values():
        lines.append(f"  {source.usage}")
        lines.extend(f"      {line}" for line in source.summary.splitlines())
    return "\n".join(lines)


def _valid_forms() -> str:
    return "valid forms: " + "; ".join(source.usage for source in _SOURCES.values())


def load_lengths(spec: str, *, seed: int = 0, count: int | None = None) -> np.ndarray:
    """Document lengths (int64 array) for a source spec such as `longtail:n=1000` or `file:PATH`.

    `seed` drives the synthetic generators. `count`: for generators, the number of documents
    (overrides `n=`); for finite sources (files, datasets, text), the first `count` documents
    (a prefix keeps document indices valid for fetching tokens; the sampler shuffles anyway).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise WorkloadError(f"a length source spec must be a non-empty string, got {spec!r}; {_valid_forms()}")
    if count is not None:
        count = positive_int(count, "count")
    name, _, argument = spec.strip().partition(":")
    source = _SOURCES.get(name.strip().lower())
    if source is None:
        hint = f" (to read the file {spec!r}, write 'file:{spec}')" if Path(spec).exists() else ""
        raise WorkloadError(f"unknown length source {name!r} in spec {spec!r}{hint}; {_valid_forms()}")
    return source.load(argument, seed, count)


def take_prefix(lengths: np.ndarray, count: int | None, where: str) -> np.ndarray:
    if count is None:
        return lengths
    if count > lengths.size:
        raise WorkloadError(f"count={count} but {where} has only {lengths.size} documents; ask for at most that")
    return lengths[:count]


# ==== synthetic generators ================================================================


def _parse_params(text: str, defaults, source: str):
    """`key=value,key=value` -> a copy of the `defaults` dataclass with those fields replaced."""
    known = {f.name: f for f in fields(defaults)}
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, raw = item.partition("=")
        key = key.strip()
        if not equals or key not in known:
            raise WorkloadError(
                f"{source}: bad parameter {item!r}; expected key=value with key among {', '.join(known)} "
                f"(e.g. '{source}:n=1000')"
            )
        changes[key] = _parse_number(raw.strip(), integer=known[key].type == "int", where=f"{source}: {key}")
    params = replace(defaults, **changes)
    params.check(source)
    return params


def _parse_number(raw: str, integer: bool, where: str) -> int | float:
    try:
        value = float(raw)
    except ValueError:
        raise WorkloadError(f"{where}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise WorkloadError(f"{where}={raw!r} must be finite")
    if integer:
        if not value.is_integer():
            raise WorkloadError(f"{where}={raw!r} must be an integer")
        return int(value)
    return value


def _require(condition: bool, source: str, message: str) -> None:
    if not condition:
        raise WorkloadError(f"{source}: {message}")


@dataclass(frozen=True)
class UniformParams:
    """megatron-core 0.16's `MockGPTLowLevelDataset`: `rng.integers(1, 4096)` lengths, 100,000
    documents, i.e. uniform on [1, 4095]. `min`/`max` here are both inclusive."""

    min: int = 1
    max: int = 4095
    n: int = 100_000

    def check(self, source: str) -> None:
        _require(self.min >= 1, source, f"min={self.min} must be >= 1")
        _require(self.max >= self.min, source, f"min={self.min} > max={self.max}; choose min <= max")
        _require(self.n >= 1, source, f"n={self.n} must be >= 1")


@dataclass(frozen=True)
class LognormalParams:
    """Lengths ~ LogNormal, rounded and clipped into [min, max].

    `mean` is the arithmetic mean length in tokens of the un-clipped distribution and `sigma`
    the standard deviation of ln(length), so mu = ln(mean) - sigma^2 / 2. The installed
    megatron-core (0.16.1) mock dataset has no lognormal option (it draws uniform lengths, see
    `uniform`); we keep its size (100,000 documents) and length range (1..4095) as defaults.
    """

    min: int = 1
    max: int = 4095
    mean: float = 1024.0
    sigma: float = 1.0
    n: int = 100_000

    def check(self, source: str) -> None:
        _require(self.min >= 1, source, f"min={self.min} must be >= 1")
        _require(self.max >= self.min, source, f"min={self.min} > max={self.max}; choose min <= max")
        _require(self.mean > 0, source, f"mean={self.mean} must be > 0")
        _require(self.sigma >= 0, source, f"sigma={self.sigma} must be >= 0")
        _require(self.n >= 1, source, f"n={self.n} must be >= 1")


@dataclass(frozen=True)
class LongTailParams:
    """A lognormal body plus a Pareto tail, rounded and clipped into [min, max].

    With probability `1 - tail` a length is `median * exp(sigma * Z)` (Z standard normal);
    with probability `tail` it is Pareto: `tail_start * U ** (-1 / alpha)` (U uniform on (0, 1]),
    whose P(length > x) falls like x^-alpha. The defaults reproduce the shape of the Wikipedia
    lengths in ../shared/data (p50 347, p90 2,112, p99 10,919, p99.9 37,353, 1.6% above 8K):
    with seed 0 and 10^6 documents they give p50 345, p90 2,107, p99 10,563, p99.9 37,407,
    1.6% above 8K, mean 1,040.
    """

    median: float = 330.0
    sigma: float = 1.3
    tail: float = 0.025
    tail_start: float = 4500.0
    alpha: float = 1.6
    min: int = 1
    max: int = 2_000_000
    n: int = 100_000

    def check(self, source: str) -> None:
        _require(self.median > 0, source, f"median={self.median} must be > 0")
        _require(self.sigma >= 0, source, f"sigma={self.sigma} must be >= 0")
        _require(0 <= self.tail <= 1, source, f"tail={self.tail} is a probability: choose 0 <= tail <= 1")
        _require(self.tail_start > 0, source, f"tail_start={self.tail_start} must be > 0")
        _require(self.alpha > 0, source, f"alpha={self.alpha} must be > 0")
        _require(self.min >= 1, source, f"min={self.min} must be >= 1")
        _require(self.max >= self.min, source, f"min={self.min} > max={self.max}; choose min <= max")
        _require(self.n >= 1, source, f"n={self.n} must be >= 1")


# Synthetic stand-ins for the paper's other two datasets. Their real length files are not
# available offline; these parameters are our judgement of the published character of each
# corpus, NOT fitted to it. Common Crawl: web pages a little longer in the median than
# Wikipedia articles, a slightly narrower body, and a thinner tail (long pages are usually cut
# by extraction). GitHub: source files, a wider body (from tiny configs to large modules) and a
# heavier tail (alpha 1.2: generated, vendored and minified files of 10^5..10^6 tokens).
# With seed 0 and 10^6 documents: commoncrawl p50 465, p90 2,397, p99 11,453, p99.9 37,646;
# github p50 740, p90 5,407, p99 29,107, p99.9 145,626.
PRESETS: dict[str, LongTailParams] = {
    "commoncrawl": LongTailParams(median=450, sigma=1.2, tail=0.02, tail_start=6000, alpha=1.7, max=1_000_000),
    "github": LongTailParams(median=700, sigma=1.4, tail=0.03, tail_start=8000, alpha=1.2, max=2_000_000),
}


def _count_override(params, count: int | None):
    return params if count is None else replace(params, n=count)


def uniform_lengths(params: UniformParams, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(params.min, params.max + 1, size=params.n, dtype=np.int64)


def lognormal_lengths(params: LognormalParams, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mu = math.log(params.mean) - params.sigma**2 / 2
    draws = rng.lognormal(mu, params.sigma, size=params.n)
    return np.clip(np.rint(draws), params.min, params.max).astype(np.int64)


def longtail_lengths(params: LongTailParams, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    body = params.median * np.exp(params.sigma * rng.standard_normal(params.n))
    in_tail = rng.random(params.n) < params.tail
    # 1 - random() lies in (0, 1], so the power never divides by zero.
    tail = params.tail_start * (1.0 - rng.random(params.n)) ** (-1.0 / params.alpha)
    draws = np.where(in_tail, tail, body)
    return np.clip(np.rint(draws), params.min, params.max).astype(np.int64)


def _generator(defaults, draw, source: str) -> Loader:
    def load(argument: str, seed: int, count: int | None) -> np.ndarray:
        params = _count_override(_parse_params(argument, defaults, source), count)
        return draw(params, seed)

    return load


def _describe_params(params) -> str:
    return ", ".join(f"{f.name}={getattr(params, f.name):g}" if f.type == "float"
                     else f"{f.name}={getattr(params, f.name)}"
                     for f in fields(params))


# ==== files ===============================================================================


def resolve_path(path: str | Path) -> Path:
    """A user path: as given (relative to the working directory), else relative to the project
    root, so that `../shared/data/wikipedia_lengths.txt` works from both."""
    candidate = Path(path).expanduser()
    if candidate.exists() or candidate.is_absolute():
        return candidate
    from_root = PROJECT_ROOT / candidate
    return from_root if from_root.exists() else candidate


def _require_file(path: Path, source: str) -> None:
    if not path.is_file():
        raise WorkloadError(
            f"{source}: {path} is not a file (relative paths are tried from the working directory "
            f"and from the project root {PROJECT_ROOT})"
        )


_DIGITS_AND_NEWLINES = np.zeros(256, dtype=bool)
_DIGITS_AND_NEWLINES[list(b"0123456789\n")] = True
_MAX_DIGITS = 18  # anything longer could overflow int64 and is not a document length anyway


def read_length_file(path: str | Path) -> np.ndarray:
    """One positive integer per line; blank lines only at the end. Fast path: numpy parses the
    whole file at once; only a malformed file is re-scanned line by line to name the culprit."""
    path = resolve_path(path)
    _require_file(path, "file")
    data = path.read_bytes().replace(b"\r\n", b"\n")
    body = data.rstrip(b" \t\r\n")
    if not body:
        raise WorkloadError(f"{path}: the file has no lengths; write one positive integer per line")
    lines = body.split(b"\n")
    well_formed = _DIGITS_AND_NEWLINES[np.frombuffer(body, dtype=np.uint8)].all() and b"\n\n" not in body
    table = np.array(lines) if well_formed else None
    if table is None or table.dtype.itemsize > _MAX_DIGITS or not all(lines[:1]) or not lines[-1]:
        _raise_first_bad_line(path, lines)
    lengths = table.astype(np.int64)
    zeros = np.flatnonzero(lengths <= 0)
    if zeros.size:
        _raise_bad_line(path, int(zeros[0]) + 1, lines[int(zeros[0])], "is not a positive integer")
    return lengths


def _raise_first_bad_line(path: Path, lines: list[bytes]) -> NoReturn:
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            _raise_bad_line(path, number, raw, "is blank (blank lines are allowed only at the end of the file)")
        if not text.isdigit() or len(text) > _MAX_DIGITS or int(text) <= 0:
            _raise_bad_line(path, number, raw, "is not a positive integer")
    raise AssertionError("unreachable: the fast path rejected a well-formed file")


def _raise_bad_line(path: Path, number: int, raw: bytes, problem: str) -> NoReturn:
    shown = raw.decode("utf-8", errors="replace")
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise WorkloadError(f"{path}:{number}: {shown!r} {problem}; "
                        "each line must hold one positive integer (a length in tokens)")


def read_jsonl_lengths(path: str | Path, field: str = "length") -> np.ndarray:
    """Each line a JSON object; `field` holds an int length, or a string whose UTF-8 byte count is
    the length (byte-level tokens, e.g. field `text`). Blank lines only at the end."""
    path = resolve_path(path)
    _require_file(path, "jsonl")
    lengths: list[int] = []
    blank_at = None
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                blank_at = blank_at or number
                continue
            if blank_at is not None:
                raise WorkloadError(f"{path}:{blank_at}: blank line before line {number}; "
                                    "blank lines are allowed only at the end")
            lengths.append(_jsonl_length(path, number, raw, field))
    if not lengths:
        raise WorkloadError(f"{path}: the file has no JSON lines; "
                            f"write one JSON object per line with a {field!r} field")
    return np.array(lengths, dtype=np.int64)


def _jsonl_length(path: Path, number: int, raw: bytes, field: str) -> int:
    where = f"{path}:{number}"
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise WorkloadError(f"{where}: not valid JSON ({error}): {raw[:80]!r}") from None
    if not isinstance(record, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(record).__name__}: {raw[:80]!r}")
    if field not in record:
        raise WorkloadError(
            f"{where}: no field {field!r} (fields: {', '.join(map(str, record)) or 'none'}); "
            f"choose the field with 'jsonl:{path}:FIELD'"
        )
    value = record[field]
    if isinstance(value, str):
        length = len(value.encode("utf-8"))
    elif isinstance(value, int) and not isinstance(value, bool):
        length = value
    else:
        raise WorkloadError(f"{where}: field {field!r} is {value!r}; expected an integer length or a text string")
    if length <= 0:
        raise WorkloadError(f"{where}: field {field!r} gives length {length}; "
                            "lengths must be positive (remove empty documents)")
    return length


def _split_jsonl_argument(argument: str) -> tuple[str, str]:
    # PATH may itself contain ':'; a trailing ':FIELD' counts only when PATH alone is not a file.
    if resolve_path(argument).is_file() or ":" not in argument:
        return argument, "length"
    path, _, field = argument.rpartition(":")
    return path, field or "length"


# ==== Megatron indexed datasets ===========================================================


def read_megatron_lengths(prefix: str | Path) -> np.ndarray:
    """Document lengths of a Megatron indexed dataset PREFIX.bin/.idx.

    In the index, a document is a run of sequences: document d holds sequences
    `document_indices[d] : document_indices[d + 1]`, and its length is the sum of their
    `sequence_lengths`. Empty documents (no tokens) are skipped: they cost nothing to train.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = str(prefix)
    for suffix in (".bin", ".idx"):
        prefix = prefix[: -len(suffix)] if prefix.endswith(suffix) else prefix
    prefix = str(resolve_path(prefix + ".idx"))[: -len(".idx")]
    if not IndexedDataset.exists(prefix):
        raise WorkloadError(f"megatron: no indexed dataset at {prefix}.bin / {prefix}.idx; give the common prefix")
    try:
        dataset = IndexedDataset(prefix, mmap=True)
        sequence_lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
        document_indices = np.asarray(dataset.document_indices, dtype=np.int64)
    except Exception as error:  # a corrupt index surfaces as assertion or struct errors
        raise WorkloadError(f"megatron: cannot read the indexed dataset {prefix}: {error!r}") from error
    boundaries = np.concatenate([[0], np.cumsum(sequence_lengths)])
    lengths = boundaries[document_indices[1:]] - boundaries[document_indices[:-1]]
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        raise WorkloadError(f"megatron: the indexed dataset {prefix} has no non-empty documents")
    return lengths


# ==== registration ========================================================================

register_source(
    "lognormal",
    "lognormal[:min=..,max=..,mean=..,sigma=..,n=..]",
    "Lognormal lengths clipped to [min, max]; mean = mean length in tokens, sigma = std of ln(length).\n"
    f"Defaults: {_describe_params(LognormalParams())} (megatron-core's mock dataset size and range).",
    _generator(LognormalParams(), lognormal_lengths, "lognormal"),
)
register_source(
    "uniform",
    "uniform[:min=..,max=..,n=..]",
    f"Uniform integer lengths, both ends inclusive: the distribution of megatron-core 0.16's mock data.\n"
    f"Defaults: {_describe_params(UniformParams())}.",
    _generator(UniformParams(), uniform_lengths, "uniform"),
)
register_source(
    "longtail",
    "longtail[:median=..,sigma=..,tail=..,tail_start=..,alpha=..,min=..,max=..,n=..]",
    "Lognormal body (median, sigma) plus, with probability `tail`, a Pareto tail (tail_start, alpha).\n"
    f"Defaults (shaped like web text / Wikipedia): {_describe_params(LongTailParams())}.",
    _generator(LongTailParams(), longtail_lengths, "longtail"),
)
for _name, _params in PRESETS.items():
    register_source(
        _name,
        f"{_name}[:key=value,...]",
        f"Synthetic stand-in for the paper's {_name} dataset (not its real lengths): longtail with\n"
        f"{_describe_params(_params)}; any longtail key overrides.",
        _generator(_params, longtail_lengths, _name),
    )
register_source(
    "file",
    "file:PATH",
    "One positive integer per line, e.g. file:../shared/data/wikipedia_lengths.txt (relative paths:\n"
    "working directory first, then the project root).",
    lambda argument, seed, count: take_prefix(read_length_file(argument), count, argument),
)
register_source(
    "jsonl",
    "jsonl:PATH[:FIELD]",
    "One JSON object per line; FIELD (default 'length') is an int length or a string whose UTF-8\n"
    "byte count is the length (e.g. jsonl:corpus.jsonl:text).",
    lambda argument, seed, count: take_prefix(read_jsonl_lengths(*_split_jsonl_argument(argument)), count, argument),
)
register_source(
    "megatron",
    "megatron:PREFIX",
    "Document lengths of a Megatron indexed dataset PREFIX.bin / PREFIX.idx (preprocess_data.py output).",
    lambda argument, seed, count: take_prefix(read_megatron_lengths(argument), count, argument),
)
