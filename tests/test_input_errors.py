"""Bad input gets one clear error naming the problem and the fix: cost-model profiles,
planner resume states; the library noise the commands silence (and what they do not); a simulation
report's readable summary."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest

import megatron_slimpack as ms
from megatron_slimpack import cli, library_noise
from megatron_slimpack.costmodel import CostModel, ProfileError, TimeCoefficients

# ---- cost-model profiles --------------------------------------------------------------------------


def _profile_dict() -> dict:
    """What `slimpack profile` writes, with made-up coefficients."""
    timed = TimeCoefficients(1e-3, 1e-6, 1e-9)
    return CostModel(ms.specs.get_model("tiny"), ms.specs.get_hardware("cpu"), dtype_bytes=4,
                     attention_backend="torch", forward=timed, backward=timed, head_forward=timed,
                     head_backward=timed).to_profile_dict()


def _changed(**entries) -> str:
    return json.dumps({**_profile_dict(), **entries})


@pytest.mark.parametrize("content, problem", [
    ("not json at all", "is not JSON (Expecting value at line 1 column 1)"),
    ("", "is not JSON (Expecting value at line 1 column 1)"),
    ('{"model": ', "is not JSON (Expecting value at line 1 column 11)"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "is not a text file (not UTF-8), so not JSON"),
    ("[1, 2]", "holds a JSON list, not a profile object"),
    ('{"model": {}}', "lacks hardware, dtype_bytes, attention_backend, forward, backward, head_forward, "
                      "head_backward, activation: not a `slimpack profile` file"),
    (_changed(forward=None), "is malformed: 'forward' is null, not an object of fitted values"),
    (_changed(backward=[1, 2, 3]), "is malformed: 'backward' is a JSON list, not an object of fitted values"),
    (_changed(forward={"c0": 1.0}), "is malformed: 'forward' lacks per_token, per_pair"),
    (_changed(forward={"c0": 1.0, "per_token": 1.0, "per_pair": 1.0, "per_byte": 2}),
     "is malformed: 'forward' has unknown per_byte"),
    (_changed(head_forward={"c0": "fast", "per_token": 1.0, "per_pair": 1.0}),
     "is malformed: head_forward.c0 is 'fast', not a finite number"),
])
def test_a_bad_profile_is_one_error_naming_the_file_and_the_problem(content, problem, tmp_path):
    path = tmp_path / "profile.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ProfileError) as error:
        CostModel.from_profile(path)
    message = str(error.value)
    assert message.startswith(f"cost-model profile {path} {problem}")
    assert "\n" not in message and isinstance(error.value, ms.SlimPackError)


def test_a_good_profile_still_loads(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_profile_dict()))
    cost = CostModel.from_profile(path)
    assert cost.profiled_forward == TimeCoefficients(1e-3, 1e-6, 1e-9) and cost.source == f"profile:{path}"


def test_cli_bad_profile_exits_2_with_one_line(tmp_path, capsys):
    """A cost-model file that is not JSON."""
    path = tmp_path / "notes.txt"
    path.write_text("these are my notes, not a profile\n")
    for argv in (["plan"], ["compare"]):
        assert cli.main([*argv, "--cost-model", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"error: cost-model profile {path} is not JSON (" in err and "slimpack profile --out FILE" in err


# ---- planner resume states ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resumable():
    """A wlb-llm planner iterator (planning inline) after one batch, and a way to make fresh ones."""
    from megatron_slimpack.megatron.data import PlannerIterator, plan_function
    from megatron_slimpack.planner.strategies import new_planner

    lengths = ms.load_lengths("longtail:n=200", seed=0)
    config = ms.SlimPackConfig(context_length=4096, strategy="wlb-llm")

    def fresh():
        sampler = ms.GlobalBatchSampler(lengths, 4096, 4, seed=0, long_documents="split")
        plan_fn = plan_function(new_planner("wlb-llm"), ms.ParallelConfig(pp=1), CostModel.analytic("tiny", "cpu"),
                                config)
        return PlannerIterator(sampler, plan_fn, plan_ahead=0, steps=4)

    first = fresh()
    next(first)
    return fresh, json.loads(json.dumps(first.state_dict()))


def _corrupt(state: dict, path: tuple, value) -> dict:
    state = copy.deepcopy(state)
    if not path:
        return value
    target = state
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return state


@pytest.mark.parametrize("path, value, problem", [
    ((), {}, "the resume state has no 'sampler' entry (it has [])"),
    ((), [1, 2], "the resume state is a list, not a dict"),
    (("sampler",), "abc", "the resume state entry 'sampler' is 'abc', not a dict"),
    (("consumed",), -1, "the resume state's 'consumed' is -1, not a count of batches"),
    (("sampler", "cursor"), 10**9, "the resume state's 'sampler' entry 'cursor' is 1000000000, beyond the corpus's "
                                   "200 documents"),
    (("sampler", "cursor"), -5, "the resume state's 'sampler' entry 'cursor' is -5, not an integer >= 0"),
    (("sampler", "epoch"), 1.5, "the resume state's 'sampler' entry 'epoch' is 1.5, not an integer >= 0"),
    (("sampler", "document"), 500, "the resume state's 'sampler' is inside document 500 at token 0, which the "
                                   "corpus of 200 documents does not have"),
    (("planner",), [], "the resume state's 'planner' is a list, not the dict a wlb-llm planner's state_dict()"),
    (("planner", "queues"), [[1], [2]], "the resume state's 'planner' is not a wlb-llm planner state: "),
    (("planner", "carried"), 5, "the resume state's 'planner' is not a wlb-llm planner state: "),
    (("planner",), {"strategy": "wlb-llm", "queues": [[], []]},
     "the resume state's 'planner' is not a wlb-llm planner state: no 'step' entry"),
])
def test_a_corrupt_resume_state_is_refused_and_changes_nothing(resumable, path, value, problem):
    """`{}`, a cursor of 1e9 or -5 are refused as a corrupt resume state, not a KeyError or IndexError
    deep inside (or, -5, a resume at the wrong batch)."""
    from megatron_slimpack.megatron.data import ResumeStateError

    fresh, saved = resumable
    iterator = fresh()
    before = (iterator.state_dict(), iterator.sampler.state_dict(), iterator.plan_fn.planner.state_dict())
    with pytest.raises(ResumeStateError) as error:
        iterator.load_state_dict(_corrupt(saved, path, value))
    assert str(error.value).startswith(problem) and "resume from the state_dict() the run saved" in str(error.value)
    assert (iterator.state_dict(), iterator.sampler.state_dict(), iterator.plan_fn.planner.state_dict()) == before
    iterator.load_state_dict(saved)  # the saved state still loads and continues
    assert next(iterator).step == 1


def test_fast_forward_needs_a_count_of_steps(resumable):
    from megatron_slimpack.megatron.data import ResumeStateError, fast_forward

    fresh, _ = resumable
    iterator = fresh()
    planner = iterator.plan_fn.planner
    for steps in (-1, 2.5, "3"):
        with pytest.raises(ResumeStateError, match="fast_forward: steps must be the number of batches already"):
            fast_forward(iterator.sampler, planner, ms.ParallelConfig(pp=1), CostModel.analytic("tiny", "cpu"),
                         iterator.plan_fn.config, steps)


# ---- library noise ----------------------------------------------------------------------------


NOISE = ["Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
         "Apex is not installed. Falling back to Torch Norm",
         "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."]
OURS = ["--context-length 7 is below 1K tokens", "slimpack: cannot plan in a worker process"]


def _warn_each(messages: list[str]) -> None:
    for message in messages:
        warnings.warn(message, UserWarning, stacklevel=2)


def test_library_notices_are_silenced_and_other_warnings_still_show():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with library_noise.silenced():
            _warn_each(NOISE + OURS)
        _warn_each(NOISE[1:2])  # afterwards: shown again
    assert [str(w.message) for w in caught] == OURS + NOISE[1:2]


def test_child_processes_inherit_the_silencing(monkeypatch):
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    code = ("import warnings; warnings.warn('Transformer Engine and Apex are not installed. x'); "
            "warnings.warn('ours, still shown')")
    with library_noise.silenced():
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "ours, still shown" in child.stderr and "not installed" not in child.stderr
    assert os.environ["PYTHONWARNINGS"] == "default"


class IndexedDataset:
    """Stands in for megatron-core's: its `__del__` fails when `__init__` did not finish."""

    def __init__(self, path):
        raise AssertionError(f"bad header, cannot read: {path}")

    def __del__(self):
        del self.index


class OtherResource(IndexedDataset):
    def __del__(self):
        del self.index


IndexedDataset.__module__ = IndexedDataset.__del__.__module__ = "megatron.core.datasets.indexed_dataset"


def test_only_the_half_built_megatron_dataset_teardown_is_dropped():
    """A corrupt `megatron:` dataset gives its one-line error only: the half-built dataset's teardown
    ("Exception ignored in: IndexedDataset.__del__" and a traceback) is dropped."""
    seen = []
    previous, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        with library_noise.silenced():
            for kind in (IndexedDataset, OtherResource):
                try:
                    kind("bad.idx")
                except AssertionError:
                    pass
    finally:
        sys.unraisablehook = previous
    assert [getattr(u.object, "__qualname__", "") for u in seen] == ["OtherResource.__del__"]


# ---- simulation reports -----------------------------------------------------------------------


def test_a_report_prints_as_a_short_summary():
    """`print(report)` prints a short summary, not the dataclass repr (700 KB for a plan)."""
    cost = CostModel.analytic("llama-7b", "h100-sxm")
    plan = ms.plan([4000, 3000, 9000, 100] * 8, parallel=ms.ParallelConfig(dp=2, pp=2, tp=2), cost=cost,
                   config=ms.SlimPackConfig(context_length=16384))
    report = ms.simulate(plan, cost)
    text = repr(report)
    assert str(report) == text and len(text) < 600 and len(text.splitlines()) == 4 and len(report.tasks) > 20
    assert f"makespan {report.iteration_time_s:.4g} s (lower bound {report.lower_bound_s:.4g} s)" in text
    assert f"bubble {100 * report.bubble_ratio:.1f}%" in text and f"MFU {100 * report.mfu:.1f}%" in text
    peaks = ", ".join(f"{peak / 1024**3:.2f}" for peak in report.peak_memory_bytes)
    assert f"peak memory per stage (GiB): [{peaks}] of " in text and text.endswith(": fits")
