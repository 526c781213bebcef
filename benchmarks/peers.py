"""Peers as their authors run them: each peer's published setting simulated against the baseline
its authors measured, next to the published gain.

    python benchmarks/peers.py                  # both benchmarks, the table docs/peers.md quotes
    python benchmarks/peers.py --json
    python benchmarks/peers.py --dcp-steps 5 --wlb-steps 10 --gpus 4,8   # a quick run

1. NVIDIA's dynamic context parallelism (Megatron-LM dev, examples/dynamic_context_parallel/,
   README "Slurm Benchmark Results"): GPT, 12 layers, hidden 2048, ffn 8192, 16 heads, vocabulary
   131072, GELU, sequence length 8192, bf16, TE; TP1 CP4 PP1, micro-batch 1, global batch 8 x DP
   samples, --max-seqlen-per-dp-cp-rank 2048; lengths lognormal (min 128, max 8192, mean 1024,
   sigma 1.5). `megatron-dynamic-cp` over the whole DP x CP pool (given as dp = GPUs, cp = 1)
   against `megatron-dp-balanced` at CP4 (dp = GPUs / 4), at 4 to 64 GPUs. NVIDIA ran 30
   iterations, dropped the first 10 and took a 10% trimmed mean; a simulated step has no warm-up,
   so every step counts and each side's step time is the 10% trimmed mean over the steps.
2. WLB-LLM (OSDI'25, arXiv 2503.17924), Table 1: 7B-128K at (TP8, CP2, PP4, DP1) on 64 GPUs and
   7B-64K at (TP4, CP2, PP4, DP1) on 32, global batch = PP x DP sequences of the context length.
   `wlb-llm` against `megatron-fixed` at the same layout (the paper's "Plain-4D": fixed-length
   sequences straight from the data loader). wlb-llm delays outlier documents across steps, so a
   run of N steps ends with documents still queued: the gain is steady-state throughput, tokens
   trained per second over the N planned steps, the final flush (which plans what is still
   queued as one more step) left out; the figure with the flush is printed beside it.

Each row states the objective each side trains: megatron-fixed cuts documents at sequence
boundaries (the pieces do not attend to each other); the others keep every document whole.

Diagnostics printed per row (what docs/peers.md uses to explain a gap), all from the simulated
plans: each side's DP imbalance and bubble (the simulator's report), the share of the baseline's
step that is exposed CP exchange and per-micro-batch overhead (the step simulated again with that
term priced at zero), and for WLB-LLM the imbalance degree (max / mean compute of the step's
micro-batches, the cost model's forward + backward of one stage) and the gain with wlb-llm priced
under the baseline's communication overlaps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace

import numpy as np

import megatron_slimpack as ms
from megatron_slimpack.costmodel import Overlaps
from megatron_slimpack.plan import sequence_sharded_pairs
from megatron_slimpack.planner.baselines.wlb_llm import DELAY_CANDIDATES
from megatron_slimpack.planner.strategies import new_planner, strategy_spec
from megatron_slimpack.simulator import per_batch_report
from megatron_slimpack.specs import ModelSpec, ParallelConfig
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

HARDWARE = "h100-sxm"
WIKIPEDIA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                         "wikipedia_lengths.txt")

# ---- NVIDIA's dynamic-CP benchmark --------------------------------------------------------------
DCP_MODEL = ModelSpec("gpt-dcp-benchmark", num_layers=12, hidden_size=2048, ffn_hidden_size=8192,
                      num_attention_heads=16, vocab_size=131072, swiglu=False)
DCP_SEQUENCE = 8192
DCP_PER_RANK_TOKENS = 2048  # --max-seqlen-per-dp-cp-rank
DCP_CP = 4
DCP_MICRO_BATCHES = 8  # per DP rank: global batch 8 x DP samples
DCP_LENGTHS = dict(min=128, max=8192, mean=1024.0, sigma=1.5)
# README "Slurm Benchmark Results": speedup of default_dynamic_cp over dp_balanced, by GPU count
DCP_PUBLISHED = {4: 1.285, 8: 1.412, 16: 1.212, 32: 1.375, 64: 1.495}
DCP_SOURCE = ("Megatron-LM dev, examples/dynamic_context_parallel/README.md 'Slurm Benchmark Results' "
              "(PR #5123, commit 192cbc35)")

# ---- WLB-LLM ------------------------------------------------------------------------------------
WLB_MODEL = "llama-7b"
# name -> (context, tp, cp, pp, dp, published speedup over Plain-4D, what the figure is)
WLB_SETTINGS = {
    "7B-128K": (131072, 8, 2, 4, 1, 1.33, "7B-128K: 1.33x"),
    "7B-64K": (65536, 4, 2, 4, 1, 1.15, "mean of the 64K models (7B, 30B, 70B): 1.15x"),
}
WLB_SOURCE = "WLB-LLM, OSDI'25 (arXiv 2503.17924), Table 1 layouts and section 7 speedups"


class Priced:
    """`cost` seen through a fixed overlap set and optional zeroed terms. The simulator prices a
    plan with its strategy's declared overlaps when given a `CostModel`; this view is not one, so
    the plan is priced exactly as the view says: used to measure what a term or an overlap
    contributes to a simulated step (never to change what a strategy is priced with)."""

    def __init__(self, cost: ms.CostModel, overlaps, *, no_cp_exchange: bool = False, no_overhead: bool = False,
                 rows_per_ring_step: bool = False):
        self._cost = cost.with_overlaps(overlaps)
        self._rows_per_ring_step = rows_per_ring_step
        self._no_cp_exchange = no_cp_exchange
        self._no_overhead = no_overhead

    def __getattr__(self, name):
        return getattr(self._cost, name)

    def exposed_cp_comm_time(self, tokens, pairs, parallel, backward):
        if self._no_cp_exchange:
            return 0.0 * tokens
        return self._cost.exposed_cp_comm_time(tokens, pairs, parallel, backward)

    def layer_time(self, tokens, pairs, parallel, backward):
        """With `rows_per_ring_step`, the attention kernel's per-query-row overhead is paid once per
        ring step (cp times) instead of once: a sensitivity for the CP-sharded short documents, whose
        chunks the ring runs as cp separate kernel calls; the pairs are priced as before."""
        seconds = self._cost.layer_time(tokens, pairs, parallel, backward)
        if self._rows_per_ring_step and parallel.cp > 1:
            seconds += (self._cost.attention_time(tokens * parallel.cp, pairs, parallel, backward)
                        - self._cost.attention_time(tokens, pairs, parallel, backward))
        return seconds

    def stage_time(self, tokens, pairs, parallel, *, backward, last_stage=False):
        layers = self.layers_per_stage(parallel)
        per_layer = (self.layer_time(tokens, pairs, parallel, backward)
                     + self.exposed_tp_comm_time(tokens, parallel, backward)
                     + self.exposed_cp_comm_time(tokens, pairs, parallel, backward))
        seconds = layers * per_layer + (0.0 if self._no_overhead else self._cost.hardware.kernel_overhead_s)
        if last_stage:
            seconds += self.head_time(tokens, parallel, backward)
        return seconds

    def forward_time(self, tokens, pairs, parallel, last_stage=False):
        return self.stage_time(tokens, pairs, parallel, backward=False, last_stage=last_stage)

    def backward_time(self, tokens, pairs, parallel, last_stage=False):
        return self.stage_time(tokens, pairs, parallel, backward=True, last_stage=last_stage)


def objective(strategy: str) -> str:
    spec = strategy_spec(strategy)
    return "documents cut at sequence boundaries" if spec.splits_documents else "documents whole"


def trimmed_mean(values, fraction: float = 0.1) -> float:
    """Mean after dropping `fraction` of the values at each end (NVIDIA's 10% trimmed mean)."""
    ordered = sorted(values)
    cut = int(len(ordered) * fraction)
    kept = ordered[cut:len(ordered) - cut] or ordered
    return float(np.mean(kept))


# ---- 1. dynamic CP ------------------------------------------------------------------------------
def clipped_lognormal_mu(mean: float, sigma: float, low: float, high: float) -> float:
    """mu of ln(length) such that the lognormal clipped into [low, high] has arithmetic mean
    `mean` (closed form of the clipped mean, solved by bisection). The unclipped rule
    mu = ln(mean) - sigma^2/2 gives a clipped mean of 906 at sigma 1.5 in [128, 8192], because the
    clip at 8192 removes most of the upper tail's mass; the published setting states the mean of
    the lengths, so the clipped mean is held at it."""
    def phi(x):
        return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))

    def clipped_mean(mu):
        a, b = (math.log(low) - mu) / sigma, (math.log(high) - mu) / sigma
        body = math.exp(mu + sigma * sigma / 2) * (phi(b - sigma) - phi(a - sigma))
        return low * phi(a) + body + high * (1.0 - phi(b))

    lo, hi = math.log(low), math.log(high)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_mean(mid) < mean else (lo, mid)
    return (lo + hi) / 2


def dcp_batches(gpus: int, steps: int, seed: int) -> list[list[int]]:
    """`steps` global batches of 8 x DP samples, DP = GPUs / CP, each sample one lognormal length
    (the mock dataset draws every sample independently)."""
    p = DCP_LENGTHS
    mu = clipped_lognormal_mu(p["mean"], p["sigma"], p["min"], p["max"])
    rng = np.random.default_rng(seed + gpus)
    dp = gpus // DCP_CP
    return [np.clip(np.rint(rng.lognormal(mu, p["sigma"], DCP_MICRO_BATCHES * dp)), p["min"], p["max"])
            .astype(int).tolist() for _ in range(steps)]


def run_dcp(gpus_list: list[int], steps: int, seed: int) -> list[dict]:
    cost = ms.CostModel.analytic(DCP_MODEL, HARDWARE)
    rows = []
    for gpus in gpus_list:
        batches = dcp_batches(gpus, steps, seed)
        sides = {
            "megatron-dynamic-cp": ParallelConfig(dp=gpus),
            "megatron-dp-balanced": ParallelConfig(dp=gpus // DCP_CP, cp=DCP_CP),
        }
        figures = {}
        for name, parallel in sides.items():
            config = ms.SlimPackConfig(strategy=name, context_length=DCP_SEQUENCE,
                                       max_micropack_tokens=DCP_PER_RANK_TOKENS)
            plans = [ms.plan(lengths, parallel=parallel, cost=cost, config=config) for lengths in batches]
            reports = [ms.simulate(plan, cost) for plan in plans]
            declared = strategy_spec(name).overlaps
            no_cp = [ms.simulate(plan, Priced(cost, declared, no_cp_exchange=True)).iteration_time_s for plan in plans]
            no_oh = [ms.simulate(plan, Priced(cost, declared, no_overhead=True)).iteration_time_s for plan in plans]
            times = [r.iteration_time_s for r in reports]
            step = trimmed_mean(times)
            figures[name] = {
                "layout": parallel.describe(), "objective": objective(name), "step_ms": 1e3 * step,
                "micro_batches_per_step": float(np.mean([_micro_batches(plan) for plan in plans])),
                "dp_imbalance": float(np.mean([r.dp_imbalance for r in reports])),
                "bubble": float(np.mean([r.bubble_ratio for r in reports])),
                "cp_exchange_share": 1.0 - trimmed_mean(no_cp) / step,
                "overhead_share": 1.0 - trimmed_mean(no_oh) / step,
                "work_per_token_us": 1e6 * work_per_token(reports),
                "rows_per_ring_step": 1e3 * trimmed_mean(
                    [ms.simulate(plan, Priced(cost, declared, rows_per_ring_step=True)).iteration_time_s
                     for plan in plans]),
            }
        dcp, base = figures["megatron-dynamic-cp"], figures["megatron-dp-balanced"]
        simulated = base["step_ms"] / dcp["step_ms"]
        published = DCP_PUBLISHED.get(gpus)
        rows.append({
            "benchmark": f"dynamic-CP {gpus} GPUs", "peer": "megatron-dynamic-cp", "baseline": "megatron-dp-balanced",
            "gpus": gpus, "steps": steps, "simulated": simulated, "published": published,
            "ratio": simulated / published if published else None, "peer_figures": dcp, "baseline_figures": base,
            "simulated_rows_per_ring_step": base["rows_per_ring_step"] / dcp["rows_per_ring_step"],
            "global_batch_samples": DCP_MICRO_BATCHES * gpus // DCP_CP,
        })
    return rows


def work_per_token(reports) -> float:
    """Compute seconds of all devices per token trained (the simulator's work bound x devices)."""
    return (sum(r.work_bound_s * r.world_size for r in reports) / sum(r.num_tokens for r in reports))


def pairs_per_token(plans) -> float:
    """Causal attention pairs computed per token trained."""
    pairs = sum(mp.attention_pairs for plan in plans for replica in plan.replicas for mp in replica.micropacks)
    return pairs / sum(mp.num_tokens for plan in plans for replica in plan.replicas for mp in replica.micropacks)


def _micro_batches(plan: ms.Plan) -> int:
    return sum(len(replica.micropacks) for replica in plan.replicas)


# ---- 2. WLB-LLM ---------------------------------------------------------------------------------
def corpus_lengths(corpus: str, seed: int) -> np.ndarray:
    if corpus == "wikipedia":
        if not os.path.isfile(WIKIPEDIA):
            raise SystemExit(f"{WIKIPEDIA} not found; use --corpus longtail (its synthetic stand-in)")
        return load_lengths(f"file:{WIKIPEDIA}")
    return load_lengths(corpus, seed=seed)


def imbalance_degree(plan: ms.Plan, cost: ms.CostModel, overlaps: Overlaps | None = None) -> float:
    """max / mean over the step's micro-batches of their time on one (not the last) stage,
    forward + backward, priced with `overlaps` (default: the plan's strategy's declared ones), as
    the simulator prices it: exposed communication and the busiest CP rank's pairs included, the
    output layer left out."""
    parallel = plan.parallel
    overlaps = overlaps or strategy_spec(plan.strategy).overlaps
    cost = cost.with_overlaps(overlaps)
    work = []
    for replica in plan.replicas:
        tokens = [float(mp.num_tokens) for mp in replica.micropacks]
        pairs = (sequence_sharded_pairs(replica.micropacks, parallel.cp) if overlaps.cp_per_sequence
                 else [float(mp.attention_pairs) for mp in replica.micropacks])
        work += [cost.forward_time(t, a, parallel) + cost.backward_time(t, a, parallel) for t, a in zip(tokens, pairs)]
    return max(work) / float(np.mean(work))


# WLB-LLM as its paper runs it (arXiv 2503.17924: TP+SP with communication overlap, all-gather CP),
# in its authors' own system; the SlimPack runtime that trains `wlb-llm` here overlaps no TP.
WLB_LLM_AS_PUBLISHED = Overlaps(tp_comm=True)
# Its baseline, Plain-4D, as the paper describes it: Megatron's overlaps, and CP sharding each
# packed sequence as a whole (2 x CP chunks of the sequence, not of each document), which leaves
# the CP ranks unequal pairs under document masking (the imbalance WLB-LLM's per-document sharding removes).
PLAIN_4D = replace(strategy_spec("megatron-fixed").overlaps, cp_per_sequence=True)


def run_wlb_llm(batches, parallel: ParallelConfig, cost: ms.CostModel, config: ms.SlimPackConfig):
    """wlb-llm over `batches`: its step plans, its final flush (None: nothing delayed at the end)
    and how many documents were still queued before it."""
    planner = new_planner("wlb-llm")
    plans = [planner.plan(b.lengths, parallel, cost, config, sources=b.sources) for b in batches]
    queued = len(planner.pending)
    return plans, planner.flush(parallel, cost, config), queued


def steady_rate(reports) -> float:
    """Tokens trained per second over the steps."""
    return per_batch_report(reports, len(reports)).tokens_per_s


def tuned_delay_fractions(sample, parallel: ParallelConfig, cost: ms.CostModel, config: ms.SlimPackConfig):
    """WLB-LLM's delay thresholds tuned as its paper does, on a sample of the corpus (`sample`:
    batches drawn with another seed than the measured ones): each of the strategy's candidate sets
    (`DELAY_CANDIDATES`), the fastest steady-state rate as the paper prices it wins, the default on
    a tie. Returns (thresholds, rate by candidate)."""
    rates = {}
    for text in DELAY_CANDIDATES:
        plans, _, _ = run_wlb_llm(sample, parallel, cost, config.with_(wlb_delay_fractions=text))
        rates[text] = steady_rate([ms.simulate(plan, cost, overlaps=WLB_LLM_AS_PUBLISHED) for plan in plans])
    return max(rates, key=rates.get), rates


def run_wlb(settings: list[str], steps: int, corpus: str, seed: int, vpp: int) -> list[dict]:
    cost = ms.CostModel.analytic(WLB_MODEL, HARDWARE)
    lengths = corpus_lengths(corpus, seed)
    rows = []
    for name in settings:
        context, tp, cp, pp, dp, published, what = WLB_SETTINGS[name]
        parallel = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp, vpp=vpp)
        # the paper's baseline takes fixed-length sequences straight from the loader: documents longer
        # than the context are cut into context-length pieces
        sampler = GlobalBatchSampler(lengths, context, pp * dp, seed=seed, long_documents="split")
        batches = [sampler.next_batch() for _ in range(steps)]
        fixed_config = ms.SlimPackConfig(strategy="megatron-fixed", context_length=context)
        fixed_plans = [ms.plan(b.lengths, parallel=parallel, cost=cost, config=fixed_config, sources=b.sources)
                       for b in batches]
        fixed = [ms.simulate(plan, cost, overlaps=PLAIN_4D) for plan in fixed_plans]
        wlb_config = ms.SlimPackConfig(strategy="wlb-llm", context_length=context)
        wlb_plans, flush_plan, delayed_at_end = run_wlb_llm(batches, parallel, cost, wlb_config)
        # priced as the paper runs it (its own system, TP overlap); `simulated_runtime_overlaps`: as
        # the SlimPack runtime trains it (serial TP)
        wlb = [ms.simulate(plan, cost, overlaps=WLB_LLM_AS_PUBLISHED) for plan in wlb_plans]
        wlb_runtime = [ms.simulate(plan, cost) for plan in wlb_plans]
        flushed = ms.simulate(flush_plan, cost, overlaps=WLB_LLM_AS_PUBLISHED) if flush_plan else None

        base_rate = steady_rate(fixed)
        # its thresholds tuned on a sample of the corpus (other batches than the measured ones)
        sampler = GlobalBatchSampler(lengths, context, pp * dp, seed=seed + 1, long_documents="split")
        tuned, tuning = tuned_delay_fractions([sampler.next_batch() for _ in range(steps)], parallel, cost,
                                              wlb_config)
        tuned_plans, _, _ = run_wlb_llm(batches, parallel, cost, wlb_config.with_(wlb_delay_fractions=tuned))
        tuned_rate = steady_rate([ms.simulate(plan, cost, overlaps=WLB_LLM_AS_PUBLISHED) for plan in tuned_plans])
        simulated = steady_rate(wlb) / base_rate
        with_flush = steady_rate(wlb + ([flushed] if flushed else [])) / base_rate
        same_overlaps = Priced(cost, strategy_spec("megatron-fixed").overlaps)
        wlb_same = [ms.simulate(plan, same_overlaps) for plan in wlb_plans]
        fixed_no_cp = [ms.simulate(plan, Priced(cost, PLAIN_4D, no_cp_exchange=True)) for plan in fixed_plans]
        released = [sum(plan.metadata.get("released_per_level", [])) for plan in wlb_plans]
        rows.append({
            "benchmark": f"WLB-LLM {name}", "peer": "wlb-llm", "baseline": "megatron-fixed",
            "gpus": parallel.world_size,
            "steps": steps, "corpus": corpus, "simulated": simulated, "published": published,
            "ratio": simulated / published, "published_figure": what,
            "simulated_with_flush": with_flush,
            "simulated_tuned": tuned_rate / base_rate, "tuned_delay_fractions": tuned,
            "sample_rates_by_delay_fractions": tuning,
            "simulated_same_overlaps": steady_rate(wlb_same) / base_rate,
            "simulated_runtime_overlaps": steady_rate(wlb_runtime) / base_rate,
            "peer_figures": {
                "layout": parallel.describe(), "objective": objective("wlb-llm"),
                "step_s": float(np.mean([r.iteration_time_s for r in wlb])),
                "overlaps": WLB_LLM_AS_PUBLISHED.to_dict(),
                "imbalance_degree": float(np.mean([imbalance_degree(p, cost) for p in wlb_plans])),
                "pp_imbalance": float(np.mean([r.pp_imbalance for r in wlb])),
                "bubble": float(np.mean([r.bubble_ratio for r in wlb])),
                "outliers_released": int(sum(released)), "documents_queued_at_end": delayed_at_end,
                "work_per_token_us": 1e6 * work_per_token(wlb), "pairs_per_token": pairs_per_token(wlb_plans),
                "fits_memory": all(r.fits_memory for r in wlb),
            },
            "baseline_figures": {
                "layout": parallel.describe(), "objective": objective("megatron-fixed"),
                "step_s": float(np.mean([r.iteration_time_s for r in fixed])),
                "overlaps": PLAIN_4D.to_dict(),
                "imbalance_degree": float(np.mean([imbalance_degree(p, cost, PLAIN_4D) for p in fixed_plans])),
                "pp_imbalance": float(np.mean([r.pp_imbalance for r in fixed])),
                "bubble": float(np.mean([r.bubble_ratio for r in fixed])),
                "cp_exchange_share": 1.0 - sum(r.iteration_time_s for r in fixed_no_cp)
                / sum(r.iteration_time_s for r in fixed),
                "fits_memory": all(r.fits_memory for r in fixed),
                "work_per_token_us": 1e6 * work_per_token(fixed), "pairs_per_token": pairs_per_token(fixed_plans),
            },
        })
    return rows


# ---- output -------------------------------------------------------------------------------------
def print_table(rows: list[dict]) -> None:
    print("| benchmark | peer (objective) | baseline (objective) | simulated | published | sim/pub |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        peer, base = row["peer_figures"], row["baseline_figures"]
        print(f"| {row['benchmark']} | {row['peer']} {peer['layout']} ({peer['objective']}) | "
              f"{row['baseline']} {base['layout']} ({base['objective']}) | {row['simulated']:.3f}x | "
              f"{row['published']:.3f}x | {row['ratio']:.3f} |")
    print()
    for row in rows:
        peer, base = row["peer_figures"], row["baseline_figures"]
        if row["peer"] == "megatron-dynamic-cp":
            print(f"{row['benchmark']}: {row['global_batch_samples']} samples/step, {row['steps']} steps; step "
                  f"{peer['step_ms']:.1f} vs {base['step_ms']:.1f} ms; micro-batches/step "
                  f"{peer['micro_batches_per_step']:.1f} vs {base['micro_batches_per_step']:.1f}; "
                  f"DP imbalance {peer['dp_imbalance']:.3f} vs "
                  f"{base['dp_imbalance']:.3f}; exposed CP exchange {100 * peer['cp_exchange_share']:.1f}% vs "
                  f"{100 * base['cp_exchange_share']:.1f}%; per-micro-batch overhead "
                  f"{100 * peer['overhead_share']:.1f}% vs {100 * base['overhead_share']:.1f}% of the step; "
                  f"compute per token "
                  f"{peer['work_per_token_us']:.3f} vs {base['work_per_token_us']:.3f} us; with the attention row "
                  f"overhead paid per ring step {row['simulated_rows_per_ring_step']:.3f}x")
        else:
            print(f"{row['benchmark']} ({row['corpus']}, {row['steps']} steps): step {peer['step_s']:.3f} vs "
                  f"{base['step_s']:.3f} s; imbalance degree {peer['imbalance_degree']:.3f} vs "
                  f"{base['imbalance_degree']:.3f}; bubble {100 * peer['bubble']:.1f}% vs {100 * base['bubble']:.1f}%; "
                  f"with the final flush {row['simulated_with_flush']:.3f}x; with its delay thresholds tuned on "
                  f"another sample ('{row['tuned_delay_fractions']}') {row['simulated_tuned']:.3f}x; "
                  f"wlb-llm priced with megatron-fixed's "
                  f"overlaps {row['simulated_same_overlaps']:.3f}x; baseline exposed CP exchange "
                  f"{100 * base['cp_exchange_share']:.1f}%; outliers released {peer['outliers_released']}, "
                  f"queued at the end {peer['documents_queued_at_end']}; attention pairs per token "
                  f"{peer['pairs_per_token']:.0f} vs {base['pairs_per_token']:.0f}; compute per token "
                  f"{peer['work_per_token_us']:.3f} vs {base['work_per_token_us']:.3f} us")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("dcp", "wlb"), help="run one of the two benchmarks")
    parser.add_argument("--gpus", default="4,8,16,32,64", help="dynamic-CP GPU counts (multiples of 4)")
    parser.add_argument("--dcp-steps", type=int, default=20, help="global batches per dynamic-CP row")
    parser.add_argument("--wlb-steps", type=int, default=40, help="global batches per WLB-LLM row")
    parser.add_argument("--wlb-settings", default="7B-128K,7B-64K")
    parser.add_argument("--corpus", default="wikipedia" if os.path.isfile(WIKIPEDIA) else "longtail",
                        help="WLB-LLM length source: wikipedia (../shared/data) or a workload spec "
                             "(longtail, github, commoncrawl, ...)")
    parser.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages for the WLB-LLM layouts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows: list[dict] = []
    if args.only in (None, "dcp"):
        rows += run_dcp([int(g) for g in args.gpus.split(",")], args.dcp_steps, args.seed)
    if args.only in (None, "wlb"):
        rows += run_wlb(args.wlb_settings.split(","), args.wlb_steps, args.corpus, args.seed, args.vpp)
    if args.json:
        print(json.dumps({"rows": rows, "sources": {"dynamic-cp": DCP_SOURCE, "wlb-llm": WLB_SOURCE},
                          "hardware": HARDWARE, "seconds": time.perf_counter() - started}, indent=2))
    else:
        print_table(rows)
        print(f"\nsources: {DCP_SOURCE}; {WLB_SOURCE}. Simulated on {HARDWARE} in "
              f"{time.perf_counter() - started:.0f} s.")
    return rows


if __name__ == "__main__":
    main()
