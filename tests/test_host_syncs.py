"""A training step waits on the device a constant number of times, however many documents,
slices, layers and MicroPacks it runs: every call that makes the host read a device tensor
(`item`, `tolist`, `cpu`, `numpy`, `bool`/`int`/`float`/`index` of a tensor,
`torch.cuda.synchronize`) drains the GPU's stream, so the runtime may make only a few per step."""
import collections
import contextlib
import json
import random
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import init_megatron, random_segmentation, random_stage_order, run_multiprocess

VOCAB = 64
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
MAX_SYNCS_PER_STEP = 4


class SyncCounter(TorchFunctionMode):
    """Counts tensor calls that read device memory on the host, by the line that made them."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and func is getattr(torch.Tensor, name, None):
            self.sites[f"{name} at {caller_outside_torch()}"] += 1
        return func(*args, **(kwargs or {}))

    def count_cuda_synchronize(self, *args, **kwargs):
        self.sites[f"torch.cuda.synchronize at {caller_outside_torch()}"] += 1

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def caller_outside_torch() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith(__file__):
            return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}"
    return "?"


def sliced_replica(rng: random.Random, sample_ids: range, slices_per_doc: int, num_micropacks: int,
                   doc_length: int, dp_ranks: list[int]):
    """The documents `sample_ids`, each cut into `slices_per_doc` equal slices; slice i of a
    document goes to one of the i-th group of MicroPacks, so every MicroPack holds slices and each
    document's slices run in order. Random asymmetric units and task order."""
    from megatron_slimpack.plan import MicroPack, ReplicaPlan, Slice

    group, step = num_micropacks // slices_per_doc, doc_length // slices_per_doc
    packs: list[list] = [[] for _ in range(num_micropacks)]
    for sid in sample_ids:
        for i in range(slices_per_doc):
            end = (i + 1) * step if i < slices_per_doc - 1 else doc_length
            packs[i * group + sid % group].append(Slice(sid, i * step, end))
    replica = ReplicaPlan([MicroPack(p) for p in packs], [], [], [], dp_ranks=dp_ranks)
    replica.forward_units = random_segmentation(rng, list(range(num_micropacks)))
    replica.backward_units = random_segmentation(rng, replica.backward_sequence())
    replica.stage_orders = [random_stage_order(rng, replica)]
    return replica


def documents_of(num_docs: int, doc_length: int) -> dict:
    return {sid: torch.randint(0, VOCAB, (doc_length,), generator=torch.Generator().manual_seed(sid))
            for sid in range(num_docs)}


def sliced_plan(num_docs: int, slices_per_doc: int, num_micropacks: int, doc_length: int = 24):
    """One replica plan of `num_docs` sliced documents (`sliced_replica`)."""
    from megatron_slimpack.plan import Plan, Sample
    from megatron_slimpack.specs import ParallelConfig

    rng = random.Random(num_docs * 1000 + slices_per_doc * 10 + num_micropacks)
    replica = sliced_replica(rng, range(num_docs), slices_per_doc, num_micropacks, doc_length, [0])
    plan = Plan([replica], [Sample(sid, doc_length) for sid in range(num_docs)], ParallelConfig(), doc_length,
                "test").validate()
    return plan, documents_of(num_docs, doc_length)


@contextlib.contextmanager
def counting_syncs():
    """A `SyncCounter` active over the block, `torch.cuda.synchronize` counted too."""
    counter, synchronize = SyncCounter(), torch.cuda.synchronize
    torch.cuda.synchronize = counter.count_cuda_synchronize
    try:
        with counter:
            yield counter
    finally:
        torch.cuda.synchronize = synchronize


def counted_step(plan, documents, num_layers: int, groups=None) -> SyncCounter:
    """One training step of a fresh tiny model over `plan`, its host syncs counted."""
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, slimpack_forward_backward
    from megatron_slimpack.runtime.model import build_gpt_model, tiny_config

    config = tiny_config(num_layers=num_layers, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    torch.manual_seed(0)
    model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=64, backend="torch")
    source = InMemoryTokenSource(documents)
    with counting_syncs() as counter:
        result = slimpack_forward_backward(model=model, plan=plan, token_source=source, kv_store=KVStore(),
                                           groups=groups)
    assert all(p.grad is not None for p in model.parameters())
    assert result.loss is not None
    return counter


def count_step_syncs(*, num_docs, slices_per_doc, num_micropacks, num_layers) -> SyncCounter:
    plan, documents = sliced_plan(num_docs, slices_per_doc, num_micropacks)
    assert len(plan.replicas[0].micropacks) == num_micropacks
    return counted_step(plan, documents, num_layers)


BASE = dict(num_docs=4, slices_per_doc=2, num_micropacks=4, num_layers=1)
DOUBLED = {
    "documents": dict(BASE, num_docs=8),
    "slices": dict(BASE, slices_per_doc=4),
    "micropacks": dict(BASE, num_micropacks=8),
    "layers": dict(BASE, num_layers=2),
    "everything": dict(num_docs=8, slices_per_doc=4, num_micropacks=8, num_layers=2),
}


def test_a_step_syncs_a_few_times(megatron_cpu):
    counter = count_step_syncs(**BASE)
    assert counter.total <= MAX_SYNCS_PER_STEP, f"{counter.total} host syncs per step: {dict(counter.sites)}"


@pytest.mark.parametrize("doubled", sorted(DOUBLED))
def test_syncs_do_not_grow_with_the_plan(megatron_cpu, doubled):
    base = count_step_syncs(**BASE)
    bigger = count_step_syncs(**DOUBLED[doubled])
    assert bigger.total == base.total, (f"doubling the {doubled}: {base.total} -> {bigger.total} host syncs per "
                                        f"step; {dict(bigger.sites)}")


# ---- DP-Merge: every member of a merge group, the group's MicroPacks shared -----------------
MERGE_DP = 2
MERGE_BASE = dict(BASE, merge_groups=1)
MERGE_DOUBLED = {**{name: dict(shape, merge_groups=1) for name, shape in DOUBLED.items()},
                 "merge groups": dict(MERGE_BASE, merge_groups=2),
                 "everything": dict(DOUBLED["everything"], merge_groups=2)}


def merged_plan(*, num_docs, slices_per_doc, num_micropacks, merge_groups, doc_length: int = 24):
    """`merge_groups` merge groups of all `MERGE_DP` ranks, each with `num_docs` sliced documents
    of its own (`sliced_replica`), then one whole document per rank in its own replica plan."""
    from megatron_slimpack.plan import MicroPack, Plan, ReplicaPlan, Sample, Slice
    from megatron_slimpack.specs import ParallelConfig

    rng = random.Random(num_docs * 1000 + slices_per_doc * 10 + num_micropacks + merge_groups * 7)
    everyone = list(range(MERGE_DP))
    replicas = [sliced_replica(rng, range(g * num_docs, (g + 1) * num_docs), slices_per_doc, num_micropacks,
                               doc_length, everyone) for g in range(merge_groups)]
    merged_docs = merge_groups * num_docs
    for rank in everyone:
        own = ReplicaPlan([MicroPack([Slice(merged_docs + rank, 0, doc_length)])], [[0]], [[0]], [], [rank])
        own.stage_orders = [[("F", 0), ("B", 0)]]
        replicas.append(own)
    num_docs_total = merged_docs + MERGE_DP
    plan = Plan(replicas, [Sample(sid, doc_length) for sid in range(num_docs_total)], ParallelConfig(dp=MERGE_DP),
                doc_length, "test").validate()
    return plan, documents_of(num_docs_total, doc_length)


def _merge_syncs_worker(rank, world_size, port, path):
    """Every shape's step on this member; its sync counts written to `path`.<rank>."""
    from megatron_slimpack.runtime import ScheduleGroups
    from megatron_slimpack.runtime.pipeline.merge import merge_groups

    init_megatron(rank, world_size, port=port)
    groups = ScheduleGroups.from_parallel_state(merge_groups=merge_groups(world_size))
    counts = {}
    for name, shape in {"base": MERGE_BASE, **MERGE_DOUBLED}.items():
        shape = dict(shape)
        num_layers = shape.pop("num_layers")
        plan, documents = merged_plan(**shape)
        counter = counted_step(plan, documents, num_layers, groups)
        counts[name] = {"total": counter.total, "sites": dict(counter.sites)}
    with open(f"{path}.{rank}", "w") as out:
        json.dump(counts, out)


@pytest.fixture(scope="module")
def merge_member_syncs(tmp_path_factory):
    """{rank: {shape: {"total", "sites"}}}: host syncs per step on every member of the merge group."""
    path = tmp_path_factory.mktemp("merge_syncs") / "counts"
    run_multiprocess(_merge_syncs_worker, MERGE_DP, str(path), timeout_s=300)
    return {rank: json.loads(open(f"{path}.{rank}").read()) for rank in range(MERGE_DP)}


@pytest.mark.slow
def test_a_merge_group_member_syncs_a_few_times(merge_member_syncs):
    for rank, counts in merge_member_syncs.items():
        base = counts["base"]
        assert base["total"] <= MAX_SYNCS_PER_STEP, f"rank {rank}: {base['total']} host syncs per step: {base['sites']}"


@pytest.mark.slow
@pytest.mark.parametrize("doubled", sorted(MERGE_DOUBLED))
def test_merge_group_syncs_do_not_grow_with_the_plan(merge_member_syncs, doubled):
    for rank, counts in merge_member_syncs.items():
        base, bigger = counts["base"], counts[doubled]
        assert bigger["total"] == base["total"], (f"rank {rank}, doubling the {doubled}: {base['total']} -> "
                                                  f"{bigger['total']} host syncs per step; {bigger['sites']}")


def test_rope_of_packed_rows_is_megatrons_thd_rope_without_its_host_reads(megatron_cpu):
    """The core attention's RoPE (one table row per token) computes exactly what megatron's THD
    RoPE computes with that table, in the forward and the backward."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_slimpack.plan import MicroPack, Slice
    from megatron_slimpack.runtime import InMemoryTokenSource, KVStore, build_batch
    from megatron_slimpack.runtime.attention.rope import apply_rotary_rows, rotary_freqs_at, slice_positions
    from megatron_slimpack.runtime.model import tiny_config

    config = tiny_config(hidden_size=32, num_attention_heads=4)
    source = InMemoryTokenSource({0: torch.arange(40), 1: torch.arange(9)})
    params = build_batch(MicroPack([Slice(1, 0, 9), Slice(0, 25, 40)]), source, KVStore(), pad_to=8).packed_seq_params
    freqs = rotary_freqs_at(RotaryEmbedding(kv_channels=8, rotary_percent=1.0), slice_positions(params),
                            params.rotary_rows)
    rows = torch.randn(params.host_cu_seqlens_q[-1], 4, 8, requires_grad=True)
    counter = SyncCounter()
    with counter:
        ours = apply_rotary_rows(rows, freqs, config)
    assert counter.total == 0, dict(counter.sites)
    megatrons = apply_rotary_pos_emb(rows, freqs, config=config, cu_seqlens=params.cu_seqlens_q)
    assert torch.equal(ours, megatrons)
    grad = torch.randn_like(ours)
    assert torch.equal(*(torch.autograd.grad(out, rows, grad)[0] for out in (ours, megatrons)))
