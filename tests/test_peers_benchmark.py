"""benchmarks/peers.py runs end to end on a tiny setting and reports every row it promises."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_peers():
    spec = importlib.util.spec_from_file_location("peers_benchmark", ROOT / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_clipped_lognormal_mean():
    peers = load_peers()
    mu = peers.clipped_lognormal_mu(1024.0, 1.5, 128, 8192)
    lengths = [length for batch in peers.dcp_batches(64, 200, seed=0) for length in batch]
    assert 5.9 < mu < 6.0
    assert 128 <= min(lengths) and max(lengths) <= 8192
    assert abs(sum(lengths) / len(lengths) - 1024) < 40  # 25,600 draws: the clipped mean held at 1024


def test_tiny_run(capsys):
    peers = load_peers()
    rows = peers.main(["--gpus", "4,8", "--dcp-steps", "2", "--wlb-steps", "2", "--wlb-settings", "7B-64K",
                       "--corpus", "longtail"])
    out = capsys.readouterr().out
    assert [row["benchmark"] for row in rows] == ["dynamic-CP 4 GPUs", "dynamic-CP 8 GPUs", "WLB-LLM 7B-64K"]
    for row in rows:
        assert row["simulated"] > 0 and row["ratio"] == row["simulated"] / row["published"]
        assert row["benchmark"] in out
    assert rows[2]["baseline_figures"]["objective"] == "documents cut at sequence boundaries"
    assert rows[2]["peer_figures"]["objective"] == "documents whole"
    # WLB-LLM's delay thresholds tuned on another sample: the fastest candidate's, then measured
    wlb = rows[2]
    rates = wlb["sample_rates_by_delay_fractions"]
    assert wlb["tuned_delay_fractions"] == max(rates, key=rates.get) and len(rates) == 6
    assert wlb["simulated_tuned"] > 0 and f"tuned on another sample ('{wlb['tuned_delay_fractions']}')" in out
