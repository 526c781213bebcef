"""`slimpack profile`: measure this device and fit the cost model's coefficients (docs/design.md section 4).

What is timed (median of `repeats` after a warm-up, torch threads as set by the caller, default
1 to match one training process per core):

* a pipeline chunk of `layers_per_stage` transformer layers (megatron-core layers built with the
  SlimPack layer spec and the runtime's own attention, `backend="torch"` on CPU), run exactly as
  the pipeline schedule runs a MicroPack on a middle stage: `forward_step` on a received leaf,
  then `backward` with an output gradient. Grid: MicroPack tokens T, slices per MicroPack n and
  the KV-prefix length P of each slice (P > 0: the prefix slices are run first, untimed, so the
  KV store holds them). Least squares per pass: chunk_seconds = c0 + per_token*T + per_pair*A
  (A: causal attention pairs, prefix included); the cost model's per-layer coefficients are the
  chunk's divided by the chunk's layers, and `kernel_overhead_s` is set to 0 (c0 holds it).
* the output layer + loss (final norm, output layer, cross-entropy, masked sum) on T tokens:
  c0 + per_token*T, forward and backward.
* activation bytes: saved-tensor bytes of the chunk's forward (unique storages, parameters
  excluded, via `saved_tensors_hooks`), least squares on per_token*T + per_pair*A +
  per_prefix_token*P_total per layer; the head's bytes per token minus the fp32 logits give
  `per_model_token`.
* p2p: gloo send/recv ping-pong between 2 processes over a few sizes; fit latency +
  bytes/bandwidth -> the hardware's link figures (or the preset's, documented, with p2p=False).

The JSON is `CostModel.to_profile_dict()` plus a "fit" section (coefficients' standard errors,
per-point residuals, MAPE); `CostModel.from_profile(path)` loads it.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, cast

import numpy as np

from ..costmodel import ActivationCoefficients, CostModel, TimeCoefficients
from ..plan import MicroPack, Slice
from ..runtime.host_memory import keep_freed_host_memory
from ..runtime.processes import spawn
from ..specs import HardwareSpec, ModelSpec, get_hardware, get_model, hardware_from_dict, model_from_dict
from .cli_options import add_model_option, positive_int

REFERENCE_TOKENS = 1024  # the speed reference: one 1024-token document, forward + backward


def reference_seconds(chunk, spec: ModelSpec, repeats: int = 3) -> float:
    """Forward + backward seconds of the reference shape on `chunk`: measured with the profile and
    again right before each validation step, so `slimpack validate` can tell the machine's speed
    drift (other jobs, clocks) from the cost model's own error."""
    point = measure_chunk(chunk, spec, REFERENCE_TOKENS, 1, 0, repeats)
    return point.forward_s + point.backward_s


DEFAULT_GRID = dict(tokens=(128, 512, 1024, 2048), slices=(1, 4), prefixes=(0, 1024))
QUICK_GRID = dict(tokens=(64, 256, 512), slices=(1, 2), prefixes=(0, 256))


@dataclass
class Point:
    tokens: int
    slices: int
    prefix: int
    pairs: int
    prefix_tokens: int
    forward_s: float
    backward_s: float
    saved_bytes: int

    @property
    def masked_entries(self) -> int:
        """Query x key entries of the slices that read a prefix (the torch kernel's mask)."""
        length = self.tokens // self.slices
        return self.slices * length * (self.prefix + length) if self.prefix else 0


@dataclass
class ProfileResult:
    cost: CostModel
    points: list[Point]
    head_points: list[dict]
    p2p_points: list[dict]
    fit: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        data = self.cost.to_profile_dict()
        data["fit"] = self.fit
        data["points"] = [asdict(p) for p in self.points]
        data["head_points"] = self.head_points
        data["p2p_points"] = self.p2p_points
        return data

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path


# ---- model helpers ---------------------------------------------------------------------------
def transformer_config(spec: ModelSpec, *, num_layers: int, **overrides):
    """A megatron TransformerConfig for a ModelSpec (fp32, Llama-style, CPU-friendly)."""
    from ..runtime.model import tiny_config

    return tiny_config(num_layers=num_layers, hidden_size=spec.hidden_size,
                       num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
                       ffn_hidden_size=spec.ffn_hidden_size, **overrides)


def ensure_megatron(seed: int = 1234) -> None:
    """One-process gloo + megatron parallel state + CPU compatibility, if not there yet."""
    import socket

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from ..runtime import compat

    compat.apply()
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(seed)


def _pairs(length: int, start: int) -> int:
    return length * start + length * (length + 1) // 2


def _median_time(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


# ---- measurements ----------------------------------------------------------------------------
def measure_chunk(chunk, spec: ModelSpec, tokens: int, slices: int, prefix: int, repeats: int,
                  device: str = "cpu", dtype=None) -> Point:
    """Forward/backward seconds and saved bytes of one MicroPack of `slices` equal slices holding
    `tokens` tokens, each slice continuing a document after `prefix` tokens, on a middle-stage chunk
    (on `device`, activations in `dtype`, default fp32; a GPU is synchronized around each timing)."""
    import torch

    from ..runtime.attention.batch import build_batch
    from ..runtime.attention.kv_store import KVStore
    from ..runtime.pipeline.executor import backward_step, forward_step
    from ..runtime.pipeline.timing import SavedBytesMeter
    from .selftest.common import synchronize

    where = torch.device(device)
    length = max(1, tokens // slices)
    generator = torch.Generator().manual_seed(tokens * 31 + slices * 7 + prefix)
    documents = {i: torch.randint(0, spec.vocab_size, (prefix + length + 1,), generator=generator)
                 for i in range(slices)}

    class Source:
        def tokens(self, sample_id, start, end):
            return documents[sample_id][start:end + 1]

    head = MicroPack([Slice(i, 0, prefix) for i in range(slices)]) if prefix else None
    body = MicroPack([Slice(i, prefix, prefix + length) for i in range(slices)])
    hidden = spec.hidden_size
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    saved = [0]

    def one(kind: str) -> float:
        store = KVStore()
        batches = [build_batch(mp, Source(), store, device) for mp in ([head] if head else []) + [body]]
        outputs = []
        for index, batch in enumerate(batches):
            leaf = torch.randn(batch.num_tokens, 1, hidden, device=device, dtype=dtype).requires_grad_()
            timed = index == len(batches) - 1
            synchronize(where)
            began = time.perf_counter()
            if timed:
                meter = SavedBytesMeter(params)
                with meter:
                    output = forward_step(chunk, batch, input_tensor=leaf)
                saved[0] = meter.bytes
            else:
                output = forward_step(chunk, batch, input_tensor=leaf)
            if timed and kind == "F":
                synchronize(where)
                forward = time.perf_counter() - began
            outputs.append((output, leaf))
        grad = torch.randn_like(outputs[-1][0])
        synchronize(where)
        began = time.perf_counter()
        backward_step(outputs[-1][0], grad, input_tensor=outputs[-1][1])
        synchronize(where)
        backward = time.perf_counter() - began
        if head:
            backward_step(outputs[0][0], torch.randn_like(outputs[0][0]), input_tensor=outputs[0][1])
        chunk.zero_grad(set_to_none=True)
        return forward if kind == "F" else backward

    forward_s = _median_time(lambda: one("F"), repeats)
    backward_s = _median_time(lambda: one("B"), repeats)
    return Point(length * slices, slices, prefix, slices * _pairs(length, prefix), slices * prefix,
                 forward_s, backward_s, saved[0])


def measure_head(model, spec: ModelSpec, tokens: int, repeats: int) -> dict:
    """Output layer + loss (final norm, output layer, cross-entropy, masked sum) on `tokens` tokens."""
    import torch

    from ..runtime.pipeline.timing import SavedBytesMeter

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    labels = torch.randint(0, spec.vocab_size, (1, tokens))
    mask = torch.ones(1, tokens)
    saved = [0]

    def run(kind):
        hidden = torch.randn(tokens, 1, spec.hidden_size).requires_grad_()
        began = time.perf_counter()
        meter = SavedBytesMeter(params)
        with meter:
            x = (model.decoder.final_layernorm(hidden) if getattr(model.decoder, "final_layernorm", None) is not None
                 else hidden)
            logits, _ = model.output_layer(x)
            loss = (model.compute_language_model_loss(labels, logits).float() * mask).sum()
            float(loss.detach())
        saved[0] = meter.bytes
        forward = time.perf_counter() - began
        began = time.perf_counter()
        loss.backward()
        backward = time.perf_counter() - began
        model.zero_grad(set_to_none=True)
        return forward if kind == "F" else backward

    return {"tokens": tokens, "forward_s": _median_time(lambda: run("F"), repeats),
            "backward_s": _median_time(lambda: run("B"), repeats), "saved_bytes": saved[0]}


def _p2p_worker(rank, world_size, port, sizes, repeats, path):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    rows = []
    for size in sizes:
        buffer = torch.zeros(size // 4)
        times = []
        for repeat in range(repeats + 1):
            dist.barrier()
            began = time.perf_counter()
            if rank == 0:
                dist.send(buffer, dst=1)
                dist.recv(buffer, src=1)
            else:
                dist.recv(buffer, src=0)
                dist.send(buffer, dst=0)
            if repeat:
                times.append((time.perf_counter() - began) / 2)
        rows.append({"bytes": size, "seconds": statistics.median(times)})
    if rank == 0:
        Path(path).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure_p2p(sizes: Sequence[int] = (4096, 65536, 1 << 20, 4 << 20), repeats: int = 5,
                timeout_s: float = 120) -> list[dict]:
    """One-way gloo send/recv seconds between two local processes (half a ping-pong)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p2p.json"
        spawn(_p2p_worker, 2, (list(sizes), repeats, str(path)), timeout_s=timeout_s)
        return json.loads(path.read_text())


# ---- fitting ---------------------------------------------------------------------------------
def least_squares(columns: list[np.ndarray], target: np.ndarray, names: list[str], nonnegative: bool = True) -> dict:
    """Fit target ~ sum(coef * column) by least squares (relative residuals weighted equally:
    each row divided by its target). Returns coefficients, their standard errors, the relative
    residuals and their mean absolute value. Negative coefficients are dropped and refitted."""
    active = list(range(len(columns)))
    weights = 1.0 / np.maximum(np.abs(target), 1e-12)
    while True:
        X = np.stack([columns[i] for i in active], axis=1) * weights[:, None]
        y = target * weights
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        if not nonnegative or (coef >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(coef)))
    values = dict.fromkeys(names, 0.0)
    errors = dict.fromkeys(names, 0.0)
    residual = y - X @ coef
    dof = max(1, len(y) - len(active))
    sigma2 = float(residual @ residual) / dof
    try:
        covariance = sigma2 * np.linalg.inv(X.T @ X)
        stderr = np.sqrt(np.maximum(np.diag(covariance), 0))
    except np.linalg.LinAlgError:
        stderr = np.full(len(active), float("nan"))
    for position, index in enumerate(active):
        values[names[index]] = float(coef[position])
        errors[names[index]] = float(stderr[position])
    prediction = sum(values[n] * c for n, c in zip(names, columns))
    relative = (prediction - target) / np.maximum(np.abs(target), 1e-12)
    return {"coefficients": values, "stderr": errors,
            "relative_stderr": {n: (errors[n] / abs(values[n]) if values[n] else None) for n in names},
            "residuals": relative.tolist(), "mape": float(np.mean(np.abs(relative)))}


def fit_profile(spec: ModelSpec, layers: int, points: list[Point], head_points: list[dict], p2p_points: list[dict],
                hardware: HardwareSpec, dtype_bytes: int = 4) -> tuple[CostModel, dict]:
    tokens = np.array([p.tokens for p in points], dtype=float)
    pairs = np.array([p.pairs for p in points], dtype=float)
    prefix = np.array([p.prefix_tokens for p in points], dtype=float)
    ones = np.ones_like(tokens)
    fit: dict[str, Any] = {}
    coefficients = {}
    for name, target in (("forward", [p.forward_s for p in points]), ("backward", [p.backward_s for p in points])):
        result = least_squares([ones, tokens, pairs], np.array(target), ["c0", "per_token", "per_pair"])
        fit[name] = result
        c = result["coefficients"]
        coefficients[name] = TimeCoefficients(c["c0"] / layers, c["per_token"] / layers, c["per_pair"] / layers)
    head_tokens = np.array([h["tokens"] for h in head_points], dtype=float)
    for name in ("forward", "backward"):
        result = least_squares([np.ones_like(head_tokens), head_tokens],
                               np.array([h[f"{name}_s"] for h in head_points]), ["c0", "per_token"])
        fit[f"head_{name}"] = result
        c = result["coefficients"]
        coefficients[f"head_{name}"] = TimeCoefficients(c["c0"], c["per_token"], 0.0)
    saved = np.array([p.saved_bytes for p in points], dtype=float)
    masked = np.array([p.masked_entries for p in points], dtype=float)
    # Prefix-free shapes (what most MicroPacks are) fix per_token and per_pair; what a KV prefix adds
    # beyond them is fitted on the prefix shapes: the copied keys (per prefix token) and the torch
    # kernel's explicit bottom-right mask (per query x key entry of a prefixed slice).
    plain = prefix == 0
    if plain.sum() >= 2 and (~plain).sum() >= 2:
        result = least_squares([tokens[plain], pairs[plain]], saved[plain], ["per_token", "per_pair"])
        base = result["coefficients"]["per_token"] * tokens + result["coefficients"]["per_pair"] * pairs
        extra = least_squares([prefix[~plain], masked[~plain]], saved[~plain] - base[~plain],
                              ["per_prefix_token", "per_masked_entry"])
        for key in ("coefficients", "stderr", "relative_stderr"):
            result[key].update(extra[key])
        prediction = (base + extra["coefficients"]["per_prefix_token"] * prefix
                      + extra["coefficients"]["per_masked_entry"] * masked)
        relative = (prediction - saved) / saved
        result["residuals"], result["mape"] = relative.tolist(), float(np.mean(np.abs(relative)))
    else:
        result = least_squares([tokens, pairs, prefix, masked], saved,
                               ["per_token", "per_pair", "per_prefix_token", "per_masked_entry"])
    fit["activation"] = result
    a = result["coefficients"]
    head_bytes = np.array([h["saved_bytes"] for h in head_points], dtype=float)
    per_model = float(np.median(head_bytes / head_tokens)) - 4.0 * spec.vocab_size
    activation = ActivationCoefficients(a["per_token"] / layers, a["per_pair"] / layers, a["per_prefix_token"] / layers,
                                        max(0.0, per_model), a["per_masked_entry"] / layers)
    fit["activation_head_bytes_per_token"] = float(np.median(head_bytes / head_tokens))
    if p2p_points:
        sizes = np.array([r["bytes"] for r in p2p_points], dtype=float)
        seconds = np.array([r["seconds"] for r in p2p_points])
        result = least_squares([np.ones_like(sizes), sizes], seconds, ["latency_s", "seconds_per_byte"])
        fit["p2p"] = result
        latency = result["coefficients"]["latency_s"]
        per_byte = result["coefficients"]["seconds_per_byte"]
        bandwidth = 1.0 / per_byte if per_byte > 0 else hardware.intra_node_bandwidth
        hardware = replace(hardware, intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
                           link_latency_s=latency)
    hardware = replace(hardware, kernel_overhead_s=0.0)
    fit["layers_per_chunk"] = layers
    cost = CostModel(spec, hardware, dtype_bytes=dtype_bytes, attention_backend="torch",
                     forward=coefficients["forward"], backward=coefficients["backward"],
                     head_forward=coefficients["head_forward"], head_backward=coefficients["head_backward"],
                     activation=activation, source="profile")
    return cost, fit


def _measure_grid(spec: ModelSpec, layers: int, grid: dict, repeats: int, threads: int, seed: int,
                  progress: Callable[[str], None] | None, before_each: Callable[[], None] = lambda: None
                  ) -> tuple[list[Point], list[dict], dict]:
    """Chunk points over the grid, the output layer + loss points, and the speed reference.
    `before_each` runs before every measurement (concurrent profiling: a barrier, so that all
    processes measure the same shape at the same time)."""
    import torch

    from ..runtime.model import build_gpt_model

    keep_freed_host_memory()  # as in the training processes, so the profile sees the same allocator
    torch.set_num_threads(threads)
    ensure_megatron()
    torch.manual_seed(seed)
    mid = build_gpt_model(transformer_config(spec, num_layers=layers), vocab_size=spec.vocab_size,
                          max_sequence_length=1 << 20, backend="torch", pre_process=False, post_process=False)
    last = build_gpt_model(transformer_config(spec, num_layers=1), vocab_size=spec.vocab_size,
                           max_sequence_length=1 << 20, backend="torch", pre_process=False, post_process=True)
    points = []
    shapes = [(t, n, p) for t in grid["tokens"] for n in grid["slices"] for p in grid["prefixes"] if t // n >= 1]
    for index, (t, n, p) in enumerate(shapes):
        before_each()
        point = measure_chunk(mid, spec, t, n, p, repeats)
        points.append(point)
        if progress:
            progress(f"[{index + 1}/{len(shapes)}] T={point.tokens} slices={n} prefix={p}: "
                     f"F {point.forward_s * 1e3:.2f} ms, B {point.backward_s * 1e3:.2f} ms, "
                     f"saved {point.saved_bytes / 2**20:.1f} MiB")
    head_points = []
    for t in sorted(set(grid["tokens"])):
        before_each()
        head_points.append(measure_head(last, spec, t, repeats))
    before_each()
    reference = {"tokens": REFERENCE_TOKENS, "layers": layers, "seconds": reference_seconds(mid, spec, repeats)}
    return points, head_points, reference


def _grid_worker(rank, world_size, port, spec_dict, layers, grid, repeats, threads, seed, path):
    """One of `concurrent` processes measuring the same grid at once (a barrier before every
    shape); rank 0 keeps its figures."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    points, head_points, reference = _measure_grid(model_from_dict(spec_dict), layers, grid, repeats, threads, seed,
                                                   None, before_each=dist.barrier)
    if rank == 0:
        Path(path).write_text(json.dumps({"points": [asdict(p) for p in points], "head_points": head_points,
                                          "reference": reference}))


def profile(model: str | ModelSpec = "tiny", *, pp: int = 2, hardware: str = "cpu", grid: Optional[dict] = None,
            repeats: int = 3, p2p: bool = True, threads: int = 1, progress: Callable[[str], None] | None = print,
            seed: int = 0, concurrent: int = 1) -> ProfileResult:
    """Time the model on this device over `grid` (keys tokens, slices, prefixes) and fit the cost
    model. The chunk holds the layers one of `pp` pipeline stages runs (the coefficients are then
    exact for that stage size; the cost model divides per layer).

    `concurrent` > 1 measures in that many processes at once (each runs the whole grid; the first
    one's figures are kept), so the profile sees the same contention for cores, caches and memory
    bandwidth as a training run with that many processes on the machine."""
    spec = get_model(model) if isinstance(model, str) else model
    layers = max(1, spec.num_layers // pp)
    grid = dict(DEFAULT_GRID, **(grid or {}))
    if concurrent > 1:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "grid.json"
            if progress:
                progress(f"measuring the grid in {concurrent} concurrent processes")
            spawn(_grid_worker, concurrent, (spec.to_dict(), layers, {k: list(v) for k, v in grid.items()}, repeats,
                                             threads, seed, str(path)), timeout_s=3600)
            data = json.loads(path.read_text())
        points, head_points, reference = [Point(**p) for p in data["points"]], data["head_points"], data["reference"]
    else:
        points, head_points, reference = _measure_grid(spec, layers, grid, repeats, threads, seed, progress)
    p2p_points = measure_p2p() if p2p else []
    cost, fit = fit_profile(spec, layers, points, head_points, p2p_points, get_hardware(hardware))
    fit["grid"] = {k: list(v) for k, v in grid.items()}
    fit["threads"] = threads
    fit["concurrent_processes"] = concurrent
    cost.reference = reference
    fit["p2p"] = fit.get("p2p", "not measured: the preset's link figures are used")
    result = ProfileResult(cost, points, head_points, p2p_points, fit)
    if progress:
        progress(describe_fit(fit))
    return result


def refit(path: str | Path, out: Optional[str | Path] = None) -> ProfileResult:
    """Refit a profile JSON's stored measurements (no new timing)."""
    data = json.loads(Path(path).read_text())
    points = [Point(**p) for p in data["points"]]
    spec = model_from_dict(data["model"])
    hardware = replace(hardware_from_dict(data["hardware"]))
    cost, fit = fit_profile(spec, int(data["fit"]["layers_per_chunk"]), points, data["head_points"], data["p2p_points"],
                            get_hardware(hardware.name) if hardware.name in ("cpu",) else hardware)
    for key in ("grid", "threads", "concurrent_processes"):
        if key in data["fit"]:
            fit[key] = data["fit"][key]
    cost.reference = data.get("reference")
    result = ProfileResult(cost, points, data["head_points"], data["p2p_points"], fit)
    result.write(out or path)
    return result


def describe_fit(fit: dict) -> str:
    lines = ["term            coefficient      rel. stderr   fit MAPE"]
    for name in ("forward", "backward", "head_forward", "head_backward", "activation", "p2p"):
        entry = fit.get(name)
        if not isinstance(entry, dict):
            continue
        for term, value in entry["coefficients"].items():
            rel = entry["relative_stderr"].get(term)
            lines.append(f"{name + '.' + term:<28} {value:12.4e}  "
                         f"{('%.1f%%' % (100 * rel)) if rel is not None else '-':>9}   {100 * entry['mape']:.1f}%")
    return "\n".join(lines)


def predict_point(cost: CostModel, point: Point, layers: int) -> tuple[float, float, float]:
    """(forward s, backward s, saved bytes) the fitted model predicts for a chunk measurement."""
    # A fitted cost model has both.
    f, b = cast(TimeCoefficients, cost.profiled_forward), cast(TimeCoefficients, cost.profiled_backward)
    a = cost.activation
    return (layers * f(point.tokens, point.pairs), layers * b(point.tokens, point.pairs),
            layers * (a.per_token * point.tokens + a.per_pair * point.pairs + a.per_prefix_token * point.prefix_tokens
                      + a.per_masked_entry * point.masked_entries))


def profile_main(args) -> int:
    """CLI hook: `slimpack profile --model NAME [--tp N] [--pp N] [--quick] [--no-p2p] --out profile.json`,
    or `slimpack profile --kernels [--quick] --out kernels.json` (kernel_profile.py)."""
    if getattr(args, "kernels", False):
        from .kernel_profile import kernel_profile_main  # torch: kept out of `slimpack --help`

        return kernel_profile_main(args)
    tp = getattr(args, "tp", 1) or 1
    if tp != 1:
        raise SystemExit("slimpack profile measures at tp=1 (the cost model divides token terms by tp); "
                         "run it without --tp")
    grid = QUICK_GRID if getattr(args, "quick", False) else None
    result = profile(getattr(args, "model", "tiny"), pp=getattr(args, "pp", 2) or 2, grid=grid,
                     repeats=getattr(args, "repeats", 3) or 3, p2p=not getattr(args, "no_p2p", False),
                     threads=getattr(args, "threads", 1) or 1, concurrent=getattr(args, "concurrent", 1) or 1)
    out = getattr(args, "out", None) or "profile.json"
    result.write(out)
    if getattr(args, "json", False):
        print(json.dumps(result.fit))  # --json: one JSON document on stdout, the rest on stderr
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(f"wrote {out}")
    return 0


def add_profile_arguments(parser) -> None:
    add_model_option(parser, "tiny", "model preset to time (default tiny)")
    parser.add_argument("--tp", type=int, default=1, choices=[1],
                        help="tensor-parallel size: 1 only (the cost model divides the token terms by tp)")
    parser.add_argument("--pp", type=positive_int, default=2, help="pipeline stages the chunk is sized for")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per grid point (default 3)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--concurrent", type=positive_int, default=1,
                        help="measure in this many processes at once (as many as the training run will use)")
    parser.add_argument("--kernels", action="store_true",
                        help="measure this device's kernel speeds (GEMM by size, the runtime's attention kernels by "
                             "document length) instead of a model's layers; the file, given as --cost-model, replaces "
                             "the published tables in the analytic model of --hardware")
    parser.add_argument("--quick", action="store_true", help="a small grid (tests)")
    parser.add_argument("--no-p2p", action="store_true", help="skip the 2-process gloo p2p measurement")
    parser.add_argument("--out", default=None,
                        help="where the profile JSON goes (default profile.json; kernels.json with --kernels)")
    parser.add_argument("--json", action="store_true", help="the fit as one JSON document on stdout (logs: stderr)")

if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_profile_arguments(parser)
    raise SystemExit(profile_main(parser.parse_args()))
