"""`slimpack profile --kernels`: this device's kernel speeds measured as tables, and a cost model whose
measured tables replace the published ones they measure (and only those)."""
from __future__ import annotations

import json

import pytest

from megatron_slimpack.apps import cli
from megatron_slimpack.apps.comparison import SearchCache
from megatron_slimpack.apps.kernel_profile import QUICK_GRID, KernelGrid, profile_kernels
from megatron_slimpack.config import SlimPackConfig
from megatron_slimpack.costmodel import (
    KERNEL_PROFILE_FORMAT,
    AttentionRate,
    CostModel,
    GemmRate,
    ProfileError,
    PublishedTable,
    read_kernel_profile,
    read_profile,
)
from megatron_slimpack.specs import ParallelConfig

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A quick profile measured on this CPU, written as `slimpack profile --kernels` writes it."""
    path = tmp_path_factory.mktemp("kernels") / "kernels.json"
    assert cli.main(["profile", "--kernels", "--quick", "--repeats", "1", "--out", str(path)]) == 0
    return path


def synthetic_profile(path, *tables: PublishedTable):
    path.write_text(json.dumps({"format": KERNEL_PROFILE_FORMAT, "tables": [t.to_dict() for t in tables]}))
    return path


def torch_forward(rates) -> PublishedTable:
    return PublishedTable("attention", "torch", "forward", True, 128, LENGTHS, tuple(rates), "synthetic")


def test_a_measured_profile_holds_the_gemm_and_each_runtime_kernel_here(measured):
    data = json.loads(measured.read_text())
    assert data["format"] == KERNEL_PROFILE_FORMAT and data["environment"]["device"] == "cpu"
    kinds = {(t["kernel"], t["backend"], t["direction"]) for t in data["tables"]}
    # On a CPU the runtime runs only its torch kernel; te is a module and never measured here.
    assert kinds == {("gemm", "matmul", "forward"), ("attention", "torch", "forward"),
                     ("attention", "torch", "backward")}
    for table in read_kernel_profile(measured):
        assert len(table.sizes) == 3 and all(rate > 0 for rate in table.tflops)
        assert "measured by `slimpack profile --kernels`" in table.source
    assert len(data["fit"]) == 9 and "te" in data["not_measured"]


def test_measured_tables_replace_only_what_they_measure(measured):
    tables = {(t.kernel, t.backend, t.direction): t for t in read_kernel_profile(measured)}
    base = CostModel.analytic("tiny", "h100-sxm", attention_backend="torch")
    cost = CostModel.load(measured, "tiny", "h100-sxm", attention_backend="torch")
    assert cost.kernels.gemm == GemmRate.fit(tables["gemm", "matmul", "forward"])
    assert cost.kernels.attention("torch", False) == AttentionRate.fit(tables["attention", "torch", "forward"])
    assert cost.kernels.attention("torch", True) == AttentionRate.fit(tables["attention", "torch", "backward"])
    for backend in ("te", "flash", "flash3"):  # not measured: their published rates stay
        for backward in (False, True):
            assert cost.kernels.attention(backend, backward) == base.kernels.attention(backend, backward)
    assert str(measured) in cost.describe()["source"]
    # a CPU's rates price a layer far slower than an H100's published ones
    parallel = ParallelConfig()
    assert cost.layer_time(1024.0, 1024 * 1025 / 2, parallel, backward=False) > \
        10 * base.layer_time(1024.0, 1024 * 1025 / 2, parallel, backward=False)


def test_cost_prints_the_measured_rate_in_place_of_the_published(tmp_path, capsys):
    doubled = [2 * rate for rate in (117.4, 155.9, 224.4, 291.1, 288.3, 288.3)]
    path = synthetic_profile(tmp_path / "k.json", torch_forward(doubled))
    argv = ["cost", "--attention-backend", "torch", "--doc-length", "4096", "--pack-tokens", "16384", "--json"]
    assert cli.main(argv) == 0
    published = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--cost-model", str(path)]) == 0
    profiled = json.loads(capsys.readouterr().out)
    assert profiled["attention_forward_tflops"] == pytest.approx(2 * 291.1, rel=0.10)
    assert profiled["attention_forward_tflops"] == pytest.approx(2 * published["attention_forward_tflops"], rel=0.10)
    assert profiled["attention_backward_tflops"] == published["attention_backward_tflops"]  # not measured
    assert profiled["gemm_tflops"] == published["gemm_tflops"]
    assert profiled["kernels"] == "h100-published+measured"


def test_plan_and_simulate_price_with_the_kernel_profile_the_plan_records(tmp_path, capsys):
    slow = [rate / 4 for rate in (117.4, 155.9, 224.4, 291.1, 288.3, 288.3)]
    path = synthetic_profile(tmp_path / "k.json", torch_forward(slow))
    plan_path = tmp_path / "plan.json"
    common = ["--workload", "longtail", "--model", "llama-7b", "--tp", "1", "--pp", "2", "--dp", "2",
              "--context-length", "16384", "--global-batch-size", "8"]
    assert cli.main(["plan", *common, "--cost-model", str(path), "--out", str(plan_path)]) == 0
    capsys.readouterr()
    assert cli.main(["simulate", str(plan_path), "--json"]) == 0
    with_profile = json.loads(capsys.readouterr().out)
    assert with_profile["cost_model"]["source"] == f"analytic with kernels measured in {path}"
    assert cli.main(["simulate", str(plan_path), "--cost-model", "analytic"]) == 2
    assert "the plan was made with" in capsys.readouterr().err


def test_the_search_cache_tells_a_measured_model_from_the_published_one(measured, tmp_path):
    cache = SearchCache(tmp_path)
    batches, config = [[4096, 2048]], SlimPackConfig()
    analytic = CostModel.analytic("tiny", "cpu", attention_backend="torch")
    profiled = CostModel.load(measured, "tiny", "cpu", attention_backend="torch")
    assert cache.key("slimpack", batches, analytic, 2, 8192, config) != \
        cache.key("slimpack", batches, profiled, 2, 8192, config)
    assert profiled.to_profile_dict()["kernel_tables"] == [t.to_dict() for t in read_kernel_profile(measured)]


@pytest.mark.parametrize("change, problem", [
    (lambda t: {**t, "tflops": t["tflops"][:1], "sizes": t["sizes"][:1]}, "at least 2 rows"),
    (lambda t: {**t, "tflops": [-1.0, *t["tflops"][1:]]}, "positive finite"),
    (lambda t: {**t, "direction": "sideways"}, "direction 'sideways'"),
    (lambda t: {k: v for k, v in t.items() if k != "backend"}, "lacks backend"),
])
def test_a_malformed_table_is_named(tmp_path, change, problem):
    table = change(torch_forward((100, 150, 200, 250, 280, 290)).to_dict())
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"format": KERNEL_PROFILE_FORMAT, "tables": [table]}))
    with pytest.raises(ProfileError, match=f"kernel profile {path}: table 0 .*{problem}.*slimpack profile --kernels"):
        CostModel.load(path, "tiny", "h100-sxm")


def test_profiles_are_told_apart(tmp_path, measured, capsys):
    with pytest.raises(ProfileError, match="is a kernel profile"):
        read_profile(measured)  # a model profile's reader names what it was given
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"tables": []}))
    with pytest.raises(ProfileError, match="is not a kernel profile"):
        read_kernel_profile(other)
    assert cli.main(["cost", "--cost-model", str(other)]) == 2
    assert "is not a kernel profile" in capsys.readouterr().err


def test_a_grid_needs_two_points_to_fit():
    with pytest.raises(ValueError, match="at least 2"):
        KernelGrid(gemm_sizes=(1024,))
    with pytest.raises(ValueError, match="exceeds pack_tokens"):
        KernelGrid(doc_lengths=(512, 4096), pack_tokens=2048)
    assert QUICK_GRID.pack_tokens >= max(QUICK_GRID.doc_lengths)


def test_profile_kernels_measures_the_grid_it_is_given():
    grid = KernelGrid(gemm_sizes=(32, 64), doc_lengths=(16, 32), pack_tokens=64, heads=1, head_dim=16)
    data = profile_kernels(grid, device="cpu", repeats=1)
    sizes = {t["kernel"]: tuple(t["sizes"]) for t in data["tables"]}
    assert sizes == {"gemm": (32, 64), "attention": (16, 32)}


@pytest.mark.parametrize("rates", [(0.0024, 0.0064, 0.0154), (0.03, 0.02, 0.01)])
def test_rates_that_never_level_off_still_fit_a_meaningful_curve(rates):
    """A CPU's attention rates grow with length at every size measured (its per-document cost rules)
    or fall with it: the unconstrained fit then has a negative peak; the bounded one keeps the peak
    at or above the slowest rate and the per-token cost non-negative, so every time is positive."""
    table = PublishedTable("attention", "torch", "forward", True, 32, (32, 64, 128), rates, "synthetic")
    fitted = AttentionRate.fit(table)
    assert fitted.peak_flops >= min(rates) * 1e12 and fitted.half_length >= 0
    assert all(fitted.seconds(1.0, n * (n + 1) / 2, n) > 0 for n in (1, 32, 128, 4096))
    if rates[0] < rates[-1]:  # rising 6.4x over 4x the length: the curve rises at most as fast as the length
        errors = [fitted.tflops(n) / rate - 1 for n, rate in zip(table.sizes, rates)]
        assert max(map(abs, errors)) < 0.45 and fitted.peak_flops > 10 * max(rates) * 1e12
    else:  # falling: no curve of the form falls, the best is one flat rate between them
        assert fitted.half_length == 0 and min(rates) < fitted.peak_flops / 1e12 < max(rates)
