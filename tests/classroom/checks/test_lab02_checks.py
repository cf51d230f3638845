"""Lab 02's checkers: a table of wrong answers per exercise -- right-numbers-wrong-algorithm ones included --
each rejected with the hint that names its mistake; right answers written differently, each accepted; stubs
reported as "not attempted" without raising; monkeypatches undone; the course's own code recognised."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import all_reduce as bound_all_reduce
from torch.distributed import distributed_c10d

from course_lib import comm
from course_lib.classroom.checks.tensor_parallel import (check_column_parallel_forward, check_row_parallel_forward,
                                                         check_tp_mlp_from_dense)
from course_lib.classroom.checks.tp_communication import check_collective_prediction, check_f_g
from course_lib.classroom.checks.vocab_parallel import check_vocab_parallel_cross_entropy
from course_lib.tensor_parallel import (ParallelMLP, RowParallelLinear, copy_dense_to_parallel, mappings,
                                        vocab_parallel_cross_entropy)


def not_yet(*args, **kwargs):
    raise NotImplementedError("write it")


def _verdict(capsys, check, *answers):
    ok = check(*answers).ok
    return ok, capsys.readouterr().out


def _t_r(group):
    return dist.get_world_size(group), dist.get_rank(group)


# ---------------------------------------------------------------- Exercise 1: column-parallel forward

def column_ok(x, weight, rank, world_size):
    return F.linear(x, weight.chunk(world_size, 0)[rank])


def column_matmul(x, weight, rank, world_size):
    return x @ weight.chunk(world_size, 0)[rank].T


def column_float64(x, weight, rank, world_size):
    return torch.einsum("sbi,oi->sbo", x.double(), weight.double().chunk(world_size, 0)[rank])


def column_patches_linear(x, weight, rank, world_size):
    F.linear = lambda *args, **kwargs: torch.zeros(1)  # a student "fixing" the library
    return x[..., : weight.shape[0] // world_size] * 0


def column_numpy(x, weight, rank, world_size):
    return column_ok(x, weight, rank, world_size).numpy()


def column_nan(x, weight, rank, world_size):
    return column_ok(x, weight, rank, world_size) * float("nan")


@pytest.mark.parametrize("answer, ok, text", [
    (column_ok, True, "✓ column_parallel_forward"),
    (column_matmul, True, "✓ column_parallel_forward"),
    (column_float64, True, "✓ column_parallel_forward"),
    (not_yet, False, "not attempted yet: write column_parallel_forward"),
    (lambda x, w, r, t: F.linear(x, w), False, "full output"),
    (lambda x, w, r, t: F.linear(x, w.chunk(t, 0)[(r + 1) % t]), False, "chunk number `rank`"),
    (lambda x, w, r, t: F.linear(x, w.chunk(t, 1)[r]), False, "dim 0"),
    (column_patches_linear, False, "replaced torch.nn.functional.linear"),
    (column_numpy, False, "return the output tensor Y_i (got ndarray)"),
    (column_nan, False, "NaN or inf"),
    (mappings.split_along_last_dim, False, "the course's own"),
])
def test_column_parallel_forward(capsys, answer, ok, text):
    linear = F.linear
    got, out = _verdict(capsys, check_column_parallel_forward, answer)
    assert got is ok and text in out, out
    assert F.linear is linear                      # a patch never outlives the checker


# ---------------------------------------------------------------- Exercise 1: row-parallel forward

def row_ok(x_shard, weight, group):
    t, r = _t_r(group)
    y = F.linear(x_shard, weight.chunk(t, 1)[r])
    dist.all_reduce(y, group=group)
    return y


def row_c10d(x_shard, weight, group):
    t, r = _t_r(group)
    y = x_shard @ weight.chunk(t, 1)[r].T
    distributed_c10d.all_reduce(y, group=group)
    return y


def row_bound_name_async(x_shard, weight, group):
    t, r = _t_r(group)
    y = F.linear(x_shard, weight.chunk(t, 1)[r])
    bound_all_reduce(y, group=group, async_op=True).wait()
    return y


def row_course_wrapper(x_shard, weight, group):
    t, r = _t_r(group)
    return comm.all_reduce(F.linear(x_shard, weight.chunk(t, 1)[r]).contiguous(), group)


def row_no_reduce(x_shard, weight, group):
    t, r = _t_r(group)
    return F.linear(x_shard, weight.chunk(t, 1)[r])


def row_wrong_dim(x_shard, weight, group):
    t, r = _t_r(group)
    y = F.linear(x_shard, weight.chunk(t, 0)[r])
    dist.all_reduce(y, group=group)
    return y


def row_avg(x_shard, weight, group):
    t, r = _t_r(group)
    y = F.linear(x_shard, weight.chunk(t, 1)[r])
    dist.all_reduce(y, op=dist.ReduceOp.AVG, group=group)
    return y


def row_twice_as_much(x_shard, weight, group):
    y = row_ok(x_shard, weight, group)
    return y * dist.get_world_size(group)


def row_gather_dense(x_shard, weight, group):       # right numbers, not tensor parallelism
    t, _ = _t_r(group)
    pieces = [torch.empty_like(x_shard) for _ in range(t)]
    dist.all_gather(pieces, x_shard.contiguous(), group=group)
    return F.linear(torch.cat(pieces, -1), weight)


def row_gather_objects(x_shard, weight, group):     # the same, through object collectives
    t, _ = _t_r(group)
    pieces = [None] * t
    dist.all_gather_object(pieces, x_shard, group=group)
    return F.linear(torch.cat(pieces, -1), weight)


def row_reduce_scatter_all_gather(x_shard, weight, group):  # an all-reduce as its two halves: the same wire
    t, r = _t_r(group)
    y = F.linear(x_shard, weight.chunk(t, 1)[r]).contiguous()
    mine = torch.empty(y.shape[0] // t, *y.shape[1:])
    dist.reduce_scatter_tensor(mine, y, group=group)
    out = torch.empty_like(y)
    dist.all_gather_into_tensor(out, mine, group=group)
    return out


def row_halves_along_features(x_shard, weight, group):     # the same, cut along the output features, as lists
    t, r = _t_r(group)
    y = F.linear(x_shard, weight.chunk(t, 1)[r])
    chunks = [c.contiguous() for c in y.chunk(t, -1)]
    mine = torch.empty_like(chunks[r])
    dist.reduce_scatter(mine, chunks, group=group)
    gathered = [torch.empty_like(c) for c in chunks]
    dist.all_gather(gathered, mine, group=group)
    return torch.cat(gathered, -1)


def row_reduce_scatter_of_x(x_shard, weight, group):        # the two halves, carrying the input, not X_i A_i
    t, r = _t_r(group)
    x_all = torch.zeros(*x_shard.shape[:-1], x_shard.shape[-1] * t)
    x_all[..., r * x_shard.shape[-1]:(r + 1) * x_shard.shape[-1]] = x_shard
    mine = torch.empty(x_all.shape[0] // t, *x_all.shape[1:])
    dist.reduce_scatter_tensor(mine, x_all.contiguous(), group=group)
    out = torch.empty_like(x_all)
    dist.all_gather_into_tensor(out, mine, group=group)
    return F.linear(out, weight)


def row_reduce_broadcast(x_shard, weight, group):   # right numbers, two collectives
    t, r = _t_r(group)
    y = F.linear(x_shard, weight.chunk(t, 1)[r]).contiguous()
    dist.reduce(y, dst=0, group=group)
    dist.broadcast(y, src=0, group=group)
    return y


def row_two_halves(x_shard, weight, group):         # right numbers, two all-reduces
    t, r = _t_r(group)
    y = F.linear(x_shard, weight.chunk(t, 1)[r])
    first, second = y[:2].contiguous(), y[2:].contiguous()
    dist.all_reduce(first, group=group)
    dist.all_reduce(second, group=group)
    return torch.cat([first, second])


def row_raises(x_shard, weight, group):
    raise ValueError("my bug")


def row_all_reduce_padded_x(x_shard, weight, group):   # right numbers, one all-reduce: of x, not of X_i A_i
    t, r = _t_r(group)
    x = torch.zeros(*x_shard.shape[:-1], weight.shape[1])
    x[..., r * x_shard.shape[-1]:(r + 1) * x_shard.shape[-1]] = x_shard
    dist.all_reduce(x, group=group)
    return F.linear(x, weight)


def row_rebuilt_from_seed(x_shard, weight, group):     # x rebuilt from the seed the checker once drew it from
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*x_shard.shape[:-1], weight.shape[1], generator=g)
    y = torch.zeros(*x_shard.shape[:-1], weight.shape[0])
    dist.all_reduce(y, group=group)
    return F.linear(x, weight)


def row_via_course_layer(x_shard, weight, group):
    t, r = _t_r(group)
    layer = RowParallelLinear(weight.shape[1], weight.shape[0], tp_group=group, bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight.chunk(t, 1)[r])
    return layer(x_shard)


@pytest.mark.parametrize("answer, ok, text", [
    (row_ok, True, "✓ row_parallel_forward"),
    (row_c10d, True, "✓ row_parallel_forward"),
    (row_bound_name_async, True, "✓ row_parallel_forward"),
    (row_course_wrapper, True, "✓ row_parallel_forward"),
    (row_reduce_scatter_all_gather, True, "✓ row_parallel_forward"),
    (row_halves_along_features, True, "✓ row_parallel_forward"),
    (row_reduce_scatter_of_x, False, "your reduce-scatter did not carry your partial sum X_i A_i"),
    (not_yet, False, "not attempted yet: write row_parallel_forward"),
    (row_no_reduce, False, "all-reduce it"),
    (row_wrong_dim, False, "weight.chunk(t, dim=1)"),
    (row_avg, False, "t times too small"),
    (row_twice_as_much, False, "t times too large"),
    (row_gather_dense, False, "gathering x and running the dense GEMM"),
    (row_gather_objects, False, "gathering x and running the dense GEMM"),
    (row_reduce_broadcast, False, "exactly one all-reduce"),
    (row_two_halves, False, "exactly one all-reduce"),
    (row_raises, False, "raised ValueError: my bug"),
    (mappings.reduce_from_tensor_model_parallel_region, False, "the course's own"),
    (row_all_reduce_padded_x, False, "did not carry your partial sum X_i A_i"),
    (row_rebuilt_from_seed, False, "rank"),
    (row_via_course_layer, False, "the course's own course_lib.tensor_parallel.layers.RowParallelLinear"),
])
def test_row_parallel_forward(capsys, answer, ok, text):
    got, out = _verdict(capsys, check_row_parallel_forward, answer)
    assert got is ok and text in out, out


# ---------------------------------------------------------------- Exercise 2: f and g

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


class G_wrapper(G_ok):  # the course's recorded all-reduce wrapper is fine
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.clone(), group)


class F_no_reduce(F_ok):
    @staticmethod
    def backward(ctx, grad):
        return grad, None


class F_avg(F_ok):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=ctx.group)
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


class G_avg(G_ok):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.AVG, group=group)
        return y


class G_gather_sum(G_ok):  # right numbers, t times the traffic
    @staticmethod
    def forward(ctx, x, group):
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return sum(pieces)


def _sum_in_two_steps(x, group):  # reduce-scatter then all-gather: one all-reduce's wire, padded to a multiple of t
    t = dist.get_world_size(group)
    flat = torch.cat([x.reshape(-1), x.new_zeros(-x.numel() % t + t)])   # always padded: the padding is tolerated
    mine = flat.new_empty(flat.numel() // t)
    dist.reduce_scatter_tensor(mine, flat, group=group)
    whole = torch.empty_like(flat)
    dist.all_gather_into_tensor(whole, mine, group=group)
    return whole[: x.numel()].reshape(x.shape)


class F_two_steps(F_ok):
    @staticmethod
    def backward(ctx, grad):
        return _sum_in_two_steps(grad, ctx.group), None


class G_two_steps(G_ok):
    @staticmethod
    def forward(ctx, x, group):
        return _sum_in_two_steps(x, group)


class F_stub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        raise NotImplementedError("f")


@pytest.mark.parametrize("f_cls, g_cls, ok, text", [
    (F_ok, G_ok, True, "✓ f and g are conjugate"),
    (F_ok, G_wrapper, True, "✓ f and g are conjugate"),
    (F_two_steps, G_two_steps, True, "✓ f and g are conjugate"),
    (F_stub, G_ok, False, "not attempted yet: write F_stub and G_ok"),
    (F_no_reduce, G_ok, False, "f's backward must all-reduce"),
    (F_avg, G_ok, False, "f's backward is t times too small"),
    (F_ok, G_reduce_back, False, "multiplies it by t"),
    (F_ok, G_identity, False, "g's forward must all-reduce"),
    (F_ok, G_avg, False, "g's forward is t times too small"),
    (F_ok, G_gather_sum, False, "moves t times the data"),
    (G_ok, G_ok, False, "f's forward must be the identity"),
    (mappings._CopyToModelParallelRegion, mappings._ReduceFromModelParallelRegion, False, "the course's own"),
])
def test_f_g(capsys, f_cls, g_cls, ok, text):
    got, out = _verdict(capsys, check_f_g, f_cls, g_cls)
    assert got is ok and text in out, out


# ---------------------------------------------------------------- Exercise 3: a TP MLP from a dense one

def mlp_ok(dense, group):
    t, r = _t_r(group)
    par = ParallelMLP(dense.config, group)
    with torch.no_grad():
        par.linear_fc1.weight.copy_(dense.linear_fc1.weight.chunk(t, 0)[r])
        par.linear_fc1.bias.copy_(dense.linear_fc1.bias.chunk(t, 0)[r])
        par.linear_fc2.weight.copy_(dense.linear_fc2.weight.chunk(t, 1)[r])
        par.linear_fc2.bias.copy_(dense.linear_fc2.bias)
    return par


def mlp_state_dict(dense, group):
    t, r = _t_r(group)
    par = ParallelMLP(dense.config, group)
    d = dense.state_dict()
    par.load_state_dict({"linear_fc1.weight": d["linear_fc1.weight"].chunk(t, 0)[r],
                         "linear_fc1.bias": d["linear_fc1.bias"].chunk(t, 0)[r],
                         "linear_fc2.weight": d["linear_fc2.weight"].chunk(t, 1)[r],
                         "linear_fc2.bias": d["linear_fc2.bias"]})
    return par


def mlp_bias_split(dense, group):
    t, r = _t_r(group)
    par = mlp_ok(dense, group)
    par.linear_fc2.bias = torch.nn.Parameter(dense.linear_fc2.bias.detach().chunk(t)[r].clone())
    return par


def mlp_wrong_rank(dense, group):
    t, r = _t_r(group)
    par = mlp_ok(dense, group)
    with torch.no_grad():
        par.linear_fc1.weight.copy_(dense.linear_fc1.weight.chunk(t, 0)[(r + 1) % t])
    return par


def mlp_from_the_old_fixed_seed(dense, group):
    """A table of the dense MLP the checker once always handed out (seed 11): it ignores the one it is given."""
    torch.manual_seed(11)
    fixed = type(dense)(dense.config)
    with torch.no_grad():
        for p in (fixed.linear_fc1.bias, fixed.linear_fc2.bias):
            p.normal_()
    return mlp_ok(fixed, group)


def mlp_course_copy(dense, group):
    return copy_dense_to_parallel(dense, ParallelMLP(dense.config, group), group)


@pytest.mark.parametrize("answer, ok, text", [
    (mlp_ok, True, "✓ tp_mlp_from_dense"),
    (mlp_state_dict, True, "✓ tp_mlp_from_dense"),
    (not_yet, False, "not attempted yet: write tp_mlp_from_dense"),
    (mlp_bias_split, False, "NOT split"),
    (mlp_wrong_rank, False, "linear_fc1.weight does not hold"),
    (lambda dense, group: dense, False, "returned a DenseMLP"),
    (mlp_course_copy, False, "the course's own course_lib.tensor_parallel.sharding.copy_dense_to_parallel"),
    (mlp_from_the_old_fixed_seed, False, "linear_fc1.weight does not hold"),
])
def test_tp_mlp_from_dense(capsys, answer, ok, text):
    got, out = _verdict(capsys, check_tp_mlp_from_dense, answer)
    assert got is ok and text in out, out


# ---------------------------------------------------------------- Exercise 4: count the collectives

def counts_ok(sp):
    if sp:
        return {("fwd", "all_gather"): 2, ("fwd", "reduce_scatter"): 2, ("bwd", "all_gather"): 4,
                ("bwd", "reduce_scatter"): 2}
    return {("fwd", "all_reduce"): 2, ("bwd", "all_reduce"): 2}


def counts_numpy(sp):
    import numpy as np
    return {k: np.int64(v) for k, v in counts_ok(sp).items()} | {("fwd", "broadcast"): 0}


def elements_ok(b, s, h, t):
    return 8 * b * s * h * (t - 1) / t


def sp_no_recompute(sp):
    c = counts_ok(sp)
    if sp:
        c[("bwd", "all_gather")] = 2
    return c


@pytest.mark.parametrize("counts, elements, ok, text", [
    (counts_ok, elements_ok, True, "✓ your predictions match"),
    (counts_numpy, lambda b, s, h, t: torch.tensor(8.0 * b * s * h * (t - 1) / t, dtype=torch.float64), True,
     "✓ your predictions match"),
    (not_yet, elements_ok, False, "not attempted yet: write predict_collectives"),
    (counts_ok, not_yet, False, "not attempted yet: write predict_elements_sent"),
    (lambda sp: {("fwd", "all_reduce"): 2}, elements_ok, False, "conjugate"),
    (sp_no_recompute, elements_ok, False, "'recompute'"),
    (lambda sp: [("fwd", "all_reduce")], elements_ok, False, "return a dict"),
    (counts_ok, lambda b, s, h, t: 4 * b * s * h * (t - 1) / t, False, "2N(t-1)/t"),
    (counts_ok, lambda b, s, h, t: float("nan"), False, "NaN"),
])
def test_collective_prediction(capsys, counts, elements, ok, text):
    got, out = _verdict(capsys, check_collective_prediction, counts, elements)
    assert got is ok and text in out, out


def test_a_wrong_prediction_is_named_without_the_recorded_counts(capsys):
    got, out = _verdict(capsys, check_collective_prediction, lambda sp: {("fwd", "all_reduce"): 1}, elements_ok)
    assert got is False
    assert "does not run fwd all_reduce x1" in out and "you did not predict in bwd" in out, out
    assert "x2" not in out, out   # the recorded counts (two all-reduces each way) are not shown


# ---------------------------------------------------------------- Exercise 5: vocab-parallel cross-entropy

def _ce_owned(logits, target, group, owns):
    """ce_ok with the ownership test ``owns(target, vocab_start, vocab_end)`` (the end excluded when right)."""
    t, r = _t_r(group)
    part = logits.shape[-1]
    top = logits.max(-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    mine = owns(target, r * part, (r + 1) * part)
    z_t = shifted.gather(-1, (target - r * part).clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(z_t, group=group)
    sum_exp = shifted.exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - z_t


def ce_ok(logits, target, group):
    return _ce_owned(logits, target, group, lambda x, start, end: (x >= start) & (x < end))


def ce_logsumexp_stacked(logits, target, group):
    """max + log(sum) - target, the target logit and the sum of exp in one all-reduce, in float64."""
    t, r = _t_r(group)
    z = logits.double()
    part = z.shape[-1]
    top = z.max(-1).values
    comm.all_reduce(top, group, op="max")
    owned = (target // part) == r
    picked = torch.where(owned, z.gather(-1, (target % part).unsqueeze(-1)).squeeze(-1), torch.zeros_like(top))
    both = torch.stack([picked, (z - top.unsqueeze(-1)).exp().sum(-1)])
    dist.all_reduce(both, group=group)
    return (top + both[1].log() - both[0]).float()


def ce_gather_logits(logits, target, group):        # right numbers, the whole logits on the wire
    t, _ = _t_r(group)
    pieces = [torch.empty_like(logits) for _ in range(t)]
    dist.all_gather(pieces, logits.contiguous(), group=group)
    full = torch.cat(pieces, -1)
    return F.cross_entropy(full.reshape(-1, full.shape[-1]), target.reshape(-1), reduction="none").view(target.shape)


def ce_reduce_padded_logits(logits, target, group):  # right numbers: an all-reduce of [s, b, V]
    t, r = _t_r(group)
    part = logits.shape[-1]
    full = torch.zeros(*logits.shape[:-1], part * t)
    full[..., r * part:(r + 1) * part] = logits
    dist.all_reduce(full, group=group)
    return F.cross_entropy(full.reshape(-1, part * t), target.reshape(-1), reduction="none").view(target.shape)


def ce_no_max(logits, target, group):
    t, r = _t_r(group)
    part = logits.shape[-1]
    mine = (target >= r * part) & (target < (r + 1) * part)
    z_t = logits.gather(-1, (target - r * part).clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(z_t, group=group)
    sum_exp = logits.exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - z_t


def ce_local_max(logits, target, group):
    t, r = _t_r(group)
    part = logits.shape[-1]
    shifted = logits - logits.max(-1, keepdim=True).values        # each rank its own max
    mine = (target >= r * part) & (target < (r + 1) * part)
    z_t = shifted.gather(-1, (target - r * part).clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine
    dist.all_reduce(z_t, group=group)
    sum_exp = shifted.exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    return sum_exp.log() - z_t


def _ce_variant(logits, target, group, *, sum_op=dist.ReduceOp.SUM, reduce_target=True, reduce_sum=True):
    t, r = _t_r(group)
    part = logits.shape[-1]
    top = logits.max(-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    mine = (target >= r * part) & (target < (r + 1) * part)
    z_t = shifted.gather(-1, (target - r * part).clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine
    if reduce_target:
        dist.all_reduce(z_t, group=group)
    sum_exp = shifted.exp().sum(-1)
    if reduce_sum:
        dist.all_reduce(sum_exp, op=sum_op, group=group)
    return sum_exp.log() - z_t


def ce_slice_end_included(logits, target, group):
    """Off by one: target <= vocab_end, so the next rank's first id is claimed twice."""
    return _ce_owned(logits, target, group, lambda x, start, end: (x >= start) & (x <= end))


def ce_slice_start_excluded(logits, target, group):
    """Off by one: target > vocab_start, so a slice's first id belongs to no rank."""
    return _ce_owned(logits, target, group, lambda x, start, end: (x > start) & (x < end))


def ce_avg(logits, target, group):
    return _ce_variant(logits, target, group, sum_op=dist.ReduceOp.AVG)


def ce_no_target_reduce(logits, target, group):
    return _ce_variant(logits, target, group, reduce_target=False)


def ce_no_sum_reduce(logits, target, group):
    return _ce_variant(logits, target, group, reduce_sum=False)


def ce_unshifted_ids(logits, target, group):
    top = logits.max(-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - top   # global ids on a local slice


def ce_rebuilt_from_seed(logits, target, group):     # the whole logits rebuilt from the checker's old seed
    t, r = _t_r(group)
    gen = torch.Generator().manual_seed(7)
    for scale, offset in ((30.0, 1000.0), (2.0, 0.0)):
        full = torch.randn(4, 2, 16, generator=gen) * scale + offset
        if torch.equal(torch.randint(0, 16, (4, 2), generator=gen), target):
            break
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.SUM, dist.ReduceOp.SUM):  # the traffic of the real thing
        dist.all_reduce(torch.zeros(target.shape), op=op, group=group)
    return F.cross_entropy(full.reshape(-1, 16), target.reshape(-1), reduction="none").view(target.shape)


def ce_mean(logits, target, group):
    return ce_ok(logits, target, group).mean()


@pytest.mark.parametrize("answer, ok, text", [
    (ce_ok, True, "✓ vocab_parallel_cross_entropy"),
    (ce_logsumexp_stacked, True, "✓ vocab_parallel_cross_entropy"),
    (not_yet, False, "not attempted yet: write vocab_parallel_cross_entropy"),
    (ce_gather_logits, False, "never the [s, b, V] logits"),
    (ce_reduce_padded_logits, False, "never the [s, b, V] logits"),
    (ce_no_max, False, "exp() overflowed"),
    (ce_local_max, False, "the max logit was not all-reduced"),
    (ce_avg, False, "log(t) too small"),
    (ce_no_target_reduce, False, "the target logit is missing"),
    (ce_no_sum_reduce, False, "the *whole* vocabulary"),
    (ce_unshifted_ids, False, "subtract your first id"),
    (ce_slice_end_included, False, "vocab_start <= target < vocab_end (the end excluded)"),
    (ce_slice_start_excluded, False, "vocab_start <= target < vocab_end (the end excluded)"),
    (ce_mean, False, "shape [s, b]"),
    (vocab_parallel_cross_entropy, False, "the course's own"),
    (ce_rebuilt_from_seed, False, "rank"),
])
def test_vocab_parallel_cross_entropy(capsys, answer, ok, text):
    got, out = _verdict(capsys, check_vocab_parallel_cross_entropy, answer)
    assert got is ok and text in out, out


def test_every_run_has_a_target_at_every_slice_edge():
    """An ownership test off by one (``<=`` for ``<`` at a slice's end, ``>`` for ``>=`` at its start) is wrong
    only for targets at a slice's first or last id: the ordinary case's targets hold every one of them, for t = 2
    and 4, wherever the seed puts them."""
    from course_lib.classroom.checks.vocab_parallel import CE_V, _targets, slice_edges

    assert slice_edges(16, 2) == [0, 7, 8, 15] and slice_edges(16, 4) == [0, 3, 4, 7, 8, 11, 12, 15]
    places = set()
    for seed in range(6):
        for t in (2, 4):
            target = _targets(torch.Generator().manual_seed(seed), t, edges=True)
            assert set(slice_edges(CE_V, t)) <= set(target.flatten().tolist()), (seed, t, target)
            assert 0 <= int(target.min()) and int(target.max()) < CE_V
            places.add(tuple(target.flatten().tolist()))
    assert len(places) > 6                                     # where the edges sit is drawn
