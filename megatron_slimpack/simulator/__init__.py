"""DAG simulator of a plan's training step (docs/design.md section 6) and its reports."""
from .dag import (
    SimulationError,
    SimulationReport,
    TaskRecord,
    busiest_device_s,
    per_batch_report,
    reports_reused,
    score,
    simulate,
)
from .memory import MemoryTimeline

__all__ = ["simulate", "reports_reused", "busiest_device_s", "score", "per_batch_report", "SimulationReport",
           "SimulationError", "TaskRecord", "MemoryTimeline"]
