"""Data with no downloads: the course corpus, a byte-level tokenizer, deterministic
Megatron-style sampling sharded by data-parallel rank, and the load-balanced
context-parallel split.

    from course_lib.data import ByteTokenizer, get_batch, get_global_batch, get_batch_on_this_cp_rank

* ``corpus``     -- ``load_documents()``, ``corpus_text()``, ``export_jsonl(path)`` (input of
  Megatron's ``tools/preprocess_data.py``).
* ``tokenizer``  -- ``ByteTokenizer`` (257 tokens: 256 bytes + eod), ``vocab_size_with_padding``.
* ``sampler``    -- Megatron's batch order: ``get_batch(iteration, micro_batch_index, dp_rank, dp_size,
  micro_batch_size, seq_length, seed, dataset=...)``, ``get_global_batch``, ``DataPosition``.
* ``cp_split``   -- ``get_batch_on_this_cp_rank(batch, cp_rank, cp_size)`` (from
  ``course_lib.context_parallel.zigzag``) and helpers.

Day 22's set-up as Megatron-LM does it (imported from their modules, not here):

* ``bpe``         -- a byte-level BPE in GPT-2's scheme, trained on the corpus, GPT-2's vocab.json + merges.txt.
* ``indexed``     -- Megatron's indexed dataset (``.bin``/``.idx``): write, read.
* ``preprocess``  -- ``python -m course_lib preprocess`` (``tools/preprocess_data.py``'s flags);
  ``train_tokenizer`` -- ``python -m course_lib tokenizer``.
* ``gpt_dataset`` -- megatron-core ``GPTDataset``'s document, sample and shuffle indices, its loss mask and
  position ids (``--eod-mask-loss``, ``--reset-position-ids``, ``--reset-attention-mask``).
* ``index_cache`` -- ``--data-cache-path``: those indices in megatron-core's cache files.
* ``plots``       -- the documents -> samples -> order picture (Lab 11, ``figures/``).
* ``blend``       -- ``--data-path`` blends and ``--split`` (``BlendedMegatronDatasetBuilder``).
* ``source``      -- the trainer's data flags and the dataset they build.
"""

from course_lib.data.corpus import corpus_text, export_jsonl, load_documents
from course_lib.data.cp_split import (cp_chunk_ids, cp_token_positions, gather_from_cp_ranks,
                                      get_batch_on_this_cp_rank, split_for_cp_rank)
from course_lib.data.sampler import (DEFAULT_SEED, DataPosition, get_batch, get_global_batch,
                                     microbatch_sample_indices)
from course_lib.data.tokenizer import EOD_TEXT, ByteTokenizer, vocab_size_with_padding

__all__ = [
    "ByteTokenizer", "EOD_TEXT", "vocab_size_with_padding",
    "load_documents", "corpus_text", "export_jsonl",
    "DataPosition", "DEFAULT_SEED", "get_batch", "get_global_batch",
    "microbatch_sample_indices",
    "get_batch_on_this_cp_rank", "split_for_cp_rank", "gather_from_cp_ranks", "cp_chunk_ids", "cp_token_positions",
]
