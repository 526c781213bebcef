"""Megatron's recompute as the planner prices it: none, selective (`--recompute-modules core_attn`,
Megatron's default), selective-mlp (`core_attn mlp`), full recompute of every layer, and block-N
(the first N layers of each model chunk recomputed whole); `layernorm` among the modules on
Transformer Engine's layer spec, which fuses the norms and so re-runs nothing for it (refused on
the local spec, whose norms it would re-run unpriced). A Megatron run with other settings is
refused with the flags to use (it would be priced as something else); the cluster scripts give
each layout the flags of its mode. The cost model's terms are checked by hand in
tests/test_cost_model.py; training with MLP recompute (vpp2) and block recompute (tp2-sp) through
the real trainer in tests/test_megatron_releases.py."""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
import torch

from megatron_slimpack.costmodel import CostModel
from megatron_slimpack.megatron import add_slimpack_args
from megatron_slimpack.megatron.args import SlimPackArgumentError, recompute_mode_of_args, validate_slimpack_args
from megatron_slimpack.specs import (
    MODELS,
    RECOMPUTE_MODES,
    ParallelConfig,
    SpecError,
    block_recompute_modes,
    recompute_flags,
    recompute_includes,
)

ROOT = Path(__file__).resolve().parents[1]


def megatron_args(*argv: str):
    """--slimpack with Megatron's recompute flags, as Megatron's parser spells them (a 8-layer model)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    parser.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    parser.add_argument("--recompute-modules", nargs="*", default=None)
    parser.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    parser.add_argument("--recompute-num-layers", type=int, default=None)
    parser.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="transformer_engine")
    return add_slimpack_args(parser).parse_args(["--slimpack", "--calculate-per-token-loss", *argv])


@pytest.mark.parametrize("mode", [*RECOMPUTE_MODES, "block-1", "block-3"])
def test_each_mode_trains_with_the_flags_it_is_priced_as(mode):
    args = megatron_args(*recompute_flags(mode))
    validate_slimpack_args(args)
    assert recompute_mode_of_args(args) == mode


def test_the_modules_may_come_in_any_order():
    assert recompute_mode_of_args(megatron_args("--recompute-granularity", "selective", "--recompute-modules",
                                                "mlp", "core_attn")) == "selective-mlp"


@pytest.mark.parametrize("modules, mode", [(["core_attn", "layernorm"], "selective"),
                                           (["layernorm", "mlp", "core_attn"], "selective-mlp"),
                                           (["layernorm"], "none")])
def test_layernorm_recompute_on_transformer_engine_layers_is_priced_as_without_it(modules, mode):
    """TE's layer spec fuses both norms into the next linear layer (`input_layernorm` and
    `pre_mlp_layernorm` are IdentityOp: tests/real_megatron/te_spec.py checks each release's spec),
    so megatron-core's layer skips the module: the layer runs, and is priced, as without it."""
    args = megatron_args("--recompute-granularity", "selective", "--recompute-modules", *modules)
    validate_slimpack_args(args)
    assert recompute_mode_of_args(args) == mode


@pytest.mark.parametrize("argv, problem", [
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm", "--transformer-impl",
      "local"], "takes --recompute-modules layernorm only with --transformer-impl transformer_engine"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp"], "'mlp' is not priced"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"], "'mlp layernorm' is not "
                                                                                          "priced"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "recomputes groups of layers together"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2",
      "--num-layers", "0"], "needs --num-layers"),
])
def test_recompute_the_planner_does_not_price_is_refused_with_the_fix(argv, problem):
    with pytest.raises(SlimPackArgumentError, match=problem) as caught:
        validate_slimpack_args(megatron_args(*argv))
    assert re.search(r"\b(use|remove)\b", str(caught.value))  # names the fix


def test_block_recompute_of_a_whole_chunk_is_every_layer():
    # 8 layers on 2 stages: 4 per chunk, each recomputed on its own
    args = megatron_args("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                         "4")
    validate_slimpack_args(args)
    assert recompute_mode_of_args(args) == "full"


def test_block_recompute_counts_layers_per_model_chunk():
    # 8 layers, pp 2 x vpp 2 (as Megatron's validation sets it): 2 layers per chunk, so block 1
    # recomputes half of them and block 2 all
    block = ("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers")
    modes = []
    for layers in ("1", "2"):
        args = megatron_args(*block, layers)
        args.virtual_pipeline_model_parallel_size = 2
        validate_slimpack_args(args)
        modes.append(recompute_mode_of_args(args))
    assert modes == ["block-1", "full"]


def test_a_block_mode_names_what_it_recomputes():
    assert ParallelConfig(pp=2, recompute="block-3").describe() == "tp1 pp2 cp1 dp1 rc-block-3"
    for wrong in ("block-0", "block", "block-x", "full-2"):
        with pytest.raises(SpecError, match="block-N"):
            ParallelConfig(recompute=wrong)
    with pytest.raises(SpecError, match="use recompute 'full', or block-N with N < 16"):
        ParallelConfig(pp=2, recompute="block-16").check_model(MODELS["llama-7b"])
    ParallelConfig(pp=2, recompute="block-15").check_model(MODELS["llama-7b"])


@pytest.mark.parametrize("mode", [*RECOMPUTE_MODES, "block-2"])
def test_the_cluster_script_gives_a_layout_its_modes_flags(mode):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import reproduce_paper
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    text = ParallelConfig(tp=2, pp=2, dp=2, recompute=mode).describe()
    layout = reproduce_paper.Layout.parse(text)
    argv = reproduce_paper.flags(reproduce_paper.layout_options(layout, base_merge=False))
    start = argv.index("--recompute-granularity") if "--recompute-granularity" in argv else len(argv)
    recompute = [flag for flag in argv[start:] if not flag.startswith("--") or flag.startswith("--recompute")]
    assert recompute == recompute_flags(mode)


def test_a_mode_that_includes_another_takes_at_least_its_time_and_holds_at_most_its_activations():
    """The layout search's recompute cascade rests on `recompute_includes`: a mode that re-runs all
    another re-runs is never faster and never holds more activations in the cost model (llama-7b,
    pp4: 8 layers a chunk, short and long packs). Selective and block-N re-run different work:
    neither includes the other."""
    cost = CostModel.analytic("llama-7b", "h100-sxm")
    modes = [*RECOMPUTE_MODES, *block_recompute_modes(8)]
    assert not recompute_includes("selective", "block-1") and not recompute_includes("block-7", "selective")
    assert recompute_includes("block-3", "block-2") and not recompute_includes("block-2", "block-3")
    assert all(recompute_includes("full", mode) and recompute_includes(mode, "none") for mode in modes)
    for tokens in (2048, 131072):
        pairs = tokens * (tokens + 1) / 2
        for mode in modes:
            parallel = ParallelConfig(pp=4, dp=2, recompute=mode)
            for lighter in modes:
                if not recompute_includes(mode, lighter):
                    continue
                other = parallel.with_(recompute=lighter)
                assert cost.backward_time(tokens, pairs, parallel) >= cost.backward_time(tokens, pairs, other)
                assert cost.activation_bytes(tokens, pairs, parallel) <= cost.activation_bytes(tokens, pairs, other)


def test_layernorm_recompute_on_the_local_spec_does_not_run_without_transformer_engine(megatron_cpu, monkeypatch):
    """Why `--recompute-modules layernorm` is refused with `--transformer-impl local`: there the norms
    are modules of their own, so megatron-core re-runs them through its output-discarding checkpoint,
    which takes `fp8=False` as fp8 on and reads Transformer Engine's FP8 state (absent here). Its CUDA
    RNG-state read is pointed at the CPU generator first, as the real trainer's CPU shim does."""
    import importlib.util

    from megatron.core.tensor_parallel import random as mp_random

    from megatron_slimpack.runtime.model import build_gpt_model, tiny_config

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here: megatron-core's output-discarding checkpoint runs")
    monkeypatch.setattr(mp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state())

    config = tiny_config(recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"])
    model = build_gpt_model(config, vocab_size=64, max_sequence_length=32, backend="torch")
    layer = model.decoder.layers[0]
    assert layer.recompute_input_layernorm and layer.recompute_pre_mlp_layernorm
    tokens = torch.randint(0, 64, (1, 16))
    with pytest.raises(NameError, match="FP8GlobalStateManager"):
        model(tokens, torch.arange(16)[None, :], None)
