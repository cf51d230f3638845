"""Data with no downloads: the course corpus, a byte-level tokenizer, deterministic
Megatron-style sampling sharded by data-parallel rank, and the load-balanced
context-parallel split.

    from course_lib.data import ByteTokenizer, get_batch, get_global_batch, get_batch_on_this_cp_rank

* ``corpus``     -- ``load_documents()``, ``corpus_text()``, ``export_jsonl(path)`` (input of
  Megatron's ``tools/preprocess_data.py``).
* ``tokenizer``  -- ``ByteTokenizer`` (257 tokens: 256 bytes + eod), ``vocab_size_with_padding``.
* ``sampler``    -- ``GPTDataset``, ``get_batch(iteration, micro_batch_index, dp_rank, dp_size,
  micro_batch_size, seq_length, seed)``, ``get_global_batch``.
* ``cp_split``   -- ``get_batch_on_this_cp_rank(batch, cp_rank, cp_size)`` (from
  ``course_lib.context_parallel.zigzag``) and helpers.
"""

from course_lib.data.corpus import corpus_text, export_jsonl, load_documents
from course_lib.data.cp_split import (cp_chunk_ids, cp_token_positions, gather_from_cp_ranks,
                                      get_batch_on_this_cp_rank, split_for_cp_rank)
from course_lib.data.sampler import (DEFAULT_SEED, GPTDataset, corpus_tokens, get_batch, get_global_batch,
                                     microbatch_sample_indices)
from course_lib.data.tokenizer import EOD_TEXT, ByteTokenizer, vocab_size_with_padding

__all__ = [
    "ByteTokenizer", "EOD_TEXT", "vocab_size_with_padding",
    "load_documents", "corpus_text", "export_jsonl",
    "GPTDataset", "DEFAULT_SEED", "corpus_tokens", "get_batch", "get_global_batch", "microbatch_sample_indices",
    "get_batch_on_this_cp_rank", "split_for_cp_rank", "gather_from_cp_ranks", "cp_chunk_ids", "cp_token_positions",
]
