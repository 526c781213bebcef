"""Runs the self-test's sections, builds the report, prints it (text or one JSON document), and
decides the exit code (0: every check that ran passed; 1: a check failed or raised)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import traceback
from typing import Callable, Optional

import torch

from ...costmodel import CostModel
from ...runtime.attention.kernels import available_backends
from ..profiler import ensure_megatron, profile
from .attention_checks import check_attention, check_dp_merge, measure_overhead
from .common import ERROR, FAILED, MEASURED, PASS, SKIP, Check, Setup, guarded, log, make_setup, skipped
from .environment import backend_reasons, environment, gpu_absent_reason
from .training import check_training

SECTIONS = ("attention", "dp_merge", "training", "overhead", "profile")
PROFILE_GRID = dict(tokens=(64, 128, 256), slices=(1, 2), prefixes=(0, 128))  # 12 shapes
PROFILE_REPEATS = 2
PROFILER_NOTE = "profiler.py builds and times its model on the CPU, with the layer spec the machine's default gives"


def resolve_device(requested: Optional[str]) -> tuple[str, str]:
    """(device, problem): the default is cuda when a GPU is visible; asking for cuda without one
    is a problem (reported, exit 1)."""
    gpu = torch.cuda.is_available()
    if requested is None:
        return ("cuda" if gpu else "cpu"), ""
    if requested == "cuda" and not gpu:
        return "cuda", f"--device cuda: {gpu_absent_reason()}"
    return requested, ""


# ---- sections --------------------------------------------------------------------------------
def backends_to_run(setup: Setup) -> tuple[list[str], dict[str, str]]:
    """(backends run here, {backend not run: why}). On the CPU only the torch kernel runs."""
    reasons = backend_reasons()
    if setup.is_gpu:
        run = available_backends()
        return run, {name: reasons[name] for name in ("te", "flash") if name not in run}
    absent = gpu_absent_reason()
    why = f"needs a CUDA GPU ({absent})" if absent else "GPU kernel: not run with --device cpu"
    return ["torch"], {"te": why, "flash": why}


def per_backend(check: Callable[[str, Setup], Check], section: str, setup: Setup) -> list[Check]:
    run, skip = backends_to_run(setup)
    checks = [guarded(f"{section}[{name}]", functools.partial(check, name, setup)) for name in run]
    return checks + [skipped(f"{section}[{name}]", reason) for name, reason in skip.items()]


def training_checks(setup: Setup) -> list[Check]:
    checks = [guarded(f"training[{setup.device.type}]", lambda: check_training(setup))]
    if not setup.is_gpu:
        absent = gpu_absent_reason() or "not run with --device cpu"
        checks.append(skipped("training[gpu]", f"bf16 on the layer spec slimpack_layer_spec('auto') gives on a GPU "
                                               f"(TE layers where TE imports): {absent}"))
    return checks


def run_profile(path: str, setup: Setup) -> Check:
    """A quick `slimpack profile` (profiler.profile, small grid, no p2p) written to `path` and
    loaded back as a cost model."""
    threads = torch.get_num_threads()
    try:  # at profile()'s default thread count (one training process per core)
        result = profile("tiny", pp=2, grid=PROFILE_GRID, repeats=PROFILE_REPEATS, p2p=False, progress=log)
    finally:
        torch.set_num_threads(threads)
    written = result.write(path)
    CostModel.from_profile(written)
    mape = {name: result.fit[name]["mape"] for name in ("forward", "backward")
            if isinstance(result.fit.get(name), dict)}
    fits = ", ".join(f"{name} MAPE {value:.1%}" for name, value in mape.items())
    return Check("profile", PASS, f"wrote {written} ({len(result.points)} shapes, {fits}); loads as a CostModel",
                 {"path": str(written), "model": "tiny", "grid": {k: list(v) for k, v in PROFILE_GRID.items()},
                  "repeats": PROFILE_REPEATS, "mape": mape, "measured_on": "cpu",
                  "note": PROFILER_NOTE if setup.is_gpu else ""})


def profile_checks(path: Optional[str], setup: Setup) -> list[Check]:
    if path is None:
        return [skipped("profile", "not requested (--profile PATH)")]
    check = guarded("profile", lambda: run_profile(path, setup))
    if check.status == ERROR and setup.is_gpu:
        check.summary += f" ({PROFILER_NOTE})"
    return [check]


def run_sections(setup: Setup, profile_path: Optional[str]) -> dict[str, list[Check]]:
    ensure_megatron()  # one-process gloo + megatron parallel state (+ the CPU layer without a GPU)
    return {
        "attention": per_backend(check_attention, "attention", setup),
        "dp_merge": per_backend(check_dp_merge, "dp_merge", setup),
        "training": training_checks(setup),
        "overhead": per_backend(measure_overhead, "overhead", setup),
        "profile": profile_checks(profile_path, setup),
    }


# ---- the report ------------------------------------------------------------------------------
def section_status(checks: list[Check]) -> str:
    statuses = {c.status for c in checks}
    if statuses & set(FAILED):
        return "fail"
    for status in (PASS, MEASURED):
        if status in statuses:
            return status
    return SKIP


def summarize(sections: dict[str, list[Check]], environment_ok: bool, seconds: float) -> dict:
    checks = [c for section in sections.values() for c in section]
    count = lambda *statuses: sum(c.status in statuses for c in checks)  # noqa: E731
    failed = count(*FAILED) + (0 if environment_ok else 1)
    ok = failed == 0
    return {"passed": count(PASS), "failed": failed, "skipped": count(SKIP), "measured": count(MEASURED),
            "ok": ok, "exit_code": 0 if ok else 1, "seconds": round(seconds, 1)}


def start_checks(chosen: str, quick: bool, profile: Optional[str], env: dict) -> tuple[dict, str]:
    """(sections, problem): the checks, or why they could not start (the runtime or megatron-core
    does not import or initialise: reported, not raised)."""
    try:
        setup = make_setup(chosen, quick)
        env["precision"] = setup.precision
        return run_sections(setup, profile), ""
    except Exception as error:  # noqa: BLE001 - the report names it
        traceback.print_exc(file=sys.stderr)
        return {}, f"the checks could not start: {type(error).__name__}: {error}"


def run_selftest(device: Optional[str] = None, quick: bool = False, profile: Optional[str] = None) -> dict:
    """Every section; returns the report (a JSON-ready dict)."""
    began = time.perf_counter()
    chosen, problem = resolve_device(device)
    env = environment(torch.device("cpu" if problem else chosen))
    sections: dict[str, list[Check]] = {}
    if not problem:
        sections, problem = start_checks(chosen, quick, profile, env)
    env["status"] = "fail" if problem else "info"
    if problem:
        env["error"] = problem
        log(problem)
        sections = {name: [skipped(name, problem)] for name in SECTIONS}
    report = {"tool": "slimpack selftest", "options": {"device": chosen, "quick": quick, "profile": profile},
              "environment": env}
    for name, checks in sections.items():
        report[name] = {"status": section_status(checks), "checks": [c.to_dict() for c in checks]}
    report["summary"] = summarize(sections, not problem, time.perf_counter() - began)
    return report


# ---- output ----------------------------------------------------------------------------------
def format_environment(env: dict) -> list[str]:
    device = env["device"]
    if device["type"] == "cuda":
        where = (f"cuda: {device['name']} ({device['capability']}, {device['memory_gib']} GiB), "
                 f"{device['count']} visible")
    else:
        where = f"cpu, {device['threads']} threads; GPU: {device['gpu']}"
    backend = env["attention_backend"]
    rows = [*env["versions"].items(), ("device", where),
            ("attention backend", f"{backend['auto']} (auto): {backend['why']}")]
    rows += [("  shape class", f"{shape}: {chosen}") for shape, chosen in backend.get("shape_classes", {}).items()]
    if "precision" in env:
        rows.append(("checks run in", env["precision"]))
    lines = ["Environment"] + [f"  {name:<20} {value}" for name, value in rows]
    if env.get("error"):
        lines.append(f"  FAIL  {env['error']}")
    return lines


def format_text(report: dict) -> str:
    lines = [f"SlimPack self-test (megatron-slimpack {report['environment']['megatron-slimpack']})", ""]
    lines += format_environment(report["environment"])
    for name in SECTIONS:
        section = report[name]
        lines += ["", f"{name} [{section['status']}]"]
        lines += [f"  {c['status'].upper():<8} {c['name']:<18} {c['summary']}" for c in section["checks"]]
    s = report["summary"]
    verdict = "OK" if s["ok"] else "FAILED"
    lines += ["", f"Result: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped, {s['measured']} "
                  f"measured in {s['seconds']} s: {verdict} (exit {s['exit_code']})"]
    return "\n".join(lines)


@contextlib.contextmanager
def stdout_to_stderr():
    """Everything written to stdout (Python or C libraries) goes to stderr meanwhile, so that with
    --json stdout holds exactly the one JSON document."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        with contextlib.suppress(Exception):  # C stdio buffers written meanwhile
            import ctypes

            ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def main_from_args(args) -> int:
    options = dict(device=args.device, quick=args.quick, profile=args.profile)
    if args.json:
        with stdout_to_stderr():
            report = run_selftest(**options)
        print(json.dumps(report, indent=1, allow_nan=False))
    else:
        report = run_selftest(**options)
        print(format_text(report))
    return report["summary"]["exit_code"]
