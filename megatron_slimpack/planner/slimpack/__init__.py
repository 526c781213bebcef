"""SlimPack's planner (docs/design.md section 5): the two-phase CP-SAT search over data-parallel
replicas (dp_phase.py, search.py) and, per replica, slicing and packing into MicroPacks with
asymmetric forward/backward units (replica.py, pack_phase.py, ladder.py), under the activation
memory budget (memory.py)."""
