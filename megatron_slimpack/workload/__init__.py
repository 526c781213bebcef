"""Workloads: where document lengths (and, for the CPU demo, real tokens) come from.

A *length source* is named by a spec string and turned into a numpy int64 array of document
lengths by `load_lengths(spec)`; `describe_sources()` prints every form. The sources:

    lognormal[:min=..,max=..,mean=..,sigma=..,n=..]     synthetic, Megatron-mock style
    uniform[:min=..,max=..,n=..]                         megatron-core 0.16's mock distribution
    longtail[:median=..,sigma=..,tail=..,tail_start=..,alpha=..,min=..,max=..,n=..]
    commoncrawl[:...] / github[:...]                     long-tail presets (synthetic stand-ins)
    file:PATH                                            one positive integer per line
    jsonl:PATH[:FIELD]                                   an int field, or a string's UTF-8 bytes
    megatron:PREFIX                                      a Megatron indexed dataset PREFIX.bin/.idx
    text[:DIR]                                           real text files, byte-level tokens

A `GlobalBatchSampler` turns lengths into global batches the way a trainer sees them: a token
budget of `global_batch_size * context_length` per step, documents in seeded random order,
nothing truncated. A document longer than the context is what `long_documents` says: refused
before any batch is drawn ("error", the default), split at the context length into samples of
their own ("split"), or left out and counted ("drop"). `check_batch_scale()` refuses batches too
large to plan; `check_lengths()` is the input check the planner uses.

Modules: lengths.py (the sources, their registry and readers, `check_lengths`), corpus.py (the
text corpus and its `text` source), sampler.py (`GlobalBatchSampler`). Their public names are
importable from this package.
"""
from .corpus import TextCorpus, TokenSource, default_text_dir
from .lengths import (
    PRESETS,
    LengthSource,
    LognormalParams,
    LongTailParams,
    UniformParams,
    WorkloadError,
    check_lengths,
    describe_sources,
    load_lengths,
    lognormal_lengths,
    longtail_lengths,
    read_jsonl_lengths,
    read_length_file,
    read_megatron_lengths,
    register_source,
    resolve_path,
    uniform_lengths,
)
from .sampler import (
    LONG_DOCUMENT_MODES,
    MAX_SAMPLES_PER_BATCH,
    BatchStats,
    GlobalBatch,
    GlobalBatchSampler,
    LongDocumentsError,
    check_batch_scale,
    check_long_documents,
    corpus_long_document_note,
    draw_global_batches,
    global_batches,
    long_document_note,
)

__all__ = [
    "WorkloadError", "check_lengths", "load_lengths", "describe_sources", "register_source", "LengthSource",
    "UniformParams", "LognormalParams", "LongTailParams", "PRESETS", "uniform_lengths", "lognormal_lengths",
    "longtail_lengths", "read_length_file", "read_jsonl_lengths", "read_megatron_lengths", "resolve_path",
    "TokenSource", "TextCorpus", "default_text_dir", "BatchStats", "GlobalBatch", "GlobalBatchSampler",
    "global_batches", "draw_global_batches", "LONG_DOCUMENT_MODES", "LongDocumentsError", "check_long_documents",
    "long_document_note",
    "MAX_SAMPLES_PER_BATCH", "check_batch_scale", "corpus_long_document_note",
]
