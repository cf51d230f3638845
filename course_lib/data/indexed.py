"""Megatron's indexed dataset: ``PREFIX.bin`` (every token, back to back) and ``PREFIX.idx`` (where
each sequence starts), the files ``tools/preprocess_data.py`` writes and ``--data-path PREFIX`` reads.

The ``.idx`` layout (megatron-core ``megatron/core/datasets/indexed_dataset.py``, ``_IndexWriter``),
all little-endian::

    b"MMIDIDX\\x00\\x00"         9 bytes, magic
    version                   uint64, always 1
    dtype code                uint8   (DType: 8 = uint16 for a vocabulary < 65500, else 4 = int32)
    sequence_count            uint64  S
    document_count            uint64  D + 1
    sequence_lengths          int32[S]    tokens per sequence
    sequence_pointers         int64[S]    byte offset of each sequence in .bin
    document_indices          int64[D+1]  0, then the sequence count after each document

With ``preprocess_data.py``'s document level a non-empty document is one sequence; an empty one adds
a document and no sequence. :func:`write_indexed_dataset` writes the same bytes as megatron-core's
``IndexedDatasetBuilder`` (``tests/data/test_indexed.py`` compares them live);
:class:`IndexedDataset` reads them (``len``, ``[i]`` -> the tokens of sequence ``i``,
``sequence_lengths``, ``document_indices``) and refuses a file that is not one, in one line;
``IndexedDataset.in_memory`` reads the same bytes without writing them (the built-in corpus).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from course_lib.rules import UsageError

INDEX_HEADER = b"MMIDIDX\x00\x00"
DTYPE_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
               np.uint16: 8}
_DTYPE_OF = {code: dtype for dtype, code in DTYPE_CODES.items()}
_FIXED = len(INDEX_HEADER) + 8 + 1 + 8 + 8   # header, version, dtype code, the two counts


class IndexedDatasetError(UsageError):
    """A prefix whose ``.bin``/``.idx`` are missing or are not Megatron's indexed dataset (one line)."""


def optimal_dtype(vocab_size: int):
    """megatron-core's ``DType.optimal_dtype``: uint16 below 65500 token ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def index_bytes(sequence_lengths: Sequence[int], document_indices: Sequence[int], dtype) -> bytes:
    """The ``.idx`` file for these sequences (see the module docstring)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths):
        pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * np.dtype(dtype).itemsize
    return b"".join([INDEX_HEADER, struct.pack("<Q", 1), struct.pack("<B", DTYPE_CODES[dtype]),
                     struct.pack("<Q", len(lengths)), struct.pack("<Q", len(document_indices)),
                     lengths.tobytes(), pointers.tobytes(), np.asarray(document_indices, dtype=np.int64).tobytes()])


def encode_documents(documents: Iterable[Sequence[int]], dtype) -> tuple[bytes, bytes]:
    """``(.bin bytes, .idx bytes)`` of token documents, one sequence per non-empty document
    (``preprocess_data.py``'s document level)."""
    info = np.iinfo(dtype)
    parts, lengths, doc_ends = [], [], [0]
    for doc in documents:
        arr = np.asarray(doc, dtype=np.int64)
        if len(arr):
            if arr.min() < info.min or arr.max() > info.max:
                raise UsageError(f"token ids {arr.min()}..{arr.max()} do not fit {np.dtype(dtype).name}; "
                                 f"the vocabulary decides the dtype (optimal_dtype)")
            parts.append(arr.astype(dtype).tobytes())
            lengths.append(len(arr))
        doc_ends.append(len(lengths))
    return b"".join(parts), index_bytes(lengths, doc_ends, dtype)


def write_indexed_dataset(prefix, documents: Iterable[Sequence[int]], vocab_size: int, *,
                          force: bool = False) -> tuple[Path, Path]:
    """Write ``prefix.bin`` and ``prefix.idx``: atomic each, checked first (an existing file is
    replaced only with ``force``). Returns the two paths."""
    from course_lib.safe_files import check_output_file, write_atomic

    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    for path in (bin_path, idx_path):
        check_output_file(path, force=force, what="--output-prefix")
    data, index = encode_documents(documents, optimal_dtype(vocab_size))
    write_atomic(bin_path, data)
    write_atomic(idx_path, index)
    return bin_path, idx_path


class IndexedDataset:
    """Read ``prefix.bin``/``prefix.idx`` (megatron-core's ``IndexedDataset``, document level).

    ``sequence_lengths`` int32 ``[S]``, ``sequence_pointers`` int64 ``[S]``, ``document_indices``
    int64 ``[D+1]``, ``dtype``; ``len(ds) == S``; ``ds[i]`` the tokens of sequence ``i``;
    ``ds.get(i, offset, length)`` a slice of it (megatron-core's ``get``)."""

    def __init__(self, prefix):
        self.prefix = str(prefix)
        idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for path in (idx_path, bin_path):
            if not path.is_file():
                raise IndexedDatasetError(f"--data-path {prefix}: {path} is missing; make both files with "
                                          f"`python -m course_lib preprocess --output-prefix ...` (the prefix is "
                                          f"the file name without .bin/.idx)")
        self._read_index(idx_path.read_bytes(), idx_path)
        need = int(self.sequence_lengths.astype(np.int64).sum()) * np.dtype(self.dtype).itemsize
        have = bin_path.stat().st_size
        if have != need:
            raise IndexedDatasetError(f"{bin_path}: {have} bytes, but {idx_path} indexes {need} "
                                      f"({'truncated' if have < need else 'longer than its index'}); "
                                      f"run preprocess again with --force")
        self._bin = np.memmap(bin_path, dtype=self.dtype, mode="r") if need else np.zeros(0, self.dtype)

    @classmethod
    def in_memory(cls, name: str, documents: Iterable[Sequence[int]], vocab_size: int) -> "IndexedDataset":
        """The dataset :func:`write_indexed_dataset` would write for ``documents``, read from the same bytes
        held in memory (nothing written); ``name`` stands for the prefix in messages and cache descriptions."""
        self = cls.__new__(cls)
        self.prefix = name
        data, index = encode_documents(documents, optimal_dtype(vocab_size))
        self._read_index(index, name)
        self._bin = np.frombuffer(data, dtype=self.dtype)
        return self

    def _read_index(self, raw: bytes, idx_path) -> None:
        """``sequence_lengths``, ``sequence_pointers``, ``document_indices`` and ``dtype`` from ``.idx`` bytes."""
        if len(raw) < _FIXED or raw[:len(INDEX_HEADER)] != INDEX_HEADER:
            raise IndexedDatasetError(f"{idx_path}: not a Megatron .idx file (no MMIDIDX header)")
        version, code = struct.unpack_from("<QB", raw, len(INDEX_HEADER))
        if version != 1 or code not in _DTYPE_OF:
            raise IndexedDatasetError(f"{idx_path}: version {version} / dtype code {code} is not Megatron's "
                                      f"(version 1, codes {sorted(_DTYPE_OF)})")
        self.dtype = _DTYPE_OF[code]
        seqs, docs = struct.unpack_from("<QQ", raw, len(INDEX_HEADER) + 9)
        if len(raw) != _FIXED + 12 * seqs + 8 * docs:
            raise IndexedDatasetError(f"{idx_path}: {len(raw)} bytes, but {seqs} sequences and {docs} document "
                                      f"bounds need {_FIXED + 12 * seqs + 8 * docs}; the file is cut or not an index")
        self.sequence_lengths = np.frombuffer(raw, np.int32, seqs, _FIXED)
        self.sequence_pointers = np.frombuffer(raw, np.int64, seqs, _FIXED + 4 * seqs)
        self.document_indices = np.frombuffer(raw, np.int64, docs, _FIXED + 12 * seqs)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // np.dtype(self.dtype).itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        return np.asarray(self._bin[start:start + length])

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)
