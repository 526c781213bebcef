"""Every strategy's plan says where each sample's tokens come from (`Plan.sample_sources`), and the
token source reads only that: through the runtime's batch builder, every slice gets exactly its
document's tokens at exactly its range, and over the steps of a run every token of every batch is
trained on exactly once (WLB-LLM's delayed documents included). Also: plan contents do not depend on
the sources, the field round-trips through JSON and is validated, and a resumed WLB-LLM planner
(fast-forwarded, or restored from its state dict) plans exactly what an uninterrupted one does."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import megatron_slimpack as ms
from megatron_slimpack.megatron.data import BatchTokenSource, PlannedBatch, fast_forward, plan_function
from megatron_slimpack.plan import Plan, PlanError, SampleSource
from megatron_slimpack.planner.strategies import StepPlanner, new_planner, strategy_names, strategy_spec
from megatron_slimpack.runtime.attention.batch import build_batch
from megatron_slimpack.workload import GlobalBatchSampler

CONTEXT = 1024
SCALE = 100_000  # token (document d, position p) = d * SCALE + p
COST = ms.CostModel.analytic("tiny", "cpu")
# The strategies the Megatron flags accept; megatron-hybrid-cp is checked too where it can run.
FLAG_STRATEGIES = ["slimpack", "slimpack-sym", "slimpack-nomerge", "megatron-fixed", "bfd", "sorted", "wlb-llm",
                   "slimpipe"]


class CodedCorpus:
    """Token at position p of document d is d * SCALE + p: any token says where it came from."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def tokens(self, document: int, start: int, end: int) -> np.ndarray:
        assert 0 <= start < end <= self.lengths[document], (document, start, end, int(self.lengths[document]))
        return int(document) * SCALE + np.arange(start, end, dtype=np.int64)


def corpus_lengths(seed: int = 0, count: int = 300) -> np.ndarray:
    """Mostly short documents, some between a quarter and the whole context (WLB-LLM delays those)
    and some longer than the context (the sampler splits them: sources with offsets > 0)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 400, size=count)
    medium = rng.random(count) < 0.25
    lengths[medium] = rng.integers(CONTEXT // 4 + 1, CONTEXT, size=int(medium.sum()))
    long = rng.random(count) < 0.1
    lengths[long] = rng.integers(CONTEXT + 1, 3 * CONTEXT, size=int(long.sum()))
    return lengths


def layout(strategy: str) -> ms.ParallelConfig:
    if strategy == "megatron-hybrid-cp":
        return ms.ParallelConfig(dp=2, pp=1)
    if strategy == "megatron-dp-balanced":
        # dp_balanced refuses a batch whose packed sequences cannot be brought to a multiple of dp (too
        # few hold two documents), as Megatron-LM's scheduler asserts; these batches of few long documents
        # are such batches at dp=2.
        return ms.ParallelConfig(dp=1, pp=2)
    return ms.ParallelConfig(dp=2, pp=2)


def config_for(strategy: str, **changes) -> ms.SlimPackConfig:
    # A deterministic budget, not the wall clock, stops CP-SAT: plans are compared across runs.
    return ms.SlimPackConfig(strategy=strategy, context_length=CONTEXT, solver_time_limit_s=60,
                             solver_deterministic_limit=0.05, **changes)


def consumed_tokens(plan: Plan, corpus: CodedCorpus, step: int = 0) -> Counter:
    """(document, position) of every input token the runtime builds for `plan` (through
    `PlannedBatch.token_source` and `build_batch`), after checking each slice's tokens and labels."""
    source = PlannedBatch(step, None, plan, 0.0).token_source(corpus)
    where = plan.source_of()
    seen: Counter = Counter()
    for replica in plan.replicas:
        for micropack in replica.micropacks:
            batch = build_batch(micropack, source, kv_store=None)
            tokens, labels = batch.tokens[0].numpy(), batch.labels[0].numpy()
            mask = batch.loss_mask[0].numpy()
            at = 0
            for piece in micropack.slices:
                document, offset, length = where[piece.sample_id]
                n = piece.length
                got = tokens[at:at + n]
                expected = document * SCALE + np.arange(offset + piece.start, offset + piece.end)
                assert (got == expected).all(), (plan.strategy, piece, document, offset)
                # the labels are the next tokens of the same piece; the piece's last token has none
                labelled = mask[at:at + n] > 0
                assert (labels[at:at + n][labelled] == got[labelled] + 1).all()
                assert labelled.sum() == n - (piece.end == length)
                seen.update(zip([document] * n, range(offset + piece.start, offset + piece.end)))
                at += n
    return seen


def batch_tokens(batch) -> Counter:
    tokens: Counter = Counter()
    for (document, offset), length in zip(batch.sources, batch.lengths):
        tokens.update(zip([document] * length, range(offset, offset + length)))
    return tokens


def run_strategy(strategy: str, steps: int, seed: int = 3):
    """Plans of `steps` batches (and WLB-LLM's flush); every batch token, every consumed token."""
    corpus = CodedCorpus(corpus_lengths(seed))
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=seed, long_documents="split")
    parallel, config = layout(strategy), config_for(strategy)
    planner = new_planner(strategy)
    plan_batch = plan_function(planner, parallel, COST, config)
    given, seen, plans = Counter(), Counter(), []
    for step in range(steps):
        batch = sampler.next_batch()
        plan = plan_batch(batch)
        given += batch_tokens(batch)
        seen += consumed_tokens(plan, corpus, step)
        plans.append((batch, plan))
    if callable(getattr(planner, "flush", None)):
        final = planner.flush(parallel, COST, config)
        if final is not None:
            seen += consumed_tokens(final.validate(), corpus)
    return corpus, plans, given, seen


def _available(strategy: str) -> None:
    if strategy == "megatron-hybrid-cp":
        pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    if strategy_spec(strategy).is_reference:
        pytest.skip(f"{strategy}: a sample is a whole sequence across documents (its source is where it begins, "
                    "its pieces are in the plan's metadata; tests/test_megatron_stock.py checks them), which the "
                    "token source, one document range per sample, cannot read: not trainable")


@pytest.mark.parametrize("strategy", sorted(set(FLAG_STRATEGIES) | set(strategy_names())))
def test_every_slice_gets_exactly_its_documents_tokens_once(strategy):
    _available(strategy)
    corpus, plans, given, seen = run_strategy(strategy, steps=4)
    split = [b for b, _ in plans if any(offset > 0 for _, offset in b.sources)]
    assert split, "the batches should hold pieces of documents longer than the context"
    assert all(count == 1 for count in seen.values()), f"{strategy}: some tokens trained on twice"
    assert seen == given, f"{strategy}: tokens missing or foreign"


def test_fixed_length_strategies_cut_documents_across_sequences():
    """megatron-fixed and slimpipe cut batch entries at sequence boundaries: such a piece's source
    is its entry's source shifted by where the cut fell."""
    for strategy in ("megatron-fixed", "slimpipe"):
        _, plans, _, _ = run_strategy(strategy, steps=2)
        for batch, plan in plans:
            entries = {(d, o): n for (d, o), n in zip(batch.sources, batch.lengths)}
            shifted = [(s, src) for s, src in zip(plan.samples, plan.sample_sources) if tuple(src) not in entries]
            assert shifted, f"{strategy}: no document crosses a sequence cut"
            for sample, (document, offset) in shifted:
                assert any(d == document and o < offset and offset + sample.length <= o + n
                           for (d, o), n in entries.items())


def test_wlb_llm_delayed_documents_keep_the_source_of_their_batch():
    _, plans, _, _ = run_strategy("wlb-llm", steps=4)
    later = 0
    for step, (batch, plan) in enumerate(plans):
        own = set(batch.sources)
        earlier = set().union(*(set(b.sources) for b, _ in plans[:step])) if step else set()
        for source in map(tuple, plan.sample_sources):
            assert source in own or source in earlier
            later += source not in own
    assert later > 0, "no document was delayed into a later step"


@pytest.mark.parametrize("strategy", ["slimpipe", "wlb-llm", "megatron-fixed"])
def test_demo_plans_train_on_their_documents_tokens(strategy):
    """The demo's planning function (megatron-fixed as exact-attention continuation slices): the
    token source it trains from gives each slice its document's tokens (a sample id read as a batch
    index fails slimpipe with KeyError and wlb-llm with 'token source returned N tokens')."""
    from megatron_slimpack.apps.demo import make_plan_function

    corpus = CodedCorpus(corpus_lengths(3))
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 2, seed=3, long_documents="split")
    plan_batch = make_plan_function(strategy, COST, ms.ParallelConfig(pp=2), ms.SlimPackConfig(context_length=CONTEXT))
    given, seen = Counter(), Counter()
    for step in range(4):
        batch = sampler.next_batch()
        plan = plan_batch(batch)
        given += batch_tokens(batch)
        seen += consumed_tokens(plan, corpus, step)
    assert all(count == 1 for count in seen.values())
    if strategy == "wlb-llm":
        assert set(seen) <= set(given)  # what it still delays comes later
    else:
        assert seen == given


# ---- plan contents do not depend on the sources ---------------------------------------------------
@pytest.mark.parametrize("strategy", FLAG_STRATEGIES)
def test_sources_change_nothing_but_the_sources(strategy):
    corpus = CodedCorpus(corpus_lengths(2))
    parallel, config = layout(strategy), config_for(strategy)
    with_sources, without = new_planner(strategy), new_planner(strategy)
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=2, long_documents="split")
    for _ in range(3):
        batch = sampler.next_batch()
        a = with_sources.plan(batch.lengths, parallel, COST, config, sources=batch.sources).validate()
        b = without.plan(batch.lengths, parallel, COST, config).validate()
        da, db = a.to_dict(include_metadata=False), b.to_dict(include_metadata=False)  # (solver times vary)
        assert da.pop("sample_sources") != db.pop("sample_sources") or all(o == 0 for _, o in batch.sources)
        assert da == db
        assert [r.to_dict() for r in a.replicas] == [r.to_dict() for r in b.replicas]


def test_default_sources_are_the_input_lengths():
    lengths = [300, 700, 100, 1000]
    for strategy in ("bfd", "sorted", "slimpack"):
        plan = new_planner(strategy).plan(lengths, layout(strategy), COST, config_for(strategy))
        assert plan.sample_sources == [(i, 0) for i in range(len(lengths))]
    fixed = new_planner("megatron-fixed").plan(lengths, layout("megatron-fixed"), COST, config_for("megatron-fixed"))
    # stream [300 | 700 | 100 | 1000] cut every 1024: the third entry crosses the first cut
    assert fixed.sample_sources == [(0, 0), (1, 0), (2, 0), (2, 24), (3, 0), (3, 948)]
    planned = ms.plan(lengths, parallel=layout("bfd"), cost=COST, config=config_for("bfd"))
    assert planned.sample_sources == [(i, 0) for i in range(len(lengths))]


def test_plan_global_batch_carries_sources():
    from megatron_slimpack.planner.strategies import plan_global_batch

    sources = [(7, 0), (7, 300), (2, 5), (9, 1024)]
    plan = plan_global_batch([300, 700, 100, 1000], parallel=layout("slimpack"), cost=COST,
                             config=config_for("slimpack"), sources=sources)
    assert [tuple(s) for s in plan.sample_sources] == sources
    with pytest.raises(PlanError, match="sample-sources"):
        plan_global_batch([300, 700], parallel=layout("bfd"), cost=COST, config=config_for("bfd"), sources=[(0, 0)])


# ---- JSON, fingerprint, validation -----------------------------------------------------------
def test_sources_round_trip_through_json_and_enter_the_fingerprint():
    _, plans, _, _ = run_strategy("slimpipe", steps=1)
    plan = plans[0][1]
    again = Plan.from_json(plan.to_json())
    assert again.sample_sources == plan.sample_sources and again.fingerprint() == plan.fingerprint()
    assert all(isinstance(s, SampleSource) for s in again.sample_sources)
    moved = Plan.from_json(plan.to_json())
    moved.sample_sources = [SampleSource(d + 1, o) for d, o in moved.sample_sources]
    assert moved.validate().fingerprint() != plan.fingerprint()


def test_json_without_sources_reads_as_identity_only_where_samples_are_the_input():
    lengths = [300, 700, 100, 1000]
    bfd = new_planner("bfd").plan(lengths, layout("bfd"), COST, config_for("bfd"), sources=[(5, 0)] * 1 + [
        (6, 0), (7, 0), (8, 0)])
    old = bfd.to_dict()
    del old["sample_sources"]
    assert Plan.from_dict(old).validate().sample_sources == [(i, 0) for i in range(len(lengths))]
    fixed = new_planner("megatron-fixed").plan(lengths, layout("megatron-fixed"), COST, config_for("megatron-fixed"))
    old = fixed.to_dict()
    del old["sample_sources"]
    with pytest.raises(PlanError, match="sample_sources"):
        Plan.from_dict(old)


def test_validate_checks_the_sources():
    lengths = [300, 700, 100]
    plan = new_planner("bfd").plan(lengths, layout("bfd"), COST, config_for("bfd"),
                                   sources=[(4, 0), (4, 300), (4, 1000)]).validate()
    plan.sample_sources = [SampleSource(4, 0), SampleSource(4, 299), SampleSource(4, 1000)]
    with pytest.raises(PlanError, match="sample-sources: samples 0 and 1 overlap in document 4"):
        plan.validate()
    plan.repeated_documents = [4]  # the input held document 4 twice (a batch across an epoch boundary)
    plan.validate()
    assert Plan.from_json(plan.to_json()).validate().repeated_documents == [4]
    plan.repeated_documents = []
    plan.sample_sources = plan.sample_sources[:2]
    with pytest.raises(PlanError, match="every sample needs one"):
        plan.validate()
    plan.sample_sources = [SampleSource(4, 0), SampleSource(4, -1), SampleSource(3, 0)]
    with pytest.raises(PlanError, match="non-negative"):
        plan.validate()
    with pytest.raises(PlanError, match="must give each sample"):
        Plan(plan.replicas, plan.samples, plan.parallel, plan.context_length, "megatron-fixed")


def test_token_source_reads_the_plan_not_the_batch():
    """A plan whose sample 0 is a piece in the middle of document 3 (as a baseline's cut would
    make it): the source serves that piece, and knows no sample outside the plan."""
    corpus = CodedCorpus([10, 10, 10, 900])
    plan = new_planner("bfd").plan([100, 5], layout("bfd"), COST, config_for("bfd"), sources=[(3, 250), (1, 2)])
    source = BatchTokenSource(corpus, plan)
    assert list(source.tokens(0, 10, 13)) == [3 * SCALE + p for p in range(260, 264)]
    assert list(source.tokens(0, 98, 100)) == [3 * SCALE + 348, 3 * SCALE + 349]  # clipped at the piece's end
    assert list(source.tokens(1, 0, 5)) == [SCALE + p for p in range(2, 7)]
    with pytest.raises(KeyError):
        source.tokens(2, 0, 1)


# ---- resuming: advance, fast_forward, state dicts --------------------------------------------------
def _resume_setup(strategy: str = "wlb-llm"):
    corpus = CodedCorpus(corpus_lengths(3))
    return corpus, layout(strategy), config_for(strategy)


def test_wlb_llm_fast_forward_resumes_exactly():
    corpus, parallel, config = _resume_setup()
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=3, long_documents="split")
    uninterrupted = plan_function(new_planner("wlb-llm"), parallel, COST, config)
    reference = [uninterrupted(sampler.next_batch()).to_dict() for _ in range(5)]
    assert uninterrupted.planner.pending  # documents are delayed: the state matters

    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=3, long_documents="split")
    planner = new_planner("wlb-llm")
    fast_forward(sampler, planner, parallel, COST, config, steps=2)
    resumed = plan_function(planner, parallel, COST, config)
    assert [resumed(sampler.next_batch()).to_dict() for _ in range(3)] == reference[2:]

    # Drawing the batches without bringing the planner along (the old resume) diverges.
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=3, long_documents="split")
    for _ in range(2):
        sampler.next_batch()
    naive = plan_function(new_planner("wlb-llm"), parallel, COST, config)
    assert [naive(sampler.next_batch()).to_dict() for _ in range(3)] != reference[2:]


def test_wlb_llm_advance_matches_planning_even_when_a_step_schedules_nothing():
    """A step whose documents are all delayed is planned like a flush; advance does the same."""
    parallel, config = ms.ParallelConfig(dp=2, pp=2), config_for("wlb-llm")
    batches = [[600, 700], [650], [300, 300, 300], [900, 100, 100], [50]]
    planning, advancing = new_planner("wlb-llm"), new_planner("wlb-llm")
    for lengths in batches:
        planning.plan(lengths, parallel, COST, config)
        advancing.advance(lengths, parallel, COST, config)
        assert advancing.state_dict() == planning.state_dict()


def test_wlb_llm_state_dict_round_trips():
    corpus, parallel, config = _resume_setup()
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=3, long_documents="split")
    batches = [sampler.next_batch() for _ in range(5)]
    first = new_planner("wlb-llm")
    plan_first = plan_function(first, parallel, COST, config)
    for batch in batches[:2]:
        plan_first(batch)
    state = json.loads(json.dumps(first.state_dict()))  # JSON-able
    assert state["carried"] or any(state["queues"])
    restored = new_planner("wlb-llm")
    restored.load_state_dict(state)
    assert restored.state_dict() == first.state_dict()
    plan_restored = plan_function(restored, parallel, COST, config)
    assert [plan_restored(b).to_dict() for b in batches[2:]] == [plan_first(b).to_dict() for b in batches[2:]]
    with pytest.raises(PlanError):
        new_planner("wlb-llm").load_state_dict({"queues": []})


@pytest.mark.parametrize("strategy", ["bfd", "megatron-fixed", "slimpipe"])
def test_stateless_planners_fast_forward_over_the_batches(strategy):
    corpus, parallel, config = _resume_setup(strategy)
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=3, long_documents="split")
    plan_batch = plan_function(new_planner(strategy), parallel, COST, config)
    reference = [plan_batch(sampler.next_batch()).to_dict() for _ in range(3)]
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=3, long_documents="split")
    planner = new_planner(strategy)
    assert type(planner) is StepPlanner and planner.state_dict() == {}
    planner.load_state_dict({})
    fast_forward(sampler, planner, parallel, COST, config, steps=2)
    assert plan_function(planner, parallel, COST, config)(sampler.next_batch()).to_dict() == reference[2]


def test_planner_iterator_checkpoint_holds_the_planner_state():
    """The planner iterator's checkpoint (sampler and planner after the last consumed batch, not
    after the batches planned ahead) resumes a WLB-LLM run exactly."""
    from megatron_slimpack.megatron.data import PlannerIterator

    corpus, parallel, config = _resume_setup()

    def iterator():
        sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 4, seed=3, long_documents="split")
        return PlannerIterator(sampler, plan_function(new_planner("wlb-llm"), parallel, COST, config), plan_ahead=2,
                               steps=5)

    def content(planned):
        plan = planned.plan.to_dict()
        plan["metadata"].pop("planning_time_s", None)
        return planned.batch.lengths, plan

    with iterator() as full:
        reference = [content(p) for p in full]
    first = iterator()
    seen = [content(p) for _, p in zip(range(2), first)]
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    assert state["planner"]["step"] == 2
    resumed = iterator()
    resumed.load_state_dict(state)
    seen += [content(p) for p in resumed]
    assert seen == reference


@pytest.mark.parametrize("strategy", sorted(set(FLAG_STRATEGIES) | set(strategy_names())))
def test_a_batch_across_an_epoch_boundary_may_hold_a_document_twice(strategy):
    """A small corpus: batches that span an epoch boundary hold some documents twice. Those (and
    only those) may overlap in a plan, and each copy is trained on."""
    from megatron_slimpack.plan import overlapping_documents

    _available(strategy)
    rng = np.random.default_rng(4)
    corpus = CodedCorpus(rng.integers(100, 2 * CONTEXT, size=10))
    sampler = GlobalBatchSampler(corpus.lengths, CONTEXT, 8, seed=4, long_documents="split")
    parallel, config = layout(strategy), config_for(strategy)
    planner = new_planner(strategy)
    plan_batch = plan_function(planner, parallel, COST, config)
    given, seen, repeats, exempted = Counter(), Counter(), 0, 0
    for step in range(6):
        batch = sampler.next_batch()
        repeats += bool(overlapping_documents(batch.sources, batch.lengths))
        plan = plan_batch(batch)
        exempted += bool(plan.repeated_documents)
        given += batch_tokens(batch)
        seen += consumed_tokens(plan, corpus, step)
    final = planner.flush(parallel, COST, config) if callable(getattr(planner, "flush", None)) else None
    if final is not None:
        seen += consumed_tokens(final.validate(), corpus)
    assert repeats and exempted, "no batch holds a document twice"
    assert seen == given
    overlapping = plan.to_dict()
    assert Plan.from_dict(overlapping).repeated_documents == plan.repeated_documents
