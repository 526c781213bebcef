"""DAG simulator of a plan's training step (design.md section 6) and its reports."""
from .dag import SimulationError, SimulationReport, TaskRecord, score, simulate
from .memory import MemoryTimeline

__all__ = ["simulate", "score", "SimulationReport", "SimulationError", "TaskRecord", "MemoryTimeline"]
