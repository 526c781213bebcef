"""Length sources, the global-batch sampler and the planner's input check."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_slimpack.workload import (
    PRESETS,
    GlobalBatchSampler,
    TextCorpus,
    TokenSource,
    WorkloadError,
    check_lengths,
    describe_sources,
    global_batches,
    load_lengths,
)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
WIKIPEDIA = PROJECT_ROOT / ".." / "shared" / "data" / "wikipedia_lengths.txt"


# ---- synthetic sources ---------------------------------------------------------------------


def test_lognormal_respects_range_count_and_seed():
    lengths = load_lengths("lognormal:min=16,max=512,mean=128,sigma=0.8,n=5000", seed=3)
    assert lengths.dtype == np.int64 and lengths.size == 5000
    assert lengths.min() >= 16 and lengths.max() <= 512
    assert 90 < np.median(lengths) < 128  # median of a lognormal = mean * exp(-sigma^2/2) = 93
    assert np.array_equal(lengths, load_lengths("lognormal:min=16,max=512,mean=128,sigma=0.8,n=5000", seed=3))
    assert not np.array_equal(lengths, load_lengths("lognormal:min=16,max=512,mean=128,sigma=0.8,n=5000", seed=4))
    assert load_lengths("lognormal", count=7).size == 7


def test_uniform_matches_megatron_mock_range():
    lengths = load_lengths("uniform:n=20000")
    assert lengths.min() >= 1 and lengths.max() <= 4095


def test_longtail_default_resembles_web_text():
    lengths = load_lengths("longtail", count=200_000)
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    assert 300 < p50 < 400 and 1700 < p90 < 2600 and 8000 < p99 < 14000
    assert 0.01 < (lengths > 8192).mean() < 0.025


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_long_tailed_and_overridable(name):
    lengths = load_lengths(name, count=50_000)
    assert np.percentile(lengths, 99) > 10 * np.percentile(lengths, 50)
    assert load_lengths(f"{name}:max=1000,n=100").max() <= 1000


@pytest.mark.parametrize(
    "spec, words",
    [
        ("zipf", ["unknown length source", "valid forms", "longtail"]),
        ("lognormal:mean=abc", ["mean", "not a number"]),
        ("lognormal:min=10,max=5", ["min=10 > max=5"]),
        ("lognormal:sigma=-1", ["sigma"]),
        ("longtail:tail=1.5", ["tail", "probability"]),
        ("longtail:n=2.5", ["n", "integer"]),
        ("lognormal:speed=3", ["speed", "key among"]),
        ("lognormal:min=-3", ["min=-3"]),
        ("", ["non-empty"]),
    ],
)
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(WorkloadError) as error:
        load_lengths(spec)
    for word in words:
        assert word in str(error.value)


def test_describe_sources_lists_every_form():
    text = describe_sources()
    for form in ("lognormal", "longtail", "commoncrawl", "github", "file:PATH", "jsonl:PATH", "megatron:PREFIX",
                 "text"):
        assert form in text


# ---- files -----------------------------------------------------------------------------------


def test_length_file_with_trailing_blank_lines(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("5\n17\n3\n\n\n")
    assert load_lengths(f"file:{path}").tolist() == [5, 17, 3]
    assert load_lengths(f"file:{path}", count=2).tolist() == [5, 17]


@pytest.mark.parametrize(
    "content, line, shown",
    [("5\n-2\n7\n", 2, "-2"), ("5\n7\nabc\n", 3, "abc"), ("5\n\n7\n", 2, "blank"), ("0\n", 1, "'0'"),
     ("4\n2.5\n", 2, "2.5")],
)
def test_malformed_length_file_names_file_and_line(tmp_path, content, line, shown):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(WorkloadError) as error:
        load_lengths(f"file:{path}")
    assert f"{path}:{line}" in str(error.value) and shown in str(error.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(WorkloadError, match="not a file"):
        load_lengths(f"file:{tmp_path / 'absent.txt'}")


@pytest.mark.skipif(not WIKIPEDIA.is_file(), reason="shared Wikipedia lengths not present")
def test_wikipedia_lengths_known_statistics():
    lengths = load_lengths("file:../shared/data/wikipedia_lengths.txt")  # relative to the project root
    assert lengths.size == 1_000_000
    assert np.median(lengths) == 347
    assert lengths.max() == 1_823_777


def test_jsonl_int_field_text_field_and_errors(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"length": 4, "text": "héllo"}, {"length": 9, "text": "ab"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    assert load_lengths(f"jsonl:{path}").tolist() == [4, 9]
    assert load_lengths(f"jsonl:{path}:text").tolist() == [6, 2]  # UTF-8 bytes: é is two

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"length": 3}\n{"length": 3\n')
    with pytest.raises(WorkloadError, match=f"{bad}:2: not valid JSON"):
        load_lengths(f"jsonl:{bad}")
    bad.write_text('{"length": 3}\n{"size": 3}\n')
    with pytest.raises(WorkloadError, match=f"{bad}:2: no field 'length'"):
        load_lengths(f"jsonl:{bad}")
    bad.write_text('{"length": 3}\n{"length": 0}\n')
    with pytest.raises(WorkloadError, match=f"{bad}:2"):
        load_lengths(f"jsonl:{bad}")


# ---- Megatron indexed dataset ------------------------------------------------------------------


def test_megatron_indexed_dataset_round_trip(tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    # A document may span several sequences: 3 + 4 tokens -> one document of 7.
    builder.add_document(torch.arange(7, dtype=torch.int32), lengths=[3, 4])
    builder.add_document(torch.arange(5, dtype=torch.int32), lengths=[5])
    builder.add_item(torch.arange(2, dtype=torch.int32))
    builder.add_item(torch.arange(6, dtype=torch.int32))
    builder.end_document()
    builder.finalize(prefix + ".idx")

    assert load_lengths(f"megatron:{prefix}").tolist() == [7, 5, 8]
    assert load_lengths(f"megatron:{prefix}.bin").tolist() == [7, 5, 8]
    with pytest.raises(WorkloadError, match="no indexed dataset"):
        load_lengths(f"megatron:{tmp_path / 'absent'}")


# ---- text corpus --------------------------------------------------------------------------------


def test_text_corpus_tokens_equal_file_bytes(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "b" / "two.py").write_bytes("print('ünïcode')\n".encode())
    (tmp_path / "a.py").write_bytes(b"x = 1\n" * 50)
    (tmp_path / "empty.py").write_bytes(b"")
    (tmp_path / "notes.txt").write_bytes(b"not python")
    (tmp_path / "site-packages" / "skipped.py").write_bytes(b"y = 2\n")

    corpus = TextCorpus(tmp_path)
    assert isinstance(corpus, TokenSource)
    assert [p.relative_to(tmp_path).as_posix() for p in corpus.paths] == ["a.py", "b/two.py"]
    for index, path in enumerate(corpus.paths):
        data = path.read_bytes()
        assert corpus.lengths[index] == len(data)
        assert corpus.tokens(index, 0, len(data)).tolist() == list(data)
        assert corpus.tokens(index, 3, 9).tolist() == list(data[3:9])
    assert load_lengths(f"text:{tmp_path}").tolist() == corpus.lengths.tolist()
    with pytest.raises(WorkloadError, match="need 0 <= start < end <= length"):
        corpus.tokens(0, 10, 10_000)


def test_default_text_corpus_is_the_standard_library():
    corpus = TextCorpus()
    assert len(corpus) > 100
    assert all("site-packages" not in p.parts for p in corpus.paths)
    assert [str(p) for p in corpus.paths] == sorted(str(p) for p in corpus.paths)
    index = len(corpus) // 2
    data = corpus.paths[index].read_bytes()
    assert corpus.tokens(index, 0, min(64, len(data))).tolist() == list(data[:64])


# ---- check_lengths --------------------------------------------------------------------------------


def test_check_lengths_accepts_integers():
    assert check_lengths([3, np.int64(5), 7.0]) == [3, 5, 7]
    assert check_lengths(np.array([1, 2, 3])) == [1, 2, 3]
    assert check_lengths([10, 20], context_length=20) == [10, 20]


@pytest.mark.parametrize(
    "lengths, words",
    [
        ([], "empty batch"),
        ([3, 0], "lengths[1] = 0"),
        ([3, -4], "lengths[1] = -4"),
        ([2.5], "not an integer"),
        ([True], "bool"),
        (["12"], "not an integer"),
        (np.array([1.0, 2.5]), "not an integer"),
        (np.array([4, 0]), "lengths[1] = 0"),
        ("123", "string"),
    ],
)
def test_check_lengths_rejects_bad_input(lengths, words):
    with pytest.raises(WorkloadError, match=words.replace("[", r"\[").replace("]", r"\]")):
        check_lengths(lengths)


def test_check_lengths_points_long_documents_to_the_sampler():
    with pytest.raises(ValueError) as error:
        check_lengths([5, 100], context_length=64)
    assert "exceeds the context length 64" in str(error.value) and "GlobalBatchSampler" in str(error.value)


# ---- the global-batch sampler ---------------------------------------------------------------------


def test_sampler_splits_long_documents_and_reports_it():
    sampler = GlobalBatchSampler([10, 25, 3], context_length=8, global_batch_size=2, seed=0, long_documents="split")
    batches = [sampler.next_batch() for _ in range(3)]
    pieces = [(doc, start, n) for b in batches for (doc, start), n in zip(b.sources, b.lengths)]
    by_doc: dict[int, list[tuple[int, int]]] = {}
    for doc, start, n in pieces[:7]:  # 10 -> 8+2, 25 -> 8+8+8+1, 3 -> 3: seven pieces in epoch 0
        by_doc.setdefault(doc, []).append((start, n))
    assert by_doc == {0: [(0, 8), (8, 2)], 1: [(0, 8), (8, 8), (16, 8), (24, 1)], 2: [(0, 3)]}
    assert sampler.split_documents >= 2 and sampler.split_pieces >= 6
    assert all(b.stats.num_tokens <= 16 and b.stats.fill_ratio == b.stats.num_tokens / 16 for b in batches)
    assert sum(b.stats.split_pieces for b in batches) >= 6
    assert [b.step for b in batches] == [0, 1, 2]
    assert batches[0].samples()[0].length == batches[0].lengths[0]


def test_sampler_rejects_bad_settings():
    with pytest.raises(WorkloadError, match="context_length"):
        GlobalBatchSampler([5], context_length=0, global_batch_size=1)
    with pytest.raises(WorkloadError, match="global_batch_size"):
        GlobalBatchSampler([5], context_length=8, global_batch_size=-1)
    with pytest.raises(WorkloadError, match="empty batch"):
        GlobalBatchSampler([], context_length=8, global_batch_size=1)


def _pieces(batches):
    return [(doc, start, n) for b in batches for (doc, start), n in zip(b.sources, b.lengths)]


sampler_inputs = st.tuples(
    st.lists(st.integers(1, 60), min_size=1, max_size=25),
    st.integers(1, 16),
    st.integers(1, 4),
    st.integers(0, 1000),
)


@settings(max_examples=60, deadline=None)
@given(sampler_inputs)
def test_sampler_properties(inputs):
    lengths, context, batch_size, seed = inputs
    budget = context * batch_size
    sampler = GlobalBatchSampler(lengths, context, batch_size, seed=seed, long_documents="split")
    batches = []
    while sum(b.stats.num_tokens for b in batches) < 2 * sum(lengths):  # two epochs
        batches.append(sampler.next_batch())

    for batch, following in zip(batches, batches[1:]):
        assert 0 < batch.stats.num_tokens <= budget
        assert all(0 < n <= context for n in batch.lengths)
        assert len(set(batch.sample_ids)) == len(batch.sample_ids)
        # Full: the piece that opened the next batch would not have fit in this one.
        assert batch.stats.num_tokens + following.lengths[0] > budget

    # Walk the pieces: each document's pieces are consecutive, start at 0 and cover it exactly,
    # and each epoch draws every document exactly once.
    completed, current, offset = [], None, 0
    for doc, start, n in _pieces(batches):
        if current is None:
            current, offset = doc, 0
        assert (doc, start) == (current, offset)
        assert n == min(context, lengths[doc] - start)
        offset += n
        if offset == lengths[doc]:
            completed.append(doc)
            current = None
    documents = len(lengths)
    assert len(completed) >= 2 * documents  # nothing dropped: two epochs of tokens were drawn
    assert sorted(completed[:documents]) == list(range(documents))
    assert sorted(completed[documents : 2 * documents]) == list(range(documents))

    # Determinism: the same seed gives the same batches.
    again = GlobalBatchSampler(lengths, context, batch_size, seed=seed, long_documents="split")
    assert _pieces([again.next_batch() for _ in batches]) == _pieces(batches)


@settings(max_examples=40, deadline=None)
@given(sampler_inputs, st.integers(0, 6), st.integers(1, 6))
def test_sampler_resume_continues_with_the_same_batches(inputs, before, after):
    lengths, context, batch_size, seed = inputs
    sampler = GlobalBatchSampler(lengths, context, batch_size, seed=seed, long_documents="split")
    for _ in range(before):
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))  # checkpoints are JSON
    expected = [sampler.next_batch() for _ in range(after)]

    resumed = GlobalBatchSampler(lengths, context, batch_size, seed=seed, long_documents="split")
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(after)] == expected
    assert (resumed.split_documents, resumed.split_pieces) == (sampler.split_documents, sampler.split_pieces)


def test_resume_with_other_settings_is_refused():
    state = GlobalBatchSampler([5, 9], 4, 2, seed=1, long_documents="split").state_dict()
    with pytest.raises(WorkloadError, match="different"):
        GlobalBatchSampler([5, 9], 4, 2, seed=2, long_documents="split").load_state_dict(state)


def test_global_batches_convenience():
    batches = global_batches("longtail:n=2000", context_length=4096, global_batch_size=4, steps=3, seed=5,
                             long_documents="split")
    assert [b.step for b in batches] == [0, 1, 2]
    assert all(b.stats.num_tokens <= 4 * 4096 and max(b.lengths) <= 4096 for b in batches)
    assert batches == global_batches("longtail:n=2000", context_length=4096, global_batch_size=4, steps=3, seed=5,
                                     long_documents="split")
