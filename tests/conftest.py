"""Shared test fixtures: megatron-core on CPU (one gloo process, or N spawned ones)."""
from __future__ import annotations

import pytest
import torch

from megatron_slimpack.plan import last_forward_needed
from megatron_slimpack.runtime.pipeline.timing import SavedBytesMeter
from megatron_slimpack.runtime.processes import SpawnError, free_port, spawn

torch.set_num_threads(1)


def init_megatron(rank: int = 0, world_size: int = 1, tp: int = 1, port: int | None = None, seed: int = 1234,
                  pp: int = 1) -> None:
    """gloo process group + megatron parallel state + CPU compatibility, in this process."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_slimpack.runtime import compat

    torch.set_num_threads(1)
    compat.apply()
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port or free_port()}", rank=rank, world_size=world_size
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)


@pytest.fixture(scope="session")
def megatron_cpu():
    """One-process megatron-core on CPU for the whole test run."""
    init_megatron()
    yield


# ---- N gloo processes -----------------------------------------------------------------------
def run_multiprocess(fn, world_size: int, *args, timeout_s: float = 120.0) -> None:
    """Run fn(rank, world_size, port, *args) in `world_size` spawned processes; fail the test with
    the failing rank's traceback, or name the ranks still running at the timeout."""
    try:
        spawn(fn, world_size, args, timeout_s=timeout_s)
    except SpawnError as error:
        pytest.fail(str(error))


# ---- runtime helpers: random plans, twin models, whole-document reference -------------------
def random_slicing(rng, length: int, max_slices: int) -> list[tuple[int, int]]:
    """Cut [0, length) into 1..max_slices non-empty contiguous pieces."""
    count = rng.randint(1, min(max_slices, length))
    cuts = sorted(rng.sample(range(1, length), count - 1)) if count > 1 else []
    bounds = [0, *cuts, length]
    return list(zip(bounds[:-1], bounds[1:]))


def random_segmentation(rng, sequence: list[int]) -> list[list[int]]:
    """A random contiguous segmentation of `sequence` into non-empty units."""
    units, current = [], []
    for item in sequence:
        current.append(item)
        if rng.random() < 0.5:
            units.append(current)
            current = []
    if current:
        units.append(current)
    return units


def random_stage_order(rng, replica) -> list[tuple[str, int]]:
    """A valid single-stage task order: a backward unit runs once its MicroPacks' forwards have."""
    needed = last_forward_needed(replica.forward_units, replica.backward_units).tolist()
    order, next_f, next_b = [], 0, 0
    while next_f < len(replica.forward_units) or next_b < len(replica.backward_units):
        can_b = next_b < len(replica.backward_units) and needed[next_b] < next_f
        if next_f < len(replica.forward_units) and (not can_b or rng.random() < 0.5):
            order.append(("F", next_f))
            next_f += 1
        else:
            order.append(("B", next_b))
            next_b += 1
    return order


def random_plan(rng, slicings: dict[int, list[tuple[int, int]]], num_micropacks: int):
    """Spread each document's slices over MicroPacks (in order, never two in one), then cut
    random asymmetric forward/backward units. Returns a validated `Plan`."""
    from megatron_slimpack.plan import MicroPack, Plan, ReplicaPlan, Sample, Slice
    from megatron_slimpack.specs import ParallelConfig

    packs: list[list] = [[] for _ in range(num_micropacks)]
    for sample_id, pieces in slicings.items():
        slots = sorted(rng.sample(range(num_micropacks), len(pieces)))
        for slot, (start, end) in zip(slots, pieces):
            packs[slot].append(Slice(sample_id, start, end))
    micropacks = [MicroPack(rng.sample(p, len(p))) for p in packs if p]
    replica = ReplicaPlan(micropacks, [], [], [], dp_ranks=[0])
    replica.forward_units = random_segmentation(rng, list(range(len(micropacks))))
    replica.backward_units = random_segmentation(rng, replica.backward_sequence())
    replica.stage_orders = [random_stage_order(rng, replica)]
    samples = [Sample(sid, pieces[-1][1]) for sid, pieces in slicings.items()]
    plan = Plan([replica], samples, ParallelConfig(), max(s.length for s in samples), "test")
    return plan.validate()


def twin_models(config, *, vocab_size: int, max_len: int, position_embedding_type: str = "rope", seed: int = 0):
    """(SlimPack model, stock megatron-core GPTModel) with the same weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_slimpack.runtime.model import build_gpt_model

    torch.manual_seed(seed)
    sliced = build_gpt_model(config, vocab_size=vocab_size, max_sequence_length=max_len,
                             position_embedding_type=position_embedding_type, backend="torch")
    stock = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization), vocab_size=vocab_size,
                     max_sequence_length=max_len, position_embedding_type=position_embedding_type)
    stock.load_state_dict(sliced.state_dict())
    return sliced, stock


def whole_document_step(model, documents: dict[int, torch.Tensor], num_loss_tokens: int) -> float:
    """Reference: each document run whole (bshd, standard causal attention); per-token loss
    summed over all documents and divided once."""
    total = 0.0
    for ids in documents.values():
        n = len(ids)
        tokens = ids[None, :]
        labels = torch.cat([ids[1:], ids.new_zeros(1)])[None, :]
        mask = torch.ones(1, n)
        mask[0, -1] = 0
        loss = model(tokens, torch.arange(n)[None, :], None, labels=labels)
        loss_sum = (loss.float() * mask).sum()
        (loss_sum / num_loss_tokens).backward()
        total += loss_sum.item()
    return total / num_loss_tokens


def grads_of(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert got.keys() == expected.keys()
    worst = max(((g - expected[k]).norm() / expected[k].norm().clamp_min(1e-30)).item() for k, g in got.items())
    assert worst <= rtol, f"worst relative gradient error {worst:.2e} > {rtol:.0e}"


def SavedTensorMeter(model) -> SavedBytesMeter:
    """Bytes autograd saves for backward inside the context: unique storages, parameters excluded."""
    return SavedBytesMeter({p.untyped_storage().data_ptr() for p in model.parameters()})


def save_whole_document_reference(config, vocab_size: int, documents, num_loss_tokens: int, path,
                                  share_embeddings_and_output_weights: bool = False) -> float:
    """One whole-document step on a stock megatron-core GPTModel (single process): saves its weights,
    gradients and loss to `path` for spawned ranks to compare against; returns the loss. With tied
    embeddings the output layer has no weight of its own: its gradient is in the embedding's."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(0)
    stock = GPTModel(config, get_gpt_layer_local_spec(normalization=config.normalization), vocab_size=vocab_size,
                     max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=share_embeddings_and_output_weights)
    loss = whole_document_step(stock, documents, num_loss_tokens)
    torch.save({"state": stock.state_dict(), "loss": loss,
                "grads": {k: p.grad.detach().clone() for k, p in stock.named_parameters()}}, path)
    return loss


def with_virtual_stages(plan, vpp: int):
    """A copy of `plan` run with `vpp` model chunks per pipeline stage: same MicroPacks and units,
    every replica plan's (merge groups' too) stage orders Megatron's interleaved 1F1B over them."""
    import copy

    from megatron_slimpack.planner.orders import interleaved_orders

    plan = copy.deepcopy(plan)
    plan.parallel = plan.parallel.with_(vpp=vpp)
    for replica in plan.replicas:
        replica.stage_orders = interleaved_orders(replica.forward_units, replica.backward_units, plan.parallel.pp, vpp)
    return plan.validate()


@pytest.fixture(autouse=True)
def private_cache_dir(tmp_path_factory, monkeypatch):
    """Each test's own $XDG_CACHE_HOME: `slimpack compare` caches search results there, and a test
    must neither read what another (or the user's own runs) left nor write into the real home."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
