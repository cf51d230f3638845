"""Lab 07's checkers: right answers (written differently from the notebook's) pass, every wrong answer in the
table fails with its own hint, the stub says "not attempted yet". The ZeRO-1 answers run on real ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib.classroom.checks import zero_stages
from course_lib.classroom.checks.distributed_optimizer import ADAM, NUMEL, check_zero1_step, padded
from course_lib.sizing import model_state_bytes


# ------------------------------------------------------------------ (a) ZeRO-1 step: answers


def _flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _unflat(flat, like):
    out, i = [], 0
    for t in like:
        out.append(flat[i:i + t.numel()].view_as(t).clone())
        i += t.numel()
    return out


def zero1_torch_optim(params, grads, dp_group, state, optimizer_in=None):
    """Right: torch.optim.Adam on a shard, tensor collectives. (``optimizer_in``: where the optimizer is
    kept, `state` unless told otherwise.)"""
    keep = state if optimizer_in is None else optimizer_in
    d, r = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    n = sum(p.numel() for p in params)
    size = -(-n // d)
    flat_g = torch.nn.functional.pad(_flat(grads), (0, size * d - n))
    g = torch.empty(size, dtype=flat_g.dtype)
    dist.reduce_scatter_tensor(g, flat_g, group=dp_group)
    if "main" not in state:
        flat_p = torch.nn.functional.pad(_flat(params), (0, size * d - n))
        state["main"] = torch.nn.Parameter(flat_p[r * size:(r + 1) * size].clone())
        keep["opt"] = torch.optim.Adam([state["main"]], **ADAM)
    state["main"].grad = g / d
    keep["opt"].step()
    full = torch.empty(size * d, dtype=flat_g.dtype)
    dist.all_gather_into_tensor(full, state["main"].detach(), group=dp_group)
    return _unflat(full[:n], params)


def zero1_by_hand(params, grads, dp_group, state):
    """Right, differently: list collectives and Adam written out (moments in `state`)."""
    d, r = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    lr, (b1, b2), eps = ADAM["lr"], ADAM["betas"], ADAM["eps"]
    flat = _flat(grads)
    n = flat.numel()
    chunk = (n + d - 1) // d
    buf = torch.zeros(chunk * d, dtype=flat.dtype)
    buf[:n] = flat
    mine = torch.zeros(chunk, dtype=flat.dtype)
    dist.reduce_scatter(mine, list(buf.split(chunk)), group=dp_group)
    mine /= d
    if not state:
        p = torch.zeros(chunk * d, dtype=flat.dtype)
        p[:n] = _flat(params)
        state.update(p=p[r * chunk:(r + 1) * chunk].clone(), m=torch.zeros(chunk, dtype=flat.dtype),
                     v=torch.zeros(chunk, dtype=flat.dtype), t=0)
    state["t"] += 1
    state["m"].mul_(b1).add_(mine, alpha=1 - b1)
    state["v"].mul_(b2).addcmul_(mine, mine, value=1 - b2)
    denom = (state["v"] / (1 - b2 ** state["t"])).sqrt() + eps
    state["p"] -= lr / (1 - b1 ** state["t"]) * state["m"] / denom
    parts = [torch.empty(chunk, dtype=flat.dtype) for _ in range(d)]
    dist.all_gather(parts, state["p"], group=dp_group)
    return _unflat(torch.cat(parts)[:n], params)


def zero1_ddp(params, grads, dp_group, state):
    flat = _flat(grads)
    dist.all_reduce(flat, group=dp_group)
    if "p" not in state:
        state["p"] = torch.nn.Parameter(_flat(params).clone())
        state["opt"] = torch.optim.Adam([state["p"]], **ADAM)
    state["p"].grad = flat / dist.get_world_size(dp_group)
    state["opt"].step()
    return _unflat(state["p"].detach(), params)


def zero1_summed(params, grads, dp_group, state):
    return zero1_torch_optim(params, [g * dist.get_world_size(dp_group) for g in grads], dp_group, state)


def zero1_fresh_state(params, grads, dp_group, state):
    return zero1_torch_optim(params, grads, dp_group, {})


def zero1_no_padding(params, grads, dp_group, state):
    d = dist.get_world_size(dp_group)
    flat = _flat(grads)
    g = torch.empty(flat.numel() // d, dtype=flat.dtype)
    dist.reduce_scatter_tensor(g, flat, group=dp_group)
    return params


def zero1_full_state(params, grads, dp_group, state):
    """Right numbers and right ops, but Adam over every parameter on every rank."""
    d = dist.get_world_size(dp_group)
    n = sum(p.numel() for p in params)
    size = -(-n // d)
    flat_g = torch.nn.functional.pad(_flat(grads), (0, size * d - n))
    g = torch.empty(size, dtype=flat_g.dtype)
    dist.reduce_scatter_tensor(g, flat_g, group=dp_group)
    full_g = torch.empty(size * d, dtype=flat_g.dtype)
    dist.all_gather_into_tensor(full_g, g / d, group=dp_group)
    if "p" not in state:
        state["p"] = torch.nn.Parameter(_flat(params).clone())
        state["opt"] = torch.optim.Adam([state["p"]], **ADAM)
    state["p"].grad = full_g[:n]
    state["opt"].step()
    return _unflat(state["p"].detach(), params)


def zero1_flat(params, grads, dp_group, state):
    return _flat(zero1_torch_optim(params, grads, dp_group, state))


def zero1_todo(params, grads, dp_group, state):
    raise NotImplementedError


_OUTSIDE = {}   # per process: each forked rank has its own copy


def zero1_moments_outside_state(params, grads, dp_group, state):
    """The right traffic and numbers, but Adam (and its moments) kept in a global: `state` holds only the shard."""
    return zero1_torch_optim(params, grads, dp_group, state, optimizer_in=_OUTSIDE)


def zero1_rebuilt_from_seed(params, grads, dp_group, state):
    """Every replica's gradients rebuilt from the seed the checker once drew them from; dummy collectives."""
    d = dist.get_world_size(dp_group)
    gen = torch.Generator().manual_seed(23)
    shapes = [tuple(p.shape) for p in params]
    for s_ in shapes:
        torch.randn(s_, generator=gen, dtype=torch.float64)
    step = state.get("step", 0)
    every = [[[1e-3 * torch.randn(s_, generator=gen, dtype=torch.float64) for s_ in shapes] for _ in range(d)]
             for _ in range(2)]
    mean = _flat([sum(every[step][k][i] for k in range(d)) / d for i in range(len(shapes))])
    if "p" not in state:
        state["p"] = torch.nn.Parameter(_flat(params).clone())
        state["opt"] = torch.optim.Adam([state["p"]], **ADAM)
    state["step"] = step + 1
    state["p"].grad = mean
    state["opt"].step()
    n = mean.numel()
    size = -(-n // d)
    dist.reduce_scatter_tensor(torch.empty(size, dtype=mean.dtype), torch.zeros(size * d, dtype=mean.dtype),
                               group=dp_group)
    dist.all_gather_into_tensor(torch.empty(size * d, dtype=mean.dtype), torch.zeros(size, dtype=mean.dtype),
                                group=dp_group)
    return _unflat(state["p"].detach(), params)


def zero1_via_checker_reference(params, grads, dp_group, state):
    from course_lib.classroom.checks.distributed_optimizer import _adam_steps
    _adam_steps(params, [grads])
    return zero1_torch_optim(params, grads, dp_group, state)


def test_zero1_right_answers_pass(capsys):
    assert check_zero1_step(zero1_torch_optim, world_sizes=(2, 4))
    assert check_zero1_step(zero1_by_hand, world_sizes=(4,))
    out = capsys.readouterr().out
    assert out.count("✓") == 2 and "15 (d=2)" in out and "24 (d=4)" in out


WRONG_ZERO1 = [
    (zero1_ddp, "plain data parallelism"),
    (zero1_summed, "*sum*"),
    (zero1_fresh_state, "forgot the first one's Adam moments"),
    (zero1_no_padding, "pad the flat buffers with zeros to 30"),
    (zero1_full_state, "carried your *gradient* shard"),
    (zero1_flat, "you returned the flat buffer"),
    (zero1_todo, "not attempted yet: write zero1_step"),
    (zero1_moments_outside_state, "`state` does not hold Adam's two moments of your shard"),
    (zero1_rebuilt_from_seed, "differ from two single-process Adam steps"),
    (zero1_via_checker_reference, "reached into the checker (course_lib.classroom.checks.distributed_optimizer._adam_steps"),
]


@pytest.mark.parametrize("fn, hint", WRONG_ZERO1, ids=[f.__name__ for f, _ in WRONG_ZERO1])
def test_zero1_wrong_answers_get_their_hint(capsys, fn, hint):
    assert not check_zero1_step(fn, world_sizes=(2,))
    out = capsys.readouterr().out
    assert hint in out and "✓" not in out


def test_padded():
    assert [padded(29, d) for d in (1, 2, 3, 4)] == [29, 30, 30, 32] and NUMEL == 29


# ------------------------------------------------------------------ (b) bytes per rank, part by part


def bytes_right(num_params, dp, stage):
    return {"params": 2 * num_params / (dp if stage == 3 else 1),
            "grads": 2 * num_params / (dp if stage >= 2 else 1),
            "optimizer": 12 * num_params / (dp if stage >= 1 else 1)}


def bytes_right_numpy_tuple(num_params, dp, stage):       # a triple of numpy numbers, the sharding as a mask
    import numpy as np
    per = np.array([2.0, 2.0, 12.0])
    sharded = np.array([stage >= 3, stage >= 2, stage >= 1])
    return tuple(np.float64(num_params) * per / np.where(sharded, dp, 1))


def test_zero_bytes_right_answers_and_zero_figure_1(capsys):
    assert zero_stages.check_zero_bytes(bytes_right) and zero_stages.check_zero_bytes(bytes_right_numpy_tuple)
    assert capsys.readouterr().out.count("✓") == 2
    # ZeRO Figure 1: 7.5B on 64 GPUs -> 120, 31.4, 16.6, 1.9 GB (computed independently here)
    assert [round(sum(bytes_right(7.5e9, 64, s).values()) / 1e9, 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]


def _with(part, fn):
    """bytes_right with one part replaced by ``fn(n, dp, stage)``."""
    return lambda n, dp, s: {**bytes_right(n, dp, s), part: fn(n, dp, s)}


WRONG_BYTES = [
    (_with("optimizer", lambda n, dp, s: 8 * n / (dp if s >= 1 else 1)), "forgets the fp32 master copy"),
    (_with("optimizer", lambda n, dp, s: 14 * n / (dp if s >= 1 else 1)), "Megatron's bf16 count"),
    (_with("optimizer", lambda n, dp, s: 4 * n / (dp if s >= 1 else 1)), "only the fp32 master copy"),
    (_with("grads", lambda n, dp, s: 2 * n / dp), "keeps whole the grads"),          # sharded from stage 0
    (_with("params", lambda n, dp, s: 2 * n), "shards the params"),                   # stage 3 kept them whole
    (_with("params", lambda n, dp, s: 4 * n / (dp if s == 3 else 1)), "16-bit in mixed precision"),
    (lambda n, dp, s: {k: v / 1e9 for k, v in bytes_right(n, dp, s).items()}, "return bytes, not GB"),
    (lambda n, dp, s: {k: v * dp for k, v in bytes_right(n, dp, s).items()}, "whole data-parallel group"),
    (lambda n, dp, s: sum(bytes_right(n, dp, s).values()), "return the three parts"),
    (lambda n, dp, s: {"params": 1.0, "grads": 2.0}, "return the three parts"),
    (lambda n, dp, s: {**bytes_right(n, dp, s), "params": "2 GB"}, "return a number, not its text"),
    (lambda n, dp, s: (_ for _ in ()).throw(NotImplementedError), "not attempted yet"),
]


@pytest.mark.parametrize("fn, hint", WRONG_BYTES)
def test_zero_bytes_wrong_answers(capsys, fn, hint):
    assert not zero_stages.check_zero_bytes(fn)
    out = capsys.readouterr().out
    assert hint in out, out


def test_bytes_hints_name_the_mistake():
    n, dp = 1e6, 8
    assert "K = 8" in zero_stages._part_hint("optimizer", 8 * n / dp, n, dp, 1)
    assert "whole data-parallel group" in zero_stages._part_hint("params", 2 * n * dp, n, dp, 2)
    assert "GiB" in zero_stages._part_hint("params", 2 * n / 2 ** 30, n, dp, 2)


# ------------------------------------------------------------------ (c) what a ds_config shards


def shards_right(config):
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    sharded = ["optimizer", "grads", "params"][:stage]
    off = []
    if zero.get("cpu_offload") or zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme"):
        off.append("optimizer states")
    if zero.get("offload_param", {}).get("device", "none") != "none":
        off.append("parameters")
    return {"sharded": sharded, "offloaded": tuple(off)}


def shards_right_sets(config):
    z = config.get("zero_optimization") or {}
    stage = int(z.get("stage", 0))
    table = {0: set(), 1: {"OS"}, 2: {"OS", "G"}, 3: {"OS", "G", "P"}}
    offloaded = {"Optimizer-States"} if (z.get("offload_optimizer") or {}).get("device") in {"cpu", "nvme"} \
        or z.get("cpu_offload") is True else set()
    if (z.get("offload_param") or {}).get("device") in {"cpu", "nvme"}:
        offloaded.add("weights")
    return {"sharded": table[stage], "offloaded": offloaded}


def test_what_it_shards_right_answers(capsys):
    assert zero_stages.check_what_it_shards(shards_right) and zero_stages.check_what_it_shards(shards_right_sets)


def _offloaded_not_sharded(config):
    ans = shards_right(config)
    norm = {"optimizer": "optimizer states", "grads": "gradients", "params": "parameters"}
    return {"sharded": {norm[x] for x in ans["sharded"]} - set(ans["offloaded"]), "offloaded": ans["offloaded"]}


def _none_is_offload(config):
    ans = shards_right(config)
    if "offload_param" in config.get("zero_optimization", {}):
        return {"sharded": ans["sharded"], "offloaded": set(ans["offloaded"]) | {"parameters"}}
    return ans


def _with_offloaded(config, part, on):
    """shards_right with ``part`` offloaded exactly when ``on(zero_optimization)``."""
    ans = shards_right(config)
    off = set(ans["offloaded"]) - {part}
    moved = {part} if on(config.get("zero_optimization", {})) else set()
    return {"sharded": ans["sharded"], "offloaded": off | moved}


def cpu_offload_key_is_on(config):
    """The old switch read by its presence: cpu_offload: false taken for on."""
    return _with_offloaded(config, "optimizer states", lambda z: "cpu_offload" in z
                           or z.get("offload_optimizer", {}).get("device") in ("cpu", "nvme"))


def optimizer_block_is_offload(config):
    """The optimizer's block read by its presence (a device of none taken for an offload); the parameters' right."""
    return _with_offloaded(config, "optimizer states", lambda z: "offload_optimizer" in z or bool(z.get("cpu_offload")))


def params_only_to_cpu(config):
    """Parameters offloaded only to the CPU: NVMe forgotten (the optimizer's right)."""
    return _with_offloaded(config, "parameters", lambda z: z.get("offload_param", {}).get("device") == "cpu")


SPECIAL_WRONG = [(cpu_offload_key_is_on, "cpu_offload: false is the old switch turned off"),
                 (optimizer_block_is_offload, "a device of \"none\""),
                 (params_only_to_cpu, "to CPU or NVMe")]
"""Answers wrong only on the drawn configs' special offloads (no fixed config tells them from the right one)."""


WRONG_SHARDS = [
    (lambda c: {**shards_right(c), "sharded": ["optimizer", "grads", "params"][:c.get("zero_optimization", {})
                                                                              .get("stage", 0) + 1]},
     "shards"),
    (_offloaded_not_sharded, "offloaded states are still sharded"),
    (_none_is_offload, "a device of \"none\""),
    (lambda c: {**shards_right(c), "offloaded": ["optimizer"] if c.get("zero_optimization", {})
                .get("offload_optimizer", {}).get("device") == "cpu" else []}, "to CPU or NVMe"),
    *SPECIAL_WRONG,
    (lambda c: {"sharded": "optimizer"}, "the keys 'sharded' and 'offloaded'"),
    (lambda c: {"sharded": ["adam moments"], "offloaded": []}, "each value is a set"),
    (lambda c: (_ for _ in ()).throw(NotImplementedError), "not attempted yet"),
]


@pytest.mark.parametrize("fn, hint", WRONG_SHARDS)
def test_what_it_shards_wrong_answers(capsys, fn, hint):
    assert not zero_stages.check_what_it_shards(fn)
    out = capsys.readouterr().out
    assert hint in out, out


def test_every_draw_has_the_special_offloads():
    """The answers of SPECIAL_WRONG agree with DeepSpeed on every fixed config; every draw of 8 seeds has a config
    where each of them is wrong."""
    import random

    def right(answer, config):
        got = {k: set(v) if k == "offloaded" else v for k, v in answer(config).items()}
        return got["offloaded"] == zero_stages.ds_truth(config)["offloaded"]

    for answer, _ in SPECIAL_WRONG:
        assert all(right(answer, c) for c in zero_stages.DS_CASES), answer.__name__
        for seed in range(8):
            drawn = zero_stages.drawn_ds_configs(random.Random(seed))
            assert not all(right(answer, c) for c in drawn), (answer.__name__, seed, drawn)


def test_the_truth_table_is_deepspeeds_definition():
    assert zero_stages.ds_truth({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}) == {
        "sharded": {"optimizer states", "gradients", "parameters"}, "offloaded": {"parameters"}}
    assert zero_stages.ds_truth({}) == {"sharded": set(), "offloaded": set()}


def test_what_it_shards_a_table_of_the_fixed_configs_fails_on_the_drawn_ones(capsys):
    """Answers looked up for the fixed configs fail on the 3 drawn per run (with a hint, not the answer)."""
    import random

    table = {repr(c): shards_right(c) for c in zero_stages.DS_CASES}
    assert not zero_stages.check_what_it_shards(lambda c: table.get(repr(c), {"sharded": [], "offloaded": []}))
    assert "hint" in capsys.readouterr().out
    drawn = [c for seed in range(50) for c in zero_stages.drawn_ds_configs(random.Random(seed))]
    assert len({repr(zero_stages.ds_truth(c)) for c in drawn}) >= 8  # the draws reach many different truths
    assert all(zero_stages.check_what_it_shards(shards_right) for _ in range(3))
