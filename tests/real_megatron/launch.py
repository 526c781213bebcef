"""Test-only entry point, run by `torch.distributed.run` once per rank:

    python -m torch.distributed.run --nproc-per-node N launch.py SCRATCH/pretrain_gpt.py <megatron flags>

It applies the CPU shim (cpu_shim.py), puts a recorder on three calls, and runs the patched
`pretrain_gpt.py` as `__main__`: the real Megatron-LM trainer, unchanged, with SlimPack's patch.

The recorder (directory `$SLIMPACK_TEST_RECORD`, one JSON-lines file per rank) writes what the
trainer's own log rounds off or never shows:
  * `train_step`: each iteration's reduced losses and grad norm at full precision;
  * `PlannedBatch.token_source`: every token range the runtime read for a sample, with the ids;
  * the first SlimPack step: this rank's model weights before any update (`weights.rank<R>.pt`);
  * at start: the megatron-core version and the `megatron.training` file the process imported.
All three wrap the real functions and return what they return.

`SLIMPACK_TEST_WITHOUT_MODEL_SEAM=1` leaves the model builder alone (install() finds no builder
module), as on a release whose way of building the model the plugin does not know: the run must
stop before its first step (hooks.check_sliced_model).

`SLIMPACK_TEST_LAST_BACKWARD_UNITS=3,5,2` (inline planning, no virtual stages): step i's plan has
its last backward unit widened to the i-th count of MicroPacks (cycling), the units before it as
planned, stage orders rebuilt as Megatron's 1F1B. Megatron's overlapped grad reduce counts
gradient hooks per backward call, so a last unit that grows and shrinks between steps is what it
must survive; the planner picks such units on real clusters, rarely on this tiny model.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cpu_shim  # noqa: E402


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Recorder:
    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.file = open(directory / f"rank{_rank()}.jsonl", "a", buffering=1)
        self.weights_saved = False

    def write(self, **record) -> None:
        self.file.write(json.dumps(record) + "\n")


def _install_recorder(recorder: _Recorder) -> None:
    import megatron.core.package_info
    from megatron.training import training

    recorder.write(kind="release", megatron_core=megatron.core.package_info.__version__,
                   training=training.__file__)

    from megatron_slimpack.megatron import data, hooks

    train_step = training.train_step

    def recorded_train_step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        losses, skipped, grad_norm = result[0], result[1], result[5]
        recorder.write(kind="iteration", iteration=int(training.get_args().curr_iteration) + 1,
                       losses={k: float(v) for k, v in losses.items()}, skipped=int(skipped),
                       grad_norm=None if grad_norm is None else float(grad_norm))
        return result

    training.train_step = recorded_train_step

    token_source = data.PlannedBatch.token_source

    def recorded_token_source(self, corpus):
        source = token_source(self, corpus)
        step = self.step
        read = source.tokens

        def tokens(sample_id, start, end):
            ids = read(sample_id, start, end)
            recorder.write(kind="tokens", step=int(step), sample=int(sample_id), start=int(start), end=int(end),
                           ids=[int(t) for t in ids])
            return ids

        source.tokens = tokens
        return source

    data.PlannedBatch.token_source = recorded_token_source

    forward_backward = hooks.slimpack_forward_backward_func

    def recorded_forward_backward(*, model, **kwargs):
        if not recorder.weights_saved:
            chunks = model if isinstance(model, (list, tuple)) else [model]
            inner = chunks[0]
            while hasattr(inner, "module"):
                inner = inner.module
            torch.save({k: v.detach().clone() for k, v in inner.state_dict().items() if torch.is_tensor(v)},
                       recorder.directory / f"weights.rank{_rank()}.pt")
            recorder.weights_saved = True
        return forward_backward(model=model, **kwargs)

    hooks.slimpack_forward_backward_func = recorded_forward_backward


def _widen_last_backward_units(counts: list[int]) -> None:
    import itertools

    from megatron_slimpack.megatron import data
    from megatron_slimpack.planner.orders import stage_orders

    plan_batch = data.StrategyPlanFunction.__call__
    steps = itertools.count()

    def widened(self, batch):
        plan = plan_batch(self, batch)
        count = counts[next(steps) % len(counts)]
        pp = plan.parallel.pp
        for replica in plan.replicas:
            units = replica.backward_units
            if len(units) < count:
                continue
            replica.backward_units = [*units[:len(units) - count], [mp for unit in units[-count:] for mp in unit]]
            warmups = [min(pp - stage - 1, len(replica.forward_units)) for stage in range(pp)]
            replica.stage_orders = stage_orders(replica.forward_units, replica.backward_units, warmups)
        return plan.validate()

    data.StrategyPlanFunction.__call__ = widened


def main() -> None:
    script = Path(sys.argv[1]).resolve()
    torch.set_num_threads(1)
    cpu_shim.apply()
    if os.environ.get("SLIMPACK_TEST_WITHOUT_MODEL_SEAM"):
        from megatron_slimpack.megatron import hooks

        hooks._model_builder_module = lambda version: None
    if os.environ.get("SLIMPACK_TEST_LAST_BACKWARD_UNITS"):
        _widen_last_backward_units([int(n) for n in os.environ["SLIMPACK_TEST_LAST_BACKWARD_UNITS"].split(",")])
    if os.environ.get("SLIMPACK_TEST_RECORD"):
        _install_recorder(_Recorder(Path(os.environ["SLIMPACK_TEST_RECORD"])))
    sys.argv = [str(script)] + sys.argv[2:]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
