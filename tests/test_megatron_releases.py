"""Every supported Megatron-LM release trains with SlimPack through its own real trainer, on CPU.

For each release (harness.RELEASES: megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2, each with
its tag's `pretrain_gpt.py` from `../shared/megatron-lm`, the release's patch applied by
scripts/apply_patches.sh) a four-layer model trains three iterations from one initial checkpoint
(`--finetune`: Megatron seeds each pipeline stage differently), documents cut into slices
(`--slimpack-max-micropack-tokens 128`), and each layout below must give the DP=1 PP=1 run's lm
loss and grad norm at every iteration (fp32, 1e-5 relative). Each launch checks several
properties at once (CI time: a launch costs 10-60 s on 2 cores):

  dp2-pp2: DP=2 x PP=2, --use-distributed-optimizer --overlap-grad-reduce, selective recompute
           (recomputing a sliced document's attention must not store its K/V twice), each step's
           last backward unit 3, 5, then 2 MicroPacks wide (Megatron's DDP counts gradient hooks
           per backward call and launches a bucket's reduce at the count it learned in step 1);
  tp2-sp:  TP=2 --sequence-parallel (padded MicroPacks, norms' gradients summed across TP) with
           --slimpack-tp-overlap (the layers' collectives as rings behind their GEMMs; the run
           stops before its first step if a linear is not the ring's), full recompute of the
           first of the stage's four layers (--recompute-method block --recompute-num-layers 1:
           the planner's block-1, a recomputed layer next to plain ones);
  vpp2:    PP=2 x 2 virtual stages per rank (interleaved 1F1B), --recompute-modules core_attn mlp
           (the planner's selective-mlp mode: the MLP block re-run in backward as well);
  resume:  a run saved at iteration 2 and resumed gives the unbroken run's iteration 3;
  bf16:    --bf16 close to fp32.

Two checks guard against a release building its model some other way than the plugin expects
(0.19 builds it through GPTModelBuilder, without the model provider 0.16-0.18 call): a launch
whose model builder is left alone must stop before its first step with SlimPack's named error,
and the layer spec each release builds for `--transformer-impl transformer_engine` must carry
the sliced core attention (and fuse both norms into the next linear layer, which is why
`--recompute-modules layernorm` re-runs nothing there).

Tests of one release share one workspace (`xdist_group`: they run in one pytest worker).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "real_megatron"))
import harness  # noqa: E402
from harness import RELEASES, assert_same_training, has_sliced_document, plans_of, relative_difference  # noqa: E402

pytestmark = [pytest.mark.real_megatron, pytest.mark.slow]

SPLIT = "90,10,0"
ITERATIONS = 3
BASE = ["--num-layers", "4", "--slimpack-max-micropack-tokens", "128"]
LAST_UNITS = (3, 5, 2)  # MicroPacks in each step's last backward unit under dp2-pp2 (launch.py)
LAYOUTS = {
    "dp2-pp2": dict(nproc=4, extra=["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                    "--overlap-grad-reduce", "--recompute-granularity", "selective"],
                    env={"SLIMPACK_TEST_LAST_BACKWARD_UNITS": ",".join(map(str, LAST_UNITS))}),
    "tp2-sp": dict(nproc=2, extra=["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   "--slimpack-tp-overlap", "--recompute-granularity", "full",
                                   "--recompute-method", "block", "--recompute-num-layers", "1"]),
    "vpp2": dict(nproc=2, extra=["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
                                 "2", "--recompute-granularity", "selective", "--recompute-modules", "core_attn",
                                 "mlp"]),
}

# The planner's recompute mode for each layout's Megatron flags: what its plans are priced with.
PLANNED_RECOMPUTE = {"dp2-pp2": "selective", "tp2-sp": "block-1", "vpp2": "selective-mlp"}


class ReleaseWorkspace:
    """One release's patched checkout, dataset, initial checkpoint and runs (each run once)."""

    def __init__(self, root: Path, release: harness.Release):
        self.root, self.release = root, release
        self.script = harness.patched_checkout(root / "checkout", release)
        self.prefix = harness.build_dataset(root / "data" / "documents", harness.random_documents(300))
        self.runs: dict[str, harness.TrainRun] = {}

    def run(self, name: str, *, nproc: int = 1, extra=(), initial: bool = True, **options) -> harness.TrainRun:
        if name not in self.runs:
            load = ["--load", str(self.initial()), "--finetune", "--no-load-optim", "--no-load-rng"] if initial else []
            self.runs[name] = harness.train(self.script, self.prefix, self.root / name, nproc=nproc, split=SPLIT,
                                            release=self.release, train_iters=options.pop("train_iters", ITERATIONS),
                                            extra=[*BASE, *load, *extra], **options)
        return self.runs[name]

    def initial(self) -> Path:
        directory = self.root / "initial"
        self.run("initial", initial=False, train_iters=1, extra=["--save", str(directory), "--save-interval", "1"])
        return directory

    def reference(self) -> harness.TrainRun:
        return self.run("reference")


_workspaces: dict[str, ReleaseWorkspace] = {}


@pytest.fixture
def workspace(request, tmp_path_factory) -> ReleaseWorkspace:
    name = request.param
    if name not in _workspaces:
        _workspaces[name] = ReleaseWorkspace(tmp_path_factory.mktemp(f"release-{name}"), RELEASES[name])
    return _workspaces[name]


def per_release(*names):
    """Parametrize over the releases, one xdist group (one worker, one workspace) each."""
    return pytest.mark.parametrize("workspace", [pytest.param(name, marks=pytest.mark.xdist_group(f"megatron-{name}"))
                                                 for name in names or RELEASES], indirect=True)


@per_release()
def test_the_reference_trains_sliced_documents_with_the_release(workspace):
    run = workspace.reference()
    assert {version.split("+")[0] for version in run.release()} == {workspace.release.core}
    plans = plans_of(run)
    assert len(plans) == ITERATIONS and all(has_sliced_document(plan) for plan in plans)


@per_release()
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_rank(workspace, layout):
    run = workspace.run(layout, **LAYOUTS[layout])
    assert_same_training(run, workspace.reference())
    plans = plans_of(run)
    assert any(has_sliced_document(plan) for plan in plans)  # later slices read earlier ones' K/V
    assert {plan["parallel"].get("recompute", "none") for plan in plans} == {PLANNED_RECOMPUTE[layout]}
    if layout == "dp2-pp2":  # the last backward unit grows, then shrinks: overlapped grad reduce survives it
        assert [[len(replica["backward_units"][-1]) for replica in plan["replicas"]] for plan in plans] == [
            [count] * 2 for count in LAST_UNITS]
    if layout == "vpp2":  # tasks (kind, unit, chunk): Megatron's vp_stage chunks, one planner iterator
        assert all(plan["parallel"].get("vpp") == 2 for plan in plans)
        assert all(len(task) == 3 for plan in plans for replica in plan["replicas"]
                   for order in replica["stage_orders"] for task in order)


@per_release()
def test_resume_matches_the_unbroken_run(workspace):
    """Saved at iteration 2 (--exit-interval saves, then stops) and started again from it."""
    saved = workspace.root / "checkpoint"
    workspace.run("first-two", extra=["--save", str(saved), "--save-interval", "2", "--exit-interval", "2"])
    resumed = workspace.run("resumed", initial=False, extra=["--load", str(saved)])
    whole = workspace.reference()
    assert sorted(resumed.iterations()) == [3]
    assert relative_difference(resumed.losses, whole.losses[2:]) <= harness.RELATIVE
    assert relative_difference(resumed.grad_norms, whole.grad_norms[2:]) <= harness.RELATIVE


@per_release()
def test_bf16_matches_fp32(workspace):
    run = workspace.run("bf16", extra=["--bf16"])
    reference = workspace.reference()
    assert relative_difference(run.losses, reference.losses) < 5e-3
    assert relative_difference(run.grad_norms, reference.grad_norms) < 3e-2


@per_release()
def test_a_model_built_without_the_sliced_attention_stops_before_training(workspace):
    """The model builder left alone (SLIMPACK_TEST_WITHOUT_MODEL_SEAM, launch.py): Megatron's own
    attention is built, and the first SlimPack step refuses it by name, not an assertion deep in
    megatron-core or a model trained without its KV prefix."""
    with pytest.raises(harness.HarnessError) as failure:
        harness.train(workspace.script, workspace.prefix, workspace.root / "without-seam", split=SPLIT,
                      release=workspace.release, train_iters=1, extra=BASE,
                      env={"SLIMPACK_TEST_WITHOUT_MODEL_SEAM": "1"})
    message = str(failure.value)
    assert "SlimPackInstallError" in message and "does not run SlimPack's sliced attention" in message
    assert "core_attention is DotProductAttention" in message
    assert "iteration        1/" not in message  # stopped before the first step


@per_release()
def test_the_transformer_engine_layer_spec_carries_the_sliced_attention(workspace):
    result = subprocess.run([sys.executable, str(harness.HERE / "te_spec.py")], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": harness.python_path(workspace.release)}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    spec = json.loads(result.stdout.strip().splitlines()[-1])
    assert spec["before"] == "StandInTE_core_attention"  # the release's TE spec, with TE's attention
    assert spec["sliced"], spec
    # the rest of the TE layer is the release's own
    assert spec["linear_qkv"].startswith("StandInTE_") and spec["linear_proj"].startswith("StandInTE_")
    # both norms fused into the next linear layer: `--recompute-modules layernorm` re-runs nothing there,
    # and the planner prices it so (megatron.args._priced_modules)
    assert spec["input_layernorm"] == spec["pre_mlp_layernorm"] == "IdentityOp"


def test_every_release_is_a_supported_one():
    from megatron_slimpack.megatron.args import NEWEST_TESTED_MCORE, SUPPORTED_MCORE, parse_version

    versions = [parse_version(release.core) for release in RELEASES.values()]
    assert sorted({v[:2] for v in versions}) == sorted(SUPPORTED_MCORE)
    assert max(versions) == NEWEST_TESTED_MCORE
