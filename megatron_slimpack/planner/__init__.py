"""Planners: one global batch of document lengths -> a `Plan` (docs/design.md section 5).

    registry.py    the strategy registry (`StrategySpec`, layout constraints, stateful planners)
    strategies.py  planning a batch with a named strategy; the public entry `plan_global_batch`
    layouts.py     the layout search: each strategy's best (dp, pp, vpp, tp, cp, recompute) per cluster
    orders.py      pipeline task orders (1F1B and interleaved, for units of any size)
    work.py        per-MicroPack work rates the planners balance
    outcomes.py    what a planning attempt returns (fits, or why not)
    slimpack/      SlimPack's own planner: slicing, packing, asymmetric units, the CP-SAT phases
    baselines/     the strategies SlimPack is compared with: common.py (1F1B schedules, dealing,
                   assembling), sequences.py (GPTDataset's fixed-length sequences), fixed.py
                   (megatron-fixed, megatron-stock), packing.py (bfd, sorted), wlb_llm.py,
                   hybrid_cp.py (Megatron's hybrid CP), slimpipe.py
"""
