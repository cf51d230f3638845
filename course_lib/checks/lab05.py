"""Checkers for Lab 05's exercises (3D/4D parallelism in practice, Day 22).

Each checker calls the student's function on many settings, compares with the
course's tested code (``ParallelConfig``, the bubble formula, the Megatron log
parser), prints one verdict line and, when wrong, the most specific hint it can
find. A function that still raises ``NotImplementedError`` gets a "not attempted
yet" line. Every checker returns True/False and never raises.
"""

from __future__ import annotations

from course_lib.checks import call_student, not_attempted
from course_lib.megatron import SEED_SWEEP, parse_log
from course_lib.pipeline.bubbles import bubble_fraction
from course_lib.topology import ParallelConfig

_call, _todo = call_student, not_attempted

# (world, tp, pp, cp, micro, global): the seed's A-F with the CPU sweep's batch and the GPU batch,
# seed 000's 32-GPU layouts, seed 001's 128-GPU run.
LAYOUTS = ([(8, tp, pp, cp, 1, 16) for tp, pp, cp in SEED_SWEEP.values()]
           + [(8, tp, pp, cp, 4, 64) for tp, pp, cp in SEED_SWEEP.values()]
           + [(32, 16, 2, 1, 1, 32), (32, 4, 8, 1, 2, 64), (128, 4, 4, 1, 8, 256), (16, 2, 2, 2, 2, 16)])
# layouts Megatron refuses: (world, tp, pp, cp, micro, global, the rule)
BAD_LAYOUTS = [(8, 3, 1, 1, 1, 16, "world_size % (tp*pp*cp)"), (8, 2, 2, 4, 1, 16, "world_size % (tp*pp*cp)"),
               (8, 1, 1, 1, 1, 12, "global % (micro*dp)"), (8, 1, 4, 1, 4, 4, "global % (micro*dp)")]


def _want(world, tp, pp, cp, micro, gbs):
    cfg = ParallelConfig(world_size=world, tp=tp, pp=pp, cp=cp, micro_batch_size=micro, global_batch_size=gbs)
    return cfg.dp, cfg.num_microbatches


def check_layout(fn) -> bool:
    """``fn(world_size, tp, pp, cp, micro_batch_size, global_batch_size) -> (dp, num_microbatches)``;
    raises ValueError when the layout is impossible."""
    for case in LAYOUTS:
        got, err = _call(fn, *case)
        if err == "todo":
            return _todo("derive_layout")
        world, tp, pp, cp, micro, gbs = case
        want = _want(*case)
        args = f"derive_layout(world_size={world}, tp={tp}, pp={pp}, cp={cp}, micro={micro}, global={gbs})"
        if err:
            print(f"✗ {args} raised {err}, expected {want}")
            return False
        try:
            dp, m = got
        except (TypeError, ValueError):
            print(f"✗ {args} returned {got!r}: return a pair (dp, num_microbatches)")
            return False
        if (dp, m) == want and all(isinstance(v, int) and not isinstance(v, bool) for v in (dp, m)):
            continue
        print(f"✗ {args} returned {got!r}, expected {want}")
        wdp, wm = want
        if dp != wdp:
            if cp > 1 and dp == world // (tp * pp):
                print("  hint: CP ranks are not data-parallel replicas: DP = world / (TP * PP * CP)")
            elif dp in (world // tp, world // pp, world // (tp * cp), world // (pp * cp)):
                print("  hint: DP is what is left after *every* model-parallel split: world / (TP * PP * CP)")
            else:
                print("  hint: DP is derived, never given: DP = world / (TP * PP * CP)")
        elif m != wm:
            if m == gbs // micro:
                print("  hint: each DP replica takes global / DP samples: m = global / (micro * DP)")
            elif m == gbs // (micro * world):
                print("  hint: divide by DP, not by the world size: TP/PP/CP ranks of one replica share its "
                      "micro-batches")
            elif m in (gbs // (micro * dp * pp), gbs // (micro * dp * tp)):
                print("  hint: TP and PP ranks of one replica all see the same micro-batches: divide by DP only")
            else:
                print("  hint: micro-batches per step m = global / (micro * DP)")
        else:
            print("  hint: return Python ints (use // after checking divisibility), not floats")
        return False
    for world, tp, pp, cp, micro, gbs, rule in BAD_LAYOUTS:
        got, err = _call(fn, world, tp, pp, cp, micro, gbs)
        if err == "todo":
            return _todo("derive_layout")
        if err and err.startswith("ValueError"):
            continue
        print(f"✗ derive_layout(world_size={world}, tp={tp}, pp={pp}, cp={cp}, micro={micro}, global={gbs}) "
              f"{'raised ' + err if err else 'returned ' + repr(got)}; Megatron refuses it: raise ValueError")
        print(f"  hint: check {rule} == 0 before dividing"
              + (" (a DP of 8 / 12 ranks is not a whole number of replicas)" if "tp" in rule else
                 " (every replica must get a whole number of micro-batches)"))
        return False
    print(f"✓ derive_layout: DP and micro-batches right on {len(LAYOUTS)} layouts (A-F on CPU and GPU batches, "
          f"seeds 000/001), {len(BAD_LAYOUTS)} impossible ones refused")
    return True


# name -> (tp, pp, cp) sets and batch settings where depth alone does not decide
BUBBLE_CASES = [
    (dict(SEED_SWEEP), 8, 1, 16),
    (dict(SEED_SWEEP), 8, 4, 64),
    ({"X": (1, 2, 1), "Y": (1, 4, 1)}, 8, 1, 8),
    ({"P": (2, 2, 2), "Q": (1, 2, 1)}, 8, 1, 8),
    ({"R": (1, 4, 2), "S": (1, 2, 1)}, 16, 2, 32),
    ({"T": (4, 2, 1), "U": (1, 1, 1), "V": (2, 4, 1)}, 16, 1, 32),
]


def _bubbles(configs, world, micro, gbs):
    out = {}
    for name, (tp, pp, cp) in configs.items():
        dp = world // (tp * pp * cp)
        out[name] = bubble_fraction(pp, gbs // (micro * dp))
    return out


def check_largest_bubble(fn) -> bool:
    """``fn(configs: {name: (tp, pp, cp)}, world_size, micro_batch_size, global_batch_size) -> name``
    of the config with the largest 1F1B bubble (p-1)/m."""
    for configs, world, micro, gbs in BUBBLE_CASES:
        got, err = _call(fn, dict(configs), world, micro, gbs)
        if err == "todo":
            return _todo("largest_bubble")
        b = _bubbles(configs, world, micro, gbs)
        want = max(b, key=b.get)
        shown = ", ".join(f"{n}: TP{t} PP{p} CP{c}" for n, (t, p, c) in configs.items())
        if err:
            print(f"✗ largest_bubble({{{shown}}}, world {world}, micro {micro}, global {gbs}) raised {err}")
            return False
        if got == want:
            continue
        print(f"✗ largest_bubble({{{shown}}}, world {world}, micro {micro}, global {gbs}) = {got!r}, "
              f"expected {want!r}")
        deepest = max(configs, key=lambda n: configs[n][1])
        if got == deepest:
            print("  hint: depth alone does not decide: compute m = global / (micro * DP) for each config; "
                  "(p-1)/m grows when a config has few micro-batches")
        elif got in b and b[got] == min(b.values()):
            print("  hint: that is the *smallest* bubble: take the config with the largest (p-1)/m")
        else:
            print("  hint: bubble = (p-1)/m with m = global / (micro * DP) and DP = world / (TP * PP * CP)")
        print("  bubbles: " + ", ".join(f"{n} {v:.3f}" for n, v in b.items()))
        return False
    print(f"✓ largest_bubble right on {len(BUBBLE_CASES)} sweeps (the seed's A-F: E, PP 4 with 8 micro-batches)")
    return True


# One iteration line per Megatron log era (format strings read in NVIDIA/Megatron-LM; see
# course_lib.megatron.logs), plus the course's own and a torchrun --tee prefixed one.
ITERATION_LINES = {
    "Megatron before core 0.6": " iteration       10/      50 | consumed samples:          640 | elapsed time per "
                                "iteration (ms): 1450.3 | learning rate: 3.000E-04 | global batch size:    64 | "
                                "lm loss: 1.051234E+01 | loss scale: 1.0 | grad norm: 12.345 | number of skipped "
                                "iterations:   0 | number of nan iterations:   0 |",
    "Megatron core 0.6-0.15": " [2025-10-04 17:56:47] iteration       20/      40 | consumed samples:         1280 | "
                              "elapsed time per iteration (ms): 640.2 | throughput per GPU (TFLOP/s/GPU): 32.6 | "
                              "learning rate: 2.200000E-04 | global batch size:    64 | lm loss: 8.250000E+00 | "
                              "loss scale: 1.0 | grad norm: 3.250 | number of skipped iterations:   0 | number of "
                              "nan iterations:   0 |",
    "Megatron core 0.16+": " [2026-02-26 04:05:51.004213] iteration        1/      30 | consumed samples:           64 "
                           "| elapsed time per iteration (ms): 5321.4 | learning rate: 3.000000E-05 | global batch "
                           "size:    64 | lm loss: 1.087000E+01 | loss scale: 1.0 | grad norm: 25.125 | number of "
                           "skipped iterations:   0 | number of nan iterations:   0 |",
    "the course's CPU log": " [2026-08-22 15:22:23.000000] iteration        5/      20 | consumed samples:  "
                            "         80 | elapsed time per iteration (ms): 95.5 | learning rate: 1.000000E-03 | "
                            "global batch size:    16 | lm loss: 4.900000E+00 | loss scale: 1.0 | grad norm: "
                            "1.000 | number of skipped iterations:   0 | number of nan iterations:   0 |",
    "torchrun --tee (prefix)": "[default7]: [2025-10-04 17:57:02] iteration       40/      40 | consumed samples:  "
                               "       2560 | elapsed time per iteration (ms): 655.9 | learning rate: 3.000000E-05 | "
                               "global batch size:    64 | lm loss: 7.125000E+00 | loss scale: 1.0 | grad norm: "
                               "2.125 | number of skipped iterations:   0 | number of nan iterations:   0 |",
}
KEYS = ("iteration", "elapsed_ms", "lm_loss")


def _close(a, b) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


def check_parse_line(fn) -> bool:
    """``fn(line) -> {"iteration": int, "elapsed_ms": float, "lm_loss": float}``."""
    for era, line in ITERATION_LINES.items():
        got, err = _call(fn, line)
        if err == "todo":
            return _todo("parse_iteration_line")
        ref = parse_log(line).iterations[0]
        want = {k: ref[k] for k in KEYS}
        if not err and isinstance(got, dict) and all(
                k in got and isinstance(got[k], (int, float)) and _close(got[k], want[k])
                for k in KEYS) and isinstance(got["iteration"], int):
            continue
        print(f"✗ {era}: parse_iteration_line returned {err or repr(got)}")
        print(f"  expected {want}")
        if err and "[" in line.split("iteration")[0]:
            print("  hint: " + ("torchrun --tee puts '[defaultN]:' in front of every line" if "default" in line else
                                "since core 0.6 the line starts with a '[date time]' stamp")
                  + ": find the 'iteration N/ M' field instead of assuming it comes first")
        elif err:
            print("  hint: split the line on '|'; each field is 'name: value' (rpartition(':') keeps names with "
                  "colons intact); the first field is 'iteration N/ M'")
        elif not isinstance(got, dict) or any(k not in got for k in KEYS):
            print(f"  hint: return a dict with the keys {', '.join(KEYS)}")
        elif got["iteration"] == ref["train_iters"]:
            print("  hint: 'iteration 10/ 50' is iteration 10 of 50: take the number before the '/'")
        elif not isinstance(got["iteration"], int):
            print("  hint: the iteration is an int")
        else:
            print("  hint: 'elapsed time per iteration (ms)' and 'lm loss' are floats (1.05E+01 parses with float())")
        return False
    print(f"✓ parse_iteration_line reads {len(ITERATION_LINES)} formats: Megatron pre-0.6, 0.6-0.15, 0.16+, the "
          f"course's, and torchrun-prefixed lines")
    return True
