"""Section 4: a few training steps of a small megatron-core GPT through the SlimPack schedule
(`slimpack_forward_backward`, pp=1), documents cut into slices vs the same documents whole.

Both runs start from the same weights and take the same SGD steps (SGD keeps a round-off
difference of the gradients a difference of the same size in the weights; Adam would turn the
sign of tiny gradients into full-size steps). Sliced execution is exact (docs/design.md section 3),
so per step the losses, the gradient norms and every parameter's gradient agree to round-off.
"""
from __future__ import annotations

import math

import torch

from ...plan import MicroPack, Plan, ReplicaPlan, Sample, Slice
from ...runtime import InMemoryTokenSource, slimpack_forward_backward
from ...runtime.attention.core import TESlicedDotProductAttention, resolve_backend, slimpack_layer_spec
from ...runtime.model import build_gpt_model, tiny_config
from ...specs import ParallelConfig
from .attention_checks import precision_overrides
from .common import FAIL, PASS, Check, Setup, finite

LEARNING_RATE = 0.5


def round_robin_plan(lengths, slice_tokens: int) -> Plan:
    """MicroPack r holds the r-th slice of every document (so MicroPacks mix documents and later
    slices read a KV prefix); one forward unit per MicroPack, backward units of two, all forwards
    first. `slice_tokens` >= the longest document: every document whole."""
    rounds = max(-(-n // slice_tokens) for n in lengths)
    micropacks = [MicroPack([Slice(doc, r * slice_tokens, min(n, (r + 1) * slice_tokens))
                             for doc, n in enumerate(lengths) if r * slice_tokens < n]) for r in range(rounds)]
    replica = ReplicaPlan(micropacks, [[i] for i in range(rounds)], [], [], dp_ranks=[0])
    sequence = replica.backward_sequence()
    replica.backward_units = [sequence[i:i + 2] for i in range(0, rounds, 2)]
    replica.stage_orders = [[("F", i) for i in range(rounds)] + [("B", i) for i in range(len(replica.backward_units))]]
    samples = [Sample(doc, n) for doc, n in enumerate(lengths)]
    return Plan([replica], samples, ParallelConfig(), max(lengths), "selftest").validate()


def layer_spec(setup: Setup):
    """(spec, description): what `slimpack_layer_spec("auto")` gives (TE layers on a GPU where TE
    imports, the local spec with the torch kernel on a machine without one); with --device cpu on
    a GPU machine, the local spec with the torch kernel."""
    if setup.is_gpu or not torch.cuda.is_available():
        te_layers = torch.cuda.is_available() and TESlicedDotProductAttention is not None
        return slimpack_layer_spec("auto"), (f"slimpack_layer_spec('auto'): {'TE' if te_layers else 'local'} layers, "
                                             f"{resolve_backend('auto')} attention")
    return slimpack_layer_spec("torch", use_te_layers=False), "local layers, torch attention (--device cpu)"


def twin_models(setup: Setup, spec):
    """Two SlimPack GPT models with the same weights on the setup's device and dtype."""
    config = tiny_config(num_layers=setup.train_layers, hidden_size=setup.train_hidden, num_attention_heads=4,
                         num_query_groups=2, use_cpu_initialization=not setup.is_gpu, **precision_overrides(setup))
    max_len = max(setup.train_lengths)
    torch.manual_seed(0)
    sliced, whole = (build_gpt_model(config, vocab_size=setup.vocab, max_sequence_length=max_len, layer_spec=spec)
                     .to(setup.device) for _ in range(2))
    whole.load_state_dict(sliced.state_dict())
    return sliced, whole


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().float().clone() for name, p in model.named_parameters() if p.grad is not None}


def one_step(model, optimizer, plan: Plan, source) -> tuple[float, dict]:
    """(loss, gradients) of one SlimPack step; then the optimizer step."""
    optimizer.zero_grad(set_to_none=True)
    result = slimpack_forward_backward(model=[model], plan=plan, token_source=source)
    grads = gradients(model)
    optimizer.step()
    return result.loss, grads


def compare_step(loss_s: float, loss_w: float, grads_s: dict, grads_w: dict) -> dict:
    norm = lambda grads: math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))  # noqa: E731
    if grads_s.keys() != grads_w.keys():
        raise RuntimeError(f"gradients of different parameters: {sorted(grads_s.keys() ^ grads_w.keys())}")
    norm_s, norm_w = norm(grads_s), norm(grads_w)
    per_param = max(float((grads_s[k] - g).norm()) / max(float(g.norm()), 1e-30) for k, g in grads_w.items())
    return {"loss_sliced": loss_s, "loss_whole": loss_w, "loss_rel_diff": abs(loss_s - loss_w) / abs(loss_w),
            "grad_norm_sliced": norm_s, "grad_norm_whole": norm_w,
            "grad_norm_rel_diff": abs(norm_s - norm_w) / max(norm_w, 1e-30), "param_grad_rel_diff": per_param}


def worst_of(values) -> float:
    """The largest value; NaN if any is NaN (max() would skip it depending on the order)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def step_failures(step: dict, setup: Setup) -> list[str]:
    """What in one step's comparison exceeds its tolerance (NaN counts as exceeding)."""
    tol = setup.tolerances
    limits = {"loss_rel_diff": tol.loss, "grad_norm_rel_diff": tol.grad_norm, "param_grad_rel_diff": tol.param_grad}
    return [f"{key} {step[key]:.1e} > {limit:.0e}" for key, limit in limits.items() if not step[key] <= limit]


def check_training(setup: Setup) -> Check:
    spec, spec_text = layer_spec(setup)
    sliced_model, whole_model = twin_models(setup, spec)
    generator = torch.Generator().manual_seed(5)
    source = InMemoryTokenSource({doc: torch.randint(0, setup.vocab, (n,), generator=generator)
                                  for doc, n in enumerate(setup.train_lengths)})
    sliced_plan = round_robin_plan(setup.train_lengths, setup.train_slice)
    whole_plan = round_robin_plan(setup.train_lengths, max(setup.train_lengths))
    runs = [(m, torch.optim.SGD(m.parameters(), lr=LEARNING_RATE), p)
            for m, p in ((sliced_model, sliced_plan), (whole_model, whole_plan))]
    steps, failures = [], []
    for index in range(setup.train_steps):
        (loss_s, grads_s), (loss_w, grads_w) = (one_step(m, o, p, source) for m, o, p in runs)
        steps.append(compare_step(loss_s, loss_w, grads_s, grads_w))
        failures += [f"step {index + 1}: {text}" for text in step_failures(steps[-1], setup)]
    keys = ("loss_rel_diff", "grad_norm_rel_diff", "param_grad_rel_diff")
    worst = {key: worst_of(s[key] for s in steps) for key in keys}
    tol = setup.tolerances
    losses = " ".join(f"{s['loss_sliced']:.4f}" for s in steps)
    summary = (f"{setup.train_steps} steps, {spec_text}, {setup.precision}: sliced losses {losses}; "
               f"worst rel diff loss {worst['loss_rel_diff']:.1e}, "
               f"grad norm {worst['grad_norm_rel_diff']:.1e}, param grads {worst['param_grad_rel_diff']:.1e} "
               f"(tol {tol.loss:.0e}/{tol.grad_norm:.0e}/{tol.param_grad:.0e})")
    if failures:
        summary += f"; {len(failures)} over tolerance, first: {failures[0]}"
    details = {"layer_spec": spec_text, "dtype": setup.precision, "documents": list(setup.train_lengths),
               "slice_tokens": setup.train_slice, "micropacks_sliced": len(sliced_plan.replicas[0].micropacks),
               "optimizer": f"SGD lr={LEARNING_RATE}", "over_tolerance": failures,
               "tolerance": {"loss": tol.loss, "grad_norm": tol.grad_norm, "param_grad": tol.param_grad},
               "steps": [{k: finite(v) for k, v in s.items()} for s in steps]}
    return Check(f"training[{'gpu' if setup.is_gpu else 'cpu'}]", FAIL if failures else PASS, summary, details)
