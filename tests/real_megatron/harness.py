"""Run Megatron-LM's real trainer on CPU from a test (see README.md beside this file).

    release = RELEASES["0.19"]                       # megatron-core wheel + the tag's trainer extract
    checkout = patched_checkout(tmp, release)        # scratch pretrain_gpt.py + SlimPack's patch
    prefix = build_dataset(tmp / "data", documents)  # a Megatron indexed dataset (megatron-core's writer)
    run = train(checkout, prefix, tmp / "run", nproc=2, release=release,
                extra=["--tensor-model-parallel-size", "2"])
    run.losses, run.grad_norms                       # per iteration, full precision

Each supported release is a megatron-core wheel and the trainer (`pretrain_gpt.py` and the
`megatron/` packages the wheel lacks) of the matching Megatron-LM tag in `../shared/megatron-lm/`,
never copied into the project. 0.16 is the venv's own megatron-core; the later wheels are
installed by `make test` into `.venv/megatron-core/<version>/` and put first on the trainer's
`PYTHONPATH`. `SLIMPACK_MEGATRON_LM` overrides the folder holding the tags' extracts.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from megatron_slimpack.runtime.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TRAINERS = Path(os.environ.get("SLIMPACK_MEGATRON_LM", ROOT.parent / "shared" / "megatron-lm"))
WHEELS = ROOT / ".venv" / "megatron-core"


@dataclass(frozen=True)
class Release:
    """One supported Megatron-LM release: the megatron-core wheel and the tag whose trainer runs it."""

    core: str  # megatron-core version, e.g. "0.19.2"
    tag: str  # the Megatron-LM tag whose trainer extract is in TRAINERS
    venv: bool = False  # the venv's own megatron-core (no separate install)

    @property
    def name(self) -> str:
        return ".".join(self.core.split(".")[:2])

    def trainer(self) -> Path:
        path = TRAINERS / self.tag
        if not (path / "pretrain_gpt.py").is_file():
            raise HarnessError(
                f"Megatron-LM's trainer is not at {path}: the real-trainer tests need ../shared/megatron-lm/{self.tag} "
                "beside the checkout (or SLIMPACK_MEGATRON_LM naming the folder that holds it)")
        return path

    def site(self) -> Optional[Path]:
        """The folder holding this release's `megatron/core` (None: the venv's own)."""
        if self.venv:
            import megatron.core.package_info as info

            if info.__version__ != self.core:
                raise HarnessError(f"the venv has megatron-core {info.__version__}, the tests expect {self.core}")
            return None
        path = WHEELS / self.core
        if not (path / "megatron" / "core" / "package_info.py").is_file():
            raise HarnessError(
                f"megatron-core {self.core} is not installed at {path}: `make test` installs it (pip install --no-deps "
                f"--ignore-requires-python megatron-core=={self.core} --target {path})")
        return path

    def package_info(self) -> Path:
        site = self.site()
        if site is None:
            import megatron.core.package_info as info

            return Path(info.__file__)
        return site / "megatron" / "core" / "package_info.py"


# The releases the plugin supports, each trained through its own trainer. 0.19.2's trainer is the
# core_v0.19.0 extract: the 0.19.2 wheel's megatron/training is the same code.
RELEASES = {release.name: release for release in (
    Release("0.16.1", "core_v0.16.1", venv=True), Release("0.17.1", "core_v0.17.1"),
    Release("0.18.2", "core_v0.18.2"), Release("0.19.2", "core_v0.19.0"))}
DEFAULT = RELEASES["0.16"]
# NullTokenizer adds one id (end of document): 511 + 1 = 512 is a multiple of Megatron's vocabulary
# padding (128 x tp) at tp 1 and 2, so every layout has the same output layer.
VOCAB_SIZE = 511
SEQ_LENGTH = 512

# The tiny Llama-style GPT every run trains (fp32, dropout 0, CPU-only flags from the README of
# ../shared/megatron-lm). Iteration counts, batch and parallelism come from each test.
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2",
    "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", "4096",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--init-method-std", "0.05",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB_SIZE),
    "--micro-batch-size", "1", "--global-batch-size", "8",
    "--lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0", "--clip-grad", "0",
    "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
    "--no-persist-layer-norm", "--distributed-backend", "gloo",
]
# SlimPack's own plans (no fixed-grouping floor), priced for the CPU they run on: these runs test
# its schedules against one rank.
# The test corpora (`random_documents`: up to 600 tokens) hold documents longer than SEQ_LENGTH:
# cut at it, as Megatron's own packing does.
SLIMPACK_FLAGS = ["--calculate-per-token-loss", "--slimpack", "--slimpack-plan-ahead", "0",
                  "--no-slimpack-fixed-grouping-floor", "--slimpack-hardware", "cpu",
                  "--slimpack-solver-deterministic-limit", "0.5", "--slimpack-solver-time-limit", "30",
                  "--slimpack-long-documents", "split"]


class HarnessError(RuntimeError):
    pass


def megatron_lm(release: Release = DEFAULT) -> Path:
    """The trainer extract of `release` (a clear error when ../shared/megatron-lm lacks it)."""
    return release.trainer()


def patched_checkout(directory: Path, release: Release = DEFAULT) -> Path:
    """A scratch copy of the release's pretrain_gpt.py with SlimPack's patch applied by
    scripts/apply_patches.sh (which reads the version from megatron/core/package_info.py: the
    release's wheel's)."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(release.trainer() / "pretrain_gpt.py", directory / "pretrain_gpt.py")
    info = directory / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(release.package_info(), info)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), str(directory)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise HarnessError(f"apply_patches.sh failed:\n{result.stdout}{result.stderr}")
    shutil.rmtree(directory / "megatron")  # only the patched script stays: megatron comes from the wheel + shared/
    return directory / "pretrain_gpt.py"


def python_path(release: Release) -> str:
    """The trainer's import path: the release's wheel first (its megatron/core and, from 0.17,
    megatron/training), the 3.11 shim for 0.19's `typing.override`, the tag's extract (the
    script and the megatron packages no wheel ships), the project."""
    site = release.site()
    paths = [*([str(site)] if site else []), str(HERE / "site"), str(release.trainer()), str(ROOT),
             os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(paths)


def build_dataset(prefix: Path, documents: Sequence[Sequence[int]]) -> Path:
    """A Megatron indexed dataset (PREFIX.bin/.idx), one sequence per document."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for document in documents:
        builder.add_item(torch.tensor(list(document), dtype=torch.int32))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def random_documents(count: int = 300, low: int = 5, high: int = 600, seed: int = 0) -> list[list[int]]:
    """`count` documents of `low`..`high` tokens; ids avoid the tokenizer's end-of-document id."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high + 1, size=count)
    return [rng.integers(0, VOCAB_SIZE - 1, size=int(n)).tolist() for n in lengths]


@dataclass
class TrainRun:
    """What one trainer run left: per-iteration figures (from the recorder), the token reads,
    the initial weights and the log."""

    directory: Path
    log: str
    records: list[dict] = field(default_factory=list)

    def iterations(self) -> dict[int, dict]:
        """iteration -> {'lm loss', 'grad norm'} (the loss from the last pipeline stage)."""
        out: dict[int, dict] = {}
        for record in self.records:
            if record["kind"] != "iteration":
                continue
            entry = out.setdefault(record["iteration"], {})
            if "lm loss" in record["losses"]:
                entry["lm loss"] = record["losses"]["lm loss"]
            if record["grad_norm"] is not None:
                entry["grad norm"] = record["grad_norm"]
        return out

    @property
    def losses(self) -> list[float]:
        return [v["lm loss"] for _, v in sorted(self.iterations().items())]

    @property
    def grad_norms(self) -> list[float]:
        return [v["grad norm"] for _, v in sorted(self.iterations().items())]

    def release(self) -> set[str]:
        """The megatron-core versions the run's processes imported."""
        return {r["megatron_core"] for r in self.records if r["kind"] == "release"}

    def token_reads(self) -> list[dict]:
        return [r for r in self.records if r["kind"] == "tokens"]

    def plans(self) -> list[Path]:
        return sorted((self.directory / "plans").glob("plan_step*.json"))

    def weights(self, rank: int = 0):
        import torch

        return torch.load(self.directory / "record" / f"weights.rank{rank}.pt")


def train(script: Path, data_prefix: Path, directory: Path, *, nproc: int = 1, extra: Sequence[str] = (),
          train_iters: int = 4, split: str = "90,10,0", slimpack: bool = True,
          timeout_s: float = 600.0, env: Optional[dict] = None, release: Release = DEFAULT) -> TrainRun:
    """Run pretrain_gpt.py under torch.distributed.run with `nproc` gloo ranks; raise with the log
    on failure."""
    directory.mkdir(parents=True, exist_ok=True)
    record = directory / "record"
    if record.exists():
        shutil.rmtree(record)
    flags = [*MODEL_FLAGS, "--train-iters", str(train_iters), "--data-path", str(data_prefix), "--split", split,
             "--data-cache-path", str(directory / "cache")]
    if slimpack:
        flags += [*SLIMPACK_FLAGS, "--slimpack-dump-plans", str(directory / "plans")]
    flags += list(extra)
    environment = {**os.environ, "SLIMPACK_TEST_RECORD": str(record), "OMP_NUM_THREADS": "1",
                   "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                   "PYTHONPATH": python_path(release),
                   **(env or {})}
    for _attempt in range(3):
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-port", str(free_port()), str(HERE / "launch.py"), str(script), *flags]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=environment,
                                    cwd=directory)
        except subprocess.TimeoutExpired as error:
            raise HarnessError(
                f"the trainer did not finish in {timeout_s} s:\n{_tail(error.stdout)}{_tail(error.stderr)}") from error
        log = result.stdout + result.stderr
        if not _lost_its_port(result.returncode, log):
            break
    (directory / "log.txt").write_text(log)
    if result.returncode != 0:
        raise HarnessError(f"the trainer failed (exit {result.returncode}):\n{_tail(log, 12000)}")
    records = []
    for path in sorted(record.glob("rank*.jsonl")):
        rank = int(path.stem[4:])
        records += [{**json.loads(line), "rank": rank} for line in path.read_text().splitlines()]
    return TrainRun(directory, log, records)


def _tail(text, limit: int = 6000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-limit:]


def _lost_its_port(returncode: int, log: str) -> bool:
    """The launcher's rendezvous found its port taken between our choice and its bind (another test
    process took it): nothing ran yet, so a new port is a fair retry."""
    return returncode != 0 and "EADDRINUSE" in log and "rendezvous" in log


# ---- comparing runs ---------------------------------------------------------------------------
RELATIVE = 1e-5  # fp32 runs of the same training: loss and grad norm per iteration


def relative_difference(a, b) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def assert_same_training(run: TrainRun, reference: TrainRun, tolerance: float = RELATIVE) -> None:
    """Both runs' lm loss and grad norm agree at every iteration (three or more)."""
    assert len(run.losses) == len(reference.losses) >= 3
    assert len(run.grad_norms) == len(reference.grad_norms)
    loss, norm = (relative_difference(run.losses, reference.losses),
                  relative_difference(run.grad_norms, reference.grad_norms))
    assert loss <= tolerance and norm <= tolerance, (
        f"lm loss {run.losses} vs {reference.losses} (rel {loss:.2e}); grad norm {run.grad_norms} vs "
        f"{reference.grad_norms} (rel {norm:.2e})")


def plans_of(run: TrainRun) -> list[dict]:
    return [json.loads(path.read_text()) for path in run.plans()]


def has_sliced_document(plan: dict) -> bool:
    slices = [s for replica in plan["replicas"] for micropack in replica["micropacks"] for s in micropack]
    return any(s[1] > 0 for s in slices)
