"""megatron-slimpack: SlimPack (fine-grained asymmetric packing) for Megatron-LM.

Public contract (docs/design.md section 8):

    from megatron_slimpack import plan, simulate, CostModel, ModelSpec, ParallelConfig, SlimPackConfig
    p = plan(lengths, parallel=ParallelConfig(dp=4, pp=4, tp=8),
             cost=CostModel.analytic("llama-7b", "h100-sxm"),
             config=SlimPackConfig(strategy="slimpack", context_length=262144))
    p.validate(); p.to_json(path); Plan.from_json(path)
    report = simulate(p, cost)
"""
from ._moved import install as _install_moved_paths
from .config import ConfigError, SlimPackConfig
from .costmodel import CostModel
from .errors import SlimPackError
from .plan import MicroPack, Plan, PlanError, ReplicaPlan, Sample, Slice
from .planner.strategies import plan_global_batch
from .simulator.dag import simulate as _simulate
from .specs import HardwareSpec, ModelSpec, ParallelConfig, SpecError
from .workload import GlobalBatchSampler, WorkloadError, load_lengths

__version__ = "0.1.0"
_install_moved_paths()  # old module paths (solver.*, cli, demo, ...) still import, with a warning


def plan(lengths, *, parallel: ParallelConfig, cost: CostModel, config: SlimPackConfig | None = None,
         sources=None) -> Plan:
    """Plan one global batch of document lengths with the configured strategy. `sources`: the
    (document, offset) each length was read from (default (i, 0)); the plan's `sample_sources`
    say where every sample's tokens are, whatever the strategy renumbers."""
    return plan_global_batch(lengths, parallel=parallel, cost=cost, config=config or SlimPackConfig(),
                             sources=sources)


def simulate(plan: Plan, cost: CostModel, *, overlaps=None):
    """Simulate one training step of `plan`; returns a `SimulationReport`. Communication is priced
    with the overlaps the plan's strategy declares, or `overlaps` (a `costmodel.Overlaps`) where given."""
    return _simulate(plan, cost, overlaps=overlaps)


__all__ = [
    "plan", "simulate", "CostModel", "ModelSpec", "HardwareSpec", "ParallelConfig", "SlimPackConfig", "ConfigError",
    "Plan", "ReplicaPlan", "MicroPack", "Slice", "Sample", "PlanError", "SpecError", "GlobalBatchSampler",
    "load_lengths", "SlimPackError", "WorkloadError", "__version__",
]
