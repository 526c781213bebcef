"""Running a plan's step: the schedule (schedule.py: one global batch, gradient reduction, the
Megatron protocol), the stage executor (executor.py: forward and backward units on megatron-core),
NCCL-safe pipeline transfers (p2p.py), DP-Merge process groups (merge.py) and task timing and
memory records (timing.py)."""
