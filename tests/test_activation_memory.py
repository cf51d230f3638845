"""Activation memory of a transformer layer: measured on real ranks == the expected saved-tensor list, exactly.

* The bytes one rank saves for backward (``saved_tensors_hooks``, one count per storage) equal
  ``expected_saved_tensors`` storage by storage, for TP 1/2/4 with and without sequence
  parallelism, flash and unfused attention, with and without dropout, and for TP x CP with
  ring attention (cp 2 and 4). The expected list is written from the layer's code, never
  from a measurement.
* The structure the paper predicts holds on the measurements: with SP a TP rank keeps exactly
  1/t of the single-rank layer; without SP the LayerNorm and GEMM inputs (our ``4sbh`` of
  Korthikanti's ``10sbh``) stay whole; the s x s score term divides by t, not t^2, and SP
  leaves it alone (myth 4 of COURSE.md).
* The paper's items add up to Korthikanti's Eq. 1 / 2 / 4 written out here by hand.
* The TP x CP layer (``ContextParallelSelfAttention``) equals the dense layer in outputs and all gradients.

The numbers are for torch 2.13's CPU kernels (see the module docstring); another torch skips
the exact comparison. Equality with the dense layer for TP +- SP itself is proven in
tests/tensor_parallel/test_tensor_parallel.py and not repeated here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course_lib import sizing
from course_lib.activation_memory import (PLOT_SETUPS, activation_bytes, activation_storages, build_layer,
                                          compare_with_paper, expected_activation_bytes, expected_saved_tensors,
                                          format_comparison, format_saved_tensors, local_tokens, measure,
                                          memory_vs_seq_length, plot_memory_vs_seq_length, record_saved_tensors)
from course_lib.launch import launch
from course_lib.tensor_parallel import (DenseTransformerLayer, TransformerConfig, allreduce_sequence_parallel_grads,
                                        gather_full_grads)
from course_lib.saved_tensors import SavedTensorRecorder
from helpers import rank_groups

TORCH_2_13 = torch.__version__.startswith("2.13")
exact = pytest.mark.skipif(not TORCH_2_13, reason="the saved-tensor list is written for torch 2.13's CPU kernels")

S, B, H, A = 16, 2, 16, 4
BASE = dict(seq_length=S, micro_batch_size=B, hidden_size=H, num_heads=A)


def _cases(with_unfused=True):
    out = []
    for sp in (False, True):
        out.append(dict(BASE, sequence_parallel=sp))                                   # the course default
        out.append(dict(BASE, sequence_parallel=sp, hidden_dropout=0.1))
        if with_unfused:
            out.append(dict(BASE, sequence_parallel=sp, attention_backend="unfused"))
            out.append(dict(BASE, sequence_parallel=sp, attention_backend="unfused", hidden_dropout=0.1,
                            attention_dropout=0.1))
    return out


LAYOUTS = [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4)]   # (tp, cp): world sizes 1, 2, 4, 4, 4


@pytest.fixture(scope="module")
def measured():
    res = {}
    for tp, cp in LAYOUTS:
        cases = _cases(with_unfused=cp == 1)
        res[(tp, cp)] = list(zip(cases, measure(cases, tp=tp, cp=cp)))
    return res


def _key(case):
    return (case["sequence_parallel"], case.get("attention_backend", "flash"), case.get("hidden_dropout", 0.0),
            case.get("attention_dropout", 0.0))


@exact
@pytest.mark.parametrize("tp,cp", LAYOUTS)
def test_measured_equals_expected_storage_by_storage(measured, tp, cp):
    n = 0
    for case, per_rank in measured[(tp, cp)]:
        want = expected_saved_tensors(tp=tp, cp=cp, **case)
        assert len(per_rank) == tp * cp
        for rank, records in enumerate(per_rank):
            got = [row["bytes"] for row in activation_storages(records)]
            assert got == [e.bytes for e in want], (
                f"tp={tp} cp={cp} rank {rank} {_key(case)}:\n{format_saved_tensors(records, want)}")
            assert activation_bytes(records) == expected_activation_bytes(tp=tp, cp=cp, **case)
            n += 1
    assert n == len(measured[(tp, cp)]) * tp * cp


@exact
def test_measurement_shows_what_sp_splits_and_what_tp_alone_does_not(measured):
    """SP: a rank keeps exactly 1/t of the single-rank layer. TP alone: the per-token parts stay whole."""
    sbh, sb = S * B * H, S * B
    one = {_key(c): activation_bytes(r[0]) for c, r in measured[(1, 1)]}
    for t in (2, 4):
        got = {_key(c): activation_bytes(r[0]) for c, r in measured[(t, 1)]}
        for key, value in got.items():
            sp, backend, hd, ad = key
            if sp:
                assert value * t == one[(False, backend, hd, ad)], key
            else:
                # replicated on every TP rank: both LayerNorm inputs, the QKV and fc1 GEMM inputs (4 sbh),
                # the LayerNorm statistics (4 sb) and, with dropout, the two masks (2 sbh); all float32
                replicated = 4 * (4 * sbh + 4 * sb + (2 * sbh if hd else 0))
                assert value == one[key] // t + replicated * (t - 1) // t, key


@exact
def test_score_term_divides_by_t_not_t_squared_and_sp_leaves_it(measured):
    """Myth 4: the softmax output [b, a/t, s, s] is the same storage size with and without SP."""
    def softmax_bytes(records):
        rows = [r for r in records if r.producer == "SafeSoftmaxBackward0"]
        assert len({r.storage for r in rows}) == 1
        return rows[0].storage_bytes

    scores = {}
    for t in (1, 2, 4):
        for case, per_rank in measured[(t, 1)]:
            if case.get("attention_backend") == "unfused" and not case.get("attention_dropout"):
                scores[(t, case["sequence_parallel"])] = softmax_bytes(per_rank[0])
    assert scores[(1, False)] == A * S * S * B * 4                  # a s^2 b float32 elements
    for t in (2, 4):
        assert scores[(t, False)] == scores[(t, True)] == scores[(1, False)] // t


def test_paper_items_add_up_to_korthikanti():
    """The paper column reproduces Eq. 1, 2 and 4 written out here (bytes, 16-bit)."""
    for s, b, h, a in ((16, 2, 16, 4), (64, 1, 64, 8), (2048, 1, 12288, 96)):
        sbh = s * b * h
        for t in (1, 2, 4, 8):
            if a % t or s % t:
                continue
            for sp in (False, True):
                rows = compare_with_paper(s, b, h, a, tp=t, sequence_parallel=sp)
                paper = sum(r["paper"] for r in rows[:-1])
                if sp:
                    want = (34 * sbh + 5 * a * s * s * b) // t               # Eq. 4: sbh/t (34 + 5as/h)
                else:
                    want = 10 * sbh + 24 * sbh // t + 5 * a * s * s * b // t  # Eq. 2 (Eq. 1 at t = 1)
                assert paper == want == rows[-1]["paper"]
                assert rows[-1]["ours"] == sum(r["ours"] for r in rows[:-1]) == expected_activation_bytes(
                    s, b, h, a, t, sp)
                assert all(r["why"] for r in rows)


def test_comparison_rows_explain_the_differences():
    rows = {r["term"]: r for r in compare_with_paper(64, 2, 64, 8, tp=2)}
    sbh = 64 * 2 * 64
    assert rows["softmax_output"]["ours"] == 0 and "flash" in rows["softmax_output"]["why"]
    assert rows["lse"]["paper"] == 0 and rows["lse"]["ours"] == 4 * (8 // 2) * 64 * 2
    assert rows["attention_dropout_mask"]["ours"] == 0 and "hidden_dropout=0" in rows["attention_dropout_mask"]["why"]
    assert rows["layernorm_inputs"]["ours"] == 2 * rows["layernorm_inputs"]["paper"] == 8 * sbh
    # a paper-like layer (unfused attention, dropout on): every paper item is present in ours
    rows = {r["term"]: r for r in compare_with_paper(64, 2, 64, 8, tp=2, attention_backend="unfused",
                                                       hidden_dropout=0.1, attention_dropout=0.1)}
    assert all(r["ours"] > 0 for r in rows.values())
    assert rows["softmax_dropout_mask"]["ours"] == 4 * rows["softmax_dropout_mask"]["paper"]  # float32 vs 1 byte
    ring = {r["term"]: r for r in compare_with_paper(64, 2, 64, 8, tp=2, sequence_parallel=True, cp=2)}
    assert ring["ring_kv"]["ours"] == 2 * 4 * 2 * (8 // 2) * 32 * (64 // 8)
    assert ring["total"]["paper"] == sizing.activation_bytes_per_layer(64, 2, 64, 8, 2, True, "none", 2)
    text = format_comparison(list(ring.values()))
    assert text.splitlines()[0].startswith("term") and "total per layer" in text


def test_record_saved_tensors_counts_a_storage_once_and_skips_parameters():
    class Views(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x).exp()                  # exp saves its output y
            q, k = y.chunk(2, dim=-1)              # two views of y
            return (q * k).sum()                   # mul saves q and k: still y's storage

    torch.manual_seed(0)
    m = Views()
    x = torch.randn(3, 8, requires_grad=True)
    _, records = record_saved_tensors(m, x)
    rows = activation_storages(records)
    assert [r["bytes"] for r in rows] == [3 * 8 * 4, 3 * 8 * 4]   # x (saved by the GEMM) and y
    assert {r["module"] for r in rows} == {"lin", "(layer)"}
    assert sorted(map(tuple, rows[1]["shapes"])) == [(3, 4), (3, 8)]
    assert any(r.parameter for r in records)                      # the weight was saved, and not counted
    assert activation_bytes(records) == 2 * 3 * 8 * 4


def test_the_recorder_also_sees_what_runs_outside_the_module():
    """The pipeline executor's use: a chunk and then its loss inside one recorder."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    with SavedTensorRecorder(lin) as saved:
        loss = lin(x).exp().sum()                 # exp (outside the module) saves its output
    assert [r["module"] for r in activation_storages(saved.records)] == ["(layer)", "(outside)"]
    assert activation_bytes(saved.records) == 2 * 3 * 8 * 4
    assert loss.requires_grad


def _ring_layer_equality(x, dy, ref):
    groups = rank_groups("tp", "cp", tp=2, cp=2)
    tp_g, cp_g = groups["tp"], groups["cp"]
    errors = {}
    for sp in (False, True):
        torch.manual_seed(3)
        layer = build_layer(TransformerConfig(hidden_size=H, num_attention_heads=A, sequence_parallel=sp), tp_g, cp_g)
        xl = local_tokens(x, tp_g, cp_g, sp).requires_grad_()
        y = layer(xl)
        y.backward(local_tokens(dy, tp_g, cp_g, sp))
        allreduce_sequence_parallel_grads(layer, tp_g)
        grads = gather_full_grads(layer, tp_g)
        for g in grads.values():                    # CP ranks hold the same weights: sum their gradients
            dist.all_reduce(g, group=cp_g)
        errors[sp] = dict(attention=type(layer.self_attention).__name__,
                          y=(y - local_tokens(ref["y"], tp_g, cp_g, sp)).abs().max().item(),
                          dx=(xl.grad - local_tokens(ref["dx"], tp_g, cp_g, sp)).abs().max().item(),
                          grads=max((grads[n] - ref["grads"][n]).abs().max().item() for n in grads),
                          n_grads=len(grads))
    return errors


def test_ring_layer_equals_dense_layer():
    """TP=2 x CP=2 (4 ranks, zigzag, causal), with and without SP: outputs, input and weight gradients."""
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    torch.manual_seed(3)
    dense = DenseTransformerLayer(TransformerConfig(hidden_size=H, num_attention_heads=A))
    xd = x.clone().requires_grad_()
    y = dense(xd)
    y.backward(dy)
    ref = dict(y=y.detach(), dx=xd.grad, grads={n: p.grad for n, p in dense.named_parameters()})
    res = launch(_ring_layer_equality, world_size=4, output="none", timeout=120, x=x, dy=dy, ref=ref)
    worst = max(e[k] for rank in res for e in rank.values() for k in ("y", "dx", "grads"))
    print(f"\nTP=2 x CP=2 ring layer vs dense, worst max-abs error: {worst:.2e}")
    for rank in res:
        for sp, e in rank.items():
            assert e["n_grads"] == len(ref["grads"])
            assert e["attention"] == "ContextParallelSelfAttention"
            for what in ("y", "dx", "grads"):
                assert e[what] <= 1e-5, (sp, what, e[what])


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp=3), "num_attention_heads=4 is not divisible by tensor-model-parallel-size=3"),
    (dict(cp=3), "not divisible by 2 × context-parallel-size=3 = 6"),
    (dict(cp=2, attention_backend="unfused"), "use attention_backend='flash'"),
    (dict(attention_dropout=0.1), "use attention_backend='unfused'"),
    (dict(cp=2, attention_dropout=0.1, attention_backend="flash"), "ring attention has no dropout"),
    (dict(attention_backend="sdpa"), "attention_backend='sdpa' is unknown"),
    (dict(seq_length=20, tp=4, cp=2, sequence_parallel=True), "= 10 is not divisible by tensor-model-parallel-size=4"),
    (dict(hidden_dropout=1.0), "hidden_dropout=1.0 must be in"),
])
def test_bad_settings_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        expected_saved_tensors(**{**BASE, **kwargs})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=match):
        measure([{**BASE, **{k: v for k, v in kwargs.items() if k not in ("tp", "cp")}}],
                tp=kwargs.get("tp", 1), cp=kwargs.get("cp", 1))


def test_memory_vs_seq_length_and_plot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = [16, 64, 256, 4096]
    ours = memory_vs_seq_length(seqs, 64, 8, tp=2, cp=2)
    assert list(ours) == [label for label, _ in PLOT_SETUPS]
    assert ours["TP+SP+CP (ring attention)"][-1] < ours["TP+SP, flash attention"][-1] < ours["TP+SP"][-1] \
        < ours["TP"][-1]
    paper = memory_vs_seq_length(seqs, 64, 8, tp=2, cp=2, source="paper")
    assert paper["TP+SP"] == [sizing.activation_bytes_per_layer(s, 1, 64, 8, 2, True) for s in seqs]
    assert "TP+SP, flash attention" not in paper       # the paper's layer always stores its scores
    fig = plot_memory_vs_seq_length(seqs, 64, 8, measured={"TP": {16: ours["TP"][0]}})
    assert len(fig.axes[0].lines) == len(ours) + 1 + 1 + len(paper)   # + the measured/formula divider
    plt.close(fig)
    with pytest.raises(ValueError, match="source='x' must be"):
        memory_vs_seq_length(seqs, 64, 8, source="x")
