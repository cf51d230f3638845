"""Ring attention on real ranks (fork, gloo): outputs and dq/dk/dv equal single-process attention for
cp in {1, 2, 4}, causal and not, zigzag and contiguous, MHA and GQA; every K/V transfer recorded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
# tensor.backward(grad) imports this lazily (it pulls in sympy, ~2.4 s); import it once here so the forked
# ranks inherit it instead of each paying for it
import torch.fx.experimental.symbolic_shapes  # noqa: F401

import course_lib.context_parallel.ring as ra
from course_lib import rules
from course_lib.comm import CommRecorder
from course_lib.context_parallel.ring import kv_bytes_per_step, ring_attention, ring_sends_per_layer
from course_lib.context_parallel.work import ring_step_work
from course_lib.context_parallel.zigzag import get_batch_on_this_cp_rank, shard_sequence
from course_lib.launch import launch
from helpers import group_of_one, rank_groups

TOL = 1e-5            # float32 against a float64 reference and against torch's float32 SDPA
B, NP, S, HN = 2, 4, 32, 8


def _rule_message(rule, *args) -> str:
    """The one-line message ``rule(*args)`` (course_lib.rules) refuses with: the layers must say the same."""
    with pytest.raises(ValueError) as err:
        rule(*args)
    return str(err.value)


def _groups():
    """World of 4: CP=2 groups of Megatron's order with TP=2 ([0,2], [1,3]), one CP=4 group, CP=1 groups."""
    cp2 = rank_groups("cp", tp=2, cp=2)["cp"]
    cp4 = rank_groups("cp", cp=4)["cp"]
    return {1: group_of_one(), 2: cp2, 4: cp4}


def _inputs(ng, seed=0):
    g = torch.Generator().manual_seed(seed)       # the same full tensors on every rank
    q = torch.randn(B, NP, S, HN, generator=g, dtype=torch.float64)
    k = torch.randn(B, ng, S, HN, generator=g, dtype=torch.float64)
    v = torch.randn(B, ng, S, HN, generator=g, dtype=torch.float64)
    dout = torch.randn(B, NP, S, HN, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _full(q, k, v, dout, causal, dtype):
    """Single-process reference with torch's SDPA (GQA by repeating K/V heads): out and dq, dk, dv."""
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)
    out.backward(dout.to(dtype))
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


def _rank_equality():
    groups = _groups()
    worst, comm_ok, n_checks = {}, [], 0
    for cp, grp in groups.items():
        r = dist.get_rank(grp)
        for causal in (False, True):
            for layout in ("zigzag", "contiguous"):
                for ng in (NP, 2):
                    q, k, v, dout = _inputs(ng, seed=cp * 10 + ng)
                    refs = {"f64": _full(q, k, v, dout, causal, torch.float64),
                            "sdpa_f32": _full(q, k, v, dout, causal, torch.float32)}
                    shard = lambda t: shard_sequence(t, r, cp, layout=layout)  # noqa: E731
                    ql, kl, vl = (shard(t).float().requires_grad_() for t in (q, k, v))
                    with CommRecorder() as rec:
                        out = ring_attention(ql, kl, vl, grp, causal=causal, layout=layout)
                        out.backward(shard(dout).float())
                    mine = [out.detach(), ql.grad, kl.grad, vl.grad]
                    for ref_name, ref in refs.items():
                        for name, a, want in zip(("out", "dq", "dk", "dv"), mine, ref):
                            err = (a.double() - shard(want).double()).abs().max().item()
                            key = (cp, causal, layout, ng, ref_name, name)
                            worst[key] = err
                            n_checks += 1
                    # communication: every K/V transfer recorded, kind "cp"
                    sends = ring_sends_per_layer(cp)
                    step_bytes = kv_bytes_per_step(B, ng, S // cp, HN, element_size=4)
                    others = {dist.get_global_rank(grp, i) for i in range(cp)} - {dist.get_rank()} if cp > 1 else set()
                    nxt = dist.get_global_rank(grp, (r + 1) % cp) if cp > 1 else None
                    prv = dist.get_global_rank(grp, (r - 1) % cp) if cp > 1 else None
                    comm_ok.append(dict(
                        cp=cp,
                        fwd_sends=rec.count(op="send", kind="cp", direction="fwd"),
                        fwd_recvs=rec.count(op="recv", kind="cp", direction="fwd"),
                        bwd_sends=rec.count(op="send", kind="cp", direction="bwd"),
                        bwd_recvs=rec.count(op="recv", kind="cp", direction="bwd"),
                        want=sends,
                        fwd_tags=sorted(e.tag for e in rec.filter(op="send", direction="fwd")),
                        bwd_tags=sorted(e.tag for e in rec.filter(op="send", direction="bwd")),
                        fwd_bytes_per_step=rec.bytes(op="send", direction="fwd") / max(cp - 1, 1),
                        want_step_bytes=step_bytes if cp > 1 else 0,
                        fwd_peers_ok=all(e.peer == nxt for e in rec.filter(op="send", direction="fwd")),
                        bwd_peers_ok=all(e.peer == prv for e in rec.filter(op="send", direction="bwd")),
                        peers_in_group=all(e.peer in others for e in rec.events),
                        other_kinds=len(rec.events) - rec.count(kind="cp"),
                        group_size_ok=all(e.group_size == cp for e in rec.events)))
    return worst, comm_ok, n_checks


def test_ring_attention_equals_full_attention_and_is_recorded():
    res = launch(_rank_equality, world_size=4, output="none", timeout=120)
    total = 0
    overall = 0.0
    for worst, comm_ok, n in res:
        total += n
        bad = {k: e for k, e in worst.items() if not e <= TOL}
        assert not bad, bad
        overall = max(overall, max(worst.values()))
        for c in comm_ok:
            cp = c["cp"]
            assert c["fwd_sends"] == c["fwd_recvs"] == c["want"]["fwd"] == 2 * (cp - 1), c
            assert c["bwd_sends"] == c["bwd_recvs"] == c["want"]["bwd"] == 4 * (cp - 1), c
            assert c["fwd_tags"] == sorted(["k", "v"] * (cp - 1))
            assert c["bwd_tags"] == sorted(["k", "v", "dk", "dv"] * (cp - 1))
            assert c["fwd_bytes_per_step"] == c["want_step_bytes"], c
            assert c["fwd_peers_ok"] and c["bwd_peers_ok"] and c["peers_in_group"] and c["group_size_ok"], c
            assert c["other_kinds"] == 0
    # 4 ranks x 3 cp x 2 masks x 2 layouts x 2 head layouts x 2 references x 4 tensors
    assert total == 4 * 3 * 2 * 2 * 2 * 2 * 4
    print(f"ring attention: worst |error| over {total} comparisons = {overall:.2e}")


def _rank_blocks_and_misc():
    grp = dist.group.WORLD
    cp, r = dist.get_world_size(), dist.get_rank()
    out = {}
    q, k, v, dout = _inputs(NP)
    ql, kl, vl = (shard_sequence(t, r, cp).float() for t in (q, k, v))
    # which blocks the forward really computes (attention_block is wrapped in the parent before the fork)
    for layout in ("zigzag", "contiguous"):
        ra._SEEN.clear()
        ring_attention(shard_sequence(q, r, cp, layout=layout).float(), shard_sequence(k, r, cp, layout=layout).float(),
                       shard_sequence(v, r, cp, layout=layout).float(), grp, causal=True, layout=layout)
        out[layout] = list(ra._SEEN)
    # determinism: the same inputs give the same bits
    runs = []
    for _ in range(2):
        a, b_, c = (t.clone().requires_grad_() for t in (ql, kl, vl))
        o = ring_attention(a, b_, c, grp, causal=True)
        o.backward(shard_sequence(dout, r, cp).float())
        runs.append([o.detach(), a.grad, b_.grad, c.grad])
    out["deterministic"] = all(torch.equal(x, y) for x, y in zip(*runs))
    # Megatron-style batch split
    batch = {"tokens": torch.arange(2 * S).view(2, S), "labels": None}
    out["batch"] = get_batch_on_this_cp_rank(batch, r, cp)
    # bad input: one-line ValueErrors, raised before any communication
    errs = {}
    cases = {
        "odd_local": lambda: ring_attention(ql[:, :, :3], kl[:, :, :3], vl[:, :, :3], grp, causal=True),
        "heads": lambda: ring_attention(ql, kl[:, :3], vl[:, :3], grp),
        "no_group": lambda: ring_attention(ql, kl, vl, None),
        "dims": lambda: ring_attention(ql[0], kl[0], vl[0], grp),
        "layout": lambda: ring_attention(ql, kl, vl, grp, layout="striped"),
        "seq": lambda: ring_attention(ql, kl[:, :, :4], vl[:, :, :4], grp),
        "head_dim": lambda: ring_attention(ql, kl[..., :4], vl, grp),
        "dtype": lambda: ring_attention(ql, kl.double(), vl, grp),
        "causal": lambda: ring_attention(ql, kl, vl, grp, causal="yes"),
        "shard": lambda: shard_sequence(torch.zeros(1, 1, 12, 2), r, cp),
    }
    for name, fn in cases.items():
        try:
            fn()
            errs[name] = "no error"
        except ValueError as exc:
            errs[name] = str(exc)
    out["errs"] = errs
    return out


def test_ring_computes_only_scheduled_blocks_and_rejects_bad_input(monkeypatch):
    seen = []
    real = ra.attention_block

    def counting(q, k, v, kind="full", softmax_scale=None):
        seen.append((q.shape[2], k.shape[2], kind))
        return real(q, k, v, kind, softmax_scale)

    monkeypatch.setattr(ra, "attention_block", counting)
    monkeypatch.setattr(ra, "_SEEN", seen, raising=False)
    res = launch(_rank_blocks_and_misc, world_size=4, output="none", timeout=60)
    for layout in ("zigzag", "contiguous"):
        work = ring_step_work(S, 4, layout, causal=True)
        for r, out in enumerate(res):
            elements = sum(sq * sk if kind == "full" else sq * (sq + 1) // 2 for sq, sk, kind in out[layout])
            assert elements == sum(step[r] for step in work)
            if layout == "zigzag":   # 3 blocks at step 0, then 2 per step: nothing above the diagonal computed
                assert len(out[layout]) == 3 + 2 * 3
    assert len(res[0]["contiguous"]) == 1 and len(res[3]["contiguous"]) == 4
    for r, out in enumerate(res):
        assert out["deterministic"]
        assert out["batch"]["labels"] is None
        assert out["batch"]["tokens"].tolist() == [[p + row * S for p in (4 * r + i for i in range(4))] +
                                                   [p + row * S for p in (4 * (7 - r) + i for i in range(4))]
                                                   for row in range(2)]
        e = out["errs"]
        assert all("\n" not in m and m != "no error" for m in e.values()), e
        assert e["odd_local"] == _rule_message(rules.sequence_split, 12, 4)        # 3 local tokens x 4 ranks
        assert e["heads"] == _rule_message(rules.heads_divisible_by_groups, 4, 3)
        assert "pass the context-parallel process group explicitly" in e["no_group"]
        assert "expected 4 dims [b, heads, s_local, head_dim]" in e["dims"]
        assert "layout='striped' is unknown" in e["layout"]
        assert e["seq"].startswith("local sequence lengths differ")
        assert e["head_dim"].startswith("head dims differ")
        assert "use one dtype" in e["dtype"]
        assert "causal='yes' must be True or False" in e["causal"]
        assert "seq_length=12 is not divisible by 2 × context-parallel-size=4 = 8" in e["shard"]


def test_bfloat16_runs_and_is_close():
    """bf16 inputs: partial results merged in float32, the output cast back (loose tolerance: bf16)."""
    def fn():
        grp, cp, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
        q, k, v, _ = _inputs(2)
        ref = shard_sequence(_full(q, k, v, torch.zeros_like(q), True, torch.float64)[0], r, cp)
        out = ring_attention(*(shard_sequence(t, r, cp).bfloat16() for t in (q, k, v)), grp, causal=True)
        return out.dtype, (out.double() - ref).abs().max().item()
    for dtype, err in launch(fn, world_size=2, output="none"):
        assert dtype == torch.bfloat16 and err < 3e-2


@pytest.mark.parametrize("cp", [2])
def test_contiguous_accepts_odd_local_length(cp):
    def fn():
        grp, r = dist.group.WORLD, dist.get_rank()
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
        ref = _full(q, k, v, torch.ones_like(q), True, torch.float64)[0]
        out = ring_attention(*(shard_sequence(t, r, cp, layout="contiguous") for t in (q, k, v)), grp,
                             causal=True, layout="contiguous")
        return (out - shard_sequence(ref, r, cp, layout="contiguous")).abs().max().item()
    assert max(launch(fn, world_size=cp, output="none")) < 1e-12


def _rank_ulysses():
    from course_lib.context_parallel.ulysses import ulysses_attention

    groups = _groups()
    worst, counts, errs = 0.0, [], {}
    for cp, grp in groups.items():
        r = dist.get_rank(grp)
        for causal in (False, True):
            for layout in ("zigzag", "contiguous"):
                for ng in {NP, 2} if cp <= 2 else {NP}:
                    q, k, v, dout = _inputs(ng, seed=7)
                    ref = _full(q, k, v, dout, causal, torch.float64)
                    shard = lambda t: shard_sequence(t, r, cp, layout=layout)  # noqa: E731
                    ql, kl, vl = (shard(t).float().requires_grad_() for t in (q, k, v))
                    with CommRecorder() as rec:
                        out = ulysses_attention(ql, kl, vl, grp, causal=causal, layout=layout)
                        out.backward(shard(dout).float())
                    for a, want in zip((out.detach(), ql.grad, kl.grad, vl.grad), ref):
                        worst = max(worst, (a.double() - shard(want)).abs().max().item())
                    counts.append((cp, rec.count(op="all_to_all", kind="cp", direction="fwd"),
                                   rec.count(op="all_to_all", kind="cp", direction="bwd"), len(rec.events)))
    q, k, v, _ = _inputs(2)
    for name, fn in {"heads": lambda: ulysses_attention(q[:, :3].float(), k[:, :1].float(), v[:, :1].float(),
                                                        groups[2]),
                     "groups": lambda: ulysses_attention(q.float()[:, :, :8], k.float()[:, :, :8],
                                                         v.float()[:, :, :8], groups[4])}.items():
        try:
            fn()
            errs[name] = "no error"
        except ValueError as exc:
            errs[name] = str(exc)
    return worst, counts, errs


def test_ulysses_all_to_all_attention_equals_full_attention():
    for worst, counts, errs in launch(_rank_ulysses, world_size=4, output="none", timeout=60):
        assert worst <= TOL, worst
        for cp, fwd, bwd, total in counts:
            want = 4 if cp > 1 else 0
            assert (fwd, bwd, total) == (want, want, 2 * want)
        assert errs["heads"] == _rule_message(rules.heads_divisible_by_cp, 3, 1, 2)
        assert errs["groups"] == _rule_message(rules.heads_divisible_by_cp, NP, 2, 4)
        assert errs["groups"].startswith("num_query_groups=2 is not divisible by context-parallel-size=4: all-to-all")
