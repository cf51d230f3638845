"""``--data-path`` and ``--split`` as megatron-core's ``BlendedMegatronDatasetBuilder`` reads them
(``megatron/core/datasets/blended_megatron_dataset_builder.py``, ``blended_dataset.py``,
``blended_megatron_dataset_config.py``, ``utils.py``; megatron-core 0.16.1).

* ``--data-path PREFIX`` or a weighted blend ``--data-path 0.7 A 0.3 B`` (:func:`parse_blend`;
  weights are normalised; an odd-length list is a list of prefixes, weighted by their sizes).
* ``--split 949,50,1`` (:func:`parse_split`): each prefix's documents are cut, in file order, into
  contiguous train / valid / test ranges: ``[round(a * D), round(b * D))`` for the split's bookends
  ``(a, b)`` (:func:`split_matrix`).
* sizes (:func:`num_samples_per_split`, Megatron-LM ``training.py::get_train_valid_test_num_samples``):
  train ``train_iters * global_batch``, valid ``(train_iters // eval_interval + 1) * eval_iters *
  global_batch`` (every evaluation takes fresh samples), test ``eval_iters * global_batch``.
* a blend of ``K`` prefixes: prefix ``k`` is asked for ``ceil(ceil(size * w_k) * 1.005)`` samples
  (``mid_level_dataset_surplus``) and the blend's sample ``i`` comes from the prefix whose share is
  furthest behind its weight (:func:`blending_indices`, ``helpers.cpp``'s ``build_blending_indices``).

:func:`build_datasets` returns one dataset per split (or None); ``dataset[i]`` is the
``seq_length + 1`` token ids of sample ``i``, ``dataset.batch(indices)`` Megatron's batch dict.
Bad input (weights that do not parse, a missing ``.idx``...) is one ``UsageError`` line.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np

from course_lib.data.gpt_dataset import MegatronGPTDataset
from course_lib.data.index_cache import CacheEntry, blended_identifiers, gpt_identifiers
from course_lib.data.indexed import IndexedDataset
from course_lib.rules import UsageError

SPLITS = ("train", "valid", "test")
MID_LEVEL_DATASET_SURPLUS = 0.005   # BlendedMegatronDatasetConfig.mid_level_dataset_surplus


def normalize(weights) -> list[float]:
    """megatron-core's ``utils.normalize``, bit for bit (NumPy's sum): the weights and split shares it
    computes are written into ``--data-cache-path``'s descriptions, so they must print the same."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def parse_blend(data_path) -> tuple[list[str], list[float] | None]:
    """``--data-path`` words -> ``(prefixes, normalised weights or None)`` (``get_blend_from_list``)."""
    words = [data_path] if isinstance(data_path, str) else list(data_path or [])
    if not words:
        raise UsageError("--data-path needs a prefix (PREFIX for PREFIX.bin/.idx) or a blend like '0.7 A 0.3 B'")
    if len(words) % 2:
        return [w.strip() for w in words], None
    weights = []
    for w in words[0::2]:
        try:
            weights.append(float(w))
        except ValueError:
            weights.append(None)
    if all(w is None for w in weights):
        return [w.strip() for w in words], None
    bad = [words[2 * i] for i, w in enumerate(weights) if w is None or not math.isfinite(w) or w <= 0]
    if bad:
        raise UsageError(f"--data-path {' '.join(words)}: {bad[0]!r} is not a positive weight; a blend is "
                         f"'WEIGHT PREFIX WEIGHT PREFIX ...', e.g. --data-path 0.7 data/a_text_document "
                         f"0.3 data/b_text_document")
    return [w.strip() for w in words[1::2]], normalize(weights)


def parse_split(split: str) -> list[float]:
    """``parse_and_normalize_split``: ``"949,50,1"`` -> ``[0.949, 0.05, 0.001]``."""
    values = [float(v) for v in re.findall(r"[.0-9]+", str(split))]
    if not values or len(values) > 3 or sum(values) <= 0:
        raise UsageError(f"--split {split!r}: give up to three non-negative shares, train,valid,test, e.g. 949,50,1")
    values += [0.0] * (3 - len(values))
    return normalize(values)


def split_matrix(vector) -> list[tuple[float, float] | None]:
    """``convert_split_vector_to_split_matrix`` (one vector): ``[0.9, 0.1, 0]`` ->
    ``[(0, 0.9), (0.9, 1.0), None]`` (None: an empty split). The same running sum from an int 0, so the
    bookends print as megatron-core's in the ``--data-cache-path`` description."""
    ends = [0]
    for v in vector:
        ends.append(ends[-1] + v)
    return [None if b <= a else (a, b) for a, b in zip(ends[:-1], ends[1:])]


def split_indices(num_documents: int, bookends) -> np.ndarray | None:
    """The document ids of one split: ``[round(a * D), round(b * D))`` (Python's round, as Megatron's)."""
    if bookends is None:
        return None
    beg, end = (int(round(x * float(num_documents))) for x in bookends)
    return np.arange(beg, end, dtype=np.int32)


def num_samples_per_split(train_iters: int, global_batch_size: int, eval_interval: int | None,
                          eval_iters: int) -> list[int]:
    """Megatron-LM's ``get_train_valid_test_num_samples`` (no --train-samples, no --full-validation)."""
    evals = (train_iters // eval_interval + 1) if eval_interval else 1
    return [train_iters * global_batch_size, evals * eval_iters * global_batch_size, eval_iters * global_batch_size]


def blending_indices(weights, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``helpers.cpp``'s ``build_blending_indices``: for each blended sample ``i``, the dataset whose
    count lags most behind ``weight * max(i, 1)`` (the first on a tie), and that dataset's next sample.
    Returns ``(dataset_index int16 [size], dataset_sample_index int64 [size])``."""
    weights = [float(w) for w in weights]
    taken = [0] * len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    for i in range(size):
        x = max(float(i), 1.0)
        errors = [w * x - t for w, t in zip(weights, taken)]
        k = max(range(len(weights)), key=lambda d: (errors[d], -d))
        dataset_index[i], sample_index[i] = k, taken[k]
        taken[k] += 1
    return dataset_index, sample_index


class BlendedSamples:
    """megatron-core's ``BlendedDataset``: sample ``i`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``.
    With ``cache_path`` (``--data-cache-path``; the datasets built with theirs) the two indices are megatron-core's
    ``HASH-BlendedDataset-SPLIT-*.npy`` files there, loaded or written."""

    def __init__(self, datasets, weights, size: int, cache_path=None):
        self.datasets = list(datasets)
        self.weights = normalize(weights)             # BlendedDataset normalises again
        build = functools.partial(blending_indices, self.weights, size)
        if cache_path is None:
            self.dataset_index, self.dataset_sample_index = build()
        else:
            identifiers = blended_identifiers([d.cache.identifiers for d in self.datasets],
                                              self.datasets[0].cache.split_name, self.weights, size)
            entry = CacheEntry(cache_path, identifiers, self.datasets[0].cache.split_name)
            self.dataset_index, self.dataset_sample_index = entry.load_or_build(build)
        for k, ds in enumerate(self.datasets):
            need = int((self.dataset_index == k).sum())
            if need > len(ds):
                raise UsageError(f"the blend asks {need} samples of dataset {k}, which has {len(ds)}")
        self.seq_length, self.eod = self.datasets[0].seq_length, self.datasets[0].eod

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]

    batch = MegatronGPTDataset.batch


def _size_per_dataset(weights, size: int, surplus: float = 0.0) -> list[int]:
    """``_get_size_per_split_per_dataset`` for one split."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def build_datasets(data_path, split: str, sizes, seq_length: int, seed: int, eod: int,
                   wanted=SPLITS, cache_path=None, tokenizer_identifiers=None, indexed=None) -> list:
    """The train/valid/test datasets of ``--data-path``/``--split`` for ``sizes`` samples each, as
    ``BlendedMegatronDatasetBuilder.build``; a split not in ``wanted`` (or empty) is None.
    ``cache_path`` (``--data-cache-path``): each ``GPTDataset``'s indices (and a blend's) are loaded from /
    written to megatron-core's files there (:mod:`course_lib.data.index_cache`), described with
    ``tokenizer_identifiers`` (the tokenizer's ``unique_identifiers``). ``indexed``: the prefixes' datasets
    already open (the built-in corpus in memory, :func:`course_lib.data.corpus.corpus_indexed_dataset`)."""
    prefixes, weights = parse_blend(data_path)
    bookends = split_matrix(parse_split(split))
    if indexed is None:
        indexed = [IndexedDataset(p) for p in prefixes]      # every prefix checked before any index is built
    wanted_ids = [i for i, name in enumerate(SPLITS) if name in wanted and bookends[i] is not None]

    def mid_level(k, i, num_samples):
        ids = split_indices(len(indexed[k].sequence_lengths), bookends[i])
        cache = None
        if cache_path is not None:
            cache = CacheEntry(cache_path, gpt_identifiers(prefixes[k], num_samples, SPLITS[i], seed, seq_length,
                                                           split, bookends, tokenizer_identifiers), SPLITS[i])
        return MegatronGPTDataset(indexed[k], ids, num_samples, seq_length, seed, eod,
                                  name=f"{SPLITS[i]} (of {prefixes[k]})", cache=cache)

    out = [None] * len(SPLITS)
    for i in wanted_ids:
        if len(prefixes) == 1 and weights is None:
            out[i] = mid_level(0, i, sizes[i])
        elif weights is None:                   # prefixes weighted by their sizes, one epoch each
            parts = [mid_level(k, i, None) for k in range(len(prefixes))]
            lengths = [len(p) for p in parts]
            total = sum(lengths)
            out[i] = BlendedSamples(parts, lengths, min(sizes[i], total), cache_path)
        else:
            target = _size_per_dataset(weights, sizes[i])
            buffered = _size_per_dataset(weights, sizes[i], MID_LEVEL_DATASET_SURPLUS)
            parts = [mid_level(k, i, buffered[k]) for k in range(len(prefixes))]
            out[i] = BlendedSamples(parts, weights, sum(target), cache_path)
    return out
