"""course_lib.comm: the wrappers compute what torch.distributed computes, the recorder sees
every call with the right fields, and the ring cost model matches a measured ring."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.communication_patterns import ring_all_reduce
from course_lib.comm import CommRecorder, ring_elements_sent
from course_lib.launch import launch
from helpers import group_of_one


def test_ring_elements_sent_formulas():
    n = 1200
    assert ring_elements_sent("all_reduce", n, 4) == 2 * 1200 * 3 / 4 == 1800
    assert ring_elements_sent("all_gather", n, 4) == 900
    assert ring_elements_sent("reduce_scatter", n, 4) == 900
    assert ring_elements_sent("all_to_all", n, 3) == 800
    assert ring_elements_sent("broadcast", n, 8) == 1200
    assert ring_elements_sent("send", n, 2) == 1200 and ring_elements_sent("recv", n, 2) == 0
    assert all(ring_elements_sent(op, n, 1) == 0 for op in ("all_reduce", "all_gather", "reduce_scatter"))
    # Narayanan et al. 2021 section 3.2: a TP layer sends 8 b s h (t-1)/t per rank (4 all-reduces of b*s*h)
    b, s, h, t = 1, 2048, 12288, 8
    assert 4 * ring_elements_sent("all_reduce", b * s * h, t) == 8 * b * s * h * (t - 1) / t
    with pytest.raises(ValueError, match="op='allreduce' is unknown"):
        ring_elements_sent("allreduce", n, 2)


def _rank_wrappers():
    g, r, t = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    x = torch.arange(24, dtype=torch.float32).view(4, 6) + 100 * r
    out = {}
    with CommRecorder() as outer:
        with CommRecorder() as inner:
            out["all_reduce"] = comm.all_reduce(x.clone(), g)
        out["all_reduce_max"] = comm.all_reduce(x.clone(), g, op="max")
        out["gather0"] = comm.all_gather(x, g, dim=0)
        out["gather1"] = comm.all_gather(x, g, dim=1)
        out["rs0"] = comm.reduce_scatter(x, g, dim=0)
        out["rs1"] = comm.reduce_scatter(x, g, dim=1)
        out["bcast"] = comm.broadcast(x.clone(), 1, g)
        out["a2a"] = comm.all_to_all(x, g)
        buf = torch.empty(3, dtype=torch.bfloat16)
        if r == 0:
            comm.send(torch.ones(3, dtype=torch.bfloat16), 1, kind="pp")
        elif r == 1:
            comm.recv(buf, 0, kind="pp")
        out["recv"] = buf if r == 1 else None
    # backward direction is inferred inside autograd
    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.clone()

        @staticmethod
        def backward(ctx, grad):
            return comm.all_reduce(grad.clone(), g)

    a = torch.ones(5, requires_grad=True)
    with CommRecorder() as auto:
        Reduce.apply(a).sum().backward()
    # reference results straight from torch.distributed
    ref = {}
    y = x.clone(); dist.all_reduce(y); ref["all_reduce"] = y
    y = x.clone(); dist.all_reduce(y, op=dist.ReduceOp.MAX); ref["all_reduce_max"] = y
    parts = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(parts, x)
    ref["gather0"], ref["gather1"] = torch.cat(parts, 0), torch.cat(parts, 1)
    total = sum(parts)
    ref["rs0"], ref["rs1"] = total.chunk(t, 0)[r], total.chunk(t, 1)[r]
    ref["bcast"] = parts[1]
    ref["a2a"] = torch.cat([p.chunk(t, 0)[r] for p in parts], 0)
    errors = {k: (out[k] - ref[k]).abs().max().item() for k in ref}
    errs = {}
    for name, fn in {"self_send": lambda: comm.send(x, r), "no_group": lambda: comm.all_reduce(x, None),
                     "bad_op": lambda: comm.all_reduce(x.clone(), g, op="mean"),
                     "uneven_rs": lambda: comm.reduce_scatter(torch.zeros(5), g)}.items():
        try:
            fn()
        except ValueError as exc:
            errs[name] = str(exc)
    return dict(errors=errors, outer=outer.events, inner=inner.events, auto=auto.events,
                recv=None if out["recv"] is None else out["recv"].float().tolist(), errs=errs,
                table=outer.table())


def test_wrappers_match_torch_distributed_and_are_recorded():
    res = launch(_rank_wrappers, world_size=2, output="none", timeout=60)
    for rank, r in enumerate(res):
        assert all(e == 0 for e in r["errors"].values()), r["errors"]
        ev = r["outer"]
        assert [e.op for e in ev] == ["all_reduce", "all_reduce", "all_gather", "all_gather", "reduce_scatter",
                                      "reduce_scatter", "broadcast", "all_to_all", "send" if rank == 0 else "recv"]
        assert len(r["inner"]) == 1 and r["inner"][0] == ev[0]            # nested recorders both see it
        assert (ev[0].numel, ev[0].bytes, ev[0].kind, ev[0].group_size, ev[0].direction) == (24, 96, "tp", 2, "fwd")
        assert ev[1].reduce_op == "max"
        assert ev[2].numel == 48 and ev[4].numel == 24                       # full tensor: gathered / pre-scatter
        assert (ev[-1].numel, ev[-1].bytes, ev[-1].kind, ev[-1].peer) == (3, 6, "pp", 1 - rank)  # bf16: 2 bytes
        assert [e.direction for e in r["auto"]] == ["bwd"]                   # inferred inside backward
        assert set(r["errs"]) == {"self_send", "no_group", "bad_op", "uneven_rs"}
        assert "cannot send to itself" in r["errs"]["self_send"]
        assert "pass the process group explicitly" in r["errs"]["no_group"]
    assert res[1]["recv"] == [1.0, 1.0, 1.0]
    assert res[0]["table"].splitlines()[0].split()[:3] == ["dir", "group", "op"]


def test_recorder_queries_and_group_of_one():
    def fn():
        one = group_of_one()
        x = torch.ones(4)
        with CommRecorder() as rec:
            same = comm.all_reduce(x, one) is x and comm.all_gather(x, one) is x and comm.reduce_scatter(x, one) is x
            comm.all_reduce(torch.ones(10), dist.group.WORLD, tag="demo")
            comm.all_reduce(torch.ones(10), dist.group.WORLD, direction="bwd")
        return same, rec.count(), rec.count(direction="bwd"), rec.count(tag="demo"), rec.numel(op="all_reduce"), \
            rec.ring_elements_sent(), len(rec.summary()), rec.filter(op=("all_gather", "all_reduce"))
    same, n, n_bwd, n_tag, numel, sent, rows, both = launch(fn, world_size=2, output="none")[0]
    assert same and n == 2 and n_bwd == 1 and n_tag == 1 and numel == 20 and rows == 2 and len(both) == 2
    assert sent == 2 * ring_elements_sent("all_reduce", 10, 2) == 20
    with pytest.raises(ValueError, match="'size' is not a CommEvent field"):
        CommRecorder().filter(size=3)


def _rank_ring_measure(numel):
    """Measure the elements a real ring sends: the course's send/recv ring all-reduce, and a ring
    all-gather written here with the recorded point-to-point wrappers."""
    sent = []
    x = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    summed = ring_all_reduce(x, sent=sent)
    want = x.clone()
    dist.all_reduce(want)
    # ring all-gather: t-1 steps, pass the chunk received last step on to the right
    g, r, t = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    shard = x[: numel // t].clone()
    chunks = [None] * t
    chunks[r] = shard
    with CommRecorder() as rec:
        for step in range(t - 1):
            send_idx, recv_idx = (r - step) % t, (r - step - 1) % t
            incoming = torch.empty_like(shard)
            # even ranks send first, odd ranks receive first: blocking calls never wait on each other in a cycle
            if r % 2 == 0:
                comm.send(chunks[send_idx], (r + 1) % t, g)
                comm.recv(incoming, (r - 1) % t, g)
            else:
                comm.recv(incoming, (r - 1) % t, g)
                comm.send(chunks[send_idx], (r + 1) % t, g)
            chunks[recv_idx] = incoming
    gathered = comm.all_gather(shard, g)
    return dict(ar_err=(summed - want).abs().max().item(), ar_sent=sum(sent),
                ag_err=(torch.cat(chunks) - gathered).abs().max().item(), ag_sent=rec.ring_elements_sent(),
                ag_numel=gathered.numel())


@pytest.mark.parametrize("t", (2, 3, 4))
def test_ring_model_matches_a_measured_ring(t):
    numel = 12 * 5
    for r in launch(_rank_ring_measure, world_size=t, output="none", timeout=60, numel=numel):
        assert r["ar_err"] <= 1e-5 and r["ag_err"] == 0
        assert r["ar_sent"] == ring_elements_sent("all_reduce", numel, t)   # 2 N (t-1)/t, measured
        assert r["ag_sent"] == ring_elements_sent("all_gather", r["ag_numel"], t)  # N (t-1)/t, measured
