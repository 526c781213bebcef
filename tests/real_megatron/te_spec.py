"""Test-only, run with a release's PYTHONPATH (harness.python_path): the layer spec that release's
trainer builds for `--transformer-impl transformer_engine`, after SlimPack's model seam.

    python te_spec.py  ->  one JSON line {"core_attention": ..., "sliced": ..., "linear_qkv": ...,
                                          "input_layernorm": ..., "pre_mlp_layernorm": ...}

Transformer Engine does not install on a CPU machine, and megatron-core cannot even name its TE
layer spec without it. A stand-in spec provider (`StandInTE`) answers every TE module with a
placeholder class named after it, so the release's own spec function runs unchanged and the
placeholders show which modules SlimPack's seam kept. Nothing is built or run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "site"))
import sitecustomize  # noqa: E402,F401  (typing.override on Python 3.11, for 0.19)


class StandInTE:
    """Megatron's TESpecProvider, with a placeholder class for every module it names."""

    def __init__(self, *args, **kwargs):
        pass

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: type(f"StandInTE_{name}", (), {})


def release_te_layer_spec(config):
    """The layer spec the installed release's trainer picks for --transformer-impl transformer_engine."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_slimpack.megatron.args import mcore_version

    gpt_layer_specs.TESpecProvider = StandInTE
    if mcore_version()[:2] >= (0, 19):
        from megatron.training.models.gpt import GPTModelConfig, default_layer_spec

        return default_layer_spec(GPTModelConfig(transformer=config, vocab_size=512), vp_stage=None)
    import gpt_builders
    from megatron.training import global_vars

    class Args:  # the few flags _get_transformer_layer_spec reads; all off for a dense GPT
        def __getattr__(self, name):
            return None

    global_vars.set_args(Args())
    return gpt_builders._get_transformer_layer_spec(True, config)


def main() -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_slimpack.runtime.attention.core import SlicedAttentionMixin, with_sliced_core_attention

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               transformer_impl="transformer_engine")
    before = release_te_layer_spec(config)
    after = with_sliced_core_attention(before, config=config)
    attention, original = after.submodules.self_attention.submodules, before.submodules.self_attention.submodules
    core = attention.core_attention
    core_module = getattr(core, "module", core)
    print(json.dumps({
        "before": getattr(getattr(original.core_attention, "module", original.core_attention), "__name__", "?"),
        "core_attention": core_module.__name__,
        "sliced": isinstance(core_module, type) and issubclass(core_module, SlicedAttentionMixin),
        "linear_qkv": getattr(attention.linear_qkv, "__name__", "?"),
        "linear_proj": getattr(attention.linear_proj, "__name__", "?"),
        # the norms TE fuses into linear_qkv and linear_fc1, which `--recompute-modules layernorm` then skips
        "input_layernorm": _name(after.submodules.input_layernorm),
        "pre_mlp_layernorm": _name(after.submodules.pre_mlp_layernorm),
    }))


def _name(submodule) -> str:
    return getattr(getattr(submodule, "module", submodule), "__name__", "?")


if __name__ == "__main__":
    main()
