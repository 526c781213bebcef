"""Per-step host work: plan checks once per plan, batches and DP-Merge layouts built with array
operations. The array code must give exactly what the per-slice, per-token definitions give
(`reference_batch`, `reference_layout` below), on plans with many documents, continuing and
ending slices, short slices dealt round-robin and sequence-parallel padding."""
import random

import numpy as np
import pytest
import torch

from conftest import random_plan, random_slicing, run_multiprocess

VOCAB = 64


# ---- the per-slice / per-token definitions ------------------------------------------------
def reference_rows(micropack, source, pad_to: int = 1) -> dict:
    """Tokens, labels, loss mask and positions slice by slice; padding rows appended."""
    tokens, labels, mask, positions, keeps = [], [], [], [], []
    for piece in micropack.slices:
        ids = torch.as_tensor(source.tokens(piece.sample_id, piece.start, piece.end), dtype=torch.long)
        n = piece.end - piece.start
        continues = len(ids) == n + 1
        tokens.append(ids[:n])
        labels.append(torch.cat([ids[1:], ids.new_zeros(n + 1 - len(ids))]))
        m = torch.ones(n)
        if not continues:
            m[-1] = 0.0
        mask.append(m)
        positions.append(torch.arange(piece.start, piece.end))
        keeps.append(continues)
    padding = -sum(s.end - s.start for s in micropack.slices) % pad_to
    tokens.append(torch.zeros(padding, dtype=torch.long))
    labels.append(torch.zeros(padding, dtype=torch.long))
    mask.append(torch.zeros(padding))
    positions.append(torch.arange(padding))
    return {"tokens": torch.cat(tokens), "labels": torch.cat(labels), "loss_mask": torch.cat(mask),
            "position_ids": torch.cat(positions), "keeps_kv": keeps, "padding": padding}


def cumulative(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def reference_layout(micropack, k: int, rank: int):
    """(gather_index, counts, local natural indices, local positions, local tokens per slice),
    token by token from `split_micropack`'s lists."""
    from megatron_slimpack.runtime.attention.context_parallel import split_micropack

    lengths = [s.end - s.start for s in micropack.slices]
    shares = split_micropack(lengths, k)
    offsets = cumulative(lengths)
    per_rank: list[list[int]] = [[] for _ in range(k)]
    for i, by_rank in enumerate(shares):
        for r, local in enumerate(by_rank):
            per_rank[r] += [offsets[i] + j for j in local]
    counts = [len(p) for p in per_rank]
    gather_index = [0] * sum(lengths)
    for r, indices in enumerate(per_rank):
        for position, index in enumerate(indices):
            gather_index[index] = r * max(counts) + position
    positions = [micropack.slices[i].start + j for i, by_rank in enumerate(shares) for j in by_rank[rank]]
    return gather_index, counts, per_rank[rank], positions, [len(by_rank[rank]) for by_rank in shares]


# ---- a plan of many documents ---------------------------------------------------------------
def many_document_micropacks(seed: int = 0, num_docs: int = 300):
    """MicroPacks of a plan of `num_docs` documents (1..160 tokens, cut into up to 4 slices each,
    spread over 24 MicroPacks), and the documents' token source."""
    from megatron_slimpack.runtime import InMemoryTokenSource

    rng = random.Random(seed)
    lengths = {sid: rng.choice([rng.randint(1, 8), rng.randint(9, 160)]) for sid in range(num_docs)}
    slicings = {sid: random_slicing(rng, n, 4) for sid, n in lengths.items()}
    plan = random_plan(rng, slicings, num_micropacks=24)
    documents = {sid: torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(sid))
                 for sid, n in lengths.items()}
    return plan.replicas[0].micropacks, InMemoryTokenSource(documents)


@pytest.mark.parametrize("pad_to", [1, 3, 8])
def test_batches_equal_the_per_slice_definition(pad_to):
    from megatron_slimpack.runtime import KVStore, build_batch

    micropacks, source = many_document_micropacks()
    assert sum(len(mp.slices) for mp in micropacks) > 300
    for mp in micropacks:
        want = reference_rows(mp, source, pad_to)
        got = build_batch(mp, source, KVStore(), pad_to=pad_to)
        for name in ("tokens", "labels", "loss_mask", "position_ids"):
            tensor = getattr(got, name)
            assert tensor.shape == (1, len(want[name])) and tensor.dtype == want[name].dtype, name
            assert torch.equal(tensor[0], want[name]), name
        params = got.packed_seq_params
        lengths = [s.end - s.start for s in mp.slices]
        segments = lengths + [want["padding"]] * bool(want["padding"])
        assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q.tolist() == cumulative(segments)
        assert params.cu_seqlens_kv is params.cu_seqlens_q
        assert params.cu_seqlens_attn_kv.tolist() == cumulative([s.end for s in mp.slices])
        assert params.host_cu_seqlens_q == cumulative(segments)
        assert params.host_cu_seqlens_attn_kv == cumulative([s.end for s in mp.slices])
        assert (params.max_seqlen_q, params.max_seqlen_attn_kv) == (max(segments), max(s.end for s in mp.slices))
        assert params.sample_ids == [s.sample_id for s in mp.slices]
        assert params.starts == [s.start for s in mp.slices]
        assert params.keeps_kv == want["keeps_kv"] and params.padding == want["padding"]
        assert torch.equal(params.token_positions, want["position_ids"])
        assert all(type(v) is int for v in params.host_cu_seqlens_q + params.sample_ids + params.starts)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_merge_layouts_equal_the_per_token_definition(k):
    from megatron_slimpack.runtime.attention.context_parallel import build_layout

    micropacks, _ = many_document_micropacks(seed=k)
    for mp in micropacks:
        for rank in range(k):
            gather_index, counts, local, positions, per_slice = reference_layout(mp, k, rank)
            layout, got_local, got_per_slice = build_layout(mp, None, k, rank)
            assert layout.gather_index.tolist() == gather_index
            assert layout.local_counts == counts and layout.full_bounds == cumulative(
                [s.end - s.start for s in mp.slices])
            assert got_local.dtype == torch.long and got_local.tolist() == local
            assert layout.local_positions.tolist() == positions == layout.host_positions
            assert got_per_slice == per_slice


def test_a_merge_layout_by_hand():
    """Slices of 9, 2 and 3 tokens over 2 ranks: the 9-token slice in 4 chunks (3, 2, 2, 2: the
    leftover token to chunk 0), rank 0 chunks 0 and 3, rank 1 chunks 1 and 2; the short slices
    round-robin, the rotation carried from one to the next."""
    from megatron_slimpack.plan import MicroPack, Slice
    from megatron_slimpack.runtime.attention.context_parallel import build_layout, token_owners

    owners = token_owners(np.array([9, 2, 3]), 2)
    assert owners.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0] + [0, 1] + [0, 1, 0]
    pack = MicroPack([Slice(5, 10, 19), Slice(6, 0, 2), Slice(7, 4, 7)])
    layout, local, per_slice = build_layout(pack, None, 2, 1)
    assert local.tolist() == [3, 4, 5, 6, 10, 12] and per_slice == [4, 1, 1]
    assert layout.host_positions == [13, 14, 15, 16, 1, 5]
    # rank 0 holds 8 tokens (the padded share): rank 1's rows of the gathered buffer start at 8
    assert layout.gather_index.tolist() == [0, 1, 2, 8, 9, 10, 11, 3, 4, 5, 12, 6, 13, 7]


@pytest.mark.parametrize("k,pad_to", [(2, 1), (3, 4), (4, 2)])
def test_merge_batches_equal_the_per_token_definition(k, pad_to):
    from megatron_slimpack.runtime import KVStore
    from megatron_slimpack.runtime.attention.context_parallel import build_cp_batch

    micropacks, source = many_document_micropacks(seed=10 + k)
    for mp in micropacks:
        full = reference_rows(mp, source)
        for rank in range(k):
            _, _, local, positions, per_slice = reference_layout(mp, k, rank)
            padding = -len(local) % pad_to
            got = build_cp_batch(mp, source, KVStore(), group=None, group_size=k, group_rank=rank, pad_to=pad_to)
            index = torch.tensor(local, dtype=torch.long)
            for name, pad in (("tokens", torch.zeros(padding, dtype=torch.long)),
                              ("labels", torch.zeros(padding, dtype=torch.long)),
                              ("loss_mask", torch.zeros(padding)), ("position_ids", torch.arange(padding))):
                want = torch.cat([full[name][index], pad])
                assert torch.equal(getattr(got, name)[0], want), name
            params = got.packed_seq_params
            segments = per_slice + [padding] * bool(padding)
            assert params.cu_seqlens_q.tolist() == cumulative(segments) == params.host_cu_seqlens_q
            assert params.cu_seqlens_attn_kv.tolist() == cumulative([s.end for s in mp.slices])
            assert params.keeps_kv == full["keeps_kv"] and params.padding == padding
            assert params.cp.host_positions == positions
            assert params.max_seqlen_q == max(segments)


# ---- plan checks once per plan --------------------------------------------------------------
def _counting(monkeypatch):
    from megatron_slimpack.runtime.pipeline import schedule

    calls = {"check_stage_orders": 0, "check_same_plan": 0}
    for name in calls:
        original = getattr(schedule, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(schedule, name, counted)
    schedule._checked_plans.clear()
    return calls


def _small_plan(seed: int):
    rng = random.Random(seed)
    slicings = {sid: random_slicing(rng, rng.randint(2, 20), 3) for sid in range(6)}
    return random_plan(rng, slicings, num_micropacks=4)


def test_checks_run_once_per_plan_and_again_when_it_changes(megatron_cpu, monkeypatch):
    from megatron_slimpack.plan import Plan
    from megatron_slimpack.runtime import InMemoryTokenSource, slimpack_forward_backward
    from megatron_slimpack.runtime.model import build_gpt_model, tiny_config

    calls = _counting(monkeypatch)
    config = tiny_config(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    model = build_gpt_model(config, vocab_size=VOCAB, max_sequence_length=64, backend="torch")
    plan = _small_plan(0)
    source = InMemoryTokenSource({s.sample_id: torch.randint(0, VOCAB, (s.length,)) for s in plan.samples})

    def step(p):
        slimpack_forward_backward(model=model, plan=p, token_source=source)

    for _ in range(3):
        step(plan)
    # the digest is exchanged every step; the stage orders are checked once
    assert calls == {"check_stage_orders": 1, "check_same_plan": 3}
    step(Plan.from_dict(plan.to_dict()))  # the same plan, another object
    assert calls == {"check_stage_orders": 1, "check_same_plan": 4}
    before = plan.fingerprint()
    next(mp for mp in plan.replicas[0].micropacks if len(mp.slices) > 1).slices.reverse()  # packed the other way
    assert plan.fingerprint() != before
    step(plan)  # changed in place: checked again
    assert calls == {"check_stage_orders": 2, "check_same_plan": 5}
    step(plan)
    assert calls == {"check_stage_orders": 2, "check_same_plan": 6}
    other = _small_plan(1)
    source.documents.update({s.sample_id: torch.randint(0, VOCAB, (s.length,)) for s in other.samples})
    step(other)
    assert calls == {"check_stage_orders": 3, "check_same_plan": 7}


def test_digest_follows_the_plans_content():
    from megatron_slimpack.plan import Plan
    from megatron_slimpack.runtime.pipeline.schedule import plan_digest

    plan = _small_plan(0)
    again = Plan.from_json(plan.to_json())
    assert plan_digest(again) == plan_digest(plan) and len(plan_digest(plan)) == 16
    changes = [
        lambda p: p.replicas[0].micropacks[0].slices.reverse(),
        lambda p: p.replicas[0].forward_units.__setitem__(slice(0, 2), [sum(p.replicas[0].forward_units[:2], [])]),
        lambda p: setattr(p, "context_length", p.context_length + 1),
        lambda p: p.replicas[0].stage_orders[0].reverse(),
        lambda p: setattr(p.replicas[0], "dp_ranks", [1]),
    ]
    seen = {plan_digest(plan)}
    for change in changes:
        copy = Plan.from_json(plan.to_json())
        change(copy)
        if copy.fingerprint() != plan.fingerprint():
            assert plan_digest(copy) not in seen
            seen.add(plan_digest(copy))
    assert len(seen) >= 4


def _cached_mismatch_worker(rank, world_size, port):
    import torch.distributed as dist

    from megatron_slimpack.runtime.pipeline import schedule

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    checked = []
    real = schedule.check_stage_orders
    schedule.check_stage_orders = lambda *a, **k: checked.append(1) or real(*a, **k)
    plan, other = _small_plan(0), _small_plan(1)
    groups = schedule.ScheduleGroups()
    for _ in range(2):  # both ranks run the same plan: the orders are checked once
        merged, own = schedule._pick_replicas(plan, 0)
        schedule._check_replicas(plan, merged + [own], groups, True)
    assert len(checked) == 1
    # rank 1 moves on to another plan while rank 0 keeps its (already checked) one: both stop
    mine = plan if rank == 0 else other
    with pytest.raises(schedule.ScheduleError, match="different plans"):
        schedule._check_replicas(mine, [mine.replicas[0]], groups, True)


@pytest.mark.slow
def test_a_rank_with_another_plan_is_caught_after_the_checks_are_cached():
    run_multiprocess(_cached_mismatch_worker, 2, timeout_s=60)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_for_a_gpu_are_the_cpu_batches():
    """On a GPU the rows and boundaries go through pinned memory and non_blocking copies: the
    result, read back after a synchronize, is the CPU batch."""
    from megatron_slimpack.runtime import KVStore, build_batch
    from megatron_slimpack.runtime.attention.context_parallel import build_cp_batch
    from megatron_slimpack.runtime.attention.seq_params import to_device

    assert to_device(np.arange(3), torch.long, "cuda").device.type == "cuda"
    micropacks, source = many_document_micropacks(seed=3)
    for mp in micropacks[:6]:
        pairs = [(build_batch(mp, source, KVStore(), pad_to=4), build_batch(mp, source, KVStore(), "cuda", 4)),
                 (build_cp_batch(mp, source, KVStore(), group=None, group_size=2, group_rank=1, pad_to=4),
                  build_cp_batch(mp, source, KVStore(), group=None, group_size=2, group_rank=1, device="cuda",
                                 pad_to=4))]
        torch.cuda.synchronize()
        for cpu, gpu in pairs:
            for name in ("tokens", "labels", "loss_mask", "position_ids"):
                assert getattr(gpu, name).is_cuda and torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name))
            for name in ("cu_seqlens_q", "cu_seqlens_attn_kv"):
                assert torch.equal(getattr(gpu.packed_seq_params, name).cpu(), getattr(cpu.packed_seq_params, name))
