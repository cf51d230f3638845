"""Samples from an indexed dataset the way megatron-core's ``GPTDataset`` draws them
(``megatron/core/datasets/gpt_dataset.py`` and ``helpers.cpp``, megatron-core 0.16.1).

Three indices, built once per split from the documents ``indices`` of that split:

* **document index** ``[E * D]`` int32: the split's documents repeated for ``E`` epochs and shuffled
  together with ``numpy.random.RandomState(seed)`` (:func:`build_document_index`). ``E`` is the
  fewest epochs whose tokens cover ``num_samples * seq_length + 1``. When the last epoch would give
  fewer than 80 % of an epoch's samples it is shuffled on its own ("separate final epoch"), so the
  few samples drawn from it are not all from the first documents of a joint shuffle.
* **sample index** ``[N + 1, 2]``: where sample ``j`` starts -- a position in the document index and
  a token offset in that document (:func:`build_sample_index`, ``helpers.cpp``'s ``build_sample_idx``).
  Samples run across document edges; sample ``j`` is the ``seq_length + 1`` tokens from its start, so
  neighbours share one token (the last label of ``j`` is the first token of ``j + 1``).
  ``N = (E * tokens_per_epoch - 1) // seq_length``.
* **shuffle index** ``[N]`` uint32: a permutation of the samples, drawn from the same random state
  after the document index (:func:`build_shuffle_index`); with a separate final epoch the samples of
  the earlier epochs and those of the last one are shuffled apart.

``MegatronGPTDataset[i]`` is sample ``shuffle_index[i]``: ``seq_length + 1`` token ids.
``tests/data/test_gpt_dataset.py`` compares every index and every sample with megatron-core's own
``GPTDataset`` built on the same files, split and seed.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from course_lib import rules

SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80   # gpt_dataset.py: `threshold = 0.80`


def num_epochs_for(num_samples: int | None, tokens_per_epoch: int, seq_length: int) -> int:
    """``GPTDataset._get_num_epochs``: the fewest epochs with ``num_samples * seq_length + 1`` tokens
    (one epoch when ``num_samples`` is None)."""
    if num_samples is None:
        return 1
    need = num_samples * seq_length + 1
    return max(1, -(-need // tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """``_build_document_index``: ``documents`` repeated ``num_epochs`` times, shuffled in place by
    ``rng`` (all epochs at once, or the last one apart). int32 ``[num_epochs * len(documents)]``."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate((first, build_document_index(documents, 1, rng, False)))


def build_sample_index(sizes, document_index, seq_length: int, num_epochs: int, tokens_per_epoch: int) -> np.ndarray:
    """``helpers.cpp``'s ``build_sample_idx`` (drop the last partial sample, one extra token):
    row ``j`` of the int32 ``[N + 1, 2]`` result is ``(position in document_index, offset)`` where
    sample ``j`` starts; row ``N`` is where the last sample ends (its ``seq_length + 1``-th token).

    Walk the documents in ``document_index`` order with a budget of ``seq_length + 1`` tokens per
    sample; a sample that ends inside a document starts the next sample at its own last token."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int32)
    position, offset = 0, 0
    for j in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining:
            length = int(sizes[document_index[position]]) - offset
            remaining -= length
            if remaining <= 0:                      # the sample ends inside this document
                offset += remaining + length - 1    # ... and the next one starts on its last token
                remaining = 0
            elif position == len(document_index) - 1:
                offset = int(sizes[document_index[position]]) - 1
                break
            else:
                position, offset = position + 1, 0
        out[j] = position, offset
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """``_build_shuffle_index``: ``[0, num_samples)`` shuffled, then ``[num_samples, total_size)``
    shuffled apart (a separate final epoch). uint32."""
    first = np.arange(num_samples, dtype=np.uint32)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.uint32)
    rng.shuffle(last)
    return np.concatenate((first, last))


class MegatronGPTDataset:
    """One split of one indexed dataset, sampled as megatron-core's ``GPTDataset``.

    Args:
        indexed: a :class:`course_lib.data.indexed.IndexedDataset` (or anything with
            ``sequence_lengths`` and ``get(i, offset, length)``).
        indices: the split's document (sequence) ids, int32, contiguous as ``--split`` cuts them.
        num_samples: samples the run will draw (Megatron: ``train_iters * global_batch_size`` for
            train); None: one epoch.
        seq_length: ``--seq-length``; seed: ``--seed``; eod: the tokenizer's eod id (``--eod-mask-loss``).
        name: the split's name, for messages.
        cache: a :class:`course_lib.data.index_cache.CacheEntry` for ``--data-cache-path``: the three indices
            are loaded from megatron-core's files there, or built and written.
    """

    def __init__(self, indexed, indices, num_samples: int | None, seq_length: int, seed: int, eod: int,
                 name: str = "train", cache=None):
        self.indexed, self.name = indexed, name
        self.indices = np.asarray(indices, dtype=np.int32)
        self.seq_length = rules.integer("seq_length", seq_length)
        self.seed = rules.integer("seed", seed, minimum=0)
        self.eod = eod
        self.num_samples = num_samples
        sizes = np.asarray(indexed.sequence_lengths, dtype=np.int32)
        tokens_per_epoch = int(sizes[self.indices].astype(np.int64).sum())
        rules.split_holds_a_sample(name, len(self.indices), tokens_per_epoch, self.seq_length)
        self.num_epochs = num_epochs_for(num_samples, tokens_per_epoch, self.seq_length)
        self.cache = cache
        build = functools.partial(self._build_indices, sizes, tokens_per_epoch)
        self.document_index, self.sample_index, self.shuffle_index = \
            build() if cache is None else cache.load_or_build(build)

    def _build_indices(self, sizes, tokens_per_epoch: int):
        """``_build_document_sample_shuffle_indices`` (the build half): ``(document, sample, shuffle)``."""
        epochs = self.num_epochs
        per_epoch = (tokens_per_epoch - 1) // self.seq_length
        separate = False
        if epochs > 1:
            before_last = ((epochs - 1) * tokens_per_epoch - 1) // self.seq_length
            separate = self.num_samples - before_last < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.indices, epochs, rng, separate)
        sample_index = build_sample_index(sizes, document_index, self.seq_length, epochs, tokens_per_epoch)
        total = len(sample_index) - 1
        return document_index, sample_index, build_shuffle_index(before_last if separate else total, total, rng)

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``shuffle_index[idx]`` (int64)."""
        j = int(self.shuffle_index[idx])
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[j], self.sample_index[j + 1]
        parts = []
        for pos in range(doc_beg, doc_end + 1):
            offset = int(off_beg) if pos == doc_beg else 0
            length = None if pos < doc_end else int(off_end) + 1 - offset
            parts.append(self.indexed.get(int(self.document_index[pos]), offset=offset, length=length))
        return np.concatenate(parts).astype(np.int64)

    def batch(self, indices, eod_mask_loss: bool = False, reset_position_ids: bool = False,
              reset_attention_mask: bool = False) -> dict:
        """Samples ``indices`` as Megatron's batch dict: ``tokens``/``labels`` int64 ``[b, s]``, ``loss_mask``
        float32 ``[b, s]``, ``position_ids`` int64 ``[b, s]`` and, with ``reset_attention_mask``,
        ``attention_mask`` bool ``[b, 1, s, s]`` (True = masked); see :func:`ltor_masks_and_position_ids`."""
        windows = np.stack([self[i] for i in indices])                        # [b, s+1]
        tokens = torch.from_numpy(windows[:, :-1].copy())
        labels = torch.from_numpy(windows[:, 1:].copy())
        masks = [ltor_masks_and_position_ids(t, self.eod, reset_position_ids, reset_attention_mask, eod_mask_loss)
                 for t in tokens]
        out = {"tokens": tokens, "labels": labels, "loss_mask": torch.stack([m[1] for m in masks]),
               "position_ids": torch.stack([m[2] for m in masks])}
        if reset_attention_mask:
            out["attention_mask"] = torch.stack([m[0] for m in masks])
        return out


def ltor_masks_and_position_ids(tokens: torch.Tensor, eod: int, reset_position_ids: bool = False,
                                reset_attention_mask: bool = False, eod_mask_loss: bool = False):
    """megatron-core's ``_get_ltor_masks_and_position_ids`` (``gpt_dataset.py``) for one sample ``[s]``.

    Returns ``(attention_mask [1, s, s] bool, True = masked, or None without reset_attention_mask;
    loss_mask [s] float32; position_ids [s] int64)``:

    * ``eod_mask_loss`` (``--eod-mask-loss``): the loss mask is 0 where the *input* token is eod (the
      prediction made from an eod, i.e. the first token of the next document, is not trained);
    * ``reset_position_ids`` (``--reset-position-ids``): positions restart at 0 after each eod (the eod
      itself keeps the position it had in its document);
    * ``reset_attention_mask`` (``--reset-attention-mask``): on top of the causal mask, a token never
      attends to a token before the last eod that precedes it (each document sees only itself).

    Vectorised: a token's segment is the number of eods strictly before it."""
    s = tokens.numel()
    is_eod = tokens == eod
    segment = torch.cumsum(is_eod.long(), 0) - is_eod.long()                  # eods strictly before each token
    loss_mask = torch.ones(s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.int64)
    if reset_position_ids:
        after_eod = torch.zeros(s, dtype=torch.int64)
        after_eod[1:] = torch.where(is_eod[:-1], torch.arange(1, s), torch.zeros(s - 1, dtype=torch.int64))
        position_ids = position_ids - torch.cummax(after_eod, 0).values       # minus where the document starts
    if not reset_attention_mask:      # the model's attention is causal by itself: no [s, s] mask to carry
        return None, loss_mask, position_ids
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & (segment[:, None] == segment[None, :])
    return ~allowed.unsqueeze(0), loss_mask, position_ids
