"""The sizing calculators against the numbers the papers publish.

Every expected value below is copied from a paper or a Megatron document (section and table
named next to it), never produced by course_lib. Where a paper rounds, the test allows exactly
that rounding and no more.

* Narayanan et al. 2021, arXiv:2104.04473 (Megatron-LM on GPU clusters): Eq. 2, 3, 4, Table 1,
  Table 2, §3.2, §5.1.
* Korthikanti et al. 2022, arXiv:2205.05198 (Reducing activation recomputation): §4.1, Eq. 1-6,
  Table 2, Table 3, Table 5, §5, §6.3, Appendix A (Eq. 7, 8).
* Rajbhandari et al. 2020, arXiv:1910.02054 (ZeRO): §3.1, §5 / Figure 1, §7.
* Megatron-LM docs/user-guide/features/dist_optimizer.md.
"""

from fractions import Fraction

import pytest

from course_lib import sizing
from course_lib.sizing import planner as plan_mod
from course_lib.sizing.published import NARAYANAN_TABLE1, OUT_OF_SAMPLE

V, S = 51200, 2048  # Narayanan §5.1 and Korthikanti §6: vocabulary 51,200, sequence 2048
A100_PEAK = 312e12  # Narayanan §5: A100 peak half-precision throughput, 312 teraFLOP/s
DAY = 86400.0

TABLE1 = NARAYANAN_TABLE1  # Narayanan Table 1, as printed (params (B), heads, hidden, layers, TP, PP, GPUs, batch,
#                           achieved TFLOP/s per GPU, % of peak, aggregate PFLOP/s)


@pytest.mark.parametrize("row", TABLE1, ids=[f"{r[0]}B" for r in TABLE1])
def test_narayanan_table1_parameters_eq2(row):
    params_b, heads, h, l = row[:4]
    p = sizing.num_parameters(l, h, V, S)
    assert round(p / 1e9, 1) == params_b
    # Eq. 2 as printed: 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)), in exact arithmetic
    assert p == 12 * l * h * h * (1 + Fraction(13, 12 * h) + Fraction(V + S, 12 * l * h))


@pytest.mark.parametrize("row", TABLE1, ids=[f"{r[0]}B" for r in TABLE1])
def test_narayanan_table1_throughput_columns_agree(row):
    _, heads, h, l, tp, pp, gpus, batch, tflops, pct, pflops = row
    # per-GPU TFLOP/s is rounded to an integer, so the aggregate agrees within 0.5 TFLOP/s x n
    assert abs(tflops * gpus / 1000 - pflops) <= 0.5 * gpus / 1000 + 0.05
    assert round(100 * tflops / 312) == pct
    # the row's layout is a valid Megatron configuration (world = tp*pp*dp, heads % tp, layers % pp)
    assert gpus % (tp * pp) == 0
    model = plan_mod.ModelSpec("row", l, h, heads, V, S)
    m = sizing.validate_config(model, tp=tp, pp=pp, dp=gpus // (tp * pp), global_batch_size=batch)
    assert m == batch // (gpus // (tp * pp))


def test_narayanan_eq3_matches_the_appendix_derivation():
    # Appendix: per layer 4 x (24Bsh^2 + 4Bs^2h) with recomputation, plus 6BshV for the logits
    B, s, l, h, v = 3, 64, 5, 96, 1000
    expected = l * 4 * (24 * B * s * h * h + 4 * B * s * s * h) + 6 * B * s * h * v
    assert sizing.flops_per_iteration(B, s, l, h, v, recompute=True) == expected
    assert expected == 96 * B * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h))


def test_narayanan_eq4_worked_examples():
    # §5.1: GPT-3, P=175B, T=300B tokens, n=1024 GPUs, X=140 TFLOP/s -> 34 days;
    # the 1T model (Table 1 last row), T=450B, n=3072, X=163 TFLOP/s -> 84 days.
    gpt3 = sizing.num_parameters(96, 12288, V, S)
    assert round(sizing.training_time_approx(300e9, gpt3, 1024, 140e12) / DAY) == 34
    assert round(sizing.training_time_approx(300e9, 175e9, 1024, 140e12) / DAY) == 34
    one_t = sizing.num_parameters(128, 25600, V, S)
    assert round(sizing.training_time_approx(450e9, one_t, 3072, 163e12) / DAY) == 84


# Narayanan Table 2: (layers, hidden) of the 174.6B (GPT-3) and 529.6B models, GPUs,
# achieved TFLOP/s per GPU, training time for 300B tokens (days). ZeRO-3 rows, then PTD-P rows.
TABLE2 = [
    ((96, 12288), 384, 144, 90), ((96, 12288), 768, 88, 74), ((96, 12288), 1536, 44, 74),
    ((105, 20480), 640, 138, 169), ((105, 20480), 1120, 98, 137), ((105, 20480), 2240, 48, 140),
    ((96, 12288), 384, 153, 84), ((96, 12288), 768, 149, 43), ((96, 12288), 1536, 141, 23),
    ((105, 20480), 560, 171, 156), ((105, 20480), 1120, 167, 80), ((105, 20480), 2240, 159, 42),
]


@pytest.mark.parametrize("row", TABLE2)
def test_narayanan_table2_training_days_follow_eq3(row):
    (l, h), gpus, tflops, days = row
    assert round(sizing.num_parameters(l, h, V, S) / 1e9, 1) in (174.6, 529.6)

    def d(x):
        return sizing.training_time(300e9, S, l, h, V, gpus, x * 1e12, recompute="full") / DAY

    # X is rounded to an integer TFLOP/s and the days to an integer
    assert d(tflops + 0.5) - 0.5 <= days <= d(tflops - 0.5) + 0.5


def test_eq4_is_a_few_percent_low_against_table2():
    # 529.6B on 560 GPUs at 171 TFLOP/s: Table 2 says 156 days; Eq. 4 drops s/(6h) and V/(16lh)
    p = sizing.num_parameters(105, 20480, V, S)
    approx = sizing.training_time_approx(300e9, p, 560, 171e12) / DAY
    exact = sizing.training_time(300e9, S, 105, 20480, V, 560, 171e12) / DAY
    assert approx < 155 and round(exact) == 156


def test_narayanan_tp_and_pp_communication_section_3_2():
    b, s, h = 2, 2048, 12288
    for t in (2, 4, 8):
        c = sizing.tp_comm_per_layer(s, b, h, t)
        assert c["forward"] + c["backward"] == pytest.approx(8 * b * s * h * (t - 1) / t, rel=1e-15)
        # sequence parallelism: the same bandwidth (reduce-scatter + all-gather = all-reduce),
        # plus Korthikanti's extra backward all-gather of each block's input
        c_sp = sizing.tp_comm_per_layer(s, b, h, t, sequence_parallel=True)
        assert c_sp["forward"] + c_sp["backward"] == c["forward"] + c["backward"]
        assert c_sp["sp_backward_all_gather"] == pytest.approx(2 * b * s * h * (t - 1) / t, rel=1e-15)
    assert sizing.pp_send_elements(s, b, h) == b * s * h  # bsh per send, each direction


def test_korthikanti_per_layer_breakdown_section_4_1():
    for s, b, h, a in ((2048, 1, 12288, 96), (512, 4, 1024, 16), (7, 3, 10, 5)):
        sbh, as2b = s * b * h, a * s * s * b
        br = sizing.activation_breakdown_per_layer(s, b, h, a)
        assert br["attention"] == 11 * sbh + 5 * as2b
        assert br["mlp"] == 19 * sbh
        assert br["layernorm"] == 4 * sbh
        assert br["total"] == sbh * (34 + Fraction(5 * a * s, h))  # Eq. 1
        assert sizing.activation_bytes_per_layer(s, b, h, a) == br["total"]


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_korthikanti_table2_rows(t):
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3
    sbh, r = s * b * h, Fraction(5 * a * s, h)
    f = sizing.activation_bytes_per_layer
    assert f(s, b, h, a, t) == sbh * (10 + Fraction(24, t) + r / t)  # Eq. 2, tensor parallel
    assert f(s, b, h, a, t, sequence_parallel=True) == sbh * (Fraction(34, t) + r / t)  # Eq. 4
    assert f(s, b, h, a, t, recompute="selective") == sbh * (10 + Fraction(24, t))
    assert f(s, b, h, a, t, sequence_parallel=True, recompute="selective") == sbh * Fraction(34, t)
    assert f(s, b, h, a, t, recompute="full") == 2 * sbh


def test_korthikanti_first_stage_eq5_eq6_and_interleaving():
    L, s, b, h, a, t = 96, 2048, 1, 12288, 96, 8
    sbh = s * b * h
    eq5 = Fraction(sbh * L, t) * (34 + Fraction(5 * a * s, h))
    for p in (1, 2, 4, 8, 16):  # "L layers worth of activations regardless of p"
        assert sizing.activation_bytes_first_stage(L, s, b, h, a, t, p, sequence_parallel=True) == eq5
        eq6 = 34 * Fraction(sbh * L, t)
        assert sizing.activation_bytes_first_stage(L, s, b, h, a, t, p, sequence_parallel=True,
                                                   recompute="selective") == eq6
    # interleaving with m = 3 model chunks (Korthikanti §6 uses m = 3 for 175B): x (1 + (p-1)/(pm))
    got = sizing.activation_bytes_first_stage(L, s, b, h, a, t, 8, vp=3, sequence_parallel=True,
                                              recompute="selective")
    assert got == pytest.approx(float(34 * Fraction(sbh * L, t) * (1 + Fraction(7, 24))), rel=1e-15)


def test_korthikanti_selective_recompute_numbers_section_5():
    # GPT-3: 5as/h = 80; MT-NLG: 64; selective recompute saves 70% and 65% of the activations
    # at a FLOPs overhead of 2.7% and 1.6%.
    for (a, h, l), ratio, saved, overhead in (((96, 12288, 96), 80, 70, 2.7),
                                              ((128, 20480, 105), 64, 65, 1.6)):
        assert 5 * a * S / h == ratio
        full = sizing.activation_bytes_per_layer(S, 1, h, a)
        selective = sizing.activation_bytes_per_layer(S, 1, h, a, recompute="selective")
        assert round(100 * (1 - selective / full)) == saved
        hw = sizing.flops_per_iteration(1, S, l, h, V, recompute="selective")
        model = sizing.flops_per_iteration(1, S, l, h, V, recompute="none")
        assert round(100 * (hw / model - 1), 1) == overhead


def test_korthikanti_eq7_eq8_as_printed():
    B, L, s, h, v = 2, 3, 128, 64, 500
    eq7 = 72 * B * L * s * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * h * L))
    eq8 = 72 * B * L * s * h * h * (1 + Fraction(s, 3 * h) + Fraction(v, 12 * h * L))
    assert sizing.flops_per_iteration(B, s, L, h, v, recompute="none") == eq7
    assert sizing.flops_per_iteration(B, s, L, h, v, recompute="selective") == eq8


# Korthikanti Table 3 (heads, hidden, layers, GPUs = global batch, TP 8; micro-batch 4 for 22B, else 1) and
# Table 5 ("present work" iteration time in s, MFU %, HFU %).
TABLE5 = [
    ("22B", 64, 6144, 48, 8, 4, 1.10, 41.5, 43.7),
    ("175B", 96, 12288, 96, 64, 64, 13.75, 51.4, 52.8),
    ("530B", 128, 20480, 105, 280, 280, 37.83, 56.0, 57.0),
    ("1T", 160, 25600, 128, 512, 512, 71.49, 56.3, 57.0),
]


@pytest.mark.parametrize("row", TABLE5, ids=[r[0] for r in TABLE5])
def test_korthikanti_table5_mfu_hfu(row):
    _, a, h, L, gpus, batch, seconds, mfu, hfu = row

    def pct(time):
        m, hw = sizing.mfu_hfu(batch, S, L, h, V, time, gpus, A100_PEAK, recompute="selective")
        return 100 * m, 100 * hw

    lo, hi = pct(seconds + 0.005), pct(seconds - 0.005)  # the time is rounded to 0.01 s
    assert lo[0] - 0.05 <= mfu <= hi[0] + 0.05
    assert lo[1] - 0.05 <= hfu <= hi[1] + 0.05


def test_korthikanti_table5_columns_agree():
    # Table 5's "throughput increase" column is full-recompute time / present-work time - 1, within the
    # rounding of the times to 0.01 s and of the percentages to 0.1
    rows = [r for r in OUT_OF_SAMPLE if r.source.startswith("Korthikanti 2022 Table 3 + Table 5")]
    full = {r.name: r.seconds for r in rows if r.recompute == "full"}
    present = {r.name: r.seconds for r in rows if r.recompute == "selective"}
    assert present == {name: seconds for name, *_, seconds, _, _ in TABLE5}
    for name, increase in (("22B", 29.0), ("175B", 31.8), ("530B", 29.7), ("1T", 32.1)):
        lo = (full[name] - 0.005) / (present[name] + 0.005) - 1
        hi = (full[name] + 0.005) / (present[name] - 0.005) - 1
        assert 100 * lo - 0.05 <= increase <= 100 * hi + 0.05


def test_korthikanti_530b_with_data_parallelism_section_6_3():
    # 8-way DP (2240 GPUs, batch x 8): 39.15 s per iteration, MFU 54.2%
    m, _ = sizing.mfu_hfu(2240, S, 105, 20480, V, 39.15, 2240, A100_PEAK)
    assert round(100 * m, 1) == 54.2


def test_korthikanti_table3_layouts_are_valid_with_three_interleaving_stages():
    # §6: "three interleaving stages (m = 3) for the 175B and 530B models"
    for a, h, L, tp, pp, gpus, batch in ((96, 12288, 96, 8, 8, 64, 64), (128, 20480, 105, 8, 35, 280, 280)):
        model = plan_mod.ModelSpec("t3", L, h, a, V, S)
        assert sizing.validate_config(model, tp=tp, pp=pp, dp=gpus // (tp * pp), vp=3,
                                      sequence_parallel=True, global_batch_size=batch) == batch


def test_zero_figure1_7_5b_on_64_gpus():
    # ZeRO §5 / Figure 1: Psi = 7.5B, K = 12, N_d = 64: 120 GB -> 31.4 -> 16.6 -> 1.9 GB
    gb = [sizing.model_state_bytes(7.5e9, dp=64, zero_stage=z).total / 1e9 for z in range(4)]
    assert gb[0] == pytest.approx(120.0)
    assert round(gb[1], 1) == 31.4
    assert round(gb[2], 1) == 16.6
    assert round(gb[3], 1) == 1.9  # §5.3 text; the issue quotes Table 1 / Figure 1 as 1.88
    assert abs(gb[3] - 1.88) <= 0.005


def test_zero_section_3_1_and_limits():
    # GPT-2 1.5B: at least 24 GB of model states, 3 GB for the fp16 parameters alone
    st = sizing.model_state_bytes(1.5e9)
    assert st.total == pytest.approx(24e9) and st.weights == pytest.approx(3e9)
    # §5.1/5.2: for large N_d, stages 1 and 2 approach 4x and 8x less than 16 Psi
    big = 10**9
    assert 16 / (sizing.model_state_bytes(1, big, 1).total) == pytest.approx(4, rel=1e-6)
    assert 16 / (sizing.model_state_bytes(1, big, 2).total) == pytest.approx(8, rel=1e-6)


def test_zero_communication_section_7():
    # stages 0-2 move 2 Psi per rank (reduce-scatter + all-gather), stage 3 moves 3 Psi (1.5x)
    psi, g = 7.5e9, 64
    base = sizing.dp_comm_per_iteration(psi, g)["total"]
    assert base == pytest.approx(2 * psi * (g - 1) / g)
    for z in (1, 2):
        assert sizing.dp_comm_per_iteration(psi, g, zero_stage=z)["total"] == base
    assert sizing.dp_comm_per_iteration(psi, g, zero_stage=3)["total"] / base == pytest.approx(1.5)


@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_megatron_distributed_optimizer_table(d):
    # Megatron-LM docs/user-guide/features/dist_optimizer.md, bytes per parameter
    f = sizing.megatron_optimizer_bytes_per_param
    rows = [("fp16", "fp16", 20, 4 + Fraction(16, d)), ("bf16", "fp32", 18, 6 + Fraction(12, d)),
            ("fp16", "fp32", 18, 6 + Fraction(12, d)), ("fp32", "fp32", 16, 8 + Fraction(8, d))]
    for param, grad, plain, dist in rows:
        assert f(d, False, param, grad).total == plain
        assert f(d, True, param, grad).total == pytest.approx(float(dist), rel=1e-15)
