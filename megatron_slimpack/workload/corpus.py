"""Real text: the embedded default workload (the running Python's standard library as documents
with byte-level tokens, no download), and the `text` length source."""
from __future__ import annotations

import fnmatch
import os
import sysconfig
from collections import OrderedDict
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from .lengths import WorkloadError, register_source, resolve_path, take_prefix


@runtime_checkable
class TokenSource(Protocol):
    """Where the runtime fetches the tokens [start, end) of a sample (a document or a piece of
    one). `sample_key` is the document index the sampler reported in `GlobalBatch.sources`."""

    def tokens(self, sample_key, start: int, end: int) -> np.ndarray: ...


def default_text_dir() -> Path:
    """The running Python's standard library: real text available everywhere, no download."""
    return Path(sysconfig.get_paths()["stdlib"])


class TextCorpus:
    """Text files as documents with byte-level tokens (token id = UTF-8 byte, vocabulary 256).

    Documents are the `*.py` files under `root`, recursively, sorted by path (deterministic on
    every rank), skipping empty files and any `site-packages` directory. Lengths come from file
    sizes; bytes are read lazily when tokens are asked for, with a small cache of whole files
    (consecutive pieces of a long document hit the cache).
    """

    VOCAB_SIZE = 256

    def __init__(self, root: str | Path | None = None, pattern: str = "*.py", cache_files: int = 16):
        self.root = Path(root).expanduser() if root else default_text_dir()
        if not self.root.is_dir():
            raise WorkloadError(f"text: {self.root} is not a directory; give a directory of text files (text:DIR)")
        self.paths, sizes = self._scan(pattern)
        if not self.paths:
            raise WorkloadError(f"text: no non-empty {pattern} files under {self.root}")
        self.lengths = np.array(sizes, dtype=np.int64)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_files = max(1, cache_files)

    def _scan(self, pattern: str) -> tuple[list[Path], list[int]]:
        found: list[tuple[str, Path]] = []
        for directory, subdirectories, names in os.walk(self.root):
            # Prune instead of filtering afterwards: a site-packages tree can be huge.
            subdirectories[:] = [name for name in subdirectories if name != "site-packages"]
            for name in fnmatch.filter(names, pattern):
                path = Path(directory, name)
                found.append((path.relative_to(self.root).as_posix(), path))
        paths, sizes = [], []
        for _, path in sorted(found):
            size = path.stat().st_size if path.is_file() else 0
            if size > 0:
                paths.append(path)
                sizes.append(size)
        return paths, sizes

    def __len__(self) -> int:
        return len(self.paths)

    def document_bytes(self, index: int) -> np.ndarray:
        """All bytes of document `index` (uint8, read-only, cached)."""
        if not 0 <= index < len(self.paths):
            raise WorkloadError(f"text: document index {index} outside 0..{len(self.paths) - 1}")
        cached = self._cache.get(index)
        if cached is None:
            cached = np.frombuffer(self.paths[index].read_bytes(), dtype=np.uint8)
            if cached.size != self.lengths[index]:
                raise WorkloadError(
                    f"text: {self.paths[index]} changed size since the corpus was scanned "
                    f"({self.lengths[index]} -> {cached.size} bytes); rebuild the TextCorpus"
                )
            self._cache[index] = cached
            if len(self._cache) > self._cache_files:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(index)
        return cached

    def tokens(self, sample_key: int, start: int, end: int) -> np.ndarray:
        """Token ids [start, end) of document `sample_key` (the document index), as int64."""
        index = int(sample_key)
        length = int(self.lengths[index]) if 0 <= index < len(self.paths) else 0
        if not 0 <= start < end <= length:
            raise WorkloadError(
                f"text: tokens [{start}, {end}) requested from document {index} of {length} tokens; "
                "need 0 <= start < end <= length"
            )
        return self.document_bytes(index)[start:end].astype(np.int64)


def load_text(argument: str, seed: int, count: int | None) -> np.ndarray:
    corpus = TextCorpus(resolve_path(argument) if argument else None)
    return take_prefix(corpus.lengths, count, f"the text corpus {corpus.root}")


register_source(
    "text",
    "text[:DIR]",
    "Real text files (*.py, recursive, sorted) as documents with byte-level tokens; default DIR is this\n"
    "Python's standard library (no download needed). TextCorpus(DIR) serves the tokens.",
    load_text,
)
