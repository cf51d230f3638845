"""``--data-cache-path``: megatron-core's on-disk cache of a ``GPTDataset``'s three indices (and a blend's two).

megatron-core (``megatron/core/datasets/megatron_dataset.py`` ``MegatronDataset.__init__`` and
``gpt_dataset.py`` ``_build_document_sample_shuffle_indices``, 0.16.1) names a split's indices by the
MD5 of a JSON description of everything that decides them::

    {"class": "GPTDataset", "dataset_path": PREFIX, "num_samples": N, "index_split": "train",
     "random_seed": --seed, "sequence_length": --seq-length, "split": "90,9,1",
     "split_matrix": [[0, 0.9], ...], "tokenizer": {the tokenizer's unique_identifiers}}

(``json.dumps(..., indent=4)``), and keeps four files under the cache folder::

    HASH-GPTDataset-train-description.txt      the description itself
    HASH-GPTDataset-train-document_index.npy   int32 [E * D]
    HASH-GPTDataset-train-sample_index.npy     int32 [N + 1, 2]
    HASH-GPTDataset-train-shuffle_index.npy    uint32 [N]

A run finds all four and loads them, or builds the indices and (rank 0 only) writes them. The course
does the same with the same names and bytes (``tests/data/test_megatron_data.py`` compares them with
what megatron-core writes, and lets megatron-core load the course's files), with two differences:
each file is written atomically and only when missing, so a run never replaces a file; and the
arrays are loaded with ``allow_pickle=False`` after the description is compared with the run's,
so a cache that does not belong to this configuration is one line, not a silent wrong order.
Without ``--data-cache-path`` megatron-core writes under ``PREFIX/cache/GPTDataset_indices``; the
course then keeps the indices in memory and writes nothing.

The tokenizer's part of the description is its ``unique_identifiers``: the course records those of
Megatron-LM's legacy tokenizers (``_GPT2BPETokenizer``, ``_NullTokenizer``), which Megatron-LM main
builds with ``--legacy-tokenizer``; without it, main's ``megatron.core.tokenizers`` tokenizer records
other fields, so its hash (its file names) differs while the arrays are the same.

A weighted blend adds megatron-core's ``BlendedDataset`` files (``blended_dataset.py``
``_build_indices``): ``HASH-BlendedDataset-train-{description.txt, dataset_index.npy (int16),
dataset_sample_index.npy (int64)}``, described by the class, its datasets' descriptions, the split,
the normalised weights and the size.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from course_lib.rules import UsageError

INDEX_FILES = {"GPTDataset": ("document_index", "sample_index", "shuffle_index"),
               "BlendedDataset": ("dataset_index", "dataset_sample_index")}
_DTYPES = {"document_index": np.int32, "sample_index": np.int32, "shuffle_index": np.uint32,
           "dataset_index": np.int16, "dataset_sample_index": np.int64}


def gpt_identifiers(dataset_path: str, num_samples, split_name: str, seed: int, seq_length: int, split: str,
                    split_matrix, tokenizer_identifiers) -> OrderedDict:
    """``MegatronDataset.unique_identifiers`` of one ``GPTDataset`` split (key order as megatron-core's)."""
    return OrderedDict(
        [("class", "GPTDataset"), ("dataset_path", dataset_path), ("num_samples", num_samples),
         ("index_split", split_name), ("random_seed", seed), ("sequence_length", seq_length), ("split", split),
         ("split_matrix", split_matrix), ("tokenizer", tokenizer_identifiers)])


def blended_identifiers(datasets, split_name: str, weights, size: int) -> OrderedDict:
    """``BlendedDataset``'s: its datasets' identifiers, the split, the normalised weights, the size."""
    return OrderedDict([("class", "BlendedDataset"), ("datasets", list(datasets)), ("split", split_name),
                        ("weights", list(weights)), ("size", size)])


@dataclass(frozen=True)
class CacheEntry:
    """One dataset's files under ``--data-cache-path``: ``folder``, ``identifiers`` (whose class names the
    kind), ``split_name``."""

    folder: str
    identifiers: OrderedDict
    split_name: str

    @property
    def description(self) -> str:
        return json.dumps(self.identifiers, indent=4)

    def files(self) -> dict[str, Path]:
        """``{affix: path}``: the description first, then the ``.npy`` files (megatron-core's names)."""
        kind = self.identifiers["class"]
        digest = hashlib.md5(self.description.encode("utf-8"), usedforsecurity=False).hexdigest()
        base = Path(self.folder) / f"{digest}-{kind}-{self.split_name}"
        return {affix: Path(f"{base}-{affix}{'.txt' if affix == 'description' else '.npy'}")
                for affix in ("description", *INDEX_FILES[kind])}

    def load_or_build(self, build) -> tuple:
        """The cached arrays when all the files are there, else ``build()``'s, written by rank 0."""
        files = self.files()
        cached = load(files, self.description)
        if cached is not None:
            return cached
        arrays = build()
        if writes_cache():
            save(files, self.description, arrays)
        return arrays


def load(files: dict[str, Path], description: str):
    """The cached arrays, or None when any file is missing (build them)."""
    if not all(path.is_file() for path in files.values()):
        return None
    if files["description"].read_text(encoding="utf-8") != description:
        raise UsageError(f"--data-cache-path: {files['description']} does not describe this run's dataset; "
                         f"the folder holds another run's files under this name: give another --data-cache-path")
    out = []
    for affix in list(files)[1:]:
        try:
            array = np.load(files[affix], allow_pickle=False, mmap_mode="r")
        except (ValueError, OSError) as exc:
            raise UsageError(f"--data-cache-path: {files[affix]} is not a NumPy index ({exc}); move the "
                             f"cache files away (they are rebuilt) or give another --data-cache-path") from None
        if array.dtype != _DTYPES[affix]:
            raise UsageError(f"--data-cache-path: {files[affix]} holds {array.dtype}, not {np.dtype(_DTYPES[affix])}; "
                             f"move it away (it is rebuilt) or give another --data-cache-path")
        out.append(array)
    return tuple(out)


def npy_bytes(array: np.ndarray) -> bytes:
    """What ``numpy.save(path, array, allow_pickle=True)`` writes (megatron-core's call), as bytes."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def save(files: dict[str, Path], description: str, arrays) -> None:
    """Write the files that are missing, each atomically (the description last, as megatron-core's readers
    test all of them: a reader never sees a half-built cache)."""
    from course_lib.safe_files import write_atomic

    for affix, array in zip(list(files)[1:], arrays):
        if not files[affix].exists():
            write_atomic(files[affix], npy_bytes(np.asarray(array)))
    if not files["description"].exists():
        write_atomic(files["description"], description)


def writes_cache() -> bool:
    """megatron-core's rule: the indices are written by global rank 0, or by a process with no world."""
    import torch.distributed as dist

    return not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0
