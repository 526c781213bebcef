"""Where SlimPack's search spends its time on one global batch: per layout, each DP-Merge sizing
(`search.Sizing`), what its plannings cost and what they found.

For each layout given (default: the pipelined layouts of one shape's family), the first batch of the
cell is planned by `SlimPackSearch` as the layout search plans it, and for each sizing the report
gives: seconds spent, plannings (whole-batch phase 1 + replica searches, retried as merge groups
grow and at lower leaner-schedule levels), the share of replicas and merge groups that did not fit
in its first planning, and the fastest predicted iteration among its plannings. The winner is the
sizing whose prediction the search keeps.

    python benchmarks/sizings.py [--model llama-7b] [--workload longtail] [--gpus 128]
                                 [--context-length 262144] [--global-batch-size 512]
                                 [--layouts "tp1 pp2 vpp4 cp1 dp64,tp1 pp4 cp1 dp32"]
                                 [--out benchmarks/results/sizings.md]
"""
from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from paper_table import current_commit

import megatron_slimpack as ms
from megatron_slimpack.planner.orders import LEANER_SCHEDULES
from megatron_slimpack.planner.outcomes import PlannedBatch, ReplicasDoNotFit
from megatron_slimpack.planner.slimpack.search import GroupSizing, Sizing, SlimPackSearch
from megatron_slimpack.specs import ParallelConfig
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

SIZING_NAMES = [sizing.value for sizing in Sizing]  # the order `SlimPackSearch.attempts` tries them
DEFAULT_LAYOUTS = ("tp1 pp2 cp1 dp64", "tp1 pp2 vpp4 cp1 dp64", "tp1 pp2 vpp8 cp1 dp64", "tp1 pp4 cp1 dp32",
                   "tp1 pp4 vpp2 cp1 dp32", "tp1 pp4 vpp4 cp1 dp32")


@dataclass
class SizingRecord:
    """What one sizing's plannings cost and found."""

    merged_documents: int
    seconds: float = 0.0
    plannings: int = 0
    first_failures: int = 0  # replicas and merge groups that did not fit its first planning
    replicas: int = 0  # replicas and merge groups of its plans
    predictions: list[float] = field(default_factory=list)


class RecordedSearch(SlimPackSearch):
    """`SlimPackSearch`, recording each sizing's plannings (`records`, in the order planned): the
    search plans one sizing's levels with the same `GroupSizing`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[SizingRecord] = []
        self._sizing: GroupSizing | None = None

    def plan_sizing(self, view: ParallelConfig, sizing: GroupSizing, leaner_level: int = len(LEANER_SCHEDULES),
                    cut_short: bool = False) -> PlannedBatch:
        if sizing is not self._sizing:
            self._sizing = sizing
            self.records.append(SizingRecord(int((sizing.group_ranks > 1).sum())))
        record = self.records[-1]
        started = time.perf_counter()
        try:
            batch = super().plan_sizing(view, sizing, leaner_level, cut_short)
            record.predictions.append(batch.predicted_iteration_s)
            record.replicas = len(batch.outcomes)
            return batch
        finally:
            record.seconds += time.perf_counter() - started

    def plan_groups(self, view: ParallelConfig, token_cap: int, group_ranks: np.ndarray,
                    leaner_level: int = len(LEANER_SCHEDULES), cut_short: bool = False) -> PlannedBatch:
        record = self.records[-1]
        record.plannings += 1
        try:
            return super().plan_groups(view, token_cap, group_ranks, leaner_level, cut_short)
        except ReplicasDoNotFit as error:
            if record.plannings == 1:
                record.first_failures = len(error.failures)
            raise


def parse_layout(text: str) -> ParallelConfig:
    values = {key: int(number) for key, number in re.findall(r"(tp|pp|vpp|cp|dp)(\d+)", text)}
    recompute = re.search(r"rc-(\S+)", text)
    return ParallelConfig(**values, recompute=recompute.group(1) if recompute else "none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--workload", default="longtail")
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--context-length", type=int, default=262144)
    parser.add_argument("--global-batch-size", type=int, default=512)
    parser.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS))
    parser.add_argument("--out", default="benchmarks/results/sizings.md")
    args = parser.parse_args()
    cost = ms.CostModel.analytic(args.model, "h100-sxm")
    sampler = GlobalBatchSampler(load_lengths(args.workload, seed=0), args.context_length, args.global_batch_size,
                                 seed=0, long_documents="split")
    lengths = sampler.next_batch().lengths
    config = ms.SlimPackConfig(context_length=args.context_length, solver_deterministic_limit=0.2,
                               strategy="slimpack")
    lines = [
        "# SlimPack's search: time and result of each DP-Merge sizing, per layout",
        "",
        f"`python benchmarks/sizings.py --model {args.model} --workload {args.workload} --gpus {args.gpus} "
        f"--context-length {args.context_length} --global-batch-size {args.global_batch_size} --layouts "
        f"\"{args.layouts}\"` at commit {current_commit()}: the first global batch ({len(lengths)} documents), "
        "one process, CP-SAT stopped at 0.2 deterministic units. Sizings in the order planned; a sizing "
        "whose groups equal an earlier one's is not planned again. \"first fails\": replicas and merge "
        "groups without a fitting schedule in the sizing's first planning, of those in its last plan. "
        "\"kept\": the sizing whose plan the search keeps (the fastest prediction).",
        "",
        "| layout | sizing | merged documents | plannings | seconds | first fails | fastest predicted (s) | kept |",
        "|---|---|---:|---:|---:|---|---:|---|",
    ]
    for text in args.layouts.split(","):
        parallel = parse_layout(text.strip())
        search = RecordedSearch(lengths, parallel, cost, config)
        started = time.perf_counter()
        search.plan()
        total = time.perf_counter() - started
        kept = min((prediction for record in search.records for prediction in record.predictions), default=None)
        for index, record in enumerate(search.records):
            fastest = min(record.predictions, default=None)
            name = SIZING_NAMES[index] if index < len(SIZING_NAMES) else f"base merge, sizing {index}"
            lines.append(
                f"| {parallel.describe()} | {name} | {record.merged_documents} | {record.plannings} | "
                f"{record.seconds:.1f} | {record.first_failures} of {record.replicas or '-'} | "
                f"{'-' if fastest is None else f'{fastest:.3f}'} | {'yes' if fastest == kept else ''} |")
        print(f"{parallel.describe()}: {total:.1f} s", flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
