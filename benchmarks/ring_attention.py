"""Ring attention on real ranks: exactness, communication, and the per-rank work of the two causal splits.

1. worst |error| of ring attention (float32) against float64 full attention, out and dq/dk/dv,
   for cp in {2, 4}, causal or not, zigzag or contiguous;
2. the recorded point-to-point traffic of one layer against 2(cp-1) forward / 4(cp-1) backward sends;
3. measured CPU seconds per rank (forward + backward, thread time: fair even when ranks share cores)
   for a causal sequence, zigzag vs contiguous, against the work model's max/mean;
4. wall time per layer (noisy on a shared laptop: ranks share cores).

Run: .venv/bin/python benchmarks/ring_attention.py [--seq 4096] [--cp 4]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # noqa: F401  (imported once here, inherited by forked ranks)

from course_lib.comm import CommRecorder
from course_lib.context_parallel.ring import (kv_bytes_per_step, reference_attention, ring_attention,
                                              ring_sends_per_layer)
from course_lib.context_parallel.work import imbalance, score_elements
from course_lib.context_parallel.zigzag import shard_sequence
from course_lib.launch import launch


def _exactness(cp_sizes=(2, 4)):
    def rank():
        grp, r = dist.group.WORLD, dist.get_rank()
        cp = dist.get_world_size()
        rows = []
        for causal in (False, True):
            for layout in ("zigzag", "contiguous"):
                g = torch.Generator().manual_seed(0)
                q, k, v, dy = (torch.randn(2, 4, 64, 16, generator=g, dtype=torch.float64) for _ in range(4))
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = reference_attention(*full, causal=causal)
                ref.backward(dy)
                sh = lambda t: shard_sequence(t, r, cp, layout=layout)  # noqa: E731
                loc = [sh(t).float().requires_grad_() for t in (q, k, v)]
                with CommRecorder() as rec:
                    out = ring_attention(*loc, grp, causal=causal, layout=layout)
                    out.backward(sh(dy).float())
                errs = [(out.double() - sh(ref)).abs().max().item()] + [
                    (a.grad.double() - sh(f.grad)).abs().max().item() for a, f in zip(loc, full)]
                rows.append((causal, layout, errs, rec.count(op="send", direction="fwd"),
                             rec.count(op="send", direction="bwd"), rec.bytes(op="send", direction="fwd"),
                             rec.table(op="send") if r == 0 else ""))
        return rows

    print("1-2. exactness (float32 ring vs float64 full attention; b=2, heads=4, s=64, d=16) and traffic")
    for cp in cp_sizes:
        res = launch(rank, world_size=cp, output="none", timeout=120)
        for i, (causal, layout, _, fwd, bwd, fbytes, table) in enumerate(res[0]):
            errs = [max(res[r][i][2][j] for r in range(cp)) for j in range(4)]
            want = ring_sends_per_layer(cp)
            step = kv_bytes_per_step(2, 4, 64 // cp, 16)
            print(f"  cp={cp} {'causal ' if causal else 'no mask'} {layout:10s} worst |err| out {errs[0]:.1e} "
                  f"dq {errs[1]:.1e} dk {errs[2]:.1e} dv {errs[3]:.1e} | sends fwd {fwd} (2(cp-1)={want['fwd']}) "
                  f"bwd {bwd} (4(cp-1)={want['bwd']}), {fbytes // max(cp - 1, 1):,} B per fwd step "
                  f"(formula {step:,})")
        print("  rank 0's sends, last configuration:\n    " + res[0][-1][-1].replace("\n", "\n    "))


def _work(seq: int, cp: int, reps: int = 3):
    def rank(layout):
        grp, r = dist.group.WORLD, dist.get_rank()
        g = torch.Generator().manual_seed(1)
        q, k, v, dy = (shard_sequence(torch.randn(1, 4, seq, 64, generator=g), r, cp, layout=layout)
                       for _ in range(4))
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        cpu, wall = [], []
        for _ in range(reps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            ring_attention(q, k, v, grp, causal=True, layout=layout).backward(dy)
            cpu.append(time.thread_time() - c0)
            dist.barrier()
            wall.append(time.perf_counter() - t0)
        return min(cpu), min(wall)

    print(f"\n3-4. causal, s={seq}, cp={cp}, heads=4, d=64: CPU seconds per rank (fwd+bwd, best of {reps})")
    for layout in ("contiguous", "zigzag"):
        res = launch(rank, world_size=cp, output="none", timeout=600, layout=layout)
        cpu = [c for c, _ in res]
        model = score_elements(seq, cp, layout)
        print(f"  {layout:10s} cpu/rank " + " ".join(f"{c:6.3f}" for c in cpu) +
              f" | max/mean measured {imbalance(cpu):.2f}, model {imbalance(model):.2f} | "
              f"wall per layer {max(w for _, w in res):.3f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cp", type=int, default=4)
    args = ap.parse_args()
    _exactness()
    _work(args.seq, args.cp)


if __name__ == "__main__":
    main()
