"""Documents longer than the context: refused by default with the count, the longest and the fix
(`long_documents="error"`), cut into context-length samples only when asked ("split"), or left
out and counted ("drop"); and global batches too large to plan, refused up front. Through the
sampler, the `slimpack` command, `compare` and the Megatron integration."""
from __future__ import annotations

import argparse
import json
import pickle
import time

import pytest

from megatron_slimpack import cli
from megatron_slimpack.config import SlimPackConfig
from megatron_slimpack.workload import (
    MAX_SAMPLES_PER_BATCH,
    GlobalBatchSampler,
    LongDocumentsError,
    WorkloadError,
    check_batch_scale,
    global_batches,
    long_document_note,
)
from test_cli_output import run_cli, stand_in_comparison


def pieces(batch) -> list[tuple[int, int, int]]:
    return [(document, start, length) for (document, start), length in zip(batch.sources, batch.lengths)]


# ---- error: the default -------------------------------------------------------------------------

def test_error_is_the_default_and_names_the_count_the_longest_the_context_and_the_fix():
    with pytest.raises(LongDocumentsError) as raised:
        GlobalBatchSampler([5, 20, 30, 3], context_length=8, global_batch_size=2)
    message = str(raised.value)
    assert "2 of the 4 documents are longer than the context length of 8 tokens" in message
    assert "the longest: 30 tokens" in message
    assert "--long-documents split" in message and "--long-documents drop" in message
    assert "--context-length of at least 30" in message and "long_documents='split'" in message
    assert isinstance(raised.value, WorkloadError)
    again = pickle.loads(pickle.dumps(raised.value))  # crosses processes intact
    assert str(again) == message and again.longest == 30
    # A corpus that fits is drawn as ever.
    assert GlobalBatchSampler([5, 8, 3], context_length=8, global_batch_size=2).next_batch().lengths


def test_error_in_the_message_spelled_for_another_command_line():
    with pytest.raises(LongDocumentsError) as raised:
        GlobalBatchSampler([50], context_length=8, global_batch_size=1)
    text = raised.value.message("--slimpack-long-documents", "--seq-length")
    assert "1 of the 1 document is longer" in text and "--slimpack-long-documents split" in text
    assert "--seq-length of at least 50" in text and "long_documents=" not in text


@pytest.mark.parametrize("value", ["truncate", "", None, "Split"])
def test_an_unknown_mode_is_refused_naming_the_modes(value):
    with pytest.raises(WorkloadError, match="long_documents must be one of split, drop, error"):
        GlobalBatchSampler([5], context_length=8, global_batch_size=1, long_documents=value)
    with pytest.raises(ValueError, match="SlimPackConfig.long_documents must be one of split, drop, error"):
        SlimPackConfig(long_documents=value)


# ---- split: the batches as before ---------------------------------------------------------------

def test_split_cuts_at_the_context_exactly_as_a_hand_computed_example():
    """[10, 25, 3] at context 8, budget 2 x 8 = 16. Seed 0 orders epoch 0 as documents 2, 0, 1
    and epoch 1 as 0, 1, 2 (numpy's default_rng(seed + epoch).permutation); a piece that does not
    fit closes the batch."""
    sampler = GlobalBatchSampler([10, 25, 3], context_length=8, global_batch_size=2, seed=0, long_documents="split")
    batches = [sampler.next_batch() for _ in range(4)]
    assert [pieces(batch) for batch in batches] == [
        [(2, 0, 3), (0, 0, 8), (0, 8, 2)],  # 13 tokens: document 1's first 8 would make 21
        [(1, 0, 8), (1, 8, 8)],
        [(1, 16, 8), (1, 24, 1)],  # epoch 1's first piece (document 0's 8) would make 17
        [(0, 0, 8), (0, 8, 2)],
    ]
    assert [(b.stats.split_documents, b.stats.split_pieces) for b in batches] == [(1, 2), (1, 2), (1, 2), (1, 2)]
    assert all(b.stats.dropped_documents == b.stats.dropped_tokens == 0 for b in batches)
    note = long_document_note(batches, [10, 25, 3], 8)
    assert note.startswith("2 documents longer than the context length of 8 tokens (the longest: 25 tokens) split")
    assert "8 such pieces in these batches" in note and "--long-documents split" in note


def test_split_and_error_draw_the_same_batches_where_nothing_is_too_long():
    lengths = [7, 3, 8, 1, 5, 6, 2]
    split = GlobalBatchSampler(lengths, 8, 2, seed=4, long_documents="split")
    default = GlobalBatchSampler(lengths, 8, 2, seed=4)
    assert [split.next_batch() for _ in range(5)] == [default.next_batch() for _ in range(5)]
    assert long_document_note([default.next_batch()], lengths, 8) is None


def test_global_batches_passes_the_mode_on():
    with pytest.raises(LongDocumentsError):
        global_batches("longtail:n=2000", 4096, 4, 1, seed=5)
    batches = global_batches("longtail:n=2000", 4096, 4, 3, seed=5, long_documents="drop")
    assert all(max(batch.lengths) <= 4096 for batch in batches)


# ---- drop: left out and counted ------------------------------------------------------------------

def test_drop_leaves_long_documents_out_and_counts_them():
    """[10, 25, 3, 6, 2] at context 8, budget 16, seed 0: documents 0 and 1 never appear; epoch 0
    (order 2, 4, 3, 0, 1) and epoch 1 (4, 0, 1, 2, 3) each skip both while batch 0 is drawn."""
    lengths = [10, 25, 3, 6, 2]
    sampler = GlobalBatchSampler(lengths, context_length=8, global_batch_size=2, seed=0, long_documents="drop")
    first = sampler.next_batch()
    assert pieces(first) == [(2, 0, 3), (4, 0, 2), (3, 0, 6), (4, 0, 2), (2, 0, 3)]
    assert (first.stats.dropped_documents, first.stats.dropped_tokens) == (4, 70)
    assert (sampler.dropped_documents, sampler.dropped_tokens) == (4, 70)
    later = [sampler.next_batch() for _ in range(6)]
    assert all(document in (2, 3, 4) for batch in [first, *later] for document, _, _ in pieces(batch))
    assert sampler.dropped_documents == sum(b.stats.dropped_documents for b in [first, *later])
    assert sampler.dropped_tokens == sum(b.stats.dropped_tokens for b in [first, *later])
    assert sampler.split_documents == sampler.split_pieces == 0
    assert first.dropped == [0, 1, 0, 1] and all(set(batch.dropped) <= {0, 1} for batch in later)
    note = long_document_note([first, *later], lengths, 8)
    assert note.startswith(f"2 documents longer than the context length of 8 tokens left out (drawn "
                           f"{sampler.dropped_documents} times), {sampler.dropped_tokens} tokens in all")


def test_drop_counters_survive_a_state_dict_round_trip():
    lengths = [10, 25, 3, 6, 2, 40, 7]
    sampler = GlobalBatchSampler(lengths, 8, 2, seed=3, long_documents="drop")
    for _ in range(3):
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))  # checkpoints are JSON
    assert (state["dropped_documents"], state["dropped_tokens"]) == (sampler.dropped_documents, sampler.dropped_tokens)
    assert state["dropped_documents"] > 0
    expected = [sampler.next_batch() for _ in range(4)]
    resumed = GlobalBatchSampler(lengths, 8, 2, seed=3, long_documents="drop")
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(4)] == expected
    assert (resumed.dropped_documents, resumed.dropped_tokens) == (sampler.dropped_documents, sampler.dropped_tokens)
    # The mode is part of the fingerprint: another mode would draw other batches.
    with pytest.raises(WorkloadError, match="long_documents"):
        GlobalBatchSampler(lengths, 8, 2, seed=3, long_documents="split").load_state_dict(state)


def test_the_megatron_resume_check_knows_the_drop_counters():
    from megatron_slimpack.megatron.data import SAMPLER_STATE_KEYS, ResumeStateError, check_sampler_state

    sampler = GlobalBatchSampler([10, 3, 6], 8, 2, seed=0, long_documents="drop")
    sampler.next_batch()
    state = sampler.state_dict()
    assert set(SAMPLER_STATE_KEYS) == set(state)
    check_sampler_state(state, 3, sampler.lengths)
    with pytest.raises(ResumeStateError, match="dropped_tokens"):
        check_sampler_state({k: v for k, v in state.items() if k != "dropped_tokens"}, 3, sampler.lengths)


def test_drop_refuses_a_corpus_of_nothing_but_long_documents():
    with pytest.raises(LongDocumentsError) as raised:
        GlobalBatchSampler([10, 25], context_length=8, global_batch_size=2, long_documents="drop")
    message = str(raised.value)
    assert "all 2 documents are longer than the context length of 8 tokens" in message
    assert "the shortest: 10 tokens" in message and "--long-documents split" in message
    assert "--context-length of at least 10" in message


# ---- the slimpack command ----------------------------------------------------------------------

@pytest.fixture
def one_long_document(tmp_path):
    """A length file: 40 short documents and one of 5,000 tokens."""
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(["5000", *[str(100 + 7 * i) for i in range(40)]]) + "\n")
    return f"file:{path}"


def plan_argv(workload: str, *extra: str) -> list[str]:
    return ["plan", "--workload", workload, "--context-length", "1024", "--global-batch-size", "16", "--tp", "1",
            "--pp", "1", "--dp", "1", "--model", "tiny", "--hardware", "cpu", "--solver-deterministic-limit", "0.2",
            *extra]


def test_plan_with_long_documents_error_exits_2_with_the_message(one_long_document, capsys):
    code, out, err = run_cli(plan_argv(one_long_document, "--long-documents", "error"), capsys)
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith(f"slimpack plan: error: --workload {one_long_document}: 1 of the 41 documents is longer")
    assert "(the longest: 5,000 tokens)" in line and "1,024 tokens" in line
    assert "--long-documents split" in line and "--long-documents drop" in line and "--context-length" in line
    assert "long_documents=" not in line  # the command's own spellings only


def test_plan_splits_by_default_and_says_so_on_stderr(one_long_document, capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["plan"]).long_documents == "split"
    plan_help = parser._subparsers._group_actions[0].choices["plan"].format_help()
    assert "{split,drop,error}" in plan_help and "(default: split)" in " ".join(plan_help.split())
    code, out, err = run_cli(plan_argv(one_long_document, "--json"), capsys)
    assert code == 0
    json.loads(out)  # the note is on stderr: stdout stays one JSON document
    notes = [line for line in err.splitlines() if "longer than the context" in line]
    assert len(notes) == 1 and notes[0].startswith("slimpack plan: note: 1 document longer than the context length "
                                                   "of 1,024 tokens (the longest: 5,000 tokens) split")


def test_plan_drops_on_request_and_counts_it(one_long_document, capsys):
    code, out, err = run_cli(plan_argv(one_long_document, "--long-documents", "drop", "--steps", "3"), capsys)
    assert code == 0 and "step 2:" in out
    (note,) = [line for line in err.splitlines() if "longer than the context" in line]
    # 3 batches of 16K tokens draw the 9.5K tokens left of the corpus about five times.
    assert note.startswith("slimpack plan: note: 1 document longer than the context length of 1,024 tokens left "
                           "out (drawn ")
    assert "times), " in note and "(--long-documents drop" in note


def test_a_short_enough_workload_prints_no_note(tmp_path, capsys):
    path = tmp_path / "short.txt"
    path.write_text("\n".join(str(100 + i) for i in range(30)) + "\n")
    code, _, err = run_cli(plan_argv(f"file:{path}", "--long-documents", "error"), capsys)
    assert code == 0 and "longer than the context" not in err


def test_compare_gets_the_mode_through_its_config(monkeypatch):
    seen = stand_in_comparison(monkeypatch)
    cli.main(["compare", "--json", "--long-documents", "drop"])
    assert seen["config"].long_documents == "drop"
    cli.main(["compare", "--json"])
    assert seen["config"].long_documents == "split"


def test_compare_notes_what_its_batches_split_or_left_out(one_long_document):
    from megatron_slimpack.apps.comparison import run_comparison
    from megatron_slimpack.costmodel import CostModel

    common = dict(workload=one_long_document, model="tiny", hardware="cpu", cost=CostModel.analytic("tiny", "cpu"),
                  gpus=1, context_length=1024, global_batch_size=4, steps=2, strategies="megatron-fixed",
                  solver_deterministic_limit=0.2, show_progress=False)
    with pytest.raises(LongDocumentsError):
        run_comparison(**common)  # the Python default: refused
    result = run_comparison(**common, long_documents="drop")
    (note,) = [line for line in result.notes() if "longer than the context" in line]
    assert note.startswith(f"{one_long_document}: 1 document longer than the context length of 1,024 tokens left out")
    assert result.to_dict()["workload_notes"] == [note]
    json.dumps(result.to_dict(), default=float)


# ---- the Megatron integration ------------------------------------------------------------------

def megatron_args(*argv: str) -> argparse.Namespace:
    from megatron_slimpack.megatron import add_slimpack_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-length", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--global-batch-size", type=int, default=2)
    return add_slimpack_args(parser).parse_args(list(argv))


def test_the_megatron_flag_defaults_to_error_and_reaches_the_config(capsys):
    from megatron_slimpack.megatron.args import slimpack_config_from_args

    assert slimpack_config_from_args(megatron_args()).long_documents == "error"
    assert slimpack_config_from_args(megatron_args("--slimpack-long-documents", "drop")).long_documents == "drop"
    with pytest.raises(SystemExit):
        megatron_args("--slimpack-long-documents", "truncate")
    assert "invalid choice" in capsys.readouterr().err


def test_the_training_sampler_refuses_long_documents_in_megatron_words(capsys):
    from megatron_slimpack.megatron.args import SlimPackArgumentError
    from megatron_slimpack.megatron.hooks import training_sampler

    lengths = [5, 20, 3]
    with pytest.raises(SlimPackArgumentError) as raised:
        training_sampler(lengths, megatron_args(), "error")
    message = str(raised.value)
    assert "1 of the 3 documents is longer than the context length of 8 tokens (the longest: 20 tokens)" in message
    assert "--slimpack-long-documents split" in message and "--seq-length of at least 20" in message
    sampler = training_sampler(lengths, megatron_args(), "split")
    assert sampler.long_documents == "split" and sampler.next_batch().lengths
    said = capsys.readouterr().out
    assert "1 of the 3 documents is longer than --seq-length 8 (the longest: 20 tokens)" in said
    assert "--slimpack-long-documents split" in said


# ---- batches too large to plan ------------------------------------------------------------------

def test_check_batch_scale_refuses_a_batch_of_millions_of_samples():
    lengths = [100] * 10
    check_batch_scale(lengths, 1000, 10)  # 100 samples
    with pytest.raises(WorkloadError) as raised:
        check_batch_scale(lengths, 10**6, 1000)  # 10^9 tokens of 100-token documents: 10^7 samples
    message = str(raised.value)
    assert f"{MAX_SAMPLES_PER_BATCH:,}" in message and "about 10,000,000 samples" in message
    assert "--global-batch-size" in message and "--context-length" in message
    assert "at most 100,000,000 tokens per batch" in message
    # Split documents count as their pieces.
    check_batch_scale([10**6], 1000, 1000, "split")  # 1,000 pieces of 1,000 tokens: 1,000 samples


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_a_huge_context_is_refused_at_once_with_one_line(command, capsys):
    began = time.perf_counter()
    code, out, err = run_cli([command, "--context-length", "1073741824", "--quiet"][:4 if command == "compare" else 3],
                             capsys)
    assert code == 2 and out == "" and time.perf_counter() - began < 30
    (line,) = err.strip().splitlines()
    assert line.startswith(f"slimpack {command}: error: a global batch of 512 sequences of 1,073,741,824 tokens")
    assert f"more than the {MAX_SAMPLES_PER_BATCH:,} the planner handles" in line
    assert "lower --global-batch-size or --context-length" in line
