"""Cost-model profiler: a tiny grid gives a loadable profile whose predictions are close to
held-out measurements (loose bounds: the CPU is shared)."""
import pytest

from megatron_slimpack.specs import ModelSpec

SPEC = ModelSpec("test-small", 2, 64, 128, 4, num_query_groups=2, vocab_size=128)
GRID = dict(tokens=(64, 192, 384), slices=(1, 2), prefixes=(0, 128))


@pytest.fixture(scope="module")
def profiled(megatron_cpu, tmp_path_factory):
    from megatron_slimpack.apps.profiler import profile

    result = profile(SPEC, pp=1, grid=GRID, repeats=2, p2p=False, progress=None)
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    result.write(path)
    return result, path


@pytest.mark.slow
def test_profile_loads_and_predicts_held_out(profiled):
    import json

    from megatron_slimpack.apps.profiler import measure_chunk, predict_point, transformer_config
    from megatron_slimpack.costmodel import CostModel
    from megatron_slimpack.runtime.model import build_gpt_model
    from megatron_slimpack.specs import ParallelConfig

    result, path = profiled
    cost = CostModel.from_profile(path)
    data = json.loads(path.read_text())
    assert data["attention_backend"] == "torch" and data["dtype_bytes"] == 4
    for term in ("forward", "backward", "activation"):
        assert data["fit"][term]["mape"] < 1.0
    # non-negative least squares: a term the noise hides may drop to 0, never below
    assert cost.profiled_forward.per_token >= 0 and cost.profiled_forward(256, 256 * 257 / 2) > 0
    assert cost.activation.per_token > 0
    # same interface as the analytic model
    parallel = ParallelConfig(pp=1)
    assert cost.forward_time(256, 256 * 257 / 2, parallel, last_stage=True) > 0

    chunk = build_gpt_model(transformer_config(SPEC, num_layers=SPEC.num_layers), vocab_size=SPEC.vocab_size,
                            max_sequence_length=4096, backend="torch", pre_process=False, post_process=False)
    # a shape outside the grid; the median of 9 runs, as a test beside it in the suite can slow a few
    held_out = measure_chunk(chunk, SPEC, 288, 2, 64, repeats=9)
    forward, backward, saved = predict_point(cost, held_out, SPEC.num_layers)
    assert saved == pytest.approx(held_out.saved_bytes, rel=0.15)  # memory is deterministic
    assert 0.33 < forward / held_out.forward_s < 3.0  # time: loose (shared CPU)
    assert 0.33 < backward / held_out.backward_s < 3.0


def test_least_squares_recovers_coefficients():
    import numpy as np

    from megatron_slimpack.apps.profiler import least_squares

    t = np.array([64, 128, 256, 512, 1024], dtype=float)
    a = t * (t + 1) / 2
    y = 1e-3 + 2e-6 * t + 3e-9 * a
    fit = least_squares([np.ones_like(t), t, a], y, ["c0", "per_token", "per_pair"])
    assert fit["coefficients"]["per_token"] == pytest.approx(2e-6, rel=1e-6)
    assert fit["mape"] < 1e-9


@pytest.mark.slow
def test_concurrent_profile_measures_in_several_processes(megatron_cpu, tmp_path):
    """--concurrent 2: the grid runs in two processes at once; the first one's points are fitted."""
    import json

    from megatron_slimpack.apps.profiler import profile
    from megatron_slimpack.costmodel import CostModel

    grid = dict(tokens=(64, 192), slices=(1,), prefixes=(0, 64))
    result = profile(SPEC, pp=1, grid=grid, repeats=1, p2p=False, progress=None, concurrent=2)
    path = result.write(tmp_path / "profile.json")
    data = json.loads(path.read_text())
    assert data["fit"]["concurrent_processes"] == 2
    assert [(p["tokens"], p["prefix"]) for p in data["points"]] == [(64, 0), (64, 64), (192, 0), (192, 64)]
    assert all(p["forward_s"] > 0 and p["backward_s"] > 0 for p in data["points"])
    assert len(data["head_points"]) == 2
    assert CostModel.from_profile(path).profiled_forward(128, 128 * 129 / 2) > 0
