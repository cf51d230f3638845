"""course_lib.data: corpus, byte tokenizer, Megatron-order DP sampling, load-balanced CP split."""

import json
import re

import numpy as np
import pytest
import torch

from course_lib.data import (ByteTokenizer, corpus_text, cp_chunk_ids,
                             cp_token_positions, export_jsonl, gather_from_cp_ranks, get_batch,
                             get_batch_on_this_cp_rank, get_global_batch, load_documents,
                             microbatch_sample_indices, split_for_cp_rank, vocab_size_with_padding)
from course_lib.data import corpus as corpus_mod
from course_lib.data.blend import parse_split, split_indices, split_matrix
from course_lib.data.corpus import corpus_indexed_dataset, corpus_token_documents
from course_lib.data.source import DEFAULT_SPLIT, corpus_dataset
from course_lib.launch import launch
from course_lib.topology import RankGrid


# ---- tokenizer ------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip_and_megatron_names():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eod == 256
    text = "TP=2, PP=2 -> DP=2; 张量并行 (tensor parallel)"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))           # one token per UTF-8 byte
    assert len(ids) == len(text) + 2 * 4                # each of the 4 CJK characters is 3 bytes
    assert tok.decode(ids) == text
    assert tok.encode(text, append_eod=True)[-1] == 256
    assert tok.decode(tok.encode("a", True) + tok.encode("b")) == "a<|endoftext|>b"
    assert tok.decode([97, 256, 98], eod_text="\n") == "a\nb"
    assert tok.tokenize(text) == ids and tok.detokenize(ids) == text


def test_byte_tokenizer_bad_input():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([65, 257])
    with pytest.raises(ValueError, match="takes a str"):
        tok.encode(b"bytes")
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"   # a cut character decodes to U+FFFD


def test_vocab_padding_matches_megatron_log_lines():
    # Megatron prints ' > padded vocab (size: 50257) with 47 dummy tokens (new size: 50304)' for GPT-2 at TP 1
    # (make_vocab_size_divisible_by=128); 50432 at TP 2, 50688 at TP 4.
    assert vocab_size_with_padding(50257, 1) == 50304
    assert vocab_size_with_padding(50257, 2) == 50432
    assert vocab_size_with_padding(50257, 4) == 50688
    assert [vocab_size_with_padding(257, tp) for tp in (1, 2, 4, 8)] == [384, 512, 512, 1024]
    assert all(384 % tp == 0 for tp in (1, 2, 4, 8))
    for args, message in (((257, 0), "tensor-model-parallel-size=0"), ((257, 1, 0), "make_vocab_size_divisible_by=0"),
                          ((True,), "orig_vocab_size=True")):
        with pytest.raises(ValueError, match=f"^{message} must be an integer >= 1$"):
            vocab_size_with_padding(*args)


# ---- corpus ---------------------------------------------------------------------------------

def test_corpus_size_documents_and_determinism():
    docs = load_documents()
    text = corpus_text()
    n_bytes = len(text.encode("utf-8"))
    assert 50_000 < n_bytes < 400_000                      # "a few hundred KB at most"
    assert len(docs) > 100 and all(d.strip() == d and d for d in docs)
    assert "\n\n" not in "".join(docs)                      # documents are paragraphs
    assert corpus_text() == text and load_documents() == docs
    assert corpus_mod.generated_documents() == corpus_mod.generated_documents()
    assert any("张量并行" in d for d in docs)                 # the seed's terms survive as UTF-8 bytes
    indexed = corpus_indexed_dataset()                       # one sequence per document, eod last
    assert len(indexed) == len(docs) and list(indexed.document_indices) == list(range(len(docs) + 1))
    for i in (0, len(docs) // 2, len(docs) - 1):
        assert indexed[i].tolist() == ByteTokenizer().encode(docs[i], append_eod=True)
    toks = torch.from_numpy(np.concatenate([indexed[i] for i in range(len(indexed))]).astype(np.int64))
    assert (toks == 256).sum() == len(docs) and toks.max() == 256 and toks.min() >= 0


def test_generated_rank_facts_agree_with_topology_grid():
    """The corpus' rank sentences are computed independently of course_lib.topology; check them against it."""
    docs = [d for d in corpus_mod.generated_documents() if d.startswith("Take ")]
    assert docs
    rx_cfg = re.compile(r"Take (\d+) ranks with tensor parallel (\d+), pipeline parallel (\d+), "
                        r"context parallel (\d+) and data parallel (\d+)\.")
    rx_rank = re.compile(r"Rank (\d+) has tensor rank (\d+), context rank (\d+), data rank (\d+) and pipeline stage (\d+)")
    rx_group = re.compile(r"The (tensor|context|data|pipeline)-parallel groups are ((?:\[[\d, ]+\] ?)+)\.")
    checked_ranks = checked_groups = 0
    for doc in docs:
        world, tp, pp, cp, dp = map(int, rx_cfg.match(doc).groups())
        grid = RankGrid(world, tp=tp, pp=pp, cp=cp)
        assert grid.dp == dp
        for r, t, c, d, p in (tuple(map(int, m)) for m in rx_rank.findall(doc)):
            assert grid.coords(r) == {"tp": t, "cp": c, "dp": d, "pp": p}
            checked_ranks += 1
        for axis, groups in rx_group.findall(doc):
            got = [list(map(int, g.split(","))) for g in re.findall(r"\[([\d, ]+)\]", groups)]
            assert got == grid.groups({"tensor": "tp", "context": "cp", "data": "dp", "pipeline": "pp"}[axis])
            checked_groups += 1
    assert checked_ranks >= 8 * 5 and checked_groups >= 16


def test_generated_arithmetic_facts_are_right():
    text = " ".join(corpus_mod.generated_documents())
    dp = re.findall(r"With (\d+) ranks, tensor parallel (\d+), pipeline parallel (\d+) and context parallel (\d+), "
                    r"the data-parallel size is \d+ / \(\d+ x \d+ x \d+\) = (\d+)\.", text)
    assert len(dp) > 50
    for w, t, p, c, d in (map(int, x) for x in dp):
        assert w == t * p * c * d
    bub = re.findall(r"A pipeline of (\d+) stages with (\d+) micro-batches has a bubble of \(\d+ - 1\) / \d+ = "
                     r"([\d.]+)", text)
    assert len(bub) == 50
    for p, m, f in bub:
        assert float(f) == pytest.approx((int(p) - 1) / int(m), abs=5.001e-4)  # printed with 3 decimals
    mbs = re.findall(r"A global batch of (\d+) with micro-batch size (\d+) and data-parallel size (\d+) gives "
                     r"\d+ / \(\d+ x \d+\) = (\d+) micro-batches", text)
    assert mbs and all(int(g) == int(b) * int(d) * int(n) for g, b, d, n in mbs)


def test_export_jsonl_for_megatron_preprocess(tmp_path):
    path = export_jsonl(tmp_path / "data" / "tiny" / "corpus.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x)["text"] for x in lines] == load_documents()


# ---- the default samples (GPTDataset on the built-in corpus) and the DP sampler -------------------

def test_default_samples_are_the_train_split_laid_end_to_end_in_document_index_order():
    """Without --data-path: the --split's train documents, shuffled (document index), laid end to end and cut
    every s tokens into s + 1 (neighbours share one), drawn in the shuffle index's order."""
    s = 32
    ds = corpus_dataset(s, 7)
    docs = corpus_token_documents()
    train = split_indices(len(docs), split_matrix(parse_split(DEFAULT_SPLIT))[0])
    assert 0 < len(train) < len(docs) and ds.indices.tolist() == train.tolist()
    assert sorted(ds.document_index.tolist()) == train.tolist() and ds.document_index.tolist() != train.tolist()
    stream = torch.tensor([t for d in ds.document_index for t in docs[d]])
    assert len(ds) == (len(stream) - 1) // s
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    b = ds.batch(range(5))
    for i in range(5):
        w = int(ds.shuffle_index[i])
        assert torch.equal(b["tokens"][i], stream[w * s:w * s + s])
        assert torch.equal(b["labels"][i], stream[w * s + 1:w * s + s + 1])
    assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])
    assert torch.equal(b["position_ids"][3], torch.arange(s))
    assert b["loss_mask"].dtype == torch.float32 and bool((b["loss_mask"] == 1).all())
    # more samples than one epoch: two epochs of documents, every sample still drawn
    two = corpus_dataset(s, 7, num_samples=len(ds) + 1)
    assert two.num_epochs == 2 and len(two) > len(ds) and sorted(two.shuffle_index.tolist()) == list(range(len(two)))


def test_seed_determinism():
    a = get_global_batch(2, 8, 48, seed=1234)
    b = get_global_batch(2, 8, 48, seed=1234)
    c = get_global_batch(2, 8, 48, seed=4321)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tokens"], c["tokens"])


@pytest.mark.parametrize("dp,micro,gbs", [(1, 4, 8), (2, 1, 8), (2, 2, 8), (4, 1, 16), (4, 2, 16), (8, 1, 8)])
def test_union_over_dp_ranks_is_the_single_process_global_batch(dp, micro, gbs):
    s = 40
    for it in (0, 3):
        ref = get_global_batch(it, gbs, s, seed=11)
        parts = {k: [] for k in ref}
        n_micro = gbs // (micro * dp)
        for mb in range(n_micro):            # Megatron consumes micro*dp samples per micro-step ...
            for r in range(dp):              # ... DP rank r taking the r-th slice of micro
                b = get_batch(it, mb, r, dp, micro, s, seed=11, global_batch_size=gbs)
                assert b["tokens"].shape == (micro, s)
                for k in ref:
                    parts[k].append(b[k])
        for k in ref:
            assert torch.equal(torch.cat(parts[k]), ref[k]), k


def test_sampler_indices_follow_megatron_pretraining_sampler():
    # MegatronPretrainingSampler: batches of micro*dp consecutive indices, rank r takes [r*micro, (r+1)*micro)
    assert list(microbatch_sample_indices(0, 0, 1, 2, 3, 12)) == [3, 4, 5]
    assert list(microbatch_sample_indices(0, 1, 0, 2, 3, 12)) == [6, 7, 8]
    assert list(microbatch_sample_indices(2, 1, 1, 2, 3, 12)) == [24 + 6 + 3, 24 + 6 + 4, 24 + 6 + 5]
    # iterations are consecutive, disjoint blocks of global_batch_size samples
    seen = [i for it in range(3) for mb in range(2) for r in range(2)
            for i in microbatch_sample_indices(it, mb, r, 2, 3, 12)]
    assert sorted(seen) == list(range(36))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(iteration=0, micro_batch_index=0, dp_rank=0, dp_size=4, micro_batch_size=3, global_batch_size=16),
     "not divisible by micro_batch_size=3"),
    (dict(iteration=0, micro_batch_index=0, dp_rank=2, dp_size=2, micro_batch_size=1), "dp_rank=2 must be an integer in 0..1 for data-parallel-size=2"),
    (dict(iteration=0, micro_batch_index=4, dp_rank=0, dp_size=2, micro_batch_size=1, global_batch_size=8),
     "micro_batch_index=4 must be an integer in 0..3 for num_microbatches=4"),
    (dict(iteration=-1, micro_batch_index=0, dp_rank=0, dp_size=1, micro_batch_size=1), "iteration=-1"),
])
def test_sampler_bad_input_is_one_line(kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)) as e:
        microbatch_sample_indices(**kwargs)
    assert "\n" not in str(e.value)


def test_dataset_bad_input():
    with pytest.raises(ValueError, match="not one sample of seq_length 100000"):
        corpus_dataset(100000, 1)
    with pytest.raises(ValueError, match="differs from seq_length"):
        get_batch(0, 0, 0, 1, 1, 16, dataset=corpus_dataset(8, 1))
    with pytest.raises(ValueError, match="past the dataset"):
        get_global_batch(len(corpus_dataset(8, 1)), 1, 8, 1)


def test_eod_mask_loss():
    b = get_global_batch(0, 32, 256, eod_mask_loss=True)
    eod = b["tokens"] == 256
    assert eod.any()
    assert torch.equal(b["loss_mask"] == 0, eod)


# ---- context-parallel split -------------------------------------------------------------------

def _megatron_cp_reference(val, cp_rank, cp_size, seq_dim):
    """Megatron's get_batch_on_this_cp_rank (megatron/core/utils.py) written out: view the sequence as
    2*cp chunks and index_select chunks (r, 2*cp-1-r)."""
    val = val.view(*val.shape[:seq_dim], 2 * cp_size, val.shape[seq_dim] // (2 * cp_size), *val.shape[seq_dim + 1:])
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1])
    val = val.index_select(seq_dim, index)
    return val.reshape(*val.shape[:seq_dim], -1, *val.shape[seq_dim + 2:])


def test_cp_positions_example_from_megatron_docstring():
    # "CP=2 ... 4 chunks, chunk_0 and chunk_3 are assigned to GPU0, chunk_1 and chunk_2 are assigned to GPU1"
    assert cp_chunk_ids(0, 2) == (0, 3) and cp_chunk_ids(1, 2) == (1, 2)
    assert cp_token_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert cp_token_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert cp_token_positions(8, 0, 1).tolist() == list(range(8))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_split_matches_megatron_and_round_trips(cp):
    s = 32
    batch = get_global_batch(1, 3, s)
    batch["attention_mask"] = torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(3, 1, s, s).clone()
    batch["unused"] = None
    before = {k: (v.clone() if v is not None else None) for k, v in batch.items()}
    parts = [get_batch_on_this_cp_rank(batch, r, cp) for r in range(cp)]
    for k, v in batch.items():                       # the input is not modified
        assert (v is None and before[k] is None) or torch.equal(v, before[k])
    for r, part in enumerate(parts):
        assert part["unused"] is None
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            assert part[k].shape == (3, s // cp)
            ref = batch[k] if cp == 1 else _megatron_cp_reference(batch[k], r, cp, 1)
            assert torch.equal(part[k], ref)
        ref = batch["attention_mask"] if cp == 1 else _megatron_cp_reference(batch["attention_mask"], r, cp, 2)
        assert torch.equal(part["attention_mask"], ref) and part["attention_mask"].shape == (3, 1, s // cp, s)
        # positions travel with the tokens
        assert torch.equal(part["position_ids"][0], cp_token_positions(s, r, cp))
    for k in ("tokens", "labels", "position_ids"):
        assert torch.equal(gather_from_cp_ranks([p[k] for p in parts]), batch[k])


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_split_balances_causal_work(cp):
    s = 64
    # causal attention: the query at position i scores i + 1 keys
    work = [int((cp_token_positions(s, r, cp) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1
    naive = [sum(range(r * s // cp + 1, (r + 1) * s // cp + 1)) for r in range(cp)]
    assert max(naive) > max(work)      # the contiguous split would overload the last rank
    all_pos = torch.cat([cp_token_positions(s, r, cp) for r in range(cp)])
    assert sorted(all_pos.tolist()) == list(range(s))


def test_cp_bad_input_is_one_line():
    with pytest.raises(ValueError, match=r"not divisible by 2 × context-parallel-size=2 = 4") as e:
        split_for_cp_rank(torch.zeros(1, 10), 0, 2)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cp_rank=2 must be an integer in 0..1 for context-parallel-size=2"):
        cp_token_positions(8, 2, 2)
    with pytest.raises(ValueError, match="same even number"):
        gather_from_cp_ranks([torch.zeros(1, 4), torch.zeros(1, 2)])


def test_real_ranks_dp_and_cp_shards_give_the_global_mean():
    """4 real ranks as DP=2 x CP=2 (Megatron order: cp fastest among dp-cp): each rank scores only its own
    tokens with a fixed bigram table; the all-reduced sum equals the single-process global-batch mean."""
    s, gbs, micro, it = 32, 8, 2, 5
    table = torch.randn(257, 257, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logp = torch.log_softmax(table, dim=-1)

    def score(tokens, labels):
        return logp[tokens, labels].neg().sum()

    def rank_fn():
        import torch.distributed as dist
        rank = dist.get_rank()
        cp_rank, dp_rank = rank % 2, rank // 2
        total = torch.zeros((), dtype=torch.float64)
        for mb in range(gbs // (micro * 2)):
            b = get_batch(it, mb, dp_rank, 2, micro, s, global_batch_size=gbs)
            b = get_batch_on_this_cp_rank(b, cp_rank, 2)
            total += score(b["tokens"], b["labels"])
        dist.all_reduce(total)
        return float(total) / (gbs * s)

    got = launch(rank_fn, world_size=4, output="none", timeout=60)
    ref = get_global_batch(it, gbs, s)
    expected = float(score(ref["tokens"], ref["labels"])) / (gbs * s)
    assert all(abs(g - expected) <= 1e-12 * abs(expected) for g in got)


def test_lab11_figure_is_drawn_by_the_figures_command_from_the_toy_dataset(tmp_path):
    """figures/data_documents_samples_order.png is what ``python -m course_lib figures`` draws now (not stale), and
    the picture's example is the lab's: three documents, four samples cut every 8 tokens, one epoch."""
    from pathlib import Path

    from course_lib.classroom.figures import COMPACT_WRITERS, WRITERS, compact_png
    from course_lib.data.plots import FIGURE_NAME, toy_dataset, write_figures

    assert WRITERS["course_lib.data.plots"] == "write_figures" and "course_lib.data.plots" in COMPACT_WRITERS
    toy = toy_dataset()
    assert toy.sample_index.tolist() == [[0, 0], [0, 8], [1, 6], [2, 7], [2, 15]] and len(toy) == 4
    (path,) = write_figures(tmp_path)
    committed = Path(__file__).resolve().parents[2] / "figures" / FIGURE_NAME
    assert compact_png(path.read_bytes()) == committed.read_bytes()
