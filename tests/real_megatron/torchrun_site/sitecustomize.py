"""Test-only, on PYTHONPATH of the processes `reproduce_paper.sh --launcher torchrun` starts in
tests/test_reproduce_end_to_end.py, which runs the real `scripts/launch_torchrun.sh` (it starts
`pretrain_gpt.py` itself, so launch.py cannot wrap it): in a process running `pretrain_gpt.py` (each
torchrun worker) it applies the CPU shim (cpu_shim.py) before the script is imported; in every
process it also gives Python 3.11 megatron-core 0.19's `typing.override` (site/sitecustomize.py)."""
import os
import runpy
import sys

_REAL_MEGATRON = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
runpy.run_path(os.path.join(_REAL_MEGATRON, "site", "sitecustomize.py"))

if sys.argv and os.path.basename(sys.argv[0]) == "pretrain_gpt.py":
    sys.path.insert(0, _REAL_MEGATRON)
    import cpu_shim

    cpu_shim.apply()
