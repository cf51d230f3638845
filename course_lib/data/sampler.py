"""Deterministic GPT samples, sharded over data-parallel ranks like Megatron-LM.

Two pieces, each following a Megatron file:

* ``GPTDataset`` (after ``megatron/core/datasets/gpt_dataset.py``): the corpus is
  one token stream (every document followed by the eod token, as
  ``tools/preprocess_data.py --append-eod`` writes it). Window ``w`` is the
  ``seq_length + 1`` tokens starting at ``w * seq_length`` (neighbouring windows
  share one token, as Megatron's sample index does), so ``tokens = window[:-1]``
  and ``labels = window[1:]``. Global sample ``i`` of epoch ``e = i // len`` is
  window ``shuffle_e[i % len]``, ``shuffle_e`` a permutation seeded by
  ``(seed, e)``. Simplified against Megatron: the document order is not shuffled
  and there is no blending or train/valid/test split.

* the batch order of ``MegatronPretrainingSampler``
  (``megatron/training/datasets/data_samplers.py``): the global batch of
  iteration ``it`` (0-based: the number of iterations already done, as in
  Megatron's training loop) is the global samples
  ``[it * G, (it + 1) * G)``, ``G = global_batch_size``. They are consumed
  ``micro_batch_size * dp`` at a time (one micro-batch on every DP rank); inside
  such a group, DP rank ``r`` takes ``[r * micro, (r + 1) * micro)``. So

      sample = it*G + micro_batch_index*(micro*dp) + dp_rank*micro + j,  j < micro

  and the union over all ``(micro_batch_index, dp_rank)`` of one iteration is
  exactly the single-process global batch ``[it*G, (it+1)*G)`` -- the property that
  makes every parallel layout see the same data (``tests/data/test_data.py`` checks it).

Batches are dicts of torch tensors with Megatron's keys (``pretrain_gpt.py``
``get_batch``): ``tokens`` and ``labels`` int64 ``[b, s]``, ``loss_mask`` float32
``[b, s]`` (ones; zeros at eod tokens with ``eod_mask_loss=True``, Megatron's
``--eod-mask-loss``), ``position_ids`` int64 ``[b, s]`` (``0..s-1``). Split them along
the sequence for context parallelism with ``course_lib.data.get_batch_on_this_cp_rank``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from course_lib import rules
from course_lib.data.corpus import load_documents
from course_lib.data.tokenizer import ByteTokenizer

DEFAULT_SEED = 1234  # Megatron's --seed default


@functools.lru_cache(maxsize=1)
def _corpus_tokens() -> np.ndarray:
    tok = ByteTokenizer()
    ids = []
    for doc in load_documents():
        ids.extend(tok.encode(doc, append_eod=True))
    arr = np.asarray(ids, dtype=np.int64)
    arr.setflags(write=False)
    return arr


def corpus_tokens() -> np.ndarray:
    """The shipped corpus as one int64 token stream (byte tokens, eod after each document)."""
    return _corpus_tokens()


class GPTDataset:
    """Windows of ``seq_length + 1`` tokens from a token stream, in a seeded order.

    Args:
        seq_length: tokens per sample (``--seq-length``).
        seed: shuffle seed (``--seed``).
        tokens: 1-D int token stream; default: the shipped corpus (``corpus_tokens()``).

    ``len(ds)`` is the number of windows in one epoch; any ``idx >= 0`` is valid
    (later epochs reuse the windows in a new order). ``ds[idx]`` is an int64
    array of ``seq_length + 1`` tokens.
    """

    def __init__(self, seq_length: int, seed: int = DEFAULT_SEED, tokens=None):
        self.seq_length = rules.integer("seq_length", seq_length)
        self.seed = rules.integer("seed", seed, minimum=0)
        self.tokens = corpus_tokens() if tokens is None else np.asarray(tokens, dtype=np.int64)
        if self.tokens.ndim != 1:
            raise rules.UsageError(f"tokens must be a 1-D token stream, got shape {tuple(self.tokens.shape)}")
        rules.seq_length_fits_corpus(self.seq_length, len(self.tokens))
        self.num_windows = (len(self.tokens) - 1) // self.seq_length
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_windows

    def shuffle_index(self, epoch: int) -> np.ndarray:
        """The window order of ``epoch`` (a permutation of ``range(len(self))``)."""
        if epoch not in self._perms:
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.num_windows)
        return self._perms[epoch]

    def window_of(self, idx: int) -> int:
        epoch, j = divmod(rules.integer("sample index", idx, minimum=0), self.num_windows)
        return int(self.shuffle_index(epoch)[j])

    def __getitem__(self, idx: int) -> np.ndarray:
        start = self.window_of(idx) * self.seq_length
        return self.tokens[start:start + self.seq_length + 1]

    def batch(self, indices, eod: int | None = ByteTokenizer.eod, eod_mask_loss: bool = False) -> dict:
        """Samples ``indices`` stacked into Megatron's batch dict (see module docstring)."""
        windows = np.stack([self[i] for i in indices])                       # [b, s+1]
        tokens = torch.from_numpy(windows[:, :-1].copy())                     # [b, s]
        labels = torch.from_numpy(windows[:, 1:].copy())                      # [b, s]
        loss_mask = torch.ones(tokens.shape, dtype=torch.float32)
        if eod_mask_loss and eod is not None:
            loss_mask[tokens == eod] = 0.0
        position_ids = torch.arange(self.seq_length, dtype=torch.int64).expand_as(tokens).contiguous()
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


@functools.lru_cache(maxsize=8)
def _corpus_dataset(seq_length: int, seed: int) -> GPTDataset:
    return GPTDataset(seq_length, seed)


class DataPosition:
    """Where the sampler stands, as state that saves itself (torchtitan's ``Stateful`` shape): the
    ``consumed_train_samples`` of Megatron's ``MegatronPretrainingSampler(consumed_samples=...)``
    (``megatron/training/datasets/data_samplers.py``). The batch order above makes it
    ``iteration x global_batch_size``, so :attr:`iteration` is where a resume continues."""

    def __init__(self, global_batch_size: int, consumed_train_samples: int = 0):
        self.global_batch_size = rules.integer("global_batch_size", global_batch_size)
        self.consumed_train_samples = rules.integer("consumed_train_samples", consumed_train_samples, minimum=0)

    @property
    def iteration(self) -> int:
        """Iterations done: ``consumed_train_samples // global_batch_size``."""
        return self.consumed_train_samples // self.global_batch_size

    def state_dict(self) -> dict:
        return {"consumed_train_samples": self.consumed_train_samples}

    def load_state_dict(self, state: dict) -> None:
        consumed = rules.integer("consumed_train_samples", state["consumed_train_samples"], minimum=0)
        if consumed % self.global_batch_size:
            raise rules.UsageError(f"consumed_train_samples={consumed} is not a whole number of global batches of "
                                   f"{self.global_batch_size}: the data position was saved with another "
                                   f"--global-batch-size; resume with that one")
        self.consumed_train_samples = consumed


def microbatch_sample_indices(iteration: int, micro_batch_index: int, dp_rank: int, dp_size: int,
                              micro_batch_size: int, global_batch_size: int | None = None) -> range:
    """Global sample indices of one micro-batch on one DP rank (Megatron's sampler order).

    ``global_batch_size`` defaults to ``micro_batch_size * dp_size`` (one micro-batch
    per step, Megatron's default when ``--global-batch-size`` is not given).
    """
    iteration = rules.integer("iteration", iteration, minimum=0)
    dp_size = rules.integer(rules.DP, dp_size)
    micro = rules.integer("micro_batch_size", micro_batch_size)
    gbs = micro * dp_size if global_batch_size is None else rules.integer("global_batch_size", global_batch_size)
    num_micro = rules.num_microbatches(gbs, micro, dp_size)
    dp_rank = rules.rank_in("dp_rank", dp_rank, dp_size, rules.DP)
    mb = rules.rank_in("micro_batch_index", micro_batch_index, num_micro, "num_microbatches")
    start = iteration * gbs + mb * micro * dp_size + dp_rank * micro
    return range(start, start + micro)


def get_batch(iteration: int, micro_batch_index: int, dp_rank: int, dp_size: int, micro_batch_size: int,
              seq_length: int, seed: int = DEFAULT_SEED, *, global_batch_size: int | None = None,
              eod_mask_loss: bool = False, dataset: GPTDataset | None = None) -> dict:
    """One micro-batch for one DP rank: ``tokens``/``labels``/``loss_mask``/``position_ids``, each ``[micro, s]``.

    ``iteration`` is 0-based (iterations already done). Uses the shipped corpus unless
    ``dataset`` is given (its ``seq_length`` must match).
    """
    idx = microbatch_sample_indices(iteration, micro_batch_index, dp_rank, dp_size, micro_batch_size,
                                    global_batch_size)
    ds = _corpus_dataset(rules.integer("seq_length", seq_length), rules.integer("seed", seed, minimum=0)) \
        if dataset is None else dataset
    if ds.seq_length != seq_length:
        raise rules.UsageError(f"dataset.seq_length={ds.seq_length} differs from seq_length={seq_length}; "
                               f"build the dataset with seq_length={seq_length}")
    return ds.batch(idx, eod_mask_loss=eod_mask_loss)


def get_global_batch(iteration: int, global_batch_size: int, seq_length: int, seed: int = DEFAULT_SEED, *,
                     eod_mask_loss: bool = False, dataset: GPTDataset | None = None) -> dict:
    """The whole global batch of ``iteration`` as one process sees it: each tensor ``[G, s]``.

    Equal to ``get_batch(iteration, 0, 0, 1, G, ...)``; the reference that every
    data-parallel layout is compared with.
    """
    return get_batch(iteration, 0, 0, 1, global_batch_size, seq_length, seed,
                     global_batch_size=global_batch_size, eod_mask_loss=eod_mask_loss, dataset=dataset)
