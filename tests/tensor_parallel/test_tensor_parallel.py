"""Tensor-parallel layers on real ranks == the dense single-process model.

One launch per TP size t in {1, 2, 4} (world size t, gloo) checks, with and
without sequence parallelism, for ParallelMLP, ParallelSelfAttention and
ParallelTransformerLayer: forward outputs, input gradients and every
parameter's gradient re-assembled from the shards, against the dense twins
(course_lib.tensor_parallel.dense) computed once in the parent process. The
same launch records every collective and checks the standalone layers
(column/row-parallel linear, vocab-parallel embedding and cross-entropy).
Tolerance: max abs error <= 1e-5 in float32. The worst error is printed (-s).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.comm import CommRecorder
from course_lib.launch import launch
from course_lib.tensor_parallel import (ColumnParallelLinear, DenseMLP, DenseSelfAttention, DenseTransformerLayer,
                                        ParallelMLP, ParallelSelfAttention, ParallelTransformerLayer,
                                        RowParallelLinear, TransformerConfig, VocabParallelEmbedding,
                                        allreduce_sequence_parallel_grads, gather_full_grads, gather_full_params,
                                        vocab_parallel_cross_entropy)
from course_lib.tensor_parallel.memory import layer_parameter_shapes

TOL = 1e-5
SEED = 1234
S, B, H, HEADS, FFN, VOCAB = 8, 2, 16, 4, 32, 32
TP_SIZES = (1, 2, 4)
KINDS = {"mlp": (DenseMLP, ParallelMLP), "attention": (DenseSelfAttention, ParallelSelfAttention),
         "layer": (DenseTransformerLayer, ParallelTransformerLayer)}


def _config(sp=False):
    return TransformerConfig(hidden_size=H, num_attention_heads=HEADS, ffn_hidden_size=FFN, num_layers=2,
                             sequence_parallel=sp)


def _inputs():
    g = torch.Generator().manual_seed(7)
    return dict(x=torch.randn(S, B, H, generator=g), dy=torch.randn(S, B, H, generator=g),
                tokens=torch.randint(0, VOCAB, (B, S), generator=g),
                target=torch.randint(0, VOCAB, (S, B), generator=g))


def _dense_reference():
    """Dense outputs and gradients, computed once in the parent (forked ranks inherit them)."""
    inp, ref = _inputs(), {}
    for kind, (dense_cls, _) in KINDS.items():
        torch.manual_seed(SEED)
        model = dense_cls(_config())
        x = inp["x"].clone().requires_grad_()
        y = model(x)
        y.backward(inp["dy"])
        ref[kind] = dict(y=y.detach(), dx=x.grad, params={n: p.detach().clone() for n, p in model.named_parameters()},
                         grads={n: p.grad.clone() for n, p in model.named_parameters()})
    # standalone linears, embedding and the LM head + loss
    torch.manual_seed(SEED)
    w1 = torch.empty(FFN, H).normal_(0, 0.02)
    w2 = torch.empty(H, FFN).normal_(0, 0.02)
    emb = torch.empty(VOCAB, H).normal_(0, 0.02)
    head = torch.empty(VOCAB, H).normal_(0, 0.02)
    ref["linear"] = dict(col=F.linear(inp["x"], w1), row=F.linear(F.linear(inp["x"], w1), w2),
                         emb=F.embedding(inp["tokens"], emb))
    head_p = head.clone().requires_grad_()
    hid = inp["x"].clone().requires_grad_()
    logits = F.linear(hid, head_p)
    loss = F.cross_entropy(logits.view(-1, VOCAB), inp["target"].view(-1), reduction="none").view(S, B)
    loss.backward(inp["dy"][..., 0])
    ref["ce"] = dict(loss=loss.detach(), dhid=hid.grad, dhead=head_p.grad)
    return inp, ref


def _err(a, b):
    return (a - b).abs().max().item()


def _rank_equality(inp, ref):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    out = dict(errors={}, comm={}, shapes={}, ln_before={}, sp_numel={})
    for sp in (False, True):
        for kind, (_, par_cls) in KINDS.items():
            key = f"{kind}{'+sp' if sp else ''}"
            torch.manual_seed(SEED)
            model = par_cls(_config(sp), g)
            rf = ref[kind]
            params = gather_full_params(model, g)
            x = (inp["x"].chunk(t)[r] if sp else inp["x"]).clone().requires_grad_()
            dy = inp["dy"].chunk(t)[r] if sp else inp["dy"]
            with CommRecorder() as fwd:
                y = model(x)
            with CommRecorder() as bwd:
                y.backward(dy)
            want_y = rf["y"].chunk(t)[r] if sp else rf["y"]
            want_dx = rf["dx"].chunk(t)[r] if sp else rf["dx"]
            if kind == "layer":
                raw = {n: p.grad.clone() for n, p in model.named_parameters() if "layernorm" in n}
                out["ln_before"][key] = max(_err(raw[n], rf["grads"][n]) for n in raw)
            with CommRecorder() as fin:
                out["sp_numel"][key] = allreduce_sequence_parallel_grads(model, g)
            grads = gather_full_grads(model, g)
            out["errors"][key] = dict(
                params=max(_err(params[n], rf["params"][n]) for n in params),
                y=_err(y, want_y), dx=_err(x.grad, want_dx),
                grads=max(_err(grads[n], rf["grads"][n]) for n in grads))
            out["comm"][key] = dict(fwd=fwd.events, bwd=bwd.events, fin=fin.events)
            out["shapes"][key] = {n: tuple(p.shape) for n, p in model.named_parameters()}

    # ---- standalone layers: column (gather_output False/True), row (input not parallel)
    torch.manual_seed(SEED)
    col = ColumnParallelLinear(H, FFN, tp_group=g, bias=False)
    row = RowParallelLinear(FFN, H, tp_group=g, bias=False, input_is_parallel=False)
    emb = VocabParallelEmbedding(VOCAB, H, tp_group=g)
    head = ColumnParallelLinear(H, VOCAB, tp_group=g, bias=False)
    lin = ref["linear"]
    with CommRecorder() as rec_col:
        y_col, _ = col(inp["x"])
    col.gather_output = True
    with CommRecorder() as rec_gather:
        y_full, _ = col(inp["x"])
    with CommRecorder() as rec_row:
        y_row, _ = row(y_full)
    y_emb = emb(inp["tokens"])
    emb.reduce_scatter_embeddings = True
    y_emb_sp = emb(inp["tokens"])
    out["errors"]["linear"] = dict(col=_err(y_col, lin["col"].chunk(t, dim=-1)[r]), gather=_err(y_full, lin["col"]),
                                   row=_err(y_row, lin["row"]), emb=_err(y_emb, lin["emb"]),
                                   emb_sp=_err(y_emb_sp, lin["emb"].transpose(0, 1).chunk(t)[r]))
    out["comm"]["linear"] = dict(col=rec_col.events, gather=rec_gather.events, row=rec_row.events)
    out["shapes"]["linear"] = dict(col=tuple(y_col.shape), emb_sp=tuple(y_emb_sp.shape))

    # ---- LM head + vocab-parallel cross-entropy vs F.cross_entropy
    hid = inp["x"].clone().requires_grad_()
    logits, _ = head(hid)                                  # [s, b, V/t]
    with CommRecorder() as rec_ce:
        loss = vocab_parallel_cross_entropy(logits, inp["target"], g)
        loss.backward(inp["dy"][..., 0])
    dhead = gather_full_grads(head, g)["weight"]
    ce = ref["ce"]
    out["errors"]["ce"] = dict(loss=_err(loss, ce["loss"]), dhid=_err(hid.grad, ce["dhid"]),
                               dhead=_err(dhead, ce["dhead"]))
    out["comm"]["ce"] = rec_ce.events
    out["logits_shape"] = tuple(logits.shape)
    return out


@pytest.fixture(scope="module")
def results():
    inp, ref = _dense_reference()
    res = {}
    for t in TP_SIZES:
        res[t] = launch(_rank_equality, world_size=t, output="none", timeout=120, inp=inp, ref=ref)
    worst = max(v for t in res for rank in res[t] for errs in rank["errors"].values() for k, v in errs.items()
                if k != "params")
    print(f"\nworst max-abs error over tp={TP_SIZES}, +-SP, all ranks and checks: {worst:.3g}")
    return res


@pytest.mark.parametrize("t", TP_SIZES)
def test_parallel_equals_dense(results, t):
    for rank, out in enumerate(results[t]):
        for key, errs in out["errors"].items():
            for what, err in errs.items():
                if what == "params":  # same seed -> the very same numbers, not just close
                    assert err == 0.0, f"tp={t} rank {rank} {key}: shards differ from the dense weights"
                else:
                    assert err <= TOL, f"tp={t} rank {rank} {key} {what}: max abs error {err:.3g} > {TOL}"


@pytest.mark.parametrize("t", (2, 4))
def test_layernorm_grads_need_the_sequence_parallel_all_reduce(results, t):
    for out in results[t]:
        # without SP the replicated LayerNorm sees every token: its gradient is already complete
        assert out["ln_before"]["layer"] <= TOL
        assert out["sp_numel"]["layer"] == 0 and out["comm"]["layer"]["fin"] == []
        # with SP each rank sees s/t tokens: the gradient is partial until summed over TP ...
        assert out["ln_before"]["layer+sp"] > 1e-3
        # ... by one all-reduce of every sequence_parallel parameter: 4 LayerNorm vectors + 2 row biases
        assert out["sp_numel"]["layer+sp"] == 6 * H
        (event,) = out["comm"]["layer+sp"]["fin"]
        assert (event.op, event.numel, event.kind) == ("all_reduce", 6 * H, "tp")
        assert out["errors"]["layer+sp"]["grads"] <= TOL  # after it, equal to the dense gradients


def _ops(events, **match):
    return [e for e in events if all(getattr(e, k) == v for k, v in match.items())]


@pytest.mark.parametrize("t", TP_SIZES)
def test_tensor_parallel_layer_collectives(results, t):
    bsh = B * S * H
    for out in results[t]:
        comm = out["comm"]
        if t == 1:  # a group of one communicates nothing
            assert all(comm[k][d] == [] for k in comm if k not in ("linear", "ce") for d in ("fwd", "bwd"))
            continue
        layer = comm["layer"]
        # exactly 2 all-reduces of b*s*h elements forward (after linear_proj, linear_fc2) and 2 backward
        assert [(e.op, e.numel) for e in layer["fwd"]] == [("all_reduce", bsh)] * 2
        assert [(e.op, e.numel) for e in layer["bwd"]] == [("all_reduce", bsh)] * 2
        assert {e.source for e in layer["fwd"]} == {"reduce_from_tensor_model_parallel_region"}
        assert {e.source for e in layer["bwd"]} == {"copy_to_tensor_model_parallel_region"}
        assert all(e.direction == "fwd" for e in layer["fwd"]) and all(e.direction == "bwd" for e in layer["bwd"])
        # MLP and attention alone: one each way
        for kind in ("mlp", "attention"):
            assert [e.op for e in comm[kind]["fwd"]] == ["all_reduce"]
            assert [e.op for e in comm[kind]["bwd"]] == ["all_reduce"]
        # Narayanan et al. 2021, section 3.2: 8 b s h (t-1)/t elements sent per rank per layer, fwd + bwd
        sent = sum(e.ring_elements_sent for e in layer["fwd"] + layer["bwd"])
        assert sent == pytest.approx(8 * B * S * H * (t - 1) / t, rel=1e-12)
        assert sum(e.bytes for e in layer["fwd"]) == 2 * bsh * 4


@pytest.mark.parametrize("t", (2, 4))
def test_sequence_parallel_collectives(results, t):
    bsh = B * S * H
    for out in results[t]:
        tp, sp = out["comm"]["layer"], out["comm"]["layer+sp"]
        # forward: each all-reduce becomes all-gather (before the column GEMM) + reduce-scatter (after the row GEMM)
        assert sorted((e.op, e.numel) for e in sp["fwd"]) == [("all_gather", bsh)] * 2 + [("reduce_scatter", bsh)] * 2
        assert [e.op for e in sp["fwd"]] == ["all_gather", "reduce_scatter"] * 2
        # backward: the conjugates (all-gather of dY, reduce-scatter of dX) ...
        conj = [e for e in sp["bwd"] if e.tag != "recompute"]
        assert sorted(e.op for e in conj) == ["all_gather"] * 2 + ["reduce_scatter"] * 2
        # ... plus Megatron's re-gather of the stored input shard for the weight gradient
        recompute = [e for e in sp["bwd"] if e.tag == "recompute"]
        assert [(e.op, e.numel) for e in recompute] == [("all_gather", bsh)] * 2
        # the same bytes as tensor parallelism's all-reduces, in each pass (ring model)
        for d, events in (("fwd", sp["fwd"]), ("bwd", conj)):
            assert sum(e.ring_elements_sent for e in events) == pytest.approx(
                sum(e.ring_elements_sent for e in tp[d]), rel=1e-12)
        assert sum(e.ring_elements_sent for e in sp["fwd"]) == pytest.approx(4 * bsh * (t - 1) / t, rel=1e-12)


@pytest.mark.parametrize("t", (2, 4))
def test_column_output_stays_sharded_and_row_input_is_not_gathered(results, t):
    for out in results[t]:
        c = out["comm"]["linear"]
        assert c["col"] == []                                   # myth 1: no communication, output sharded
        assert out["shapes"]["linear"]["col"] == (S, B, FFN // t)
        assert [e.op for e in c["gather"]] == ["all_gather"]    # only gather_output=True gathers
        assert [e.op for e in c["row"]] == ["all_reduce"]       # row-parallel: one all-reduce, after the GEMM
        assert out["shapes"]["linear"]["emb_sp"] == (S // t, B, H)
        # attention: heads are local after the QKV split -- the only forward collective is after linear_proj
        assert [e.source for e in out["comm"]["attention"]["fwd"]] == ["reduce_from_tensor_model_parallel_region"]


@pytest.mark.parametrize("t", TP_SIZES)
def test_vocab_parallel_cross_entropy_never_gathers_logits(results, t):
    for out in results[t]:
        assert out["logits_shape"] == (S, B, VOCAB // t)
        events = out["comm"]["ce"]
        if t == 1:
            assert events == []
            continue
        # forward: max, target logit, sum of exp -- three all-reduces of s*b numbers, never s*b*V
        assert [(e.op, e.reduce_op, e.numel, e.direction, e.source) for e in events if e.direction == "fwd"] == [
            ("all_reduce", op, S * B, "fwd", "vocab_parallel_cross_entropy") for op in ("max", "sum", "sum")]
        # backward: the loss's own gradient is local; the one collective is the LM head's f (dX all-reduce)
        assert [(e.op, e.numel, e.source) for e in events if e.direction == "bwd"] == [
            ("all_reduce", S * B * H, "copy_to_tensor_model_parallel_region")]
        assert max(e.numel for e in events) < S * B * VOCAB


@pytest.mark.parametrize("t", TP_SIZES)
def test_memory_shapes_match_real_modules(results, t):
    cfg = _config()
    want = {r["name"]: r["shape"] for r in layer_parameter_shapes(cfg, t)}
    for out in results[t]:
        assert out["shapes"]["layer"] == want
        assert out["shapes"]["layer+sp"] == want
    one = {r["name"]: r for r in layer_parameter_shapes(cfg, 1)}
    for r in layer_parameter_shapes(cfg, t):
        full, mine = torch.Size(one[r["name"]]["shape"]).numel(), torch.Size(r["shape"]).numel()
        assert mine * (t if r["split"] else 1) == full   # split tensors: exactly 1/t; replicated: all of it
