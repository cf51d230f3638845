"""Day 22's set-up against megatron-core 0.16.1, live: the course's tokenizer files, the indexed
dataset ``preprocess`` writes, and the samples ``--data-path``/``--split``/blends draw.

* the byte-level BPE equals Hugging Face ``tokenizers``' byte-level BPE loaded from the same
  ``vocab.json``/``merges.txt`` (megatron-core 0.16.1's ``GPT2BPETokenizer`` is
  ``MegatronHFTokenizer`` -> transformers' GPT-2 tokenizer, whose fast form is that library), and
  Megatron-LM's own ``gpt2_tokenization.GPT2Tokenizer`` (its ``_GPT2BPETokenizer``) loads the files and
  encodes and decodes every text the same way, where ``MEGATRON_LM_DIR`` names a checkout that has it;
* ``.bin/.idx`` byte-identical to megatron-core's ``IndexedDatasetBuilder``, read by its ``IndexedDataset``;
* every sample of all three splits (one prefix, several epochs) and of a weighted blend equals
  megatron-core's ``GPTDataset``/``BlendedMegatronDatasetBuilder``; the sample index equals its
  compiled ``helpers.build_sample_idx`` on random sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

from course_lib.data.blend import build_datasets, parse_blend
from course_lib.data.bpe import BPETokenizer, TokenizerFileError, train_bpe
from course_lib.data.corpus import export_jsonl, load_documents
from course_lib.data.gpt_dataset import build_sample_index
from course_lib.data.indexed import IndexedDataset, IndexedDatasetError, encode_documents, optimal_dtype
from course_lib.data.preprocess import preprocess

HOSTILE = ["", " ", "Hello world", "张量并行 and 流水线并行", "😀👩‍👩‍👧 🇫🇷", "\x00\x01\x7f\t\r\n  \n\n   x",
           "it's   we'll  DON'T 123 4567 ²½ Ⅻ ٣", "a" * 300, "\u200b\ufeff e\u0301 ﬁ \ud7ff", "  lead\n\n\n trail   ",
           "x" + "\U0010ffff" + "y"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The corpus exported, the tokenizer trained and saved, the corpus preprocessed (the lab's steps)."""
    d = tmp_path_factory.mktemp("tiny")
    tok = train_bpe(load_documents(), 1024)
    vocab, merges = tok.save(d)
    export_jsonl(d / "corpus.jsonl")
    (bin_path, idx_path), = preprocess(d / "corpus.jsonl", d / "gpt_text", BPETokenizer.from_files(vocab, merges),
                                       ("text",), append_eod=True).values()
    return {"dir": d, "tok": tok, "vocab": vocab, "merges": merges, "prefix": str(bin_path)[:-4]}


def test_bpe_round_trip_and_files(tiny):
    tok = tiny["tok"]
    assert tok.vocab_size == 1024 and tok.eod == 1023 and len(tok.merges) == 767
    for text in HOSTILE + load_documents()[:20]:
        assert tok.decode(tok.encode(text)) == text
    again = BPETokenizer.from_files(tiny["vocab"], tiny["merges"])
    assert again.encoder == tok.encoder and again.merges == tok.merges
    corpus = load_documents()
    ids = [i for doc in corpus for i in tok.encode(doc, append_eod=True)]
    assert sum(len(d.encode()) for d in corpus) / len(ids) > 3.0          # measured 3.57 bytes per token
    # the merges are the most frequent pairs: the first is "the"'s or a space pair, never a rare one
    assert tok.decode([tok.encode(" the")[0]]) == " the"


def test_bpe_equals_hugging_face_byte_level_bpe(tiny):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(tiny["vocab"]), str(tiny["merges"])))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    for text in HOSTILE + load_documents():
        assert tiny["tok"].encode(text) == hf.encode(text).ids, text[:40]


def test_tokenizer_files_refused_in_one_line(tiny, tmp_path):
    with pytest.raises(TokenizerFileError, match="needs both --vocab-file"):
        BPETokenizer.from_files(tiny["vocab"], None)
    with pytest.raises(TokenizerFileError, match="no such file"):
        BPETokenizer.from_files(tmp_path / "nope.json", tiny["merges"])
    other = train_bpe(["zzz yyy zzz yyy qqq qqq"], 300)
    v, _ = other.save(tmp_path)
    with pytest.raises(TokenizerFileError, match="same tokenizer"):
        BPETokenizer.from_files(v, tiny["merges"])


def test_indexed_dataset_bytes_equal_megatron_core(tiny, tmp_path):
    torch = pytest.importorskip("torch")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = [[5, 6, 7, 1023], [], [9, 1023], list(range(1000)) + [1023]]
    for vocab_size, docs_ in ((1024, docs), (70000, docs + [[69999, 1]])):
        dtype = optimal_dtype(vocab_size)
        assert dtype is indexed.DType.optimal_dtype(vocab_size)
        builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
        for doc in docs_:           # preprocess_data.py: add_document(ids, sentence lengths)
            builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)] if doc else [])
        builder.finalize(str(tmp_path / "m.idx"))
        data, index = encode_documents(docs_, dtype)
        assert (tmp_path / "m.bin").read_bytes() == data
        assert (tmp_path / "m.idx").read_bytes() == index
    theirs = indexed.IndexedDataset(tiny["prefix"])
    ours = IndexedDataset(tiny["prefix"])
    assert len(theirs) == len(ours) == 129
    assert np.array_equal(theirs.document_indices, ours.document_indices)
    for i in (0, 64, 128):
        assert np.array_equal(theirs[i], ours[i])
    tok = tiny["tok"]
    assert tok.decode(ours[0]) == load_documents()[0] + "<|endoftext|>"


def test_preprocess_cli_refuses_bad_input_and_writes_nothing(tiny, tmp_path, capsys):
    from course_lib.__main__ import main

    src = tmp_path / "in.jsonl"
    base = ["preprocess", "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(tiny["vocab"]), "--merge-file", str(tiny["merges"]), "--append-eod", "--workers", "1"]
    cases = [('{"text": "a"}\n{"text": "b"\n', "line 2: not JSON"),
             ('{"text": "a"}\n{"body": "b"}\n', "line 2: no key 'text'"),
             ('{"text": 3}\n', "line 1: 'text' holds a int")]
    for content, message in cases:
        src.write_text(content)
        assert main(base + ["--input", str(src)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not list(tmp_path.glob("out*"))
    assert main(base[:7] + ["--input", str(src)]) == 2                                  # a vocab without merges
    assert "needs both --vocab-file" in capsys.readouterr().err and not list(tmp_path.glob("out*"))
    corpus = ["--input", str(tiny["dir"] / "corpus.jsonl")]
    assert main(base + corpus) == 0
    assert (tmp_path / "out_text_document.bin").read_bytes() == open(tiny["prefix"] + ".bin", "rb").read()
    capsys.readouterr()
    assert main(base + corpus) == 2 and "already exists; pass --force" in capsys.readouterr().err


def test_bad_data_path_one_line(tiny, tmp_path):
    with pytest.raises(IndexedDatasetError, match="is missing"):
        IndexedDataset(tmp_path / "nothing")
    cut = tmp_path / "cut"
    (cut.with_suffix(".idx")).write_bytes(open(tiny["prefix"] + ".idx", "rb").read())
    (cut.with_suffix(".bin")).write_bytes(open(tiny["prefix"] + ".bin", "rb").read()[:-10])
    with pytest.raises(IndexedDatasetError, match="truncated"):
        IndexedDataset(cut)
    with pytest.raises(ValueError, match="is not a positive weight"):
        parse_blend(["0.7", "A", "x", "B"])
    with pytest.raises(ValueError, match="is not a positive weight"):
        parse_blend(["-1", "A", "1", "B"])
    assert parse_blend(["A", "B"]) == (["A", "B"], None)


@pytest.fixture
def megatron_core_world():
    """megatron-core's blend builder asks torch.distributed for its rank: a world of one (per test: a
    forked launch must not inherit it)."""
    dist = pytest.importorskip("torch.distributed")
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _megatron_core_datasets(data_path, split, sizes, seq_length, seed, tok, cache, masks=False):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    class Tokenizer:      # what GPTDatasetConfig reads of a tokenizer
        vocab_size, eod, unique_identifiers = tok.vocab_size, tok.eod, tok.unique_identifiers

    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=get_blend_from_list(data_path),
                              split=split, path_to_cache=str(cache), tokenizer=Tokenizer(), reset_position_ids=masks,
                              reset_attention_mask=masks, eod_mask_loss=masks)
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


@pytest.mark.parametrize("blend, split, sizes, seq_length", [
    ("one", "90,9,1", [320, 96, 8], 32),          # the trainer's sizes for 40 iterations of 8, eval 3 x 4
    ("one", "80,15,5", [5000, 300, 60], 64),      # many epochs: a separate final epoch
    ("blend", "90,8,2", [300, 40, 20], 32),       # --data-path 0.7 A 0.3 B
])
def test_samples_equal_megatron_core(tiny, megatron_core_world, tmp_path, blend, split, sizes, seq_length):
    import shutil

    prefix = tiny["prefix"]
    if blend == "one":
        data_path = [prefix]
    else:
        other = str(tmp_path / "b_text_document")
        for suffix in (".bin", ".idx"):
            shutil.copy(prefix + suffix, other + suffix)
        data_path = ["0.7", prefix, "0.3", other]
    theirs = _megatron_core_datasets(data_path, split, sizes, seq_length, 1234, tiny["tok"], tmp_path / "cache")
    ours = build_datasets(data_path, split, sizes, seq_length, 1234, tiny["tok"].eod)
    for a, b in zip(theirs, ours):
        assert len(a) == len(b) >= 8
        for i in range(len(a)):
            window = b[i]
            assert np.array_equal(a[i]["tokens"].numpy(), window[:-1]) and np.array_equal(a[i]["labels"].numpy(),
                                                                                           window[1:]), i


def _cache_files(folder) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_data_cache_path_files_equal_megatron_core_and_load_both_ways(tiny, megatron_core_world, tmp_path):
    """``--data-cache-path``: the course writes megatron-core's file names (MD5 of the same description)
    and bytes for every split of a blend (each GPTDataset's three indices, the BlendedDataset's two);
    megatron-core loads the course's files without rebuilding them,
    and the course loads them back (a description of another run is one line)."""
    import os
    import shutil

    from course_lib.rules import UsageError

    other = str(tmp_path / "b_text_document")
    for suffix in (".bin", ".idx"):
        shutil.copy(tiny["prefix"] + suffix, other + suffix)
    data_path = ["2", tiny["prefix"], "1", other]           # weights 2/3, 1/3: normalised as megatron-core does
    tok = BPETokenizer.from_files(str(tiny["vocab"]), str(tiny["merges"]))
    assert tok.unique_identifiers == {"class": "_GPT2BPETokenizer",
                                      "tokenizer_path": [str(tiny["vocab"]), str(tiny["merges"])]}
    args = (data_path, "90,8,2", [300, 40, 20], 32, 1234, tok.eod)
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours = build_datasets(*args, cache_path=ours_dir, tokenizer_identifiers=tok.unique_identifiers)
    _megatron_core_datasets(data_path, "90,8,2", [300, 40, 20], 32, 1234, tok, theirs_dir)
    mine, theirs = _cache_files(ours_dir), _cache_files(theirs_dir)
    assert sorted(mine) == sorted(theirs)
    assert sum("-GPTDataset-" in n for n in mine) == 2 * 3 * 4            # 2 prefixes x 3 splits x 4 files
    assert sum("-BlendedDataset-" in n for n in mine) == 3 * 3            # 3 splits x (description + 2 indices)
    assert all(mine[name] == theirs[name] for name in mine)
    stamps = {p.name: p.stat().st_mtime_ns for p in ours_dir.iterdir()}
    again = _megatron_core_datasets(data_path, "90,8,2", [300, 40, 20], 32, 1234, tok, ours_dir)
    assert {p.name: p.stat().st_mtime_ns for p in ours_dir.iterdir()} == stamps     # loaded, not rebuilt
    loaded = build_datasets(*args, cache_path=ours_dir, tokenizer_identifiers=tok.unique_identifiers)
    for a, b, c in zip(again, ours, loaded):
        assert isinstance(c.datasets[0].sample_index, np.memmap) and isinstance(c.dataset_index, np.memmap)
        assert all(np.array_equal(a[i]["tokens"].numpy(), b[i][:-1]) and np.array_equal(b[i], c[i])
                   for i in range(len(a)))
    name = next(n for n in mine if n.endswith("-train-description.txt"))
    (ours_dir / name).write_text("another run")
    with pytest.raises(UsageError, match="does not describe this run"):
        build_datasets(*args, cache_path=ours_dir, tokenizer_identifiers=tok.unique_identifiers)
    assert os.listdir(ours_dir) and (ours_dir / name).read_text() == "another run"   # nothing replaced


def test_masks_and_position_ids_equal_megatron_core(tiny, megatron_core_world, tmp_path):
    """``--eod-mask-loss --reset-position-ids --reset-attention-mask``: loss mask, positions and attention
    mask of every valid sample equal megatron-core's ``GPTDataset`` outputs; without them, ones and 0..s-1."""
    import torch

    theirs = _megatron_core_datasets([tiny["prefix"]], "90,9,1", [8, 64, 8], 64, 1234, tiny["tok"],
                                     tmp_path / "cache", masks=True)[1]
    ours = build_datasets([tiny["prefix"]], "90,9,1", [8, 64, 8], 64, 1234, tiny["tok"].eod)[1]
    batch = ours.batch(range(len(ours)), eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    eods = 0
    for i in range(len(ours)):
        want = theirs[i]
        eods += int((want["tokens"] == tiny["tok"].eod).sum())
        for key in ("tokens", "loss_mask", "position_ids", "attention_mask"):
            assert torch.equal(batch[key][i], want[key]), (i, key)
    assert eods >= 5                                                       # documents do end inside samples
    plain = ours.batch([0, 1])
    assert "attention_mask" not in plain and bool((plain["loss_mask"] == 1).all())
    assert torch.equal(plain["position_ids"][1], torch.arange(64))


def test_sample_index_equals_megatron_core_helper():
    helpers = pytest.importorskip("megatron.core.datasets.helpers")
    rng = np.random.default_rng(0)
    for _ in range(30):
        sizes = rng.integers(1, 40, size=int(rng.integers(1, 12))).astype(np.int32)
        epochs = int(rng.integers(1, 4))
        doc_index = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc_index)
        tokens = int(sizes.sum())
        seq = int(rng.integers(2, max(3, tokens)))
        if epochs * tokens - 1 < seq:
            continue
        want = helpers.build_sample_idx(sizes, doc_index, seq, epochs, tokens, True, True)
        assert np.array_equal(build_sample_index(sizes, doc_index, seq, epochs, tokens), want)


def _train_rank(argv):
    from course_lib.train import parse_args, pretrain

    return pretrain(parse_args(argv))


def test_trainer_reads_megatron_data_in_megatron_core_order(tiny, tmp_path):
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    """``--data-path --split --tokenizer-type --vocab-file --merge-file``: each iteration's global batch is
    megatron-core's train samples ``[it*G, (it+1)*G)``; TP2 x DP2 on 4 ranks trains as one process does."""
    from course_lib.data import get_global_batch
    from course_lib.data.source import build_train_dataset
    from course_lib.launch import launch
    from course_lib.training.logs import parse_log
    from course_lib.train import args_to_argv, parse_args, train_single_process, validate_args

    data = ["--data-path", tiny["prefix"], "--split", "90,9,1", "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", str(tiny["vocab"]), "--merge-file", str(tiny["merges"])]
    argv = ["--uniform-vocab-padding", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
            "--lr", "3e-3", "--lr-decay-style", "constant", *data]
    run = validate_args(parse_args(argv), 1)
    args = run.namespace()
    assert parse_args(args_to_argv(args)).data_path == [tiny["prefix"]]          # what torchrun's ranks get
    assert args.padded_vocab_size == 1024                    # the tokenizer's vocabulary, padded to 128
    theirs = _megatron_core_datasets([tiny["prefix"]], "90,9,1", [3 * 8, 8, 8], 32, 1234, tiny["tok"],
                                     tmp_path / "cache")[0]
    ds = build_train_dataset(run, 8)
    for it in range(3):
        batch = get_global_batch(it, 8, 32, 1234, dataset=ds)
        want = np.stack([theirs[i]["tokens"].numpy() for i in range(it * 8, it * 8 + 8)])
        assert np.array_equal(batch["tokens"].numpy(), want), it
    reference = train_single_process(parse_args(argv))
    evaluating = argv + ["--eval-interval", "2", "--eval-iters", "2"]
    cache = tmp_path / "index_cache"
    res = launch(_train_rank, world_size=4, output="none", timeout=120,
                 argv=evaluating + ["--tensor-model-parallel-size", "2", "--data-cache-path", str(cache)])
    assert len(list(cache.glob("*-GPTDataset-train-*"))) == len(list(cache.glob("*-GPTDataset-valid-*"))) == 4
    got = res[-1]["lm_loss"]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, reference["lm_loss"])) < 1e-4, (got, reference["lm_loss"])
    assert reference["lm_loss"][0] == pytest.approx(np.log(1024), rel=0.05)   # the BPE vocabulary, not 257 bytes
    # --eval-interval 2 --eval-iters 2: after iteration 2 and after the last, Megatron's lines, the same loss as
    # one rank evaluating the same valid samples
    one = launch(_train_rank, world_size=1, output="none", timeout=120, argv=evaluating)[0]["validation"]
    four = res[-1]["validation"]
    assert [v["prefix"] for v in four] == ["iteration 2", "iteration 3 on validation set"]
    assert all(abs(a["lm_loss"] - b["lm_loss"]) < 1e-4 * b["lm_loss"] for a, b in zip(four, one)), (four, one)
    log = parse_log("\n".join(res.outputs))
    assert [v["label"] for v in log.validation] == [v["prefix"] for v in four]
    assert [v["lm_loss_value"] for v in log.validation] == pytest.approx([v["lm_loss"] for v in four], rel=1e-6)


@pytest.mark.parametrize("extra, message", [
    (["--data-path", "nowhere/x_text_document"], "needs the tokenizer that made it"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "without --data-path"),
    (["--vocab-file", "v.json"], "need --tokenizer-type"),
    (["--seq-length", "64", "--split", "1,0,99"], "not one sample"),
    (["--data-cache-path", "VOCAB"], "is a file; give a folder"),
])
def test_trainer_data_flags_refused_in_one_line(tiny, extra, message):
    from course_lib.train import parse_args, validate_args

    extra = [str(tiny["vocab"]) if word == "VOCAB" else word for word in extra]
    if "--split" in extra or "--data-cache-path" in extra:
        extra = extra + ["--data-path", tiny["prefix"], "--tokenizer-type", "GPT2BPETokenizer",
                         "--vocab-file", str(tiny["vocab"]), "--merge-file", str(tiny["merges"])]
    with pytest.raises(ValueError, match=message):
        validate_args(parse_args(extra), 1)


def test_builtin_corpus_is_the_default_through_megatron_path(megatron_core_world, tmp_path):
    """Without data flags the trainer reads the built-in corpus through ``--data-path``'s path: its in-memory
    indexed dataset is the bytes ``write_corpus_dataset`` writes; the default's train and valid batches are those
    of ``--data-path PREFIX --tokenizer-type NullTokenizer --vocab-size 256`` over those files and megatron-core's
    ``GPTDataset``'s on them (Megatron's ``--split`` 969,30,1, ``--seed``); the one-process losses are equal, and
    ``--eval-interval`` evaluates on the valid split. ``--tokenizer-type NullTokenizer --vocab-size 256`` is the
    byte vocabulary (eod 256, 257 ids, as megatron-core's NullTokenizer): the same model, starting at ln 384."""
    import warnings
    from pathlib import Path

    from course_lib.data import ByteTokenizer, get_global_batch
    from course_lib.data.blend import num_samples_per_split
    from course_lib.data.corpus import corpus_indexed_dataset, write_corpus_dataset
    from course_lib.data.source import DEFAULT_SPLIT, build_train_dataset, build_valid_dataset, load_tokenizer
    from course_lib.train import parse_args, train_single_process, validate_args

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as McoreNull
    prefix = str(tmp_path / "builtin_text_document")
    write_corpus_dataset(prefix)
    ds, memory = IndexedDataset(prefix), corpus_indexed_dataset()
    assert Path(prefix + ".bin").read_bytes() == memory._bin.tobytes()
    for name in ("sequence_lengths", "sequence_pointers", "document_indices"):
        assert np.array_equal(getattr(ds, name), getattr(memory, name)), name
    iters, gbs, seq = 3, 4, 64
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(seq),
             "--micro-batch-size", "4", "--global-batch-size", str(gbs), "--train-iters", str(iters), "--lr", "3e-3",
             "--eval-interval", "2", "--eval-iters", "2"]
    files = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
    default, on_files = validate_args(parse_args(model), 1), validate_args(parse_args(model + files), 1)
    assert default.data.split == on_files.data.split == DEFAULT_SPLIT == "969,30,1"          # Megatron's default
    tok, theirs_tok = load_tokenizer(on_files.data), McoreNull(256)
    assert (tok.vocab_size, tok.eod) == (theirs_tok.vocab_size, theirs_tok._eod_id) == (257, ByteTokenizer.eod)
    sizes = num_samples_per_split(iters, gbs, 2, 2)
    theirs = _megatron_core_datasets([prefix], DEFAULT_SPLIT, sizes[:2] + [None], seq, 1234, tok, tmp_path / "cache")
    ours = [build_train_dataset(default, gbs), build_valid_dataset(default, gbs)]
    files_ds = [build_train_dataset(on_files, gbs), build_valid_dataset(on_files, gbs)]
    for split in range(2):
        assert len(ours[split]) == len(files_ds[split]) == len(theirs[split])
        for it in range(sizes[split] // gbs):
            want = np.stack([theirs[split][i]["tokens"].numpy() for i in range(it * gbs, it * gbs + gbs)])
            for ds_ in (ours[split], files_ds[split]):
                assert np.array_equal(get_global_batch(it, gbs, seq, 1234, dataset=ds_)["tokens"].numpy(), want)
    assert default.namespace().padded_vocab_size == on_files.namespace().padded_vocab_size == 384
    losses = train_single_process(parse_args(model))["lm_loss"]
    assert losses == train_single_process(parse_args(model + files))["lm_loss"]              # bit for bit
    assert losses[0] == pytest.approx(np.log(384), rel=0.02)
    with pytest.raises(ValueError, match="needs --vocab-size"):
        validate_args(parse_args(model + files[:-2]), 1)


def test_eval_interval_without_data_path_is_the_files_valid_split(tmp_path):
    """``--eval-interval`` on the built-in corpus: Megatron's validation lines on the default ``--split``'s valid
    documents, the same losses as on ``write_corpus_dataset``'s files with the NullTokenizer."""
    from course_lib.data.corpus import write_corpus_dataset
    from course_lib.launch import launch

    prefix = str(tmp_path / "builtin_text_document")
    write_corpus_dataset(prefix)
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "3", "--lr", "3e-3",
             "--eval-interval", "2", "--eval-iters", "2"]
    files = ["--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
    evaluated = [launch(_train_rank, world_size=1, output="none", timeout=120, argv=argv)[0]
                 for argv in (model, model + files)]
    assert [v["prefix"] for v in evaluated[0]["validation"]] == ["iteration 2", "iteration 3 on validation set"]
    assert evaluated[0]["validation"] == evaluated[1]["validation"]
    assert evaluated[0]["lm_loss"] == evaluated[1]["lm_loss"]


def test_data_cache_path_without_data_path_writes_then_loads_the_same_indices(tmp_path):
    """``--data-cache-path`` on the built-in corpus: the first build (validate_args's check) writes megatron-core's
    index files (train), later builds load them untouched; all draw the samples of the in-memory build."""
    import torch

    from course_lib.data import get_global_batch
    from course_lib.data.source import build_train_dataset, corpus_dataset
    from course_lib.train import parse_args, validate_args

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "3",
            "--data-cache-path", str(tmp_path / "cache")]
    run = validate_args(parse_args(argv), 1)
    first = build_train_dataset(run, 4)
    written = sorted(p.name for p in (tmp_path / "cache").glob("*-GPTDataset-train-*"))
    assert len(written) == 4
    stamps = [p.stat().st_mtime_ns for p in sorted((tmp_path / "cache").glob("*-GPTDataset-train-*"))]
    second = build_train_dataset(run, 4)
    assert [p.stat().st_mtime_ns for p in sorted((tmp_path / "cache").glob("*-GPTDataset-train-*"))] == stamps
    plain = corpus_dataset(32, 1234, 12)
    for it in range(3):
        want = get_global_batch(it, 4, 32, 1234, dataset=plain)["tokens"]
        assert all(torch.equal(get_global_batch(it, 4, 32, 1234, dataset=d)["tokens"], want) for d in (first, second))


def _megatron_lm_gpt2_tokenization():
    """Megatron-LM's own ``megatron/training/tokenizer/gpt2_tokenization.py`` (what its ``_GPT2BPETokenizer``
    wraps, up to core_v0.16.1), loaded by path from the checkout ``MEGATRON_LM_DIR``; skipped without one."""
    import importlib.util
    import os
    from pathlib import Path

    root = os.environ.get("MEGATRON_LM_DIR")
    path = Path(root or ".") / "megatron" / "training" / "tokenizer" / "gpt2_tokenization.py"
    if not root or not path.is_file():
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM checkout with megatron/training/tokenizer/gpt2_tokenization.py "
                    "(core_v0.16.1 has it; main dropped it)")
    spec = importlib.util.spec_from_file_location("megatron_lm_gpt2_tokenization", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_megatron_lm_gpt2_tokenizer_loads_the_files_and_agrees(tiny):
    """As Megatron-LM's ``_GPT2BPETokenizer`` builds it: ``GPT2Tokenizer(vocab, merges, errors='replace',
    special_tokens=[], max_len=None)``; its eod is the vocabulary's ``<|endoftext|>``."""
    theirs = _megatron_lm_gpt2_tokenization().GPT2Tokenizer(str(tiny["vocab"]), str(tiny["merges"]), errors="replace",
                                                             special_tokens=[], max_len=None)
    ours = tiny["tok"]
    assert theirs.encoder["<|endoftext|>"] == ours.eod and len(theirs.encoder) == ours.vocab_size
    for text in HOSTILE + load_documents():
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, text[:40]
        assert theirs.decode(ids) == text, text[:40]
