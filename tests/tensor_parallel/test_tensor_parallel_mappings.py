"""The f/g and scatter/gather operators against their definitions, on 4 real ranks; bad input.

Rank r's input is ``xs[r]`` and its upstream gradient ``dys[r]`` (distinct per
rank, drawn from per-rank seeds every rank can regenerate), so each forward
value and each input gradient is checked against a formula over all ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import rules
from course_lib.comm import CommRecorder
from course_lib.launch import launch
from helpers import group_of_one
from course_lib.tensor_parallel import (ColumnParallelLinear, DenseMLP, ParallelMLP, ParallelSelfAttention,
                                        RowParallelLinear, TransformerConfig, VocabParallelEmbedding,
                                        copy_dense_to_parallel, copy_to_tensor_model_parallel_region,
                                        gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
                                        reduce_from_tensor_model_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region,
                                        scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)

W = 4
SHAPE = (8, 2, 12)  # [s, b, h], divisible by W on the first and last dims


def _per_rank(seed):
    return [torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed + r)) for r in range(W)]


def _rank_mappings():
    g, r = dist.group.WORLD, dist.get_rank()
    xs, dys = _per_rank(100), _per_rank(200)
    xsum, dysum = sum(xs), sum(dys)
    cat = lambda ts, d: torch.cat(ts, dim=d)  # noqa: E731
    # name: (function, input (same on all ranks for scatters), expected y, expected dx, expected (op, dir) events)
    cases = {
        "f": (copy_to_tensor_model_parallel_region, xs[r], xs[r], dysum, [("all_reduce", "bwd")]),
        "g": (reduce_from_tensor_model_parallel_region, xs[r], xsum, dys[r], [("all_reduce", "fwd")]),
        "scatter_last": (scatter_to_tensor_model_parallel_region, xs[0], xs[0].chunk(W, -1)[r],
                         None, [("all_gather", "bwd")]),
        "gather_last": (gather_from_tensor_model_parallel_region, xs[r].chunk(W, -1)[0], cat([x.chunk(W, -1)[0] for x in xs], -1),
                        None, [("all_gather", "fwd")]),
        "scatter_seq": (scatter_to_sequence_parallel_region, xs[0], xs[0].chunk(W, 0)[r], None,
                        [("all_gather", "bwd")]),
        "gather_seq": (gather_from_sequence_parallel_region, xs[r].chunk(W, 0)[0], cat([x.chunk(W, 0)[0] for x in xs], 0),
                       None, [("all_gather", "fwd"), ("reduce_scatter", "bwd")]),
        "reduce_scatter_seq": (reduce_scatter_to_sequence_parallel_region, xs[r], xsum.chunk(W, 0)[r], None,
                               [("all_gather", "bwd"), ("reduce_scatter", "fwd")]),
    }
    errors, events = {}, {}
    for name, (fn, x0, want_y, want_dx, _) in cases.items():
        x = x0.clone().requires_grad_()
        with CommRecorder() as rec:
            y = fn(x, g)
            dy = dys[r][tuple(slice(0, n) for n in y.shape)].contiguous()  # this rank's upstream gradient
            y.backward(dy)
        if name == "scatter_last":      # backward all-gathers the ranks' gradient slices
            want_dx = cat([dys[q][tuple(slice(0, n) for n in y.shape)] for q in range(W)], -1)
        elif name == "scatter_seq":
            want_dx = cat([dys[q][tuple(slice(0, n) for n in y.shape)] for q in range(W)], 0)
        elif name == "gather_last":     # backward keeps this rank's slice of its own gradient
            want_dx = dy.chunk(W, -1)[r]
        elif name == "gather_seq":      # backward reduce-scatters (the consumer is tensor-parallel)
            want_dx = sum(d[tuple(slice(0, n) for n in y.shape)] for d in dys).chunk(W, 0)[r]
        elif name == "reduce_scatter_seq":
            want_dx = cat([dys[q][tuple(slice(0, n) for n in y.shape)] for q in range(W)], 0)
        errors[name] = ((y - want_y).abs().max().item(), (x.grad - want_dx).abs().max().item())
        events[name] = sorted((e.op, e.direction) for e in rec.events)
    # gather with a replicated consumer: the backward is a plain split, no communication
    x = xs[r].chunk(W, 0)[0].clone().requires_grad_()
    with CommRecorder() as rec:
        y = gather_from_sequence_parallel_region(x, g, tensor_parallel_output_grad=False)
        y.backward(dys[0])
    errors["gather_seq_replicated"] = (0.0, (x.grad - dys[0].chunk(W, 0)[r]).abs().max().item())
    events["gather_seq_replicated"] = sorted((e.op, e.direction) for e in rec.events)

    # a group of one: every mapping returns its input untouched and communicates nothing
    mine = group_of_one()
    same = {}
    with CommRecorder() as rec:
        for name, (fn, *_rest) in cases.items():
            x = xs[r].clone().requires_grad_()
            y = fn(x, mine)
            same[name] = y is x
            y.sum().backward()
    return dict(errors=errors, events=events, same=same, single_events=len(rec.events),
                expected={k: sorted(v[4]) for k, v in cases.items()})


def test_mappings_match_their_definitions():
    for rank, out in enumerate(launch(_rank_mappings, world_size=W, output="none", timeout=60)):
        for name, (err_y, err_dx) in out["errors"].items():
            assert err_y <= 1e-6 and err_dx <= 1e-6, f"rank {rank} {name}: forward {err_y:.3g}, backward {err_dx:.3g}"
        for name, want in out["expected"].items():
            assert out["events"][name] == want, f"{name}: recorded {out['events'][name]}, expected {want}"
        assert out["events"]["gather_seq_replicated"] == [("all_gather", "fwd")]
        assert all(out["same"].values()) and out["single_events"] == 0


def _rank_bad_inputs():
    g = dist.group.WORLD
    msgs = {}

    def catch(name, fn):
        try:
            fn()
            msgs[name] = None
        except ValueError as exc:
            msgs[name] = str(exc)

    catch("heads", lambda: ParallelSelfAttention(TransformerConfig(hidden_size=24, num_attention_heads=6), g))
    catch("ffn", lambda: ParallelMLP(TransformerConfig(hidden_size=16, num_attention_heads=4, ffn_hidden_size=10), g))
    catch("column", lambda: ColumnParallelLinear(16, 10, tp_group=g))
    catch("row", lambda: RowParallelLinear(10, 16, tp_group=g))
    catch("row_sp", lambda: RowParallelLinear(16, 16, tp_group=g, input_is_parallel=False, sequence_parallel=True))
    catch("vocab", lambda: VocabParallelEmbedding(30, 16, tp_group=g))
    catch("seq", lambda: scatter_to_sequence_parallel_region(torch.zeros(6, 2, 16), g))
    catch("no_group", lambda: copy_to_tensor_model_parallel_region(torch.zeros(2), None))
    catch("no_group_layer", lambda: ColumnParallelLinear(16, 16, tp_group=None))
    return msgs


def test_bad_input_gives_one_line_value_errors():
    msgs = launch(_rank_bad_inputs, world_size=W, output="none", timeout=60)[0]
    assert msgs["heads"] == "num_attention_heads=6 is not divisible by tensor-model-parallel-size=4; " \
                           "use a tensor-model-parallel-size that divides 6 (1, 2, 3, 6)"
    assert msgs["ffn"] == "ffn_hidden_size=10 is not divisible by tensor-model-parallel-size=4; " \
                         "use a multiple of 4, e.g. 8 or 12"
    assert msgs["column"] == msgs["ffn"].replace("ffn_hidden_size", "output_size")     # one rule: tp_split
    assert msgs["row"] == msgs["ffn"].replace("ffn_hidden_size", "input_size")
    assert "input_is_parallel=True" in msgs["row_sp"]
    with pytest.raises(ValueError) as vocab:
        rules.vocab_divisible_by_tp(30, 4)
    assert msgs["vocab"] == str(vocab.value)
    assert msgs["seq"].startswith("sequence length 6 (first dimension) is not divisible by tensor-model-parallel-size=4")
    assert "pass the tensor-parallel process group explicitly" in msgs["no_group"]
    assert "pass the tensor-parallel process group explicitly" in msgs["no_group_layer"]
    assert all("\n" not in m for m in msgs.values())


def test_config_validation():
    with pytest.raises(ValueError, match="hidden_size=10 is not divisible by num_attention_heads=4"):
        TransformerConfig(hidden_size=10, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_dropout=1.5 must be in"):
        TransformerConfig(hidden_size=8, num_attention_heads=2, hidden_dropout=1.5)
    assert TransformerConfig(hidden_size=8, num_attention_heads=2).ffn_hidden_size == 32


def _rank_copy_dense():
    g = dist.group.WORLD
    cfg = TransformerConfig(hidden_size=16, num_attention_heads=4)
    torch.manual_seed(0)
    dense = DenseMLP(cfg)
    torch.manual_seed(99)                      # a different seed: different shards ...
    par = ParallelMLP(cfg, g)
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(3))
    before = (par(x) - dense(x)).abs().max().item()
    copy_dense_to_parallel(dense, par, g)      # ... until the dense weights are copied in
    after = (par(x) - dense(x)).abs().max().item()
    try:
        copy_dense_to_parallel(torch.nn.Linear(16, 16), par, g)
        mismatch = None
    except ValueError as exc:
        mismatch = str(exc)
    return before, after, mismatch


def test_copy_dense_to_parallel():
    for before, after, mismatch in launch(_rank_copy_dense, world_size=2, output="none", timeout=60):
        assert before > 1e-3 and after <= 1e-6
        assert mismatch.startswith("dense and parallel modules differ in parameters")

