"""Checker for the GPU prediction (Lab 05, exercise 6): which of A-F is fastest on one 8 x H100 node.

``check_gpu_winner(fn)``: ``fn() -> {"tiny_gpt": (config, reason), "gpt_13b": (config, reason)}``, the
config of the seed's sweep with the shortest projected step among those whose busiest rank fits, and the
key of :data:`GPU_REASONS` that says why, compared with :func:`course_lib.sizing.projection.project`.
:func:`gpu_projections` and :func:`gpu_winner` give the notebook the same projection. The checker prints
one verdict line ("not attempted yet" while the stub raises NotImplementedError) and, when wrong, a hint
built from the projected costs; it never raises.
"""

from __future__ import annotations

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import safe_repr
from course_lib.topology.seed import SEED_SWEEP

GPU_MODELS = {"tiny_gpt": "the seed's tiny GPT", "gpt_13b": "the 13B GPT"}
GPU_REASONS = {
    "dp_fits": "the model fits on one GPU: DP alone has no per-layer communication and no bubble",
    "small_tp_short_pp": "it must be split: TP 2 inside the NVLink node costs a small share of the GEMM time and a "
                         "2-stage pipeline with many micro-batches idles little -- less than more TP's all-reduces, "
                         "a deeper pipeline's bubble or the CP ring",
    "tp_is_free": "all-reduces on NVLink are free, so the config with the most TP wins",
    "deep_pp": "PP sends one tensor per micro-batch, far less than TP, so the deepest pipeline wins",
    "as_on_cpu": "the GPU ranking is the CPU sweep's ranking",
    "least_memory": "the config with the least memory per GPU wins",
}
_REASON_HINTS = {
    "tp_is_free": "NVLink makes TP cheap, not free: every all-reduce still costs a start-up and bytes / 370 GB/s "
                  "(NCCL on H100 NVLink), and TP shrinks each GEMM -- compare the TP time of B and C in the projection",
    "deep_pp": "PP's traffic is small, but a deep pipeline idles: (p-1)/m with m = global / (micro * DP), and "
               "more here, because the last stage also runs the output layer",
    "as_on_cpu": "the CPU ranking comes from gloo on 2 shared cores, where one all-reduce costs about a hundred "
                 "GEMMs (review question 1); on NVLink an all-reduce costs about as much as a GEMM or less",
    "least_memory": "memory only decides whether a config fits; among those that fit, the step time decides",
}
GPU_BATCH = {"tiny_gpt": (4, 64), "gpt_13b": (1, 64)}   # (micro, global), as review question 6 sizes them


def gpu_models() -> dict:
    """``{key: ModelSpec}``: the seed's tiny GPT and the 13B GPT of review question 6."""
    from course_lib.sizing import PRESETS, ModelSpec

    return {"tiny_gpt": PRESETS["tiny GPT (seed)"]["model"],
            "gpt_13b": ModelSpec("13B GPT", num_layers=40, hidden_size=5120, num_heads=40, vocab_size=51200,
                                 seq_length=2048)}


def gpu_projections(hardware: str = "H100") -> dict:
    """``{key: {config: Projection}}``: A-F of the seed on one 8-GPU node, SP with TP (review question 6's plans)."""
    from course_lib.sizing.projection import project_configs

    return {key: project_configs(model, SEED_SWEEP, 8, hardware, micro_batch_size=GPU_BATCH[key][0],
                                 global_batch_size=GPU_BATCH[key][1], sequence_parallel=True)  # off where TP = 1
            for key, model in gpu_models().items()}


def gpu_winner(projections: dict) -> str:
    """The config with the shortest projected step among those whose busiest rank fits."""
    fits = [n for n, p in projections.items() if p.plan.fits]
    return min(fits, key=lambda n: projections[n].step_time)


def _reason_for(projection) -> str:
    c = projection.plan.config
    if c["tp"] * c["pp"] * c["cp"] == 1:
        return "dp_fits"
    return "small_tp_short_pp"


def _costs(p) -> str:
    from course_lib.sizing.projection import seconds_text

    parts = p.breakdown()
    shown = [f"{k} {seconds_text(v)}" for k, v in parts.items() if v > 1e-4 * p.step_time]
    return f"step {seconds_text(p.step_time)} = " + " + ".join(shown)


def _config_hint(key: str, got: str, want: str, projections: dict) -> str:
    """Why ``got`` loses, from its own projection (the winner ``want`` only decides which part to name: the
    hint never names it nor shows its numbers)."""
    p, w = projections[got], projections[want]
    gpu = p.hardware.hbm_gb
    if not p.plan.fits:
        return (f"{got} does not fit: its busiest rank needs {p.plan.memory['total'] / 1e9:.1f} GB of {gpu:.0f} GB, "
                f"so it cannot run at all, whatever its projected step")
    c = p.plan.config
    if c["cp"] > 1:
        why = "CP adds a K/V ring in every attention on top of TP's all-reduces"
    elif c["tp"] > w.plan.config["tp"]:
        why = (f"TP {c['tp']}'s all-reduces take {p.breakdown()['tp'] * 1e3:.3g} ms per step; a config that fits "
               f"with less TP spends less")
    elif c["pp"] > w.plan.config["pp"]:
        why = (f"PP {c['pp']} idles longer in the bubble ({p.bubble:.3f} of the busy time) than a config that fits "
               f"with fewer stages")
    else:
        why = "its communication costs more than it saves"
    return f"{got}: {_costs(p)} -- {why}"


@exercise("predict_gpu_winner")
def check_gpu_winner(fn, hardware: str = "H100") -> bool:
    """``fn() -> {"tiny_gpt": (config, reason), "gpt_13b": (config, reason)}``: the config of A-F with
    the shortest projected step on one 8-GPU node among those that fit, and the key of
    :data:`GPU_REASONS` that says why. Compared with :func:`course_lib.sizing.projection.project`."""
    if is_course_answer(fn):
        return False
    answers, err = checked_call(fn, references=references_for("predict_gpu_winner"))
    if err == "todo":
        return not_attempted("predict_gpu_winner")
    shape = (None if isinstance(answers, dict) and set(answers) == set(GPU_MODELS) else
             f"returned {safe_repr(answers)}: return a dict with the keys {', '.join(GPU_MODELS)}, "
             "each (config, reason)")
    if err or shape:
        print(f"✗ predict_gpu_winner: {err or shape}")
        return False
    projected = gpu_projections(hardware)
    for key, label in GPU_MODELS.items():
        answer = answers[key]
        if not isinstance(answer, (tuple, list)) or len(answer) != 2 or not all(isinstance(x, str) for x in answer):
            print(f"✗ {key}: {safe_repr(answer)} is not a pair (config, reason) of two strings, "
                  "e.g. ('A', 'dp_fits')")
            return False
        got, reason = answer[0].strip().upper(), answer[1].strip()
        if got not in SEED_SWEEP:
            print(f"✗ {key}: {safe_repr(answer[0])} is not one of the configs {', '.join(SEED_SWEEP)}")
            return False
        if reason not in GPU_REASONS:
            print(f"✗ {key}: reason {safe_repr(answer[1])} is not a key of GPU_REASONS: "
                  f"{', '.join(GPU_REASONS)}")
            return False
        plans = projected[key]
        want = gpu_winner(plans)
        if got != want:
            print(f"✗ {label}: {got} is not the fastest config that fits on 8 x {hardware}")
            print(f"  hint: {_config_hint(key, got, want, plans)}")
            return False
        if reason != _reason_for(plans[want]):
            print(f"✗ {label}: {want} is right, but not because {GPU_REASONS[reason]!r}")
            hint = _REASON_HINTS.get(reason) or "look at which configs fit, then at what each adds to the step"
            print(f"  hint: {hint}")
            return False
    tiny, big = (projected[k] for k in GPU_MODELS)
    tw, bw = gpu_winner(tiny), gpu_winner(big)
    print(f"✓ predict_gpu_winner: {tw} for the tiny GPT ({_costs(tiny[tw])}) and {bw} for the 13B GPT "
          f"({_costs(big[bw])}) on 8 x {hardware}, projected")
    return True
