"""Integration with Megatron-LM's trainer (docs/design.md section 7).

    from megatron_slimpack.megatron import add_slimpack_args, install
    pretrain(..., extra_args_provider=add_slimpack_args)      # megatron-core 0.16 / 0.17
    args = parse_and_validate_args(extra_args_provider=add_slimpack_args); install(args)   # 0.18+

`patches/` holds this change for a Megatron-LM checkout's pretrain_gpt.py, applied by
`scripts/apply_patches.sh`. Importing this package does not import megatron.training.
"""
from .args import (
    SlimPackArgumentError,
    add_slimpack_args,
    slimpack_config_from_args,
    validate_slimpack_args,
    with_slimpack_args,
)


def install(args=None, **kwargs):
    """See `hooks.install`."""
    from .hooks import install as _install

    return _install(args, **kwargs)


def uninstall() -> None:
    from .hooks import uninstall as _uninstall

    _uninstall()


__all__ = ["add_slimpack_args", "with_slimpack_args", "validate_slimpack_args", "slimpack_config_from_args",
           "SlimPackArgumentError", "install", "uninstall"]
