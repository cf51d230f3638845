"""One parallel configuration, sized end to end: memory per rank, bubble, communication, FLOPs.

:func:`plan` is the pure, tested function under the explorer widget
(:mod:`course_lib.classroom.widgets.sizing`): it only combines the paper formulas of :mod:`.flops`,
:mod:`.memory` and :mod:`.comm`, and :func:`validate_config` turns every impossible
combination into a one-line ValueError that the widget shows instead of a plot.

Conventions: bytes are decimal (1 GB = 1e9 bytes, as in ZeRO's 120 GB example); the memory is
that of the busiest rank, a first-stage rank, whose model states are sharded over the ``dp * cp``
ranks Megatron shards over; activations are 16-bit (Korthikanti). Communication is bytes one rank
sends per iteration. ``precision`` (default ``"fp16"``, the papers' mixed precision: Narayanan 2021
trained in fp16) decides the bytes per element: fp16 counts ZeRO's 2 + 2 + 12 bytes per parameter and
sends every element in 2 bytes (Megatron reduces fp16 grads in fp16); ``"bf16"`` counts Megatron's
bf16 -- grads accumulated and reduced in fp32 (``--accumulate-allreduce-grads-in-fp32``, which
``--bf16`` switches on unless ``--grad-reduce-in-bf16``), Megatron-FSDP's (ZeRO-2/3) in
``--megatron-fsdp-main-grads-dtype`` (default: the param dtype) -- through
:func:`.memory.megatron_state_bytes` and :func:`.comm.dp_comm_bytes_per_iteration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib import rules
from course_lib.sizing import _checks
from course_lib.sizing.comm import (
    cp_comm_per_layer,
    dp_comm_bytes_per_iteration,
    pp_comm_per_iteration,
    tp_comm_per_layer,
)
from course_lib.sizing.flops import flops_per_iteration, num_parameters, parameters_per_stage
from course_lib.sizing.memory import (
    activation_bytes_per_layer,
    interleaving_factor,
    megatron_grad_dtype,
    megatron_state_bytes,
    model_state_bytes,
    output_activation_terms,
)
from course_lib.topology import ParallelConfig

GB = 1e9


@dataclass(frozen=True)
class ModelSpec:
    """A GPT shape in the papers' terms (4h GeLU MLP, multi-head attention, tied embeddings)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    seq_length: int
    note: str = ""

    @property
    def num_parameters(self) -> int:
        """Narayanan Eq. 2."""
        return num_parameters(self.num_layers, self.hidden_size, self.vocab_size, self.seq_length)


# Each preset: the model and a configuration to start from. Sources in the notes.
PRESETS: dict[str, dict] = {
    "GPT-3 175B": {
        "model": ModelSpec("GPT-3 175B", 96, 12288, 96, 51200, 2048,
                           "GPT-3 shape as in Narayanan §5.3.2 and Korthikanti Table 3 (V = 51200)"),
        "config": dict(tp=8, pp=8, dp=16, cp=1, vp=1, sequence_parallel=True, recompute="selective",
                       zero_stage=1, micro_batch_size=1, global_batch_size=1536),
    },
    "1T (Narayanan Table 1)": {
        "model": ModelSpec("1T (Narayanan Table 1)", 128, 25600, 160, 51200, 2048,
                           "last row of Narayanan Table 1: 3072 GPUs, TP 8 x PP 64, batch 3072"),
        "config": dict(tp=8, pp=64, dp=6, cp=1, vp=1, sequence_parallel=False, recompute="full",
                       zero_stage=0, micro_batch_size=1, global_batch_size=3072),
    },
    "Llama-like 70B": {
        "model": ModelSpec("Llama-like 70B", 80, 8192, 64, 32000, 4096,
                           "Llama-2-70B's depth, width, heads, vocabulary and context, counted with "
                           "the papers' GPT formulas (GeLU 4h MLP, no grouped-query attention), so "
                           "64.7B parameters; the real model (SwiGLU 28672, 8 KV groups) has 69B"),
        "config": dict(tp=8, pp=4, dp=4, cp=1, vp=1, sequence_parallel=True, recompute="selective",
                       zero_stage=1, micro_batch_size=1, global_batch_size=512),
    },
    "tiny GPT (seed)": {
        "model": ModelSpec("tiny GPT (seed)", 8, 512, 8, 50304, 1024,
                           "the Day 22 seed's model: 8 layers, hidden 512, 8 heads; GPT-2 BPE "
                           "vocabulary padded to 50304 as Megatron does, sequence 1024"),
        "config": dict(tp=2, pp=2, dp=2, cp=1, vp=1, sequence_parallel=False, recompute="none",
                       zero_stage=0, micro_batch_size=4, global_batch_size=64),
    },
}


def parallel_config(model: ModelSpec, tp=1, pp=1, dp=1, cp=1, vp=1, sequence_parallel=False, micro_batch_size=1,
                    global_batch_size=None) -> ParallelConfig:
    """The layout as a validated :class:`~course_lib.topology.ParallelConfig` on ``tp·pp·dp·cp`` GPUs.

    The planner takes DP (it sizes a cluster); the config derives it back from the world size, so
    every layout rule -- heads, layers, CP chunks, SP, micro-batches, interleaving -- is the one
    the trainer and ``megatron-cmd`` apply (:mod:`course_lib.rules`). ``vp = 1``: no interleaving.
    """
    rules.integer("vocab_size", model.vocab_size)
    sizes = {name: rules.integer(flag, value) for name, flag, value in (
        ("tp", rules.TP, tp), ("pp", rules.PP, pp), ("dp", rules.DP, dp), ("cp", rules.CP, cp),
        ("vp", rules.VPP, vp))}
    return ParallelConfig(world_size=sizes["tp"] * sizes["pp"] * sizes["dp"] * sizes["cp"], tp=tp, pp=pp, cp=cp,
                          num_layers=model.num_layers, num_attention_heads=model.num_heads,
                          hidden_size=model.hidden_size, seq_length=model.seq_length,
                          micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                          sequence_parallel=sequence_parallel, virtual_pipeline_model_parallel_size=vp)


def validate_config(model: ModelSpec, tp=1, pp=1, dp=1, cp=1, vp=1, sequence_parallel=False,
                    recompute="none", zero_stage=0, micro_batch_size=1, global_batch_size=None) -> int:
    """Check a configuration the way Megatron would; return the number of micro-batches.

    The layout rules are :func:`parallel_config`'s (the rule book's); the planner adds its own
    inputs: the recompute mode, the ZeRO stage and ``vocab_size % tp == 0`` (the model's
    vocabulary is already padded, e.g. GPT-2's 50257 to 50304).
    """
    return _checked(model, tp, pp, dp, cp, vp, sequence_parallel, recompute, zero_stage, micro_batch_size,
                    global_batch_size).num_microbatches


def _checked(model, tp, pp, dp, cp, vp, sequence_parallel, recompute, zero_stage, micro_batch_size,
             global_batch_size) -> ParallelConfig:
    config = parallel_config(model, tp, pp, dp, cp, vp, sequence_parallel, micro_batch_size, global_batch_size)
    _checks.recompute_mode(recompute)
    if zero_stage not in (0, 1, 2, 3):
        raise rules.UsageError(f"zero_stage={zero_stage!r} is not one of 0, 1, 2, 3 (ZeRO-DP stages)")
    rules.vocab_divisible_by_tp(model.vocab_size, tp)
    return config


@dataclass
class Plan:
    """Everything :func:`plan` computed for one configuration (bytes, FLOPs, fractions)."""

    model: ModelSpec
    config: dict
    world_size: int
    num_microbatches: int
    num_parameters: int
    params_per_stage: list
    memory: dict  # busiest (first-stage) rank: weights, grads, optimizer, activations, total
    stage_memory: list  # one dict like ``memory`` per pipeline stage (1F1B; None if interleaved)
    gpu_memory_bytes: float
    bubble: float | None
    comm: dict  # bytes one rank sends per iteration: tp, pp, dp, cp
    model_flops: int
    hardware_flops: int
    notes: list = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.gpu_memory_bytes

    def memory_gb(self) -> dict:
        return {k: v / GB for k, v in self.memory.items()}


def _bubble(pp, m, vp):
    try:
        from course_lib.pipeline.bubbles import bubble_fraction
    except ImportError:
        return None
    return bubble_fraction(pp, m, vp=vp)


def plan(model: ModelSpec, tp=1, pp=1, dp=1, cp=1, vp=1, sequence_parallel=False, recompute="none",
         zero_stage=0, micro_batch_size=1, global_batch_size=None, gpu_memory_gb=80.0, precision="fp16",
         grad_reduce_in_bf16=False, megatron_fsdp_main_grads_dtype="auto") -> Plan:
    """Size one configuration of ``model`` on ``tp * pp * dp * cp`` GPUs.

    Memory per rank (bytes): weights, grads, optimizer on the stage's :func:`.flops.parameters_per_stage`
    count with ``N_d = dp * cp`` -- :func:`.memory.model_state_bytes` (ZeRO's 2 + 2 + 12) for
    ``precision="fp16"``, :func:`.memory.megatron_state_bytes` for ``"bf16"`` / ``"fp32"`` with the grads
    in :func:`.memory.megatron_grad_dtype` (Megatron's ``--grad-reduce-in-bf16`` and
    ``--megatron-fsdp-main-grads-dtype``: ``grad_reduce_in_bf16``, ``megatron_fsdp_main_grads_dtype``);
    activations from
    :func:`.memory.activation_bytes_per_layer` times the layers and micro-batches the stage holds
    (Korthikanti Eq. 5: stage ``S`` of a 1F1B pipeline holds ``min(p - S, m)`` micro-batches;
    interleaving multiplies the first stage by ``1 + (p-1)/(p v)``), plus the embedding terms
    on the first stage and the output-layer terms on the last. Communication: :mod:`.comm`,
    times the layers and micro-batches of the busiest rank, 2 bytes per element (activations, and the
    parameters DP gathers; DP's gradient reduction in the grad dtype: 4 bytes under bf16).
    FLOPs: Eq. 7 (model) and Eq. 3 / Eq. 8 (hardware, by recompute mode).
    """
    config = _checked(model, tp, pp, dp, cp, vp, sequence_parallel, recompute, zero_stage, micro_batch_size,
                      global_batch_size)
    _checks.positive_number("gpu_memory_gb", gpu_memory_gb)
    grad_dtype = megatron_grad_dtype(precision, zero_stage, grad_reduce_in_bf16=grad_reduce_in_bf16,
                                     fsdp_main_grads_dtype=megatron_fsdp_main_grads_dtype)
    element_bytes = {"fp32": 4, "bf16": 2, "fp16": 2}
    recompute = _checks.recompute_mode(recompute)
    m = config.num_microbatches
    notes = list(config.notes)
    sequence_parallel = config.sequence_parallel          # off with tp = 1, as Megatron does (said in notes)
    s, b, h, a, L = model.seq_length, micro_batch_size, model.hidden_size, model.num_heads, model.num_layers
    gbs = config.effective_global_batch_size

    stage_params = parameters_per_stage(L, h, model.vocab_size, s, a, tp, pp)
    per_layer = activation_bytes_per_layer(s, b, h, a, tp, sequence_parallel, recompute, cp)
    outside = output_activation_terms(s // cp, b, h, model.vocab_size, tp, sequence_parallel)
    layers_per_stage = config.layers_per_stage()[0]

    def stage(index: int, inflight: float) -> dict:
        states = (model_state_bytes(stage_params[index], dp * cp, zero_stage) if precision == "fp16" else
                  megatron_state_bytes(stage_params[index], dp * cp, zero_stage, precision, grad_dtype))
        act = per_layer * layers_per_stage * inflight
        if index == 0:
            act += outside["embedding"] * min(pp, m)
        if index == pp - 1:
            act += outside["output"]  # one micro-batch in flight on the last stage
        mem = {"weights": states.weights, "grads": states.grads, "optimizer": states.optimizer,
               "activations": float(act)}
        mem["total"] = sum(mem.values())
        return mem

    if vp == 1:
        stage_memory = [stage(i, min(pp - i, m)) for i in range(pp)]
        first = stage_memory[0]
    else:
        stage_memory = None
        first = stage(0, pp * interleaving_factor(pp, vp))
        notes.append("interleaved schedule: only the first stage is sized (Korthikanti §4.2.3)")
    busiest = max(stage_memory, key=lambda d: d["total"]) if stage_memory else first
    if cp > 1 and recompute == "none":
        notes.append("with context parallelism the 5as^2b score term is an upper bound: "
                     "ring attention uses flash attention, which stores no scores")

    tokens_layers = layers_per_stage * m  # layer-micro-batches a rank runs per iteration
    tp_elems = tp_comm_per_layer(s, b, h, tp, sequence_parallel, recompute, cp)["total"] * tokens_layers
    pp_elems = pp_comm_per_iteration(s, b, h, pp, m, vp, tp, cp, sequence_parallel)["total"]
    dp_bytes = dp_comm_bytes_per_iteration(stage_params[0], dp, cp, zero_stage, grad_bytes=element_bytes[grad_dtype],
                                           param_bytes=element_bytes[precision])
    cp_elems = (cp_comm_per_layer(s, b, h, a, cp, tp)["total_estimate"] * tokens_layers) if cp > 1 else 0.0
    comm = {"tp": 2.0 * tp_elems, "pp": 2.0 * pp_elems, "dp": float(dp_bytes), "cp": 2.0 * cp_elems}
    if cp > 1:
        notes.append("CP communication counts the exact forward ring plus a 2x-forward backward estimate")

    shape = (gbs, s, L, h, model.vocab_size)
    return Plan(
        model=model,
        config=dict(tp=tp, pp=pp, dp=dp, cp=cp, vp=vp, sequence_parallel=sequence_parallel,
                    recompute=recompute, zero_stage=zero_stage, micro_batch_size=micro_batch_size,
                    global_batch_size=gbs, precision=precision, grad_dtype=grad_dtype),
        world_size=tp * pp * dp * cp,
        num_microbatches=m,
        num_parameters=model.num_parameters,
        params_per_stage=stage_params,
        memory=busiest,
        stage_memory=stage_memory,
        gpu_memory_bytes=gpu_memory_gb * GB,
        bubble=_bubble(pp, m, vp),
        comm=comm,
        model_flops=flops_per_iteration(*shape, recompute="none"),
        hardware_flops=flops_per_iteration(*shape, recompute=recompute),
        notes=notes,
    )


def summary(p: Plan) -> str:
    """A deterministic text summary of a :class:`Plan` (GB = 1e9 bytes), for notebooks and widgets."""
    c = p.config
    mem = p.memory_gb()
    lines = [
        f"{p.model.name}: {p.num_parameters / 1e9:.1f}B parameters (Narayanan Eq. 2)",
        f"TP={c['tp']} PP={c['pp']} DP={c['dp']} CP={c['cp']} VP={c['vp']} SP={c['sequence_parallel']} "
        f"recompute={c['recompute']} ZeRO={c['zero_stage']} -> {p.world_size} GPUs, "
        f"{p.num_microbatches} micro-batches of {c['micro_batch_size']} (global batch {c['global_batch_size']})",
        "memory of the busiest rank: " + ", ".join(
            f"{k} {mem[k]:.2f} GB" for k in ("weights", "grads", "optimizer", "activations", "total")),
        f"fits on a {p.gpu_memory_bytes / GB:.0f} GB GPU: {'yes' if p.fits else 'no'}",
        "bubble: " + ("n/a (course_lib.pipeline.bubbles not available)" if p.bubble is None
                      else f"{p.bubble:.3f} of the ideal time"),
        "sent per rank per iteration: " + ", ".join(f"{k.upper()} {v / GB:.3f} GB" for k, v in p.comm.items()),
        f"FLOPs per iteration: model {p.model_flops:.3e}, hardware {p.hardware_flops:.3e}",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
