"""course_lib.context_parallel, single process: the zigzag split, the ring schedule, the work counts,
the block maths (log-sum-exp merge, block backward) against torch, pictures and the Lab 04 checkers."""

from __future__ import annotations

import math

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from course_lib import context_parallel, data  # noqa: E402
from course_lib.classroom.checks import context_parallel as cp_checks  # noqa: E402
from course_lib.context_parallel.attention import ContextParallelSelfAttention  # noqa: E402
from course_lib.context_parallel.plots import plot_ring_steps  # noqa: E402
from course_lib.context_parallel.ring import (attention_block, attention_block_backward,  # noqa: E402
                                              kv_bytes_per_step, merge_partials, reference_attention,
                                              ring_sends_per_layer)
from course_lib.context_parallel.schedule import CAUSAL, FULL, kv_source_rank, ring_schedule, step_blocks  # noqa: E402
from course_lib.context_parallel.work import (critical_path, imbalance, plot_attention_work,  # noqa: E402
                                              ring_step_work, score_elements, score_elements_closed_form)
from course_lib.context_parallel.zigzag import (chunks_for_rank, check_sequence_split, rank_chunk_ids,  # noqa: E402
                                                shard_sequence, token_positions, unshard_sequence)
from course_lib.tensor_parallel import ParallelSelfAttention, TransformerConfig  # noqa: E402


# ------------------------------------------------------------------ zigzag split


def test_zigzag_matches_megatron_example():
    # megatron/core/utils.py get_batch_on_this_cp_rank: "for CP=2, the 4 chunks are assigned as
    # (chunk_0, chunk_3) -> GPU 0 and (chunk_1, chunk_2) -> GPU 1"
    assert [chunks_for_rank(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert [chunks_for_rank(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert token_positions(0, 2, 8) == [0, 1, 6, 7]
    assert token_positions(1, 2, 8) == [2, 3, 4, 5]
    assert token_positions(1, 4, 8, "contiguous") == [2, 3]
    for cp in range(1, 9):
        for layout in ("zigzag", "contiguous"):
            ids = sorted(k for r in range(cp) for k in rank_chunk_ids(r, cp, layout))
            assert ids == list(range(2 * cp if layout == "zigzag" else cp))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard_roundtrip(layout):
    cp, s = 4, 16
    x = torch.arange(2 * 3 * s * 5).view(2, 3, s, 5)
    shards = [shard_sequence(x, r, cp, layout=layout) for r in range(cp)]
    for r, t in enumerate(shards):
        assert t.shape == (2, 3, s // cp, 5)
        assert torch.equal(t, x[:, :, token_positions(r, cp, s, layout)])
    assert torch.equal(unshard_sequence(shards, layout=layout), x)
    tokens = torch.arange(s).repeat(2, 1)                                  # [b, s]: seq_dim=1
    assert shard_sequence(tokens, 0, cp, seq_dim=1, layout=layout)[0].tolist() == token_positions(0, cp, s, layout)


def test_one_get_batch_on_this_cp_rank_cuts_the_attention_mask_rows_like_megatron():
    assert context_parallel.get_batch_on_this_cp_rank is data.get_batch_on_this_cp_rank
    s = 8
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).expand(2, 1, s, s)
    batch = {"tokens": torch.arange(2 * s).view(2, s), "attention_mask": mask, "labels": None}
    part = context_parallel.get_batch_on_this_cp_rank(batch, 1, 2)            # chunks 1 and 2: positions 2..5
    assert part["tokens"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert torch.equal(part["attention_mask"], mask[:, :, 2:6, :])            # query rows cut, every key kept
    assert part["labels"] is None and set(part) == set(batch)
    assert context_parallel.get_batch_on_this_cp_rank(batch, 0, 1)["tokens"] is batch["tokens"]


def test_context_parallel_attention_overrides_only_the_core_attention():
    assert issubclass(ContextParallelSelfAttention, ParallelSelfAttention)
    assert ContextParallelSelfAttention.forward is ParallelSelfAttention.forward   # one head split, one projection
    assert "core_attention" in vars(ContextParallelSelfAttention)
    with pytest.raises(ValueError, match="ring attention has no dropout") as e:
        ContextParallelSelfAttention(TransformerConfig(hidden_size=8, num_attention_heads=2, attention_dropout=0.1),
                                     tp_group=None, cp_group=object())
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="cp_group is None"):
        ContextParallelSelfAttention(TransformerConfig(hidden_size=8, num_attention_heads=2), None, None)


def test_split_errors_are_one_line():
    with pytest.raises(ValueError, match=r"^seq_length=10 is not divisible by 2 × context-parallel-size=4 = 8 "
                                         r"\(load-balanced causal CP .*\); use a multiple of 8, e.g. 8 or 16$"):
        check_sequence_split(10, 4, "zigzag")
    with pytest.raises(ValueError, match=r"seq_length=10 is not divisible by context-parallel-size=4 \(each rank"):
        check_sequence_split(10, 4, "contiguous")
    assert check_sequence_split(12, 4, "contiguous") == 3
    with pytest.raises(ValueError, match="seq_length=12 is not divisible by 2 × context-parallel-size=4 = 8"):
        shard_sequence(torch.zeros(1, 1, 12, 2), 0, 4)
    with pytest.raises(ValueError, match="cp_rank=4 must be an integer in 0..3"):
        chunks_for_rank(4, 4)
    with pytest.raises(ValueError, match="context-parallel-size=0 must be an integer >= 1"):
        chunks_for_rank(0, 0)
    with pytest.raises(ValueError, match="layout='ring' is unknown"):
        token_positions(0, 2, 8, "ring")
    with pytest.raises(ValueError, match="seq_dim=4 is out of range"):
        shard_sequence(torch.zeros(1, 1, 8, 2), 0, 2, seq_dim=4)


# ------------------------------------------------------------------ the ring schedule


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_ring_visits_every_kv_once(cp):
    for r in range(cp):
        fwd = [kv_source_rank(r, i, cp, "fwd") for i in range(cp)]
        bwd = [kv_source_rank(r, i, cp, "bwd") for i in range(cp)]
        assert sorted(fwd) == sorted(bwd) == list(range(cp))
        assert fwd[0] == r and bwd[-1] == r            # start with own K/V; backward ends with own dK/dV home
        assert bwd[0] == fwd[-1]                       # the backward starts with the K/V the forward kept
    for direction, hop in (("fwd", 1), ("bwd", -1)):
        sched = ring_schedule(cp, direction=direction)
        for i in range(cp - 1):                        # what r sends after step i is what r+hop holds at i+1
            for r in range(cp):
                nxt = sched[i][r]["sends_to"]
                assert nxt == (r + hop) % cp and sched[i + 1][nxt]["kv_rank"] == sched[i][r]["kv_rank"]
        assert all(cell["sends_to"] is None for cell in sched[-1])


def test_zigzag_causal_blocks_are_balanced_per_step():
    for cp in (2, 3, 4, 8):
        for r in range(cp):
            kinds0 = sorted(b.kind for b in step_blocks(r, 0, cp, "zigzag", True))
            assert kinds0 == [CAUSAL, CAUSAL, FULL]
            for i in range(1, cp):
                blocks = step_blocks(r, i, cp, "zigzag", True)
                assert [b.kind for b in blocks] == [FULL, FULL]
                src = kv_source_rank(r, i, cp)
                if src < r:    # TE's case: all queries x the K/V's first chunk
                    assert {(b.q_index, b.kv_index) for b in blocks} == {(0, 0), (1, 0)}
                else:          # the queries' second chunk x all K/V
                    assert {(b.q_index, b.kv_index) for b in blocks} == {(1, 0), (1, 1)}
        # contiguous: rank r computes at steps 0..r only
        for r in range(cp):
            busy = [bool(step_blocks(r, i, cp, "contiguous", True)) for i in range(cp)]
            assert busy == [i <= r for i in range(cp)]
    assert all(b.kind == FULL for b in step_blocks(0, 1, 4, "zigzag", causal=False))
    with pytest.raises(ValueError, match="step=4 must be an integer in 0..3"):
        kv_source_rank(0, 4, 4)
    with pytest.raises(ValueError, match="direction='back' must be 'fwd' or 'bwd'"):
        kv_source_rank(0, 0, 4, "back")


# ------------------------------------------------------------------ work


def test_work_counts_match_closed_form():
    for cp in (1, 2, 3, 4, 8):
        for s in (2 * cp, 4 * cp, 12 * cp):
            for layout in ("zigzag", "contiguous"):
                for causal in (True, False):
                    counted = score_elements(s, cp, layout, causal)
                    assert counted == score_elements_closed_form(s, cp, layout, causal)
                    assert sum(counted) == (s * (s + 1) // 2 if causal else s * s)
                    # the blocks the ring computes add up to the same per-rank work
                    per_step = ring_step_work(s, cp, layout, causal)
                    assert [sum(step[r] for step in per_step) for r in range(cp)] == counted
    # hand-computed: s=64, cp=4. contiguous c=16: 256 r + 136; zigzag c=8: 64*7 + 8*9 = 520 on every rank
    assert score_elements(64, 4, "contiguous") == [136, 392, 648, 904]
    assert score_elements(64, 4, "zigzag") == [520] * 4
    assert imbalance(score_elements(64, 4, "contiguous")) == pytest.approx(904 / 520)
    assert critical_path(64, 4, "contiguous") == 904 and critical_path(64, 4, "zigzag") == 520
    assert ring_step_work(64, 4, "zigzag", unit="blocks") == [[3] * 4] + [[2] * 4] * 3
    # contiguous imbalance -> 2 - 1/cp for long sequences: last rank (2cp-1)/cp^2 of s^2/2 vs mean 1/cp
    w = score_elements(8 * 4096, 8, "contiguous")
    assert imbalance(w) == pytest.approx(2 - 1 / 8, rel=1e-3)


def test_ring_comm_formulas():
    assert ring_sends_per_layer(1) == {"fwd": 0, "bwd": 0}
    assert ring_sends_per_layer(4) == {"fwd": 6, "bwd": 12}
    # b=1, 8 query groups of 128 dims, 32k tokens over cp=8: 4096 local tokens of K and V in bf16
    assert kv_bytes_per_step(1, 8, 4096, 128, element_size=2) == 2 * 4096 * 8 * 128 * 2 == 16 * 2**20


# ------------------------------------------------------------------ block maths vs torch


def _sdpa(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_block_merge_equals_full_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    full = _sdpa(q, k, v, False)
    pieces = [(0, 5), (5, 6), (6, 12)]                 # unequal key blocks, merged one by one
    out, lse = None, None
    for a, b in pieces:
        o, l_ = attention_block(q, k[:, :, a:b], v[:, :, a:b])
        out, lse = (o, l_) if out is None else merge_partials(out, lse, o, l_)
    assert torch.allclose(out, full, atol=1e-12)
    scale = 1 / math.sqrt(8)
    assert torch.allclose(lse, torch.logsumexp(q @ k.transpose(-1, -2) * scale, -1), atol=1e-12)
    # a diagonal causal block equals SDPA's causal attention of that square
    o, _ = attention_block(q, k, v, "causal")
    assert torch.allclose(o, _sdpa(q, k, v, True), atol=1e-12)
    # a partial with no visible key (lse = -inf) has weight 0
    o2, l2 = merge_partials(out, lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert torch.equal(o2, out) and torch.equal(l2, lse)
    assert torch.allclose(reference_attention(q, k, v, causal=True), _sdpa(q, k, v, True), atol=1e-12)


def test_block_backward_equals_autograd():
    g = torch.Generator().manual_seed(1)
    s = 8
    q, k, v = (torch.randn(1, 2, 2 * s, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, 2, 2 * s, 4, generator=g, dtype=torch.float64)
    ref = _sdpa(q, k, v, True)
    ref.backward(dout)
    with torch.no_grad():
        out = ref.detach()
        lse = torch.logsumexp((q @ k.transpose(-1, -2) / 2).masked_fill(
            torch.ones(2 * s, 2 * s, dtype=torch.bool).triu(1), float("-inf")), -1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qi in range(2):                            # 2x2 chunk blocks of the causal matrix
            for ki in range(qi + 1):
                kind = "causal" if qi == ki else "full"
                qs, ks = slice(qi * s, (qi + 1) * s), slice(ki * s, (ki + 1) * s)
                a, b, c = attention_block_backward(q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                                   dout[:, :, qs], lse[:, :, qs], kind)
                dq[:, :, qs] += a
                dk[:, :, ks] += b
                dv[:, :, ks] += c
    for mine, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(mine, want, atol=1e-12)


# ------------------------------------------------------------------ pictures


def test_figures():
    fig = plot_attention_work(32, 4)
    assert len(fig.axes) == 3
    assert "max/mean 1.00" in " ".join(t.get_text() for t in fig.axes[2].get_legend().get_texts())
    plt.close(fig)
    for cp, direction, show in ((4, "fwd", True), (2, "bwd", False), (1, "fwd", True)):
        fig = plot_ring_steps(cp, direction=direction, show_blocks=show)
        assert len(fig.axes) == cp * (2 if show else 1)
        titles = [ax.get_title() for ax in fig.axes[:cp]]
        assert titles[-1].endswith("last step: no transfer")
        plt.close(fig)
    with pytest.raises(ValueError, match="context-parallel-size=0"):
        plot_ring_steps(0)


# ------------------------------------------------------------------ Lab 04 checkers


def _merge_ok(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2, lse


def _merge_naive(o1, l1, o2, l2):
    tot = torch.exp(l1) + torch.exp(l2)
    return (torch.exp(l1) / tot)[..., None] * o1 + (torch.exp(l2) / tot)[..., None] * o2, torch.log(tot)


def _todo(*args):
    raise NotImplementedError("write me")


@pytest.mark.parametrize("fn, ok, expect", [
    (_todo, False, "not attempted yet"),
    (_merge_ok, True, "✓ merge equals one softmax"),
    (lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)), False, "you averaged the outputs"),
    (lambda o1, l1, o2, l2: (o1 + o2, torch.logaddexp(l1, l2)), False, "forgot to rescale by exp(lse_i - lse)"),
    (_merge_naive, False, "exp(lse) overflows"),
    (lambda o1, l1, o2, l2: (torch.cat([o1, o2], 2), torch.cat([l1, l2], 2)), False, "you appended"),
    (lambda o1, l1, o2, l2: (_merge_ok(o1, l1, o2, l2)[0], l1 + l2), False, "you added the log-sum-exps"),
    (lambda o1, l1, o2, l2: (torch.exp(l1 - torch.logaddexp(l1, l2)) * o1, l1), False, "unsqueeze(-1)"),
])
def test_check_merge(capsys, fn, ok, expect):
    assert cp_checks.check_merge(fn).ok is ok
    assert expect in capsys.readouterr().out


@pytest.mark.parametrize("fn, ok, expect", [
    (_todo, False, "not attempted yet"),
    (lambda r, cp: (r, 2 * cp - 1 - r), True, "✓ chunks_for_rank matches"),
    (lambda r, cp: (2 * cp - 1 - r, r), False, "early chunk first"),
    (lambda r, cp: (r, cp - 1 - r), False, "not cp"),
    (lambda r, cp: (r, 2 * cp - r), False, "off by one"),
    (lambda r, cp: (2 * r, 2 * r + 1), False, "contiguous split in disguise"),
    (lambda r, cp: (r, r + cp), False, "still grows with r"),
    (lambda r, cp: r, False, "return a pair"),
    (lambda r, cp: 1 / 0, False, "raised ZeroDivisionError"),
])
def test_check_chunks_for_rank(capsys, fn, ok, expect):
    assert cp_checks.check_chunks_for_rank(fn).ok is ok
    assert expect in capsys.readouterr().out
