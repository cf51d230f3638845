"""Lab 02's checkers accept right answers, catch typical wrong ones with the specific hint, and
report unattempted exercises without raising."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.checks import lab02
from course_lib.tensor_parallel import ParallelMLP, copy_dense_to_parallel


# ----------------------------------------------------------------- reference answers

def column_ok(x, weight, rank, world_size):
    return F.linear(x, weight.chunk(world_size, 0)[rank])


def row_ok(x_shard, weight, group):
    y = F.linear(x_shard, weight.chunk(dist.get_world_size(group), 1)[dist.get_rank(group)])
    dist.all_reduce(y, group=group)
    return y


class F_ok(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class G_ok(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def mlp_ok(dense, group):
    return copy_dense_to_parallel(dense, ParallelMLP(dense.config, group), group)


def counts_ok(sp):
    if sp:
        return {("fwd", "all_gather"): 2, ("fwd", "reduce_scatter"): 2, ("bwd", "all_gather"): 4,
                ("bwd", "reduce_scatter"): 2}
    return {("fwd", "all_reduce"): 2, ("bwd", "all_reduce"): 2}


def elements_ok(b, s, h, t):
    return 8 * b * s * h * (t - 1) / t


def not_yet(*args, **kwargs):
    raise NotImplementedError("write it")


# ------------------------------------------------------------------------ tests

def test_right_answers_pass(capsys):
    assert lab02.check_column_parallel_forward(column_ok)
    assert lab02.check_row_parallel_forward(row_ok)
    assert lab02.check_f_g(F_ok, G_ok)
    assert lab02.check_tp_mlp_from_dense(mlp_ok)
    assert lab02.check_collective_prediction(counts_ok, elements_ok)
    assert capsys.readouterr().out.count("✓") == 5


def test_not_attempted_is_reported_without_raising(capsys):
    class F_stub(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            raise NotImplementedError("f")

    assert not lab02.check_column_parallel_forward(not_yet)
    assert not lab02.check_row_parallel_forward(not_yet)
    assert not lab02.check_f_g(F_stub, G_ok)
    assert not lab02.check_tp_mlp_from_dense(not_yet)
    assert not lab02.check_collective_prediction(not_yet, elements_ok)
    out = capsys.readouterr().out
    assert out.count("not attempted yet") == 5
    names = ["column_parallel_forward", "row_parallel_forward", "F_stub and G_ok", "tp_mlp_from_dense",
             "predict_collectives"]      # the shared line of course_lib.checks.not_attempted, naming the exercise
    assert out.splitlines() == [f"not attempted yet: write {name} above, then re-run this cell" for name in names]


def _hint(capsys, check, answer, *more):
    assert not check(answer, *more)
    return capsys.readouterr().out


def test_column_hints(capsys):
    assert "full output" in _hint(capsys, lab02.check_column_parallel_forward, lambda x, w, r, t: F.linear(x, w))
    assert "chunk number `rank`" in _hint(capsys, lab02.check_column_parallel_forward,
                                         lambda x, w, r, t: F.linear(x, w.chunk(t, 0)[(r + 1) % t]))
    assert "dim 0" in _hint(capsys, lab02.check_column_parallel_forward,
                            lambda x, w, r, t: F.linear(x, w.chunk(t, 1)[r]))


def test_row_hints(capsys):
    def no_reduce(x_shard, weight, group):
        return F.linear(x_shard, weight.chunk(dist.get_world_size(group), 1)[dist.get_rank(group)])

    assert "all-reduce it" in _hint(capsys, lab02.check_row_parallel_forward, no_reduce)

    def wrong_dim(x_shard, weight, group):
        y = F.linear(x_shard, weight.chunk(dist.get_world_size(group), 0)[dist.get_rank(group)])
        dist.all_reduce(y, group=group)
        return y

    assert "weight.chunk(t, dim=1)" in _hint(capsys, lab02.check_row_parallel_forward, wrong_dim)


def test_f_g_hints(capsys):
    class F_no_reduce(F_ok):
        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class G_reduce_back(G_ok):
        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad)
            return grad, None

    class G_identity(G_ok):
        @staticmethod
        def forward(ctx, x, group):
            return x.view_as(x)

    assert "f's backward must all-reduce" in _hint(capsys, lab02.check_f_g, F_no_reduce, G_ok)
    assert "multiplies it by t" in _hint(capsys, lab02.check_f_g, F_ok, G_reduce_back)
    assert "g's forward must all-reduce" in _hint(capsys, lab02.check_f_g, F_ok, G_identity)
    assert "f's forward must be the identity" in _hint(capsys, lab02.check_f_g, G_ok, G_ok)


def test_tp_mlp_hints(capsys):
    def bias_split(dense, group):
        t, r = dist.get_world_size(group), dist.get_rank(group)
        par = mlp_ok(dense, group)
        par.linear_fc2.bias = torch.nn.Parameter(dense.linear_fc2.bias.detach().chunk(t)[r].clone())
        return par

    def wrong_rank(dense, group):
        t, r = dist.get_world_size(group), dist.get_rank(group)
        par = mlp_ok(dense, group)
        with torch.no_grad():
            par.linear_fc1.weight.copy_(dense.linear_fc1.weight.chunk(t, 0)[(r + 1) % t])
        return par

    assert "NOT split" in _hint(capsys, lab02.check_tp_mlp_from_dense, bias_split)
    assert "linear_fc1.weight does not hold" in _hint(capsys, lab02.check_tp_mlp_from_dense, wrong_rank)
    assert "returned a DenseMLP" in _hint(capsys, lab02.check_tp_mlp_from_dense, lambda dense, group: dense)


def test_collective_prediction_hints(capsys):
    out = _hint(capsys, lab02.check_collective_prediction, lambda sp: {("fwd", "all_reduce"): 2}, elements_ok)
    assert "conjugate" in out
    def sp_no_recompute(sp):
        c = counts_ok(sp)
        if sp:
            c[("bwd", "all_gather")] = 2
        return c
    assert "'recompute'" in _hint(capsys, lab02.check_collective_prediction, sp_no_recompute, elements_ok)
    assert "2N(t-1)/t" in _hint(capsys, lab02.check_collective_prediction, counts_ok,
                                lambda b, s, h, t: 4 * b * s * h * (t - 1) / t)
