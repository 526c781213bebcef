"""Test-only, on PYTHONPATH of every trainer process (spawned planner processes included):
megatron-core 0.19's `megatron.training.models` imports `typing.override`, new in Python 3.12;
on 3.11 it is `typing_extensions.override` (the same decorator: it only marks the method)."""
import typing

if not hasattr(typing, "override"):
    from typing_extensions import override

    typing.override = override
