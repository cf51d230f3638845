"""The sizing calculators: bad input, internal consistency and the planner (the explorer widget: tests/classroom/test_widgets.py).

The published-number checks are in tests/sizing/test_sizing_papers.py.
"""

import sys

import pytest

from course_lib import sizing
from course_lib.sizing import PRESETS, ModelSpec, plan, validate_config
from course_lib.sizing.planner import summary

TINY = PRESETS["tiny GPT (seed)"]["model"]


def one_line_error(fn, *args, match, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_sizing_does_not_import_torch():
    code = "import sys, course_lib.sizing, course_lib.classroom.widgets.sizing; print('torch' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_impossible_inputs_are_one_line_value_errors():
    msg = one_line_error(sizing.activation_bytes_per_layer, 2048, 1, 384, 6, tp=4,
                         match="num_attention_heads=6 is not divisible by tensor-model-parallel-size=4")
    assert "1, 2, 3, 6" in msg  # names the fix
    one_line_error(sizing.num_parameters, -1, 512, 100, 64, match="num_layers=-1 must be an integer >= 1")
    one_line_error(sizing.num_parameters, 2, 512.0, 100, 64, match="hidden_size=512.0")
    one_line_error(sizing.num_parameters, True, 512, 100, 64, match="num_layers=True")
    one_line_error(sizing.flops_per_iteration, 0, 2048, 2, 64, 100, match="global_batch_size=0")
    one_line_error(sizing.flops_per_iteration, 1, 2048, 2, 64, 100, recompute="some",
                   match="recompute='some' is not one of none, selective, full")
    one_line_error(sizing.activation_bytes_per_layer, 1004, 1, 512, 8, tp=8, sequence_parallel=True,
                   match="seq_length/context-parallel-size = 1004 is not divisible by "
                         "tensor-model-parallel-size=8")
    one_line_error(sizing.activation_bytes_first_stage, 10, 64, 1, 64, 4, pp=4,
                   match="num_layers=10 is not divisible by pipeline-model-parallel-size=4")
    one_line_error(sizing.activation_bytes_first_stage, 8, 64, 1, 64, 4, pp=1, vp=2, match="needs pipeline")
    one_line_error(sizing.model_state_bytes, -5, match="num_params=-5 must be a finite number > 0")
    one_line_error(sizing.model_state_bytes, 10, 4, 4, match="zero_stage=4 is not one of 0, 1, 2, 3")
    one_line_error(sizing.megatron_optimizer_bytes_per_param, 2, True, "fp32", "bf16", match="fp32 params")
    one_line_error(sizing.parameters_per_stage, 2, 64, 101, 16, 4, tp=2, match="vocab_size=101")
    one_line_error(sizing.tp_comm_per_layer, 100, 1, 64, 2, cp=3, match="context-parallel-size=3")
    one_line_error(sizing.cp_comm_per_layer, 128, 1, 64, 8, 2, num_query_groups=3,
                   match="num_attention_heads=8 is not divisible by num_query_groups=3")
    one_line_error(sizing.training_time_approx, 1e9, 1e9, 8, 0, match="flops_per_gpu=0")


def test_validate_config_rules_from_the_seeds():
    m = validate_config(TINY, tp=2, pp=2, dp=2, micro_batch_size=4, global_batch_size=64)
    assert m == 64 // (4 * 2)  # micro-batches = global / (micro x DP)
    one_line_error(validate_config, TINY, tp=3, match="num_attention_heads=8 is not divisible by "
                                                      "tensor-model-parallel-size=3")
    one_line_error(validate_config, TINY, pp=3, match="num_layers=8 is not divisible by "
                                                      "pipeline-model-parallel-size=3")
    one_line_error(validate_config, TINY, dp=4, micro_batch_size=4, global_batch_size=40,
                   match="global_batch_size=40 is not divisible by micro_batch_size=4 × data-parallel-size=4 = 16; "
                         "use a multiple of 16, e.g. 32 or 48")
    one_line_error(validate_config, TINY, pp=2, vp=2, global_batch_size=3,
                   match="num_microbatches=3 % microbatch_group_size_per_vp_stage=2 = 1 must be 0 or >= pp_size=2")
    one_line_error(validate_config, TINY, pp=2, vp=3, match="stage 0 has 4 layers, not divisible by "
                                                            "virtual_pipeline_model_parallel_size=3")
    one_line_error(validate_config, TINY, zero_stage=5, match="zero_stage=5")
    one_line_error(validate_config, ModelSpec("odd", 2, 512, 8, 50304, 1004), cp=4,
                   match="seq_length=1004 is not divisible by 2 × context-parallel-size=4 = 8")
    one_line_error(validate_config, ModelSpec("bad", 2, 500, 8, 100, 64), match="hidden_size=500 is not "
                                                                               "divisible by num_attention_heads=8")
    # the Day 22 sweep A-F on 8 ranks (TP/PP/DP, F with CP=2) are all valid
    for tp, pp, dp, cp in ((1, 1, 8, 1), (2, 1, 4, 1), (4, 1, 2, 1), (2, 2, 2, 1), (1, 4, 2, 1), (2, 2, 1, 2)):
        validate_config(TINY, tp=tp, pp=pp, dp=dp, cp=cp, micro_batch_size=4, global_batch_size=64)
        assert tp * pp * dp * cp == 8


def test_parameter_breakdown_terms():
    h, l, v, s = 64, 3, 1000, 128
    br = sizing.parameter_breakdown(l, h, v, s)
    assert sum(br["per_layer"].values()) == 12 * h * h + 13 * h
    assert br["total"] == l * (12 * h * h + 13 * h) + (v + s) * h == sizing.num_parameters(l, h, v, s)


def test_eq2_counts_a_real_gpt_built_from_torch_modules():
    torch = pytest.importorskip("torch")
    nn = torch.nn
    l, h, v, s = 3, 48, 311, 40

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    model = nn.ModuleDict({"wte": nn.Embedding(v, h), "wpe": nn.Embedding(s, h),
                           "layers": nn.ModuleList(Layer() for _ in range(l)), "ln_f": nn.LayerNorm(h)})
    # output layer tied to wte: no extra parameters; Eq. 2 leaves out the final LayerNorm (2h)
    counted = sum(p.numel() for p in model.parameters())
    br = sizing.parameter_breakdown(l, h, v, s)
    assert counted == br["total"] + br["final_layernorm_not_in_eq2"]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 4), (4, 2), (8, 8)])
def test_parameters_per_stage_reassemble_eq2(tp, pp):
    l, h, a, v, s = 16, 256, 8, 1024, 128
    stages = sizing.parameters_per_stage(l, h, v, s, a, tp, pp)
    assert len(stages) == pp
    # every TP rank of every stage together: Eq. 2, plus the copies Megatron keeps: the replicated
    # row-parallel biases and LayerNorms (6h per layer) and position embedding on t-1 more ranks,
    # and with pp > 1 the last stage's copy of the word embedding
    replicated = (tp - 1) * (6 * h * l + s * h) + (v * h if pp > 1 else 0)
    assert tp * sum(stages) == sizing.num_parameters(l, h, v, s) + replicated
    assert sizing.parameters_per_rank(l, h, v, s, a, tp, pp) == stages[0]


def test_activation_memory_consistency():
    s, b, h, a = 256, 2, 128, 8
    f = sizing.activation_bytes_per_layer
    for t in (1, 2, 4, 8):
        # SP never stores more than plain TP, and selective never more than none
        assert f(s, b, h, a, t, True) <= f(s, b, h, a, t)
        assert f(s, b, h, a, t, recompute="selective") < f(s, b, h, a, t)
        assert f(s, b, h, a, t, True, "full") == 2 * s * b * h // t
    # at t = 1 sequence parallelism changes nothing
    assert f(s, b, h, a, 1, True) == f(s, b, h, a, 1)
    # fewer micro-batches than stages: only m are in flight on the first stage
    per_layer = f(s, b, h, a)
    assert sizing.activation_bytes_first_stage(8, s, b, h, a, pp=4, num_microbatches=2) == per_layer * 2 * 2
    assert sizing.interleaving_factor(4, 1) == 1 and sizing.interleaving_factor(4, 2) == 1 + 3 / 8
    # context parallelism: 1/cp of the tokens; the score term keeps all keys
    cp = 2
    assert f(s, b, h, a, cp=cp, recompute="selective") == f(s // cp, b, h, a, recompute="selective")
    assert f(s, b, h, a, cp=cp) == 34 * (s // cp) * b * h + 5 * a * (s // cp) * s * b


def test_output_activation_terms_korthikanti_4_3():
    s, b, h, v, t = 256, 1, 128, 1024, 4
    sbh = s * b * h
    sp = sizing.output_activation_terms(s, b, h, v, t, sequence_parallel=True)
    assert sp == {"embedding": sbh // t, "output": 4 * sbh // t * (1 + v // h)}
    assert sizing.activation_bytes_outside_layers(s, b, h, v, t, pp=4) == sbh // t * 4
    assert sizing.activation_bytes_outside_layers(s, b, h, v, t, pp=1) == sbh // t * (1 + 4 * (1 + v // h))


def test_one_ring_cost_model_named_as_a_cost():
    from course_lib import comm, communication_patterns

    assert sizing.ring_elements_sent is comm.ring_elements_sent      # the recorder and the formulas share it
    assert not hasattr(sizing, "ring_all_reduce")                    # that name is Lab 00's ring, a collective
    assert callable(communication_patterns.ring_all_reduce)
    with pytest.raises(ValueError, match="group_size=0 must be an integer >= 1"):
        sizing.ring_elements_sent("all_reduce", 8, 0)


def test_communication_conventions():
    assert sizing.ring_elements_sent("all_reduce", 100, 4) == 150
    assert sizing.ring_elements_sent("all_gather", 100, 4) == 75
    assert sizing.ring_elements_sent("all_reduce", 100, 1) == 0  # a group of one sends nothing
    c = sizing.tp_comm_per_layer(128, 2, 64, 4, recompute="full")
    assert c["recompute_forward"] == c["forward"]  # full recompute re-runs the forward collectives
    assert sizing.tp_comm_per_layer(128, 2, 64, 4, recompute="selective")["recompute_forward"] == 0
    # pipeline: SP and CP shrink the tensor each rank sends
    assert sizing.pp_send_elements(128, 2, 64, tp=4, cp=2, sequence_parallel=True) == 128 // 8 * 2 * 64
    x = sizing.pp_send_elements(128, 2, 64)
    assert sizing.pp_comm_per_iteration(128, 2, 64, pp=1, num_microbatches=8)["total"] == 0
    assert sizing.pp_comm_per_iteration(128, 2, 64, pp=4, num_microbatches=8)["total"] == 2 * 8 * x
    assert sizing.pp_comm_per_iteration(128, 2, 64, pp=2, num_microbatches=8)["total"] == 8 * x
    assert sizing.pp_comm_per_iteration(128, 2, 64, pp=4, num_microbatches=8, vp=2)["total"] == 2 * 2 * 8 * x
    # DP over the dp x cp group
    assert sizing.dp_comm_per_iteration(1000, dp=2, cp=2)["group_size"] == 4
    # CP ring forward: K and V chunks, cp - 1 steps each
    cpc = sizing.cp_comm_per_layer(128, 1, 64, 8, cp=4)
    assert cpc["forward"] == 2 * 3 * (128 // 4) * 64
    assert sizing.cp_comm_per_layer(128, 1, 64, 8, cp=4, num_query_groups=2)["forward"] == 2 * 3 * 32 * 8 * 2


def test_model_state_bytes_stages():
    psi, n = 1000.0, 8
    st = [sizing.model_state_bytes(psi, n, z) for z in range(4)]
    assert st[0] == (2 * psi, 2 * psi, 12 * psi)
    assert st[1] == (2 * psi, 2 * psi, 12 * psi / n)
    assert st[2] == (2 * psi, 2 * psi / n, 12 * psi / n)
    assert st[3] == (2 * psi / n, 2 * psi / n, 12 * psi / n)
    assert sizing.model_state_bytes(psi, 1, 3).total == st[0].total  # one rank: nothing to shard


def test_plan_composes_the_formulas():
    p = plan(TINY, tp=2, pp=2, dp=2, micro_batch_size=4, global_batch_size=64)
    assert p.world_size == 8 and p.num_microbatches == 8
    s, b, h, a, L, v = TINY.seq_length, 4, TINY.hidden_size, TINY.num_heads, TINY.num_layers, TINY.vocab_size
    stages = sizing.parameters_per_stage(L, h, v, s, a, 2, 2)
    st = sizing.model_state_bytes(stages[0], 2, 0)
    per_layer = sizing.activation_bytes_per_layer(s, b, h, a, 2)
    first = p.stage_memory[0]
    assert (first["weights"], first["grads"], first["optimizer"]) == tuple(st)
    emb = sizing.output_activation_terms(s, b, h, v, 2, False)["embedding"]
    assert first["activations"] == per_layer * (L // 2) * 2 + emb * 2  # 2 micro-batches in flight
    last = p.stage_memory[1]
    out = sizing.output_activation_terms(s, b, h, v, 2, False)["output"]
    assert last["activations"] == per_layer * (L // 2) * 1 + out
    assert p.memory == max(p.stage_memory, key=lambda d: d["total"])
    assert p.comm["tp"] == 2 * sizing.tp_comm_per_layer(s, b, h, 2)["total"] * (L // 2) * 8
    assert p.comm["dp"] == 2 * sizing.dp_comm_per_iteration(stages[0], 2)["total"]
    assert p.model_flops == sizing.flops_per_iteration(64, s, L, h, v, "none")
    assert p.bubble == sizing.bubble_fraction(2, 8)


def test_megatron_grad_dtype_and_state_bytes_follow_megatrons_flags():
    """Megatron-LM main: bf16 reduces grads in fp32 (arguments.py ~1204-1217) unless --grad-reduce-in-bf16, fp16
    in fp16 unless --accumulate-allreduce-grads-in-fp32; Megatron-FSDP keeps them in
    --megatron-fsdp-main-grads-dtype, default auto = the param dtype (_resolve_group_grad_dtype)."""
    from course_lib.sizing.memory import megatron_grad_dtype, megatron_state_bytes, optimizer_offload_bytes_per_param

    assert [megatron_grad_dtype("bf16", z) for z in range(4)] == ["fp32", "fp32", "bf16", "bf16"]
    assert megatron_grad_dtype("bf16", 1, grad_reduce_in_bf16=True) == "bf16"
    assert megatron_grad_dtype("fp16", 0) == "fp16" and megatron_grad_dtype("fp16", 1, accumulate_allreduce_grads_in_fp32=True) == "fp32"
    assert megatron_grad_dtype("bf16", 3, fsdp_main_grads_dtype="fp32") == "fp32"
    assert megatron_grad_dtype("fp32", 3) == "fp32"
    one_line_error(megatron_grad_dtype, "bf16", 3, fsdp_main_grads_dtype="fp8", match="megatron-fsdp-main-grads-dtype")
    one_line_error(megatron_grad_dtype, "int8", match="precision='int8'")
    psi, d = 1000.0, 8
    assert megatron_state_bytes(psi, d, 1, "bf16") == (2 * psi, 4 * psi, 12 * psi / d)          # 6 + 12/d
    assert megatron_state_bytes(psi, d, 0, "fp16") == (2 * psi, 2 * psi, 16 * psi)            # 20
    assert megatron_state_bytes(psi, d, 3, "bf16") == (2 * psi / d, 2 * psi / d, 12 * psi / d)  # auto: bf16 grads
    assert megatron_state_bytes(psi, d, 2, "bf16", "fp32") == (2 * psi, 4 * psi / d, 12 * psi / d)
    assert megatron_state_bytes(psi, d, 3, "fp32") == (4 * psi / d, 4 * psi / d, 8 * psi / d)
    # --optimizer-cpu-offload: HybridDeviceOptimizer's host holds fp32 main params, moments and an fp32 grad copy
    for grads in ("fp32", "bf16"):
        off = optimizer_offload_bytes_per_param(d, True, "bf16", grads)
        assert off["host"] == 16 / d and off["host_grads"] == 4 / d and off["device_optimizer"] == 0


def test_plan_counts_dp_traffic_in_the_grad_dtype():
    """fp16 (the default: the papers'): every DP element in 2 bytes, ZeRO's 2 + 2 + 12. bf16: Megatron reduces
    the grads in fp32 (4 bytes), gathers the params in bf16 (2) and holds 18 (6 + 12/d) bytes per parameter;
    Megatron-FSDP's grads stay bf16 unless --megatron-fsdp-main-grads-dtype fp32."""
    stages = sizing.parameters_per_stage(TINY.num_layers, TINY.hidden_size, TINY.vocab_size, TINY.seq_length,
                                         TINY.num_heads, 2, 1)
    kw = dict(tp=2, dp=4, micro_batch_size=4, global_batch_size=64)
    ring = sizing.dp_comm_per_iteration(stages[0], 4, zero_stage=0)["total"] / 2    # one ring pass, elements
    for zero, fp16, bf16, bf16_fsdp_fp32 in ((0, 4, 8, 8), (1, 4, 6, 6), (2, 4, 4, 6), (3, 6, 6, 8)):
        assert plan(TINY, zero_stage=zero, **kw).comm["dp"] == pytest.approx(fp16 * ring)
        p = plan(TINY, zero_stage=zero, precision="bf16", **kw)
        assert p.comm["dp"] == pytest.approx(bf16 * ring), zero
        wide = plan(TINY, zero_stage=zero, precision="bf16", megatron_fsdp_main_grads_dtype="fp32", **kw)
        assert wide.comm["dp"] == pytest.approx(bf16_fsdp_fp32 * ring), zero
    p = plan(TINY, zero_stage=1, precision="bf16", **kw)
    assert p.config["grad_dtype"] == "fp32"
    assert p.stage_memory[0]["grads"] == 4 * stages[0] and p.stage_memory[0]["optimizer"] == 12 * stages[0] / 4
    narrow = plan(TINY, zero_stage=1, precision="bf16", grad_reduce_in_bf16=True, **kw)
    assert narrow.comm["dp"] == pytest.approx(4 * ring) and narrow.config["grad_dtype"] == "bf16"


def test_plan_fit_verdicts_and_notes():
    gpt3 = PRESETS["GPT-3 175B"]["model"]
    assert not plan(gpt3, tp=1, pp=1, dp=8, global_batch_size=8).fits  # 175B x 16 bytes on one GPU
    ok = plan(gpt3, **PRESETS["GPT-3 175B"]["config"])
    assert ok.fits and ok.memory["total"] < 80e9
    p = plan(TINY, tp=1, dp=8, sequence_parallel=True, micro_batch_size=1, global_batch_size=8)
    assert p.config["sequence_parallel"] is False and "no effect" in p.notes[0]
    inter = plan(gpt3, tp=8, pp=8, dp=1, vp=3, sequence_parallel=True, recompute="selective",
                 global_batch_size=64)
    assert inter.stage_memory is None and "interleaved" in inter.notes[0]
    cp = plan(TINY, tp=2, pp=2, dp=1, cp=2, micro_batch_size=4, global_batch_size=16)
    assert cp.comm["cp"] > 0 and any("CP communication" in n for n in cp.notes)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_plan_and_summarise(name):
    p = plan(PRESETS[name]["model"], **PRESETS[name]["config"])
    text = summary(p)
    assert text.startswith(PRESETS[name]["model"].name) and "fits on a 80 GB GPU" in text


def test_bubbles_are_the_pipeline_labs_functions():
    bubbles = pytest.importorskip("course_lib.pipeline.bubbles")
    assert sizing.bubble_fraction is bubbles.bubble_fraction  # one implementation, shared
    assert sizing.inflight_microbatches is bubbles.inflight_microbatches
    assert sizing.pipeline_bubble_time is bubbles.pipeline_bubble_time
    # Narayanan §2.2: (p-1)/m, and /v interleaved; seed review question: PP=2 vs PP=4 at m=8
    assert sizing.bubble_fraction(2, 8) == 1 / 8 and sizing.bubble_fraction(4, 8) == 3 / 8
    assert sizing.bubble_fraction(4, 8, vp=2) == 3 / 16


