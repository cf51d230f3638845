"""Speed of the pipeline simulator (goal: p=64, m=1024 in about a second) and the
calibrated executor's measured bubble against the formula (p=4, m=8).

Run: .venv/bin/python benchmarks/pipeline_sim.py
"""

import time

from course_lib.pipeline import bubble_fraction, build_schedule, pipeline_bubble_time, simulate


def bench_simulator():
    print("simulator (pure Python, one process): build the schedule, then simulate it")
    for name, pp, m, vp, tw in (("1f1b", 64, 1024, 1, 0.0), ("gpipe", 64, 1024, 1, 0.0),
                                ("zb-h1", 64, 1024, 1, 1.0), ("interleaved", 64, 1024, 2, 0.0)):
        t0 = time.perf_counter()
        s = build_schedule(name, pp, m, vp)
        t1 = time.perf_counter()
        tl = simulate(s, 1.0, 2.0, tw)
        t2 = time.perf_counter()
        actions = sum(len(a) for a in s.ranks)
        if name == "zb-h1":  # Qi et al. Table 2 over the ideal time m (t_f + t_b + t_w)
            formula = pipeline_bubble_time(name, pp, 1.0, 2.0, tw) / (m * (3.0 + tw))
        else:
            formula = bubble_fraction(pp, m, vp)
        print(f"  {name:12s} p={pp} m={m} v={vp}: {actions:7d} actions, build {t1 - t0:5.2f} s, "
              f"simulate {t2 - t1:5.2f} s; bubble {tl.bubble_fraction:.5f} (formula {formula:.5f})")


def bench_executor():
    from course_lib.pipeline.executor import execute

    print("executor (4 real ranks, gloo): 1F1B p=4 m=8, each F sleeps to t_f, each B to 2 t_f")
    want = bubble_fraction(4, 8)
    for t_f in (0.01, 0.02, 0.05):
        for p2p in ("batched", "prefetch"):
            run = execute(build_schedule("1f1b", 4, 8), compute_time=(t_f, 2 * t_f, 0.0), p2p=p2p)
            tl = run.timeline
            ideal = (8 + 3) * 3 * t_f
            print(f"  t_f={t_f * 1000:4.0f} ms {p2p:8s}: makespan {tl.makespan:.3f} s (ideal {ideal:.3f}), "
                  f"bubble {tl.bubble_fraction:.4f} vs formula {want:.4f} "
                  f"({100 * (tl.bubble_fraction - want) / want:+.1f}%)")


if __name__ == "__main__":
    bench_simulator()
    bench_executor()
