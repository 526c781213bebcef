"""The plugin inside Megatron-LM's real trainer (core_v0.16.1, `../shared/megatron-lm`), on CPU:
the strategies, layouts and data paths beyond what tests/test_megatron_releases.py checks for every
release.

Every test drives `pretrain_gpt.py` -> `pretrain()` -> `train()` with SlimPack's patch applied
(tests/real_megatron/: harness, CPU shim, recorder) and compares what the trainer computed:
per-iteration lm loss and grad norm (fp32, dropout 0, 4 iterations), against the DP=1 PP=1
`--slimpack` run on the same global batches and the same initial weights (every run loads one
checkpoint with `--finetune --no-load-optim --no-load-rng`, since Megatron seeds each pipeline
stage differently). `--slimpack-max-micropack-tokens 128` makes the planner cut documents into
slices, so every layout runs sliced attention through the KV store.

Tests name the defect they guard: 1 gradients reduced twice, 3 `--split` ignored, 4 strategies
fed other documents' tokens, 5 the fp16 loss scale never applied, 6 wlb-llm's resume state
(2, recompute on sliced documents: tests/test_megatron_releases.py).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "real_megatron"))
import harness  # noqa: E402
from harness import RELATIVE, assert_same_training, has_sliced_document, plans_of, relative_difference  # noqa: E402

pytestmark = [pytest.mark.real_megatron, pytest.mark.slow]

SPLIT = "90,10,0"
NUM_DOCUMENTS = 300
TRAIN_DOCUMENTS = 270  # megatron-core's split of 300 sequences at 90,10,0
TRAIN_IDS = 400  # training documents use token ids below this; validation documents ids from it up
SLICED = ["--slimpack-max-micropack-tokens", "128"]
FOUR_LAYERS = ["--num-layers", "4"]  # pp=2 x vpp=2 needs a layer per virtual stage
VIRTUAL_STAGES = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
# The flags each initial checkpoint's model is built with (later flags win over harness.MODEL_FLAGS).
INITIAL_FLAGS = {"tied": [], "untied": ["--untie-embeddings-and-output-weights"], "four-layers": FOUR_LAYERS}


class Workspace:
    """One patched checkout, datasets, initial checkpoints and the runs the tests share."""

    def __init__(self, root: Path):
        self.root = root
        self.script = harness.patched_checkout(root / "checkout")
        rng = np.random.default_rng(0)
        lengths = rng.integers(5, 601, size=NUM_DOCUMENTS)
        self.documents = [
            rng.integers(0 if i < TRAIN_DOCUMENTS else TRAIN_IDS,
                         TRAIN_IDS if i < TRAIN_DOCUMENTS else harness.VOCAB_SIZE - 1, size=int(n)).tolist()
            for i, n in enumerate(lengths)]
        self.prefix = harness.build_dataset(root / "data" / "documents", self.documents)
        self.runs: dict[str, harness.TrainRun] = {}

    def run(self, name: str, *, nproc: int = 1, extra=(), initial: str | None = "tied", data=None,
            **options) -> harness.TrainRun:
        """Run once per test run under `name`; `initial`: the checkpoint every comparison starts from."""
        if name not in self.runs:
            load = []
            if initial is not None:
                load = ["--load", str(self.initial(initial)), "--finetune", "--no-load-optim", "--no-load-rng"]
            self.runs[name] = harness.train(self.script, data or self.prefix, self.root / name, nproc=nproc,
                                            split=SPLIT, extra=[*SLICED, *load, *extra], **options)
        return self.runs[name]

    def initial(self, kind: str) -> Path:
        """A checkpoint after one DP=1 iteration: the common starting weights (tied or untied)."""
        extra = INITIAL_FLAGS[kind]
        directory = self.root / f"initial-{kind}"
        self.run(f"initial-{kind}", initial=None, train_iters=1,
                 extra=[*extra, "--save", str(directory), "--save-interval", "1"])
        return directory

    def reference(self):
        return self.run("reference")

    def dataset_tokens(self, document: int, start: int, end: int) -> list[int]:
        return self.documents[document][start:end]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    harness.megatron_lm()  # a clear error, not a skip, when ../shared/megatron-lm is missing
    return Workspace(tmp_path_factory.mktemp("real_megatron"))


# ---- layouts: the same training as DP=1 PP=1 ---------------------------------------------------
LAYOUTS = {
    # defect 1: DP=2 grad norm was exactly 2x (finalize_model_grads ran twice)
    "dp2": dict(nproc=2, extra=["--eval-interval", "2", "--eval-iters", "1"]),  # evaluation: Megatron's schedule
    "pp2-tied": dict(nproc=2, extra=["--pipeline-model-parallel-size", "2"]),
    "tp2": dict(nproc=2, extra=["--tensor-model-parallel-size", "2"]),
    # sequence parallelism: padded MicroPacks, SP norms' gradients summed by finalize_model_grads
    "tp2-sequence-parallel-pp2": dict(nproc=4, extra=["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                      "--pipeline-model-parallel-size", "2"]),
    "dp2-base-merge-2": dict(nproc=2, extra=["--slimpack-base-merge", "2"]),
    # planned ahead in the worker process (the other runs plan inline, --slimpack-plan-ahead 0)
    "dp2-planned-ahead-in-a-process": dict(nproc=2, extra=["--slimpack-plan-ahead", "2"]),
}


def test_the_reference_run_slices_documents(workspace):
    plans = plans_of(workspace.reference())
    assert len(plans) == 4 and all(has_sliced_document(plan) for plan in plans)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_one_rank(workspace, layout):
    run = workspace.run(layout, **LAYOUTS[layout])
    assert_same_training(run, workspace.reference())
    if layout == "dp2":
        assert run.log.count("validation loss") >= 2  # Megatron's own schedule on its validation iterator
    if layout == "dp2-base-merge-2":
        assert all(any(len(r["dp_ranks"]) == 2 for r in plan["replicas"]) for plan in plans_of(run))


def test_untied_embeddings_with_two_stages(workspace):
    untied = ["--untie-embeddings-and-output-weights"]
    reference = workspace.run("untied-dp1", initial="untied", extra=untied)
    run = workspace.run("untied-pp2", nproc=2, initial="untied", extra=[*untied, "--pipeline-model-parallel-size", "2"])
    assert_same_training(run, reference)


def test_virtual_stages_with_overlapped_parameter_gathers(workspace):
    """The distributed optimizer with --overlap-param-gather under interleaving:
    Megatron hands the schedule one param_sync_func per chunk (aligned gathers), which it launches
    chunk by chunk (`_ParamSync`); DDP's forward pre-hooks wait on them. PP=2 x vpp=2 x DP=2
    trains like DP=1 PP=1."""
    reference = workspace.run("four-layers-dp1", initial="four-layers", extra=FOUR_LAYERS, train_iters=3)
    run = workspace.run("vpp2-dp2-overlap-param-gather", nproc=4, initial="four-layers", train_iters=3,
                        extra=[*FOUR_LAYERS, *VIRTUAL_STAGES, "--use-distributed-optimizer", "--overlap-grad-reduce",
                               "--overlap-param-gather"])
    assert_same_training(run, reference)


def test_a_variable_count_strategy_trains_with_virtual_stages(workspace):
    """Megatron's interleaved 1F1B takes a multiple of pp micro-batches per step; sorted's count
    follows the batch (9 on this data), which stopped the run at the first such step
    (a PlanError). Its packer now splits micro-batches (whole documents, nothing padded), so PP=2 x
    vpp=2 trains like DP=1 PP=1 with the same strategy. (bfd and wlb-llm share the code; their
    counts here are multiples of 2 already: `tests/test_interleaved.py` covers them.)"""
    flags = ["--slimpack-strategy", "sorted", *FOUR_LAYERS]
    reference = workspace.run("four-layers-sorted-dp1", initial="four-layers", extra=flags, train_iters=3)
    run = workspace.run("vpp2-sorted", nproc=2, initial="four-layers", train_iters=3, extra=[*flags, *VIRTUAL_STAGES])
    plans = plans_of(run)
    counts = [len(replica["micropacks"]) for plan in plans for replica in plan["replicas"]]
    assert counts and all(count % 2 == 0 for count in counts)
    assert any(plan["metadata"]["num_sequences"] % 2 for plan in plans)  # a step that needed a split
    assert_same_training(run, reference)


def test_dp_merge_outlier(workspace):
    """Documents of up to 2048 tokens in batches of 2 x 2048: DP=2 shares the heaviest with DP-Merge."""
    rng = np.random.default_rng(1)
    lengths = [*rng.integers(1500, 2049, size=12), *rng.integers(5, 200, size=100)]
    documents = [rng.integers(0, TRAIN_IDS, size=int(n)).tolist() for n in rng.permutation(lengths)]
    prefix = harness.build_dataset(workspace.root / "data-outliers" / "documents", documents)
    long_batches = ["--seq-length", "2048", "--global-batch-size", "2", "--slimpack-max-micropack-tokens", "512"]
    reference = workspace.run("outliers-dp1", data=prefix, extra=long_batches)
    run = workspace.run("outliers-dp2", nproc=2, data=prefix, extra=long_batches)
    merged = [plan for plan in plans_of(run) if any(r.get("dp_ranks") == [0, 1] for r in plan["replicas"])]
    assert merged, "no step of the DP=2 run shared an outlier through DP-Merge: the test lost its subject"
    assert_same_training(run, reference)


def test_gradient_clipping(workspace):
    clip = ["--clip-grad", "0.2"]
    reference = workspace.run("clip-dp1", extra=clip)
    run = workspace.run("clip-dp2", nproc=2, extra=clip)
    assert min(reference.grad_norms) > 0.2, "the clip must be active in every iteration"
    # Adam makes clipping a small change of the update, but one beyond the comparison's tolerance
    assert relative_difference(reference.losses[1:], workspace.reference().losses[1:]) > 2 * RELATIVE
    assert_same_training(run, reference)


def test_fp16_matches_fp32(workspace):
    """defect 5: under --fp16 the optimizer unscaled gradients that were never scaled (grad norm
    1/4096 of fp32's at this initial scale). (--bf16: tests/test_megatron_releases.py.)"""
    run = workspace.run("fp16", extra=["--fp16", "--initial-loss-scale", "4096"])
    reference = workspace.reference()
    assert relative_difference(run.losses, reference.losses) < 5e-3
    assert relative_difference(run.grad_norms, reference.grad_norms) < 3e-2


def test_the_patch_changes_nothing_without_slimpack(workspace):
    """The patched pretrain_gpt.py without --slimpack trains exactly as Megatron-LM's own."""
    runs = [harness.train(script, workspace.prefix, workspace.root / name, split=SPLIT, slimpack=False, train_iters=3)
            for name, script in (("stock", harness.megatron_lm() / "pretrain_gpt.py"),
                                 ("patched-off", workspace.script))]
    assert runs[0].losses == runs[1].losses and runs[0].grad_norms == runs[1].grad_norms
    assert not runs[1].plans()


# ---- the loss itself, against documents run whole ----------------------------------------------
def test_first_iteration_loss_equals_documents_run_whole(workspace, megatron_cpu):
    """The DP=1 run's first lm loss = an independent megatron-core GPTModel (no SlimPack code)
    run on each document of the first plan whole, from the weights the trainer started with."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_slimpack.runtime.model import tiny_config

    workspace.initial("tied")
    run = workspace.runs["initial-tied"]
    plan = plans_of(run)[0]
    config = tiny_config(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=128)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=harness.VOCAB_SIZE + 1,
                     max_sequence_length=4096, position_embedding_type="rope",
                     share_embeddings_and_output_weights=True)
    missing, unexpected = model.load_state_dict(run.weights(), strict=False)
    assert not unexpected and all("_extra_state" in key for key in missing)
    model.eval()
    loss_sum, tokens = 0.0, 0
    lengths = {sample_id: length for sample_id, length in plan["samples"]}
    with torch.no_grad():
        for sample_id, (document, offset) in zip(lengths, plan["sample_sources"]):
            ids = torch.tensor(workspace.dataset_tokens(document, offset, offset + lengths[sample_id]))
            if len(ids) < 2:
                continue
            losses = model(ids[None, :-1], torch.arange(len(ids) - 1)[None], None, labels=ids[None, 1:])
            loss_sum += float(losses.double().sum())
            tokens += len(ids) - 1
    assert relative_difference(run.losses[0], loss_sum / tokens) <= RELATIVE


# ---- checkpoints ----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["wlb-llm"])
def test_resume_matches_the_uninterrupted_run(workspace, strategy):
    """defect 6: wlb-llm's delayed documents were lost on resume (steps 4-5 differed). (SlimPack's
    own strategy: tests/test_megatron_releases.py, for every release.)"""
    flags = ["--slimpack-strategy", strategy]
    whole = workspace.reference() if strategy == "slimpack" else workspace.run(f"{strategy}-whole", extra=flags)
    saved = workspace.root / f"{strategy}-checkpoint"
    # A job stopped after iteration 2 (Megatron's --exit-interval saves, then exits) and started again.
    workspace.run(f"{strategy}-first-half",
                  extra=[*flags, "--save", str(saved), "--save-interval", "2", "--exit-interval", "2"])
    resumed = workspace.run(f"{strategy}-resumed", initial=None, extra=[*flags, "--load", str(saved)])
    assert sorted(resumed.iterations()) == [3, 4]
    assert relative_difference(resumed.losses, whole.losses[2:]) <= RELATIVE
    assert relative_difference(resumed.grad_norms, whole.grad_norms[2:]) <= RELATIVE


# ---- data: the training split, and exactly the planned documents' tokens ------------------------
def test_training_never_reads_validation_documents(workspace):
    """defect 3: the planner sampled every document under the prefix, --split ignored."""
    run = workspace.reference()
    reads = run.token_reads()
    assert reads and max(max(read["ids"], default=0) for read in reads) < TRAIN_IDS
    for plan in plans_of(run):
        assert max(document for document, _ in plan["sample_sources"]) < TRAIN_DOCUMENTS


def plans_by_step(run) -> dict[int, dict]:
    return {int(path.stem.removeprefix("plan_step")): json.loads(path.read_text()) for path in run.plans()}


def check_tokens(workspace, run) -> None:
    """Every token range the runtime read is the dataset's at the plan's (document, offset), and
    every sample of every step is read whole, each position once."""
    plans = plans_by_step(run)
    by_step: dict[int, list[dict]] = {}
    for read in run.token_reads():
        by_step.setdefault(read["step"], []).append(read)
    assert sorted(by_step) == sorted(plans)
    for step, reads in by_step.items():
        plan = plans[step]
        length = {sample_id: n for sample_id, n in plan["samples"]}
        source = dict(zip(length, map(tuple, plan["sample_sources"])))
        covered = {sample_id: np.zeros(n, dtype=int) for sample_id, n in length.items()}
        for read in reads:
            document, offset = source[read["sample"]]
            stop = min(read["end"] + 1, length[read["sample"]])
            assert read["ids"] == workspace.dataset_tokens(document, offset + read["start"], offset + stop), (
                f"step {step} sample {read['sample']} [{read['start']}, {read['end']}) got other tokens")
            covered[read["sample"]][read["start"]:read["end"]] += 1
        for sample_id, counts in covered.items():
            assert (counts == 1).all(), f"step {step}: sample {sample_id} was not read exactly once per position"


STRATEGIES = ["slimpack", "slimpack-sym", "slimpack-nomerge", "megatron-fixed", "bfd", "sorted", "wlb-llm", "slimpipe"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_on_its_documents_tokens(workspace, strategy):
    """defect 4: megatron-fixed, slimpipe and wlb-llm renumber samples; the token source read a
    sample id as a batch index (75 of 96 slices got another document's tokens)."""
    if strategy == "slimpack":
        run = workspace.reference()
    elif strategy == "wlb-llm":
        run = workspace.run("wlb-llm-whole", extra=["--slimpack-strategy", "wlb-llm"])
    else:
        run = workspace.run(f"strategy-{strategy}", train_iters=2, extra=["--slimpack-strategy", strategy])
    check_tokens(workspace, run)


# ---- the planner worker process ----------------------------------------------------------------
def planner_worker_of(run_directory: Path) -> int | None:
    """The pid of the planner worker (a multiprocessing spawn child) of the trainer whose command
    line names `run_directory` (its --data-cache-path), or None while there is none."""
    def cmdline(pid) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return ""

    def parent(pid) -> int:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return 0

    for entry in Path("/proc").iterdir():
        command = cmdline(entry.name) if entry.name.isdigit() else ""
        if "spawn_main" in command and "resource_tracker" not in command:
            if str(run_directory) in cmdline(parent(entry.name)):
                return int(entry.name)
    return None


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_failed_planner_worker_stops_every_rank_within_a_minute(workspace, how):
    """The planner worker process SIGKILLed, or stopped (SIGSTOP: alive, sending nothing) after
    the first iteration of a DP=2 run planned ahead in it: the source rank raises SlimPack's
    PlannerError naming the worker (at once when killed, after --slimpack-planner-timeout, 30 s here, when
    hung), and the launcher stops the other rank; nothing waits forever."""
    directory = workspace.root / f"planner-{how}"
    outcome: dict = {}

    def train():
        try:
            harness.train(workspace.script, workspace.prefix, directory, nproc=2, split=SPLIT, train_iters=500,
                          timeout_s=400,
                          extra=[*SLICED, "--slimpack-plan-ahead", "1", "--slimpack-planner-timeout", "30"])
        except harness.HarnessError as error:
            outcome["error"] = str(error)

    runner = threading.Thread(target=train, daemon=True)
    runner.start()
    first_iteration = directory / "record" / "rank0.jsonl"
    deadline = time.monotonic() + 300
    pid = None
    while time.monotonic() < deadline and runner.is_alive():
        if first_iteration.is_file() and '"iteration"' in first_iteration.read_text():
            pid = planner_worker_of(directory)
            if pid is not None:
                break
        time.sleep(0.2)
    assert pid is not None, f"no planner worker found while the run trained: {outcome}"
    os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    signalled = time.monotonic()
    runner.join(120)
    stopped_after = time.monotonic() - signalled
    if how == "hung":
        try:
            os.kill(pid, signal.SIGKILL)  # never leave a stopped process behind
        except ProcessLookupError:
            pass
    assert not runner.is_alive(), "the trainer still runs two minutes after its planner worker failed"
    assert stopped_after < 60, f"the trainer stopped {stopped_after:.0f} s after its planner worker failed"
    error = outcome.get("error", "")
    expected = (f"planner worker process (pid {pid}) exited with code -9" if how == "killed"
                else f"planner worker process (pid {pid}) sent no plan in 30 s")
    assert "PlannerError" in error and expected in error, error[-3000:]


def test_strategies_the_runtime_cannot_run_are_refused():
    from megatron_slimpack.megatron.args import STRATEGY_CHOICES, SlimPackArgumentError, validate_slimpack_args
    from megatron_slimpack.planner.strategies import strategy_names

    assert sorted(STRATEGY_CHOICES) == sorted(STRATEGIES)
    args = type("Args", (), dict(slimpack=True, calculate_per_token_loss=True,
                                 slimpack_strategy="megatron-hybrid-cp"))()
    refused = [name for name in strategy_names() if name not in STRATEGIES]
    assert refused, "megatron-hybrid-cp is registered for simulation and must be refused for training"
    for name in refused:
        args.slimpack_strategy = name
        with pytest.raises(SlimPackArgumentError, match=f"--slimpack-strategy {name!r}"):
            validate_slimpack_args(args)
