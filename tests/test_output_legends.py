"""The lines under `plan`, `simulate` and `compare` tables (where the seconds come from, what the
abbreviated headers mean), every written file announced on stderr, and Gantt chart titles that
name what ran and how long it took. JSON and CSV stay machine-readable."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import megatron_slimpack as ms
from megatron_slimpack import cli, comparison
from megatron_slimpack.costmodel import CostModel, TimeCoefficients
from megatron_slimpack.simulator import report

PLAN = ["plan", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--context-length", "4096",
        "--global-batch-size", "4", "--tp", "1", "--pp", "2", "--dp", "1", "--solver-deterministic-limit", "0.2",
        "--solver-time-limit", "60"]
TINY_ON_CPU = "simulated on cpu with cost model analytic, model tiny"
SIMULATE_LEGEND = ("legend: MFU = model FLOPs utilisation; bubble = idle share of all devices' time; "
                   "DP/PP imb. = max/mean compute over data-parallel ranks/pipeline stages; "
                   "DP exposed = gradient reduction after the last backward; lower bound = no plan can be faster")
COMPACT_LEGEND = "legend: MFU = model FLOPs utilisation; bubble = idle share of all devices' time"


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def wrote(command: str, err: str) -> list[Path]:
    """The files a command announced on stderr, in order."""
    prefix = f"slimpack {command}: wrote "
    return [Path(line.removeprefix(prefix)) for line in err.splitlines() if line.startswith(prefix)]


def after_last_table(out: str) -> list[str]:
    lines = out.rstrip("\n").splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith("|"))
    return [line for line in lines[last + 1:] if line]


# ---- the helpers ----------------------------------------------------------------------------------

def test_source_names_hardware_cost_model_and_model():
    assert report.figures_source(CostModel.analytic("llama-7b", "h100-sxm").describe()) == (
        "simulated on h100-sxm with cost model analytic, model llama-7b")
    described = {"model": "tiny", "hardware": "cpu", "source": "profile:/p/profile.json"}
    assert report.figures_source(described) == "simulated on cpu with cost model profile /p/profile.json, model tiny"


def test_legend_spells_out_only_the_abbreviated_headers_present():
    assert report.legend(["name", *report._HEADERS]) == SIMULATE_LEGEND
    assert report.comparison_legend(wide=True) == SIMULATE_LEGEND
    assert report.comparison_legend(wide=False) == COMPACT_LEGEND
    assert report.legend(["strategy", "layout", "iteration_s", "tokens_per_s"]) is None


def test_legend_words_match_the_usage_guide():
    """The legend says in short what docs/usage.md's column table says."""
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    for phrase in ("model FLOPs utilisation", "idle share of all devices'", "gradient reduction",
                   "after the last backward", "no plan can be faster", "forward and backward scheduling units",
                   "of the replica on one pipeline stage"):
        assert phrase in usage
    for phrase in ("model FLOPs utilisation", "idle share of all devices'", "after the last backward",
                   "no plan can be faster"):
        assert phrase in SIMULATE_LEGEND
    assert "scheduling units" in cli.PLAN_LEGEND and "of the replica on one pipeline stage" in cli.PLAN_LEGEND


def test_gantt_title_names_model_context_layout_and_time():
    title = report.gantt_title("slimpack", "tp8 pp4 cp1 dp4", model="llama-7b", context_length=65536,
                               iteration_s=2.3456, hardware="h100-sxm", step=0)
    assert title == ("slimpack, llama-7b, 64K context, tp8 pp4 cp1 dp4, step 0: 2.346 s per iteration, "
                     "simulated on h100-sxm")
    assert report.gantt_title("bfd", "tp1 pp2 dp1") == "bfd, tp1 pp2 dp1"
    assert report.context_label(1000) == "1,000"


# ---- plan -------------------------------------------------------------------------------------------

def test_plan_table_says_where_its_seconds_come_from_and_announces_each_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, printed, said = run_cli([*PLAN, "--steps", "2", "--out", str(out)], capsys)
    assert code == 0
    assert after_last_table(printed)[-2:] == printed.rstrip("\n").splitlines()[-2:] == [TINY_ON_CPU, cli.PLAN_LEGEND]
    assert printed.count(TINY_ON_CPU) == 1 and printed.count("step 1: ") == 1  # once, under the last step's tables
    assert "F/B units = forward/backward scheduling units" in cli.PLAN_LEGEND
    assert "F/B s/stage = forward/backward compute seconds" in cli.PLAN_LEGEND
    files = wrote("plan", said)
    assert files == [tmp_path / "plan.step0.json", tmp_path / "plan.step1.json"]
    assert all(ms.Plan.from_json(path).context_length == 4096 for path in files)
    assert "wrote" not in printed


def test_plan_json_is_only_json_and_still_announces_the_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, printed, said = run_cli([*PLAN, "--json", "--out", str(out)], capsys)
    assert code == 0 and json.loads(printed)[0]["file"] == str(out)
    assert wrote("plan", said) == [out] and out.is_file()


# ---- simulate ---------------------------------------------------------------------------------------

@pytest.fixture
def plan_file(tmp_path, capsys) -> Path:
    path = tmp_path / "plan.json"
    assert run_cli([*PLAN, "--out", str(path)], capsys)[0] == 0
    return path


def test_simulate_says_where_its_seconds_come_from_and_what_the_columns_mean(plan_file, tmp_path, capsys):
    gantt, trace = tmp_path / "chart.png", tmp_path / "trace.json"
    code, printed, said = run_cli(["simulate", str(plan_file), "--gantt", str(gantt), "--trace", str(trace)], capsys)
    assert code == 0
    assert printed.startswith("| name | layout | iteration (s) |")
    assert after_last_table(printed) == [TINY_ON_CPU, SIMULATE_LEGEND]
    assert "\n\nsimulated on " in printed  # a blank line ends the Markdown table first
    assert wrote("simulate", said) == [gantt, trace]
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "traceEvents" in json.loads(trace.read_text())


def test_simulate_json_adds_the_cost_model_and_nothing_else_to_stdout(plan_file, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    code, printed, said = run_cli(["simulate", str(plan_file), "--json", "--trace", str(trace)], capsys)
    figures = json.loads(printed)
    assert code == 0 and figures["iteration_s"] > 0
    assert figures["cost_model"] == {"model": "tiny", "hardware": "cpu", "source": "analytic"}
    assert wrote("simulate", said) == [trace] and trace.is_file()
    code, printed, said = run_cli(["simulate", str(plan_file)], capsys)
    assert code == 0 and wrote("simulate", said) == []  # nothing written, nothing announced


def test_simulate_names_a_profile_by_its_path(tmp_path, capsys):
    timed = TimeCoefficients(1e-3, 1e-6, 1e-9)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(CostModel(ms.specs.get_model("tiny"), ms.specs.get_hardware("cpu"), dtype_bytes=4,
                                            attention_backend="torch", forward=timed, backward=timed,
                                            head_forward=timed, head_backward=timed).to_profile_dict()))
    plan = tmp_path / "plan.json"
    assert run_cli([*PLAN, "--cost-model", str(profile), "--out", str(plan)], capsys)[0] == 0
    code, printed, _ = run_cli(["simulate", str(plan)], capsys)
    assert code == 0
    assert after_last_table(printed)[0] == f"simulated on cpu with cost model profile {profile}, model tiny"


def test_simulate_gantt_title_names_model_context_layout_and_time(plan_file, tmp_path, capsys, monkeypatch):
    titles = []
    real = report.write_gantt

    def recording(report_, path, title=None, horizon_s=None):
        titles.append(title)
        return real(report_, path, title=title, horizon_s=horizon_s)

    monkeypatch.setattr(report, "write_gantt", recording)
    code, printed, _ = run_cli(["simulate", str(plan_file), "--json", "--gantt", str(tmp_path / "g.png")], capsys)
    assert code == 0
    seconds = json.loads(printed)["iteration_s"]
    assert titles == [f"slimpack, tiny, 4K context, tp1 pp2 cp1 dp1: {seconds:.3f} s per iteration, simulated on cpu"]


# ---- compare ----------------------------------------------------------------------------------------

COMPARE = ["compare", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--gpus", "2",
           "--context-length", "4096", "--global-batch-size", "4", "--strategies", "megatron-fixed,bfd",
           "--workers", "1"]


def test_compare_table_says_where_its_seconds_come_from_and_announces_every_file(tmp_path, capsys, monkeypatch):
    titles = {}
    real = comparison.write_gantt

    def recording(report_, path, title=None, horizon_s=None):
        titles[Path(path).stem] = (title, report_.iteration_time_s)
        return real(report_, path, title=title, horizon_s=horizon_s)

    monkeypatch.setattr(comparison, "write_gantt", recording)
    out, charts = tmp_path / "compare.md", tmp_path / "charts"
    code, printed, said = run_cli([*COMPARE, "--out", str(out), "--gantt-dir", str(charts)], capsys)
    assert code == 0
    table, footer = printed.split("\n\n")[:2]
    assert table.startswith("| strategy | layout |")
    assert footer.splitlines()[:2] == [TINY_ON_CPU, COMPACT_LEGEND]
    files = wrote("compare", said)
    assert files == [out, out.with_suffix(".json"), charts / "megatron-fixed.png", charts / "bfd.png"]
    assert all(path.is_file() for path in files)
    assert f"\n\n{TINY_ON_CPU}\n\n{COMPACT_LEGEND}\n\n" in out.read_text()  # the Markdown document has them too
    assert json.loads(out.with_suffix(".json").read_text())["cost_model"] == {
        "model": "tiny", "hardware": "cpu", "source": "analytic"}
    layouts = {row["strategy"]: row["layout"] for row in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert set(titles) == set(layouts) == {"megatron-fixed", "bfd"}
    for name, (title, seconds) in titles.items():
        assert title == (f"{name}, tiny, 4K context, {layouts[name]}, step 0: {seconds:.3f} s per iteration, "
                         "simulated on cpu")


def test_compare_wide_legend_and_machine_readable_outputs(capsys):
    quiet = [*COMPARE, "--quiet"]  # (the search is cached after the first run)
    code, printed, said = run_cli([*quiet, "--wide"], capsys)
    assert code == 0 and printed.split("\n\n")[1].splitlines()[:2] == [TINY_ON_CPU, SIMULATE_LEGEND]
    assert said == ""
    code, printed, _ = run_cli([*quiet, "--csv"], capsys)
    assert code == 0 and "legend" not in printed and "simulated on" not in printed
    assert printed.startswith("strategy,layout,iteration_s,")
    code, printed, _ = run_cli([*quiet, "--json"], capsys)
    assert code == 0 and json.loads(printed)["cost_model"]["hardware"] == "cpu"
