"""`slimpack selftest` on the CPU: the report's sections, exit codes, JSON on stdout only, GPU
checks skipped with a reason, and checks that fail when the kernel is wrong."""
import contextlib
import importlib.util
import io
import json

import pytest
import torch

from megatron_slimpack.apps.cli import main

SECTIONS = ("environment", "attention", "dp_merge", "training", "overhead", "profile", "summary")
NO_GPU = not torch.cuda.is_available()


def run_cli(*argv) -> tuple[int, str]:
    """(exit code, stdout) of `slimpack selftest ARGV` in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["selftest", *argv])
    return code, out.getvalue()


def checks_of(report: dict, section: str) -> dict[str, dict]:
    return {c["name"]: c for c in report[section]["checks"]}


def top_left_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, dropout_p):
    """A wrong kernel: causal masks aligned top-left, so a slice's queries miss most of their prefix."""
    from megatron_slimpack.runtime.attention.kernels import segment_attention

    bounds_q, bounds_kv = cu_q.tolist(), cu_kv.tolist()
    outputs = []
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i]:bounds_q[i + 1]]
        ks, vs = k[bounds_kv[i]:bounds_kv[i + 1]], v[bounds_kv[i]:bounds_kv[i + 1]]
        mask = torch.ones(qs.shape[0], ks.shape[0], dtype=torch.bool).tril(0)
        outputs.append(segment_attention(qs, ks, vs, mask, scale, dropout_p))
    return torch.cat(outputs)


@pytest.fixture(scope="module")
def json_run():
    """One `--json --quick` run, with a library printing to stdout in the middle of it."""
    from megatron_slimpack.apps.selftest import report

    original = report.run_sections

    def noisy(*args, **kwargs):
        print("noise from a library")
        return original(*args, **kwargs)

    report.run_sections = noisy
    try:
        code, out = run_cli("--json", "--quick")
    finally:
        report.run_sections = original
    return code, out


def test_json_is_one_document_with_every_section(json_run):
    code, out = json_run
    report = json.loads(out)  # the whole of stdout: one document, the noise went to stderr
    assert code == 0 and report["summary"]["exit_code"] == 0 and report["summary"]["ok"]
    for section in SECTIONS:
        assert section in report
    for section in SECTIONS[1:-1]:
        assert report[section]["status"] in ("pass", "measured", "skip") and report[section]["checks"]
    versions = report["environment"]["versions"]
    assert set(versions) == {"torch", "cuda", "cudnn", "transformer-engine", "flash-attn", "megatron-core"}
    assert versions["torch"] == torch.__version__
    backend = report["environment"]["attention_backend"]
    assert backend["auto"] in backend["available"] and backend["why"]
    assert checks_of(report, "attention")["attention[torch]"]["status"] == "pass"
    assert checks_of(report, "dp_merge")["dp_merge[torch]"]["status"] == "pass"
    training = checks_of(report, "training")[f"training[{report['options']['device']}]"]
    assert training["status"] == "pass" and len(training["steps"]) == 2
    overhead = checks_of(report, "overhead")["overhead[torch]"]
    assert overhead["status"] == "measured" and overhead["ratio"] > 0
    assert checks_of(report, "profile")["profile"]["status"] == "skip"


@pytest.mark.skipif(not NO_GPU, reason="checks the report of a machine without a GPU")
def test_without_a_gpu_the_gpu_checks_are_skipped_with_the_reason(json_run):
    report = json.loads(json_run[1])
    assert report["options"]["device"] == "cpu" and report["environment"]["device"]["type"] == "cpu"
    assert "no CUDA GPU" in report["environment"]["device"]["gpu"]
    for section in ("attention", "dp_merge", "overhead"):
        checks = checks_of(report, section)
        for backend in ("te", "flash"):
            assert checks[f"{section}[{backend}]"]["status"] == "skip"
            assert "needs a CUDA GPU" in checks[f"{section}[{backend}]"]["summary"]
    gpu_training = checks_of(report, "training")["training[gpu]"]
    assert gpu_training["status"] == "skip" and "no CUDA GPU" in gpu_training["summary"]
    for name, module in (("transformer-engine", "transformer_engine"), ("flash-attn", "flash_attn")):
        if importlib.util.find_spec(module) is None:
            assert report["environment"]["versions"][name] == "not installed"
    if torch.version.cuda is None:
        assert report["environment"]["versions"]["cuda"].startswith("not installed")
    assert checks_of(report, "attention")["attention[torch]"]["dtype"] == "float32"


def test_text_report_exits_0_on_cpu():
    code, out = run_cli("--quick", "--device", "cpu")
    assert code == 0
    assert out.startswith("SlimPack self-test")
    for text in ("Environment", "megatron-core", "attention backend", "PASS     attention[torch]",
                 "PASS     dp_merge[torch]", "PASS     training[cpu]", "MEASURED overhead[torch]", "SKIP     profile",
                 "OK (exit 0)"):
        assert text in out


def test_a_wrong_mask_fails_the_attention_check_with_exit_1(monkeypatch):
    from megatron_slimpack.runtime.attention import kernels

    monkeypatch.setitem(kernels.KERNELS, "torch", top_left_kernel)
    code, out = run_cli("--json", "--quick", "--device", "cpu")
    report = json.loads(out)
    assert code == 1 and report["summary"]["exit_code"] == 1 and not report["summary"]["ok"]
    attention = checks_of(report, "attention")["attention[torch]"]
    assert attention["status"] == "fail" and attention["errors"]["out"]["max_rel"] > attention["tolerance"]
    # the same wrong kernel is caught by DP-Merge's check and by the training comparison too
    assert checks_of(report, "dp_merge")["dp_merge[torch]"]["status"] == "fail"
    training = checks_of(report, "training")["training[cpu]"]
    assert training["status"] == "fail" and training["over_tolerance"]
    assert report["attention"]["status"] == "fail"


def test_a_nan_kernel_fails_and_the_report_stays_valid_json(monkeypatch):
    from megatron_slimpack.apps.profiler import ensure_megatron
    from megatron_slimpack.apps.selftest.attention_checks import check_attention
    from megatron_slimpack.apps.selftest.common import CPU_SETUP
    from megatron_slimpack.runtime.attention import kernels

    ensure_megatron()
    monkeypatch.setitem(kernels.KERNELS, "torch", lambda *a: kernels.torch_kernel(*a) * float("nan"))
    check = check_attention("torch", CPU_SETUP)
    assert check.status == "fail"
    assert json.loads(json.dumps(check.to_dict(), allow_nan=False))["errors"]["out"]["max_rel"] == "nan"


def test_an_exception_is_an_error_not_a_crash(monkeypatch):
    from megatron_slimpack.apps.selftest import report

    def broken(name, setup):
        raise RuntimeError("kernel exploded")

    setup = report.make_setup("cpu", quick=True)
    checks = report.per_backend(broken, "attention", setup)
    assert checks[0].status == "error" and "kernel exploded" in checks[0].summary
    assert report.summarize({"attention": checks}, True, 0.0)["exit_code"] == 1


@pytest.mark.skipif(not NO_GPU, reason="asks for cuda on a machine without one")
def test_device_cuda_without_a_gpu_fails_with_the_reason():
    code, out = run_cli("--json", "--device", "cuda")
    report = json.loads(out)
    assert code == 1 and report["environment"]["status"] == "fail"
    assert "--device cuda" in report["environment"]["error"]
    assert all(report[s]["status"] == "skip" for s in SECTIONS[1:-1])


def test_profile_writes_a_cost_model(tmp_path, monkeypatch):
    from megatron_slimpack.apps.selftest import report
    from megatron_slimpack.costmodel import CostModel

    monkeypatch.setattr(report, "PROFILE_GRID", dict(tokens=(32, 64, 96), slices=(1,), prefixes=(0, 32)))
    monkeypatch.setattr(report, "PROFILE_REPEATS", 1)
    path = tmp_path / "profile.json"
    (check,) = report.profile_checks(str(path), report.make_setup("cpu", quick=True))
    assert check.status == "pass", check.summary
    assert CostModel.from_profile(path) is not None and check.details["path"] == str(path)
    (skipped,) = report.profile_checks(None, report.make_setup("cpu", quick=True))
    assert skipped.status == "skip" and "--profile" in skipped.summary


def test_checks_that_cannot_start_are_reported_not_raised(monkeypatch):
    from megatron_slimpack.apps.selftest import report

    def no_runtime(setup, profile):
        raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(report, "run_sections", no_runtime)
    result = report.run_selftest(device="cpu", quick=True)
    assert result["summary"]["exit_code"] == 1 and result["environment"]["status"] == "fail"
    assert "libcudnn" in result["environment"]["error"]
    assert all(result[s]["status"] == "skip" for s in SECTIONS[1:-1])
    json.dumps(result, allow_nan=False)
