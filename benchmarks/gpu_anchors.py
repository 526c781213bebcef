"""One GPU measured against the cost model: what `slimpack cost` predicts for a llama-7b layer on an
H100 (the published kernel tables) next to what this GPU measures, the bottom-right causal paths
torch offers for a slice's KV prefix, and a single-GPU training comparison.

    python benchmarks/gpu_anchors.py --out gpu_anchors.json          # a CUDA GPU and megatron-core
    python benchmarks/gpu_anchors.py --device cpu --quick            # the code paths, tiny shapes

Sections (each one's rows are printed and written to the JSON):
 1. gemm: the layer's four GEMMs (QKV, attention output, fc1 of SwiGLU, fc2) forward, bf16, on T
    tokens: measured ms and TFLOP/s against the model's `gemm_forward_ms`.
 2. attention: causal attention on T tokens of equal documents of L tokens, forward and backward,
    through torch SDPA's flash backend (flash-attention 2), SDPA's cuDNN backend and the runtime's
    torch kernel (PyTorch's varlen flash attention), each against the rates of the backend that
    prices it (`--attention-backend flash`, `te`, `torch`).
 3. layer: one megatron-core layer built with the SlimPack spec and the runtime's torch attention
    kernel (SDPA per whole-document segment; tiles with an online softmax for a segment with a KV
    prefix), forward and backward as a middle pipeline stage runs a MicroPack
    (`profiler.measure_chunk`), against the model's `layer_forward_ms`/`layer_backward_ms`.
 4. bottom_right: slices with a KV prefix (queries see the prefix and their own causal block)
    through the runtime's torch kernel (on a GPU: PyTorch's varlen flash attention) and its
    per-segment fallback (SDPA with `causal_lower_right`): forward and q/k/v-gradient errors
    against the fp32 masked softmax, and milliseconds.
 5. steps: a 2-layer llama-7b-wide GPT trained on one batch of the embedded text corpus planned by
    megatron-fixed and by slimpack (pp=1, dp=1), step time measured and simulated (H100 model,
    torch attention) side by side as ratios.
Nothing here asserts: it measures. The selftest (`slimpack selftest`) holds the pass/fail checks.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_slimpack.apps.cost import cost_figures  # noqa: E402
from megatron_slimpack.apps.selftest.common import median_seconds  # noqa: E402
from megatron_slimpack.costmodel import CostModel  # noqa: E402
from megatron_slimpack.specs import ParallelConfig, get_model  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def timed_ms(run: Callable[[], object], device: str, repeats: int) -> float:
    """Median milliseconds of `run` after one warm-up, the GPU synchronized around each run."""
    return median_seconds(run, repeats, torch.device(device)) * 1e3


def precision(dtype) -> dict:
    """TransformerConfig fields for `dtype` (fp32: the config's default)."""
    return {} if dtype == torch.float32 else {"bf16": True, "params_dtype": dtype, "pipeline_dtype": dtype}


def model_cost(spec, backend: str) -> CostModel:
    return CostModel.analytic(spec, "h100-sxm", attention_backend=backend)


# ---- 1. GEMMs ---------------------------------------------------------------------------------
def gemm_rows(spec, tokens_list, device, dtype, repeats) -> list[dict]:
    h, f = spec.hidden_size, spec.ffn_hidden_size
    kv = spec.kv_heads * (h // spec.num_attention_heads)
    shapes = {"qkv": (h, h + 2 * kv), "proj": (h, h), "fc1": (h, 2 * f), "fc2": (f, h)}
    cost = model_cost(spec, "flash")
    rows = []
    for tokens in tokens_list:
        total_ms, flops = 0.0, 0.0
        for k, n in shapes.values():
            x = torch.randn(tokens, k, device=device, dtype=dtype)
            w = torch.randn(k, n, device=device, dtype=dtype)
            total_ms += timed_ms(lambda x=x, w=w: x @ w, device, repeats)
            flops += 2.0 * tokens * k * n
        model = cost_figures(cost, ParallelConfig(), tokens, tokens)
        rows.append({"tokens": tokens, "measured_ms": round(total_ms, 4),
                     "measured_tflops": round(flops / total_ms / 1e9, 1),
                     "model_ms": model["gemm_forward_ms"], "model_tflops": model["gemm_tflops"],
                     "measured_over_model": round(total_ms / model["gemm_forward_ms"], 3)})
        log(f"gemm T={tokens}: {rows[-1]}")
    return rows


# ---- 2. attention -----------------------------------------------------------------------------
# Each kernel and the cost-model backend that prices it: torch's SDPA restricted to its flash
# backend (flash-attention 2 inside torch) and to cuDNN (what Transformer Engine's fused attention
# calls), and the runtime's own torch kernel on a GPU (PyTorch's varlen flash attention, THD).
ATTENTION_KERNELS = {"sdpa_flash": "flash", "sdpa_cudnn": "te", "runtime_torch_varlen": "torch"}


def attention_call(kernel: str, q, k, v, length: int):
    """(forward, inputs) of one kernel on documents [docs, heads, length, d] (SDPA's layout)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_slimpack.runtime.attention.kernels import torch_varlen_attention

    if kernel == "runtime_torch_varlen":
        docs, heads, _, d = q.shape
        thd = [x.detach().transpose(1, 2).reshape(docs * length, x.shape[1], d).contiguous().requires_grad_()
               for x in (q, k, v)]
        cu = torch.arange(docs + 1, device=q.device, dtype=torch.int32) * length
        return (lambda: torch_varlen_attention(*thd, cu, cu, length, length, d ** -0.5)), thd
    backend = SDPBackend.FLASH_ATTENTION if kernel == "sdpa_flash" else SDPBackend.CUDNN_ATTENTION
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}

    def forward():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    return forward, [q, k, v]


def attention_rows(spec, pack_tokens, doc_lengths, device, dtype, repeats) -> list[dict]:
    heads, d = spec.num_attention_heads, spec.hidden_size // spec.num_attention_heads
    groups = spec.kv_heads
    rows = []
    for length in doc_lengths:
        docs = max(1, pack_tokens // length)
        q = torch.randn(docs, heads, length, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(docs, groups, length, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(docs, groups, length, d, device=device, dtype=dtype, requires_grad=True)
        pairs = docs * length * (length + 1) / 2
        flops = 4.0 * pairs * heads * d
        for kernel, backend in ATTENTION_KERNELS.items():
            row: dict = {"kernel": kernel, "priced_as": backend, "doc_length": length, "documents": docs}
            try:
                forward, inputs = attention_call(kernel, q, k, v, length)
                grad = torch.randn_like(forward())

                def backward(forward=forward, inputs=inputs, grad=grad):
                    torch.autograd.grad(forward(), inputs, grad)

                forward_ms = timed_ms(forward, device, repeats)
                backward_ms = timed_ms(backward, device, repeats) - forward_ms
            except Exception as error:  # noqa: BLE001 - a kernel this torch or device lacks is a result
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                rows.append(row)
                log(f"attention L={length} {kernel}: {row['error']}")
                continue
            model = cost_figures(model_cost(spec, backend), ParallelConfig(), length, docs * length)
            row.update({
                "forward_ms": round(forward_ms, 4), "forward_tflops": round(flops / forward_ms / 1e9, 1),
                "backward_ms": round(backward_ms, 4), "backward_tflops": round(2.5 * flops / backward_ms / 1e9, 1),
                # the model's kernel rate (its published table) and its time (with the sustained share)
                "model_forward_tflops": float(model["attention_forward_tflops"]),
                "model_backward_tflops": float(model["attention_backward_tflops"]),
                "model_forward_ms": float(model["attention_forward_ms"]),
                "model_backward_ms": float(model["attention_backward_ms"]),
                "forward_measured_over_model": round(forward_ms / float(model["attention_forward_ms"]), 3),
                "backward_measured_over_model": round(backward_ms / float(model["attention_backward_ms"]), 3)})
            rows.append(row)
            log(f"attention L={length} {kernel}: {row}")
    return rows


# ---- 3. one layer -----------------------------------------------------------------------------
def layer_chunk(spec, device, dtype):
    from megatron_slimpack.apps.profiler import ensure_megatron, transformer_config
    from megatron_slimpack.runtime.model import build_gpt_model

    ensure_megatron()
    config = transformer_config(spec, num_layers=1, use_cpu_initialization=device == "cpu", **precision(dtype))
    chunk = build_gpt_model(config, vocab_size=spec.vocab_size, max_sequence_length=1 << 20, backend="torch",
                            pre_process=False, post_process=False)
    return chunk.to(device)


def layer_rows(spec, shapes, device, dtype, repeats) -> list[dict]:
    """shapes: (pack tokens, slices, KV prefix per slice)."""
    from megatron_slimpack.apps.profiler import measure_chunk

    chunk = layer_chunk(spec, device, dtype)
    rows = []
    for tokens, slices, prefix in shapes:
        point = measure_chunk(chunk, spec, tokens, slices, prefix, repeats, device=device, dtype=dtype)
        length = tokens // slices
        row = {"pack_tokens": tokens, "slices": slices, "kv_prefix": prefix,
               "forward_ms": round(point.forward_s * 1e3, 3), "backward_ms": round(point.backward_s * 1e3, 3),
               "saved_gib": round(point.saved_bytes / 2**30, 3)}
        for backend in ("flash", "torch"):
            cost = model_cost(spec, backend)
            pairs = point.pairs
            forward = cost.stage_time(tokens, pairs, ParallelConfig(), backward=False) - cost.hardware.kernel_overhead_s
            backward = cost.stage_time(tokens, pairs, ParallelConfig(), backward=True) - cost.hardware.kernel_overhead_s
            per_layer = cost.layers_per_stage(ParallelConfig())
            row[f"model_{backend}_forward_ms"] = round(float(forward) / per_layer * 1e3, 3)
            row[f"model_{backend}_backward_ms"] = round(float(backward) / per_layer * 1e3, 3)
        row["forward_measured_over_flash_model"] = round(row["forward_ms"] / row["model_flash_forward_ms"], 3)
        row["backward_measured_over_flash_model"] = round(row["backward_ms"] / row["model_flash_backward_ms"], 3)
        row["doc_or_slice_length"] = length
        rows.append(row)
        log(f"layer {tokens}x{slices} prefix {prefix}: {row}")
    del chunk
    return rows


# ---- 4. bottom-right causal paths -------------------------------------------------------------
def per_segment(q, k, v, cu_q, cu_kv, max_q, max_kv):
    """The torch kernel's per-segment GPU path: SDPA with `causal_lower_right` for a segment with a
    KV prefix (`kernels.lower_right_attention`), plain causal SDPA otherwise."""
    from megatron_slimpack.runtime.attention.kernels import lower_right_attention, segment_attention

    scale = q.shape[-1] ** -0.5
    bounds_q, bounds_kv = cu_q.tolist(), cu_kv.tolist()
    outputs = []
    for i in range(len(bounds_q) - 1):
        (q0, q1), (k0, k1) = bounds_q[i:i + 2], bounds_kv[i:i + 2]
        qs, ks, vs = q[q0:q1], k[k0:k1], v[k0:k1]
        whole = qs.shape[0] == ks.shape[0]
        outputs.append(segment_attention(qs, ks, vs, None, scale, 0.0) if whole
                       else lower_right_attention(qs, ks, vs, scale, 0.0))
    out = torch.cat(outputs)
    return out.reshape(out.shape[0], -1)


def bottom_right_rows(segments_list, heads, groups, head_dim, device, dtype, repeats) -> list[dict]:
    from megatron_slimpack.apps.selftest.attention_checks import (
        exact_fp32,
        forward_backward,
        masked_softmax_attention,
        tensor_errors,
        varlen_case,
        worst,
    )
    from megatron_slimpack.apps.selftest.common import Setup
    from megatron_slimpack.runtime.attention.kernels import torch_kernel

    def runtime_torch(q, k, v, cu_q, cu_kv, max_q, max_kv):
        out = torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, None, 0.0)
        return out.reshape(out.shape[0], -1)

    # On an sm80+ GPU in bf16 the runtime's kernel is one varlen call; the per-segment path is its fallback.
    paths = {"runtime_torch_kernel": runtime_torch, "per_segment_lower_right": per_segment}
    rows = []
    for segments in segments_list:
        setup = Setup(device=torch.device(device), dtype=dtype, heads=heads, groups=groups, head_dim=head_dim,
                      attention_segments=segments, merge_slices=(), merge_group_sizes=(), train_lengths=(),
                      train_slice=1, train_steps=0, train_hidden=0, train_layers=0, vocab=0, overhead_lengths=(),
                      overhead_slice=1, repeats=repeats)
        case = varlen_case(segments, setup, seed=11)
        check_reference = sum(p + n for p, n in segments) <= 8192  # the fp32 reference holds H x Tq x Tk scores
        reference = None
        if check_reference:
            with exact_fp32():
                reference = forward_backward(masked_softmax_attention, case.to(torch.float32))
        for name, attend in paths.items():
            row: dict = {"segments": [list(s) for s in segments], "path": name}
            try:
                if reference is not None:
                    errors = tensor_errors(forward_backward(attend, case), reference)
                    row["worst_tensor"], row["worst_rel_error"] = worst(errors)
                ms = timed_ms(lambda attend=attend, case=case: forward_backward(attend, case), device, repeats)
                row["forward_backward_ms"] = round(ms, 3)
            except Exception as error:  # noqa: BLE001 - a path torch refuses is a result
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
            log(f"bottom-right {segments} {name}: {row}")
    return rows


# ---- 5. training steps ------------------------------------------------------------------------
def step_rows(model_name, layers, context, sequences, device, dtype, steps) -> list[dict]:
    from megatron_slimpack.apps.demo import demo_model_spec, make_plan_function
    from megatron_slimpack.apps.profiler import ensure_megatron, transformer_config
    from megatron_slimpack.config import SlimPackConfig
    from megatron_slimpack.megatron.planned import BatchTokenSource
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.runtime.pipeline.schedule import slimpack_forward_backward
    from megatron_slimpack.workload import GlobalBatchSampler, TextCorpus

    ensure_megatron()
    corpus = TextCorpus(None)
    spec = demo_model_spec(model_name, corpus.VOCAB_SIZE)
    spec = spec.__class__(**{**spec.to_dict(), "num_layers": layers})
    cost = model_cost(spec, "torch")
    # The standard library holds files longer than the context: cut at it (the paper's setting).
    batch = GlobalBatchSampler(corpus.lengths, context, sequences, seed=0, long_documents="split").next_batch()
    torch.manual_seed(0)
    model = build_gpt_model(transformer_config(spec, num_layers=layers, use_cpu_initialization=device == "cpu",
                                               **precision(dtype)),
                            vocab_size=spec.vocab_size, max_sequence_length=context, backend="torch").to(device)
    config = SlimPackConfig(context_length=context, seed=0)
    rows = []
    for strategy in ("megatron-fixed", "slimpack"):
        began = time.perf_counter()
        plan = make_plan_function(strategy, cost, ParallelConfig(), config)(batch)
        planning_s = time.perf_counter() - began
        source = BatchTokenSource(corpus, plan)

        def step(plan=plan, source=source):
            model.zero_grad(set_to_none=True)
            return slimpack_forward_backward(model=[model], plan=plan, token_source=source)

        step_ms = timed_ms(step, device, steps)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = torch.cuda.max_memory_allocated() / 2**30
        else:
            peak = None
        rows.append({"strategy": strategy, "tokens": plan.num_tokens, "documents": len(batch.lengths),
                     "micropacks": len(plan.replicas[0].micropacks), "planning_s": round(planning_s, 2),
                     "step_ms": round(step_ms, 2), "tokens_per_s": round(plan.num_tokens / step_ms * 1e3),
                     "simulated_ms": round(plan.metadata["predicted"]["iteration_s"] * 1e3, 2),
                     "peak_gib": None if peak is None else round(peak, 2)})
        log(f"steps {strategy}: {rows[-1]}")
    fixed, slim = rows
    rows.append({"strategy": "slimpack / megatron-fixed",
                 "measured_speedup": round(fixed["step_ms"] / slim["step_ms"], 3),
                 "simulated_speedup": round(fixed["simulated_ms"] / slim["simulated_ms"], 3)})
    log(f"steps: {rows[-1]}")
    return rows


def environment(device: str) -> dict:
    import importlib.metadata as metadata

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), sms=props.multi_processor_count,
                   cudnn=torch.backends.cudnn.version())
    for package in ("megatron-core", "transformer-engine", "flash-attn", "ortools"):
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = None
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the code paths, e.g. on a CPU)")
    parser.add_argument("--sections", default="gemm,attention,layer,bottom_right,steps")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write every section's rows here as JSON")
    args = parser.parse_args()
    device, quick = args.device, args.quick
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    spec = get_model("llama-7b")
    if quick:
        spec = replace(get_model("tiny"))
    sections = args.sections.split(",")
    result: dict = {"environment": environment(device), "model": spec.name, "dtype": str(dtype).replace("torch.", "")}
    log(f"environment: {result['environment']}")
    runs = {
        "gemm": lambda: gemm_rows(spec, (256, 512) if quick else (1024, 4096, 16384), device, dtype, args.repeats),
        "attention": lambda: attention_rows(spec, 512 if quick else 16384,
                                            (64, 512) if quick else (512, 1024, 2048, 4096, 8192, 16384),
                                            device, dtype, args.repeats),
        "layer": lambda: layer_rows(spec, ((256, 4, 0), (256, 1, 256)) if quick else
                                    ((16384, 32, 0), (16384, 8, 0), (16384, 2, 0), (16384, 1, 0), (4096, 1, 0),
                                     (4096, 1, 12288), (4096, 4, 1024)), device, dtype, args.repeats),
        "bottom_right": lambda: bottom_right_rows((((48, 32), (0, 24)),), 4, 2, 16, device, dtype, args.repeats)
        if quick else bottom_right_rows((((3000, 1024), (0, 512), (5, 1)), ((12288, 4096),)), 32, 8, 128, device, dtype,
                          args.repeats),
        "steps": lambda: step_rows(spec.name, 2, 1024 if quick else 16384, 2 if quick else 4,
                                   device, dtype, 2 if quick else 3),
    }
    for name in sections:
        began = time.perf_counter()
        try:
            result[name] = runs[name]()
        except Exception as error:  # noqa: BLE001 - one section failing leaves the others' figures
            import traceback

            traceback.print_exc()
            result[name] = {"error": f"{type(error).__name__}: {error}"}
        log(f"{name}: {time.perf_counter() - began:.1f} s")
        if device == "cuda":
            torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as out:
                json.dump(result, out, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
