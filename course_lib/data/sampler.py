"""Megatron's batch order over a dataset's samples, sharded over data-parallel ranks.

The samples are megatron-core ``GPTDataset``'s (:mod:`course_lib.data.gpt_dataset`, built by
:mod:`course_lib.data.source`: ``--data-path``'s, or the built-in corpus's by default). The batch order is
``MegatronPretrainingSampler``'s (``megatron/training/datasets/data_samplers.py``): the global batch of
iteration ``it`` (0-based: the number of iterations already done, as in Megatron's training loop) is the
samples ``[it * G, (it + 1) * G)``, ``G = global_batch_size``. They are consumed ``micro_batch_size * dp``
at a time (one micro-batch on every DP rank); inside such a group, DP rank ``r`` takes
``[r * micro, (r + 1) * micro)``. So

    sample = it*G + micro_batch_index*(micro*dp) + dp_rank*micro + j,  j < micro

and the union over all ``(micro_batch_index, dp_rank)`` of one iteration is exactly the single-process
global batch ``[it*G, (it+1)*G)`` -- the property that makes every parallel layout see the same data
(``tests/data/test_data.py`` checks it).

Batches are dicts of torch tensors with Megatron's keys (``pretrain_gpt.py`` ``get_batch``): ``tokens``
and ``labels`` int64 ``[b, s]``, ``loss_mask`` float32 ``[b, s]`` (ones; zeros at eod tokens with
``eod_mask_loss=True``, Megatron's ``--eod-mask-loss``), ``position_ids`` int64 ``[b, s]`` (``0..s-1``).
Split them along the sequence for context parallelism with ``course_lib.data.get_batch_on_this_cp_rank``.
"""

from __future__ import annotations

from course_lib import rules

DEFAULT_SEED = 1234  # Megatron's --seed default


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
              eod_mask_loss: bool = False, dataset=None) -> dict:
    """One micro-batch for one DP rank: ``tokens``/``labels``/``loss_mask``/``position_ids``, each ``[micro, s]``.

    ``iteration`` is 0-based (iterations already done). ``dataset``: the run's samples
    (:func:`course_lib.data.source.build_train_dataset`; its ``seq_length`` must match); default: the
    built-in corpus's train split for ``seed`` (:func:`course_lib.data.source.corpus_dataset`, one epoch).
    """
    idx = microbatch_sample_indices(iteration, micro_batch_index, dp_rank, dp_size, micro_batch_size,
                                    global_batch_size)
    if dataset is None:
        from course_lib.data.source import corpus_dataset

        dataset = corpus_dataset(rules.integer("seq_length", seq_length), rules.integer("seed", seed, minimum=0))
    if dataset.seq_length != seq_length:
        raise rules.UsageError(f"dataset.seq_length={dataset.seq_length} differs from seq_length={seq_length}; "
                               f"build the dataset with seq_length={seq_length}")
    if idx.stop > len(dataset):
        raise rules.UsageError(f"samples {idx.start}..{idx.stop - 1} are past the dataset's {len(dataset)}; build it "
                               f"for the run's samples (course_lib.data.source.build_train_dataset)")
    return dataset.batch(idx, eod_mask_loss=eod_mask_loss)


def get_global_batch(iteration: int, global_batch_size: int, seq_length: int, seed: int = DEFAULT_SEED, *,
                     eod_mask_loss: bool = False, dataset=None) -> dict:
    """The whole global batch of ``iteration`` as one process sees it: each tensor ``[G, s]``.

    Equal to ``get_batch(iteration, 0, 0, 1, G, ...)``; the reference that every
    data-parallel layout is compared with.
    """
    return get_batch(iteration, 0, 0, 1, global_batch_size, seq_length, seed,
                     global_batch_size=global_batch_size, eod_mask_loss=eod_mask_loss, dataset=dataset)
