"""The cluster projection (course_lib.sizing.projection) against the papers and against first principles.

Expected values come from the papers, datasheets and NCCL measurements named beside them, never from the
code under test:

* Narayanan et al. 2021 (SC21, arXiv:2104.04473) Table 1: the ten A100 runs' layouts and their
  achieved teraFLOP/s per GPU (``NARAYANAN_TABLE1`` of course_lib/sizing/published.py, copied from the
  paper). Full recomputation (§5.1) on Selene (DGX A100, 8 x 200 Gb/s HDR per node, §5); the table
  gives no micro-batch size: we use 1. The GEMM model (course_lib/sizing/gemm.py) is fitted to these
  rows, and ``test_gemm_model_is_the_table1_fit`` redoes the fit.
* Out of sample (fitted to nothing): Korthikanti et al. 2022 Tables 3-5 and §6.3, Narayanan Table 2's
  PTD-P rows (``OUT_OF_SAMPLE``), Korthikanti Table 4's per-layer times (``KORTHIKANTI_TABLE4``).
* Narayanan Figure 13 (162.2B GPT on 64 A100s, TP x PP = 64): throughput is highest at TP 8 and
  falls once TP leaves the 8-GPU node (TP 16, 32).
* NVIDIA datasheets and the NCCL maintainers' NVLink bus bandwidths (course_lib/sizing/hardware.py).
"""

import math
from dataclasses import replace
from functools import lru_cache

import pytest

from course_lib.__main__ import main
from course_lib.sizing import flops_per_iteration
from course_lib.sizing.gemm import (ELEMENTWISE_TRAFFIC, FIT_SUMMARY, GEMM_HALF_FLOPS, GEMM_PEAK_EFFICIENCY, Gemm,
                                    gemm_seconds,
                                    layer_gemms, logits_gemm)
from course_lib.sizing.hardware import HARDWARE, get_hardware
from course_lib.sizing.planner import ModelSpec
from course_lib.sizing.projection import Assumptions, project, project_published, published_error
from course_lib.sizing.published import KORTHIKANTI_TABLE4, OUT_OF_SAMPLE, table1_runs

V, S = 51200, 2048  # Narayanan §5.1: vocabulary 51,200, sequence 2048
TABLE1 = table1_runs()


@lru_cache(maxsize=None)
def _projected(run, **overrides):
    """project_published, once per (run, overrides) in this module: several tests read the same projections."""
    return project_published(run, **overrides)


@lru_cache(maxsize=None)
def _table1_errors(peak_efficiency=GEMM_PEAK_EFFICIENCY, elementwise_traffic=ELEMENTWISE_TRAFFIC,
                   half_flops=GEMM_HALF_FLOPS) -> tuple:
    given = dict(gemm_peak_efficiency=peak_efficiency, elementwise_traffic=elementwise_traffic,
                 gemm_half_flops=half_flops)
    defaults = dict(gemm_peak_efficiency=GEMM_PEAK_EFFICIENCY, elementwise_traffic=ELEMENTWISE_TRAFFIC,
                    gemm_half_flops=GEMM_HALF_FLOPS)
    overrides = {k: v for k, v in given.items() if v != defaults[k]}  # the fit's own: the same key as _projected(r)
    return tuple(published_error(r, _projected(r, **overrides)) for r in TABLE1)


@pytest.fixture(scope="module", autouse=True)
def _projections_dropped_after_the_module():
    """The cached projections hold ~180 MB (their timelines): dropped when this module's tests are done, so that the
    xdist worker does not carry them into every later test, whose forks (ranks) copy its page tables."""
    yield
    _projected.cache_clear()
    _table1_errors.cache_clear()


def _fit_objective(errors) -> float:
    """What the fit minimises: the summed squared log-error of the projected TFLOP/s per GPU."""
    return sum(math.log1p(e) ** 2 for e in errors)


def _span(errors) -> str:
    return f"{100 * min(errors):+.1f}%..{100 * max(errors):+.1f}%"


def _report(runs, errors) -> list:
    lines = []
    for r, e in zip(runs, errors):
        paper = f"{r.tflops} TFLOP/s" if r.tflops is not None else f"{r.seconds} s"
        lines.append(f"  {r.source:<58} {r.name:>7} TP{r.tp} PP{r.pp:<3} {r.gpus:>5} GPUs, {r.recompute:<9} "
                     f"{'SP' if r.sequence_parallel else '  '} paper {paper:>13}: {e:+.1%}")
    return lines


def test_table1_achieved_tflops_within_10_percent_on_every_row(capsys):
    errors = _table1_errors()
    report = "\n".join([f"Narayanan Table 1 vs projection (the fit: eta_max {GEMM_PEAK_EFFICIENCY}, "
                        f"{ELEMENTWISE_TRAFFIC} element-wise HBM passes; the script's micro-batches):"]
                       + _report(TABLE1, errors))
    with capsys.disabled():
        print("\n" + report)
    assert max(abs(e) for e in errors) <= 0.10, report
    assert min(errors) < 0 < max(errors), report  # the fit is centred, no per-row tuning


def test_gemm_model_is_the_table1_fit():
    # the fit: the (eta_max, element-wise passes) on the grid of 0.01 x 0.1 that minimises the summed squared
    # log-error over Table 1 (run as the authors' script ran it); the constants must beat every neighbour
    # (the search over 0.62-0.69 x 1.7-2.3 that found them is too slow to rerun here; one element-wise pass
    # with any eta_max and W_half does no better than 0.034, and a W_half > 0 on top only slides along a
    # flat valley, to 0.0042 at (0.73, 2.3, 28e9): Table 1 does not determine a third number)
    best = _fit_objective(_table1_errors())
    assert best < 0.0075 and GEMM_HALF_FLOPS == 0.0
    for i in (-1, 0, 1):
        for j in (-1, 0, 1):
            if (i, j) != (0, 0):
                eta, passes = round(GEMM_PEAK_EFFICIENCY + 0.01 * i, 2), round(ELEMENTWISE_TRAFFIC + 0.1 * j, 1)
                assert _fit_objective(_table1_errors(eta, passes)) > best, (eta, passes)


def test_out_of_sample_runs_within_10_percent(capsys):
    projections = [_projected(r) for r in OUT_OF_SAMPLE]
    errors = [published_error(r, p) for r, p in zip(OUT_OF_SAMPLE, projections)]
    report = "\n".join(["Out of sample (nothing fitted to them): projected throughput vs published"]
                       + _report(OUT_OF_SAMPLE, errors))
    with capsys.disabled():
        print("\n" + report)
    assert all(p.plan.fits for p in projections)
    korthikanti = [e for r, e in zip(OUT_OF_SAMPLE, errors) if r.source.startswith("Korthikanti")]
    narayanan = [e for r, e in zip(OUT_OF_SAMPLE, errors) if r.source.startswith("Narayanan")]
    assert max(abs(e) for e in narayanan) <= 0.10, report
    # Korthikanti's 1T runs are Table 1's last pipeline a year later, 8.7% faster per GPU; the projection prices
    # the 2022 code's asynchronous column-parallel backward (2.0% of it) and no more: its full-recompute row stays
    # just past 10% (test_korthikanti_residual_is_the_2022_code_on_table1_pipelines says what is left and why)
    assert max(abs(e) for e in korthikanti) <= 0.105, report
    assert [(r.name, r.recompute) for r, e in zip(OUT_OF_SAMPLE, errors) if abs(e) > 0.10] == [("1T", "full")], report
    # the one line the projection prints says these numbers and the fit's
    assert FIT_SUMMARY.endswith(f"Table 1 (10 runs): {_span(_table1_errors())}; out of sample, Korthikanti "
                                f"2022 Tables 3-5 + §6.3 ({len(korthikanti)} runs): {_span(korthikanti)}, "
                                f"Narayanan Table 2 PTD-P ({len(narayanan)}): {_span(narayanan)}"), FIT_SUMMARY


def test_korthikanti_residual_is_the_2022_code_on_table1_pipelines(capsys):
    """Why Korthikanti's 1T rows project slow, from the papers' settings. Korthikanti's 530B and 1T
    full-recompute runs are Narayanan Table 1's 530B and 1T pipelines again -- the same model, TP 8, PP,
    micro-batch 1, m = 280 / 512 micro-batches per pipeline, the same interleaving (3 chunks for 530B in both,
    Table 1's script; none for 1T), full recomputation, seq 2048, vocabulary 51,200 -- and differ in data
    parallelism (DP 9 / 6 in 2021, 1 in 2022) and in the code. Measured with Narayanan's own FLOP count (Eq. 3,
    recompute included: for full recomputation that is Korthikanti's HFU), the 2022 code runs these identical
    pipelines 10.3% and 8.7% faster per GPU. Of the code's changes between Megatron-LM 6985e58 (Table 1's, per
    its script's README) and 2022, the projection prices the asynchronous column-parallel backward
    (async_tensor_model_parallel_allreduce, on by default from 3f65246911, merged 2021-09-02): with DP it
    projects the 2022 run 2.7% / 2.0% faster. Left unexplained: x1.073 / x1.065, which the 1T row meets with
    its in-sample -4.6%: -10.4% out of sample. Not priced, as no source reachable here settles them:
    gradient-accumulation fusion
    (83b1e42f30, 2022-02, on only when gradients accumulate in fp32, i.e. bf16 -- the precision of Korthikanti's
    runs is not in their paper's abstract nor in Megatron-LM's scripts of 2022, which all use --fp16), the
    persistent LayerNorm kernel (a2fdcdf061) and library versions."""
    t1 = {r.name: r for r in TABLE1}
    lines = []
    for k in (r for r in OUT_OF_SAMPLE if r.source.startswith("Korthikanti 2022 Table 3") and r.recompute == "full"
              and r.name in ("530B", "1T")):
        n = t1["529.6B" if k.name == "530B" else "1008.0B"]
        for a in ("heads", "hidden", "layers", "tp", "pp", "micro_batch", "vp", "recompute", "sequence_parallel"):
            assert getattr(k, a) == getattr(n, a), (k.name, a)
        assert k.batch // (k.dp * k.micro_batch) == n.batch // (n.dp * n.micro_batch)     # micro-batches per pipeline
        assert k.async_tensor_model_parallel_allreduce and not n.async_tensor_model_parallel_allreduce
        pk, pn = _projected(k), _projected(n)
        same_code = _projected(k, async_tensor_model_parallel_allreduce=False)
        measured_2022 = pk.plan.hardware_flops / (k.seconds * k.gpus) / 1e12               # Narayanan's Eq. 3 per GPU
        speedup = measured_2022 / n.tflops
        projected_ratio = pk.achieved_flops_per_gpu / pn.achieved_flops_per_gpu           # DP 1 + async, vs 2021
        dp_only = same_code.achieved_flops_per_gpu / pn.achieved_flops_per_gpu
        e_in, e_out = published_error(n, pn), published_error(k, pk)
        assert 1.0 < dp_only < 1.006 and 1.015 < projected_ratio < 1.03 and speedup > 1.08, (k.name, projected_ratio)
        assert 1.06 < speedup / projected_ratio < 1.08, (k.name, speedup / projected_ratio)
        lines.append(f"  {k.name}: 2022 {measured_2022:.1f} vs 2021 {n.tflops} TFLOP/s per GPU on the same pipeline "
                     f"(x{speedup:.3f}); projected x{projected_ratio:.3f} (DP alone x{dp_only:.3f}), unexplained "
                     f"x{speedup / projected_ratio:.3f}; projection in sample {e_in:+.1%}, out of sample {e_out:+.1%}")
    assert len(lines) == 2
    with capsys.disabled():
        print("\nKorthikanti 2022 on Narayanan Table 1's pipelines (full recompute):\n" + "\n".join(lines))


def test_korthikanti_table5_is_the_authors_utilisation_table():
    # Megatron-LM's README (commit 32132c6e84, 2022-05-20, by the authors) prints Table 5's present-work runs as
    # MFU / HFU: 22B 41.5 / 43.7, 175B 51.4 / 52.8, 530B 56.0 / 57.0, 1T 56.3 / 57.0 (%); the paper's abstract the
    # §6.3 run (530B on 2240 GPUs) as 54.2% MFU. Our copies of those iteration times give them back, with
    # Korthikanti's Eq. 7 for the model FLOPs and Eq. 8 for the hardware FLOPs (selective recompute counted as
    # 72bsh^2L s/(6h) more: Eq. 7 with s/(3h)), to the rounding of the printed seconds
    readme = {"22B": (41.5, 43.7), "175B": (51.4, 52.8), "530B": (56.0, 57.0), "1T": (56.3, 57.0)}
    runs = [r for r in OUT_OF_SAMPLE if r.source.startswith("Korthikanti") and r.recompute == "selective"]
    assert [r.name for r in runs] == ["22B", "175B", "530B", "1T", "530B"]
    for r in runs:
        B, s, L, h = r.batch, S, r.layers, r.hidden
        model = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
        hardware = 72 * B * s * L * h * h * (1 + s / (3 * h) + V / (12 * h * L))
        assert _projected(r).plan.model_flops == pytest.approx(model, rel=1e-12)
        per_gpu_second = r.seconds * r.gpus * 312e12
        rounding = 0.005 / r.seconds + 0.0005 / 0.4          # seconds printed to 0.01, percentages to 0.1
        mfu, hfu = (54.2, None) if r.gpus == 2240 else readme[r.name]
        assert 100 * model / per_gpu_second == pytest.approx(mfu, rel=rounding), r.name
        if hfu is not None:
            assert 100 * hardware / per_gpu_second == pytest.approx(hfu, rel=rounding), r.name
            assert r.dp == 1, r.name          # the README: "measured using a data parallel size of one"
    # the abstract's other number: the same 530B run on 2240 GPUs with full recomputation reaches 42.1% MFU, i.e.
    # 50.4 s; the 2022 code's setting set as on the rows above, the projection is 4.1% slow (6.1% without it)
    six_three = next(r for r in runs if r.gpus == 2240)
    full = replace(six_three, recompute="full", sequence_parallel=False, seconds=None)
    seconds = _projected(full).plan.model_flops / (0.421 * full.gpus * 312e12)
    projected = _projected(full).step_time
    blocking = _projected(full, async_tensor_model_parallel_allreduce=False).step_time
    assert -0.045 < seconds / projected - 1 < -0.035 and -0.065 < seconds / blocking - 1 < -0.055


def test_korthikanti_table4_layer_times():
    # one 22B layer (TP 8, micro-batch 4), Korthikanti's 2022 code, whose column-parallel backward runs its
    # collective beside a GEMM (async_tensor_model_parallel_allreduce, on by default there): the forward within
    # 2% and the backward within 3% in all five settings; without that setting (the 2021 code the fit is of) the
    # backward projects 10-16% slow
    model = ModelSpec("22B", 48, 6144, 64, V, S)
    for name, recompute, sp, fwd_ms, bwd_ms in KORTHIKANTI_TABLE4:
        kw = dict(tp=8, sequence_parallel=sp, recompute=recompute, micro_batch_size=4, global_batch_size=4,
                  hardware="A100")
        layer = project(model, async_tensor_model_parallel_allreduce=True, **kw).layer
        assert fwd_ms / 1e3 == pytest.approx(layer["forward"], rel=0.02), name
        assert bwd_ms / 1e3 == pytest.approx(layer["backward"], rel=0.03), name
        blocking = project(model, **kw).layer
        assert 1.09 < blocking["backward"] / (bwd_ms / 1e3) < 1.17, name
        assert blocking["forward"] == layer["forward"], name


def test_async_column_parallel_backward_hides_each_collective_up_to_its_gemm():
    # Megatron's column-parallel backward (tensor_parallel/layers.py, LinearWithGradAccumulationAndAsync-
    # Communication): the input-gradient all-reduce runs beside the weight-gradient GEMM; with SP the input
    # all-gather beside the input-gradient GEMM and the reduce-scatter beside the weight-gradient GEMM. QKV and
    # MLP up are the column-parallel linears; each collective is hidden up to its GEMM's time
    a100, eta, t, s, b, h, a = get_hardware("A100"), GEMM_PEAK_EFFICIENCY, 8, 2048, 1, 8192, 64
    model = ModelSpec("m", 4, h, a, V, s)
    qkv = 2 * b * s * h * 3 * h / t / (eta * 312e12)           # both large, compute-bound on an A100
    up = 2 * b * s * h * 4 * h / t / (eta * 312e12)
    all_reduce = 2 * (t - 1) / t * b * s * h * 2 / 230e9 + 10e-6   # NCCL's 230 GB/s on A100 NVLink, 10 us
    gather = (t - 1) / t * b * s * h * 2 / 230e9 + 10e-6            # one all-gather = one reduce-scatter
    assert all_reduce < qkv < up and gather < qkv
    for sp, hidden_per_layer in ((False, 2 * all_reduce), (True, 4 * gather)):
        kw = dict(tp=t, sequence_parallel=sp, global_batch_size=1, hardware="A100")
        off, on = project(model, **kw), project(model, async_tensor_model_parallel_allreduce=True, **kw)
        assert off.layer["backward"] - on.layer["backward"] == pytest.approx(hidden_per_layer, rel=1e-9), sp
        assert off.layer["forward"] == on.layer["forward"]
        assert off.groups["tp"].exposed - on.groups["tp"].exposed == pytest.approx(4 * hidden_per_layer, rel=1e-9)
        assert off.groups["tp"].seconds == on.groups["tp"].seconds       # the same bytes, sent; fewer waited for
    # a collective longer than its GEMM is hidden only for the GEMM's time (links at 1% of their bandwidth)
    slow = dict(tp=t, global_batch_size=1, hardware="A100", link_efficiency=0.01)
    off, on = project(model, **slow), project(model, async_tensor_model_parallel_allreduce=True, **slow)
    assert 100 * (all_reduce - 10e-6) + 10e-6 > up
    assert off.layer["backward"] - on.layer["backward"] == pytest.approx(qkv + up, rel=1e-9)


def test_layer_gemms_add_up_to_the_papers_flops():
    # every rank's GEMMs, x3 (forward + two gradient GEMMs), over all tp x cp ranks and layers, plus the
    # logits = Korthikanti Eq. 7 (Narayanan Appendix: 24Bsh^2 + 4Bs^2h per layer forward, 2BshV logits)
    s, b, h, a, v, L = 1024, 2, 768, 12, 32000, 5
    for tp, cp in ((1, 1), (4, 1), (2, 2), (1, 4)):
        per_rank = sum(g.flops for g in layer_gemms(s, b, h, a, tp, cp)) * L + logits_gemm(s, b, h, v, tp, cp).flops
        assert 3 * per_rank * tp * cp == flops_per_iteration(b, s, L, h, v, recompute="none")
    qkv, scores, values, proj, up, down = layer_gemms(s, b, h, a, tp=4)
    assert (qkv.m, qkv.k, qkv.n) == (b * s, h, 3 * h // 4) and (proj.k, proj.n) == (h // 4, h)
    assert (scores.batch, scores.m, scores.k, scores.n) == (b * a // 4, s, h // a, s)
    assert (up.n, down.k) == (4 * h // 4, 4 * h // 4) and values.k == s
    # flash attention keeps the s x s scores on chip: same FLOPs, far fewer bytes
    fused = layer_gemms(s, b, h, a, tp=4, flash_attention=True)[1]
    assert fused.flops == scores.flops and fused.bytes == 2 * scores.batch * 2 * s * (h // a)


def test_gemm_seconds_is_a_roofline_with_a_fixed_cost_per_kernel():
    a100, eta, w_half = get_hardware("A100"), GEMM_PEAK_EFFICIENCY, 8e9      # a per-kernel cost, as one may set
    rate = eta * 312e12
    big = Gemm("big", 1, 1, 8192, 8192, 8192, 2 * 3 * 8192 ** 2)  # 1.1e12 FLOPs, 2730 FLOP/byte: compute-bound
    assert gemm_seconds(big, a100, eta, w_half) == pytest.approx((big.flops + w_half) / rate, rel=1e-12)
    assert big.flops / gemm_seconds(big, a100, eta, w_half) / 312e12 == pytest.approx(
        eta * big.flops / (big.flops + w_half), rel=1e-12)
    assert gemm_seconds(big, a100) == pytest.approx(big.flops / rate, rel=1e-12)          # the fit: no fixed cost
    # a head's QK^T at s = 2048, h/a = 96: 88 FLOP/byte, under the A100's ridge of 153: HBM-bound
    head = Gemm("scores", 2, 24, 2048, 96, 2048, 2 * 24 * (2 * 2048 * 96 + 2048 ** 2))
    assert gemm_seconds(head, a100, eta, w_half) == pytest.approx(2 * (head.bytes / 2.039e12 + w_half / rate),
                                                                  rel=1e-12)
    assert gemm_seconds(big, a100, 1.0, 0.0) == big.flops / 312e12


def test_tp_across_the_node_boundary_lowers_throughput():
    # Narayanan Figure 13: 162.2B GPT (l=32, h=20480, a=128: Eq. 2 gives 162.2B), 64 A100s
    model = ModelSpec("162.2B", 32, 20480, 128, V, S)
    assert round(model.num_parameters / 1e9, 1) == 162.2
    x = {}
    for tp, pp in ((8, 8), (16, 4), (32, 2)):
        proj = project(model, tp=tp, pp=pp, dp=1, recompute="full", global_batch_size=128, hardware="A100")
        x[tp] = proj.achieved_flops_per_gpu
        assert proj.groups["tp"].link == ("NVLink" if tp <= 8 else "network")
        assert proj.groups["pp"].link == "network"
    assert x[8] > x[16] > x[32]
    # TP 16 spans 2 nodes with 8 GPUs each: 8 NICs, min(230, 8 x 25) = 200 GB/s, with half-size GEMMs;
    # TP 32 spans 4 nodes, 8 per node: the same bandwidth, 4 x more all-reduces per FLOP than TP 8
    assert x[32] < 0.9 * x[8]


def test_hardware_profiles_are_the_datasheet_numbers():
    a100, h100, h200 = (get_hardware(n) for n in ("A100", "h100", "H200-SXM"))
    assert a100.peak_flops == 312e12 and a100.hbm_bytes == 80e9 and a100.hbm_bandwidth == 2.039e12
    assert h100.peak_flops == 989.4e12 and h100.hbm_bytes == 80e9 and h100.hbm_bandwidth == 3.35e12
    assert h200.peak_flops == h100.peak_flops and h200.hbm_bytes == 141e9 and h200.hbm_bandwidth == 4.8e12
    # NVLink: datasheets print the bidirectional total per GPU (600, 900 GB/s); one direction is half
    assert 2 * a100.nvlink_bandwidth == 600e9 and 2 * h100.nvlink_bandwidth == 900e9 == 2 * h200.nvlink_bandwidth
    # one HCA per GPU: 200 Gb/s HDR (Selene), 400 Gb/s NDR (DGX/HGX H100, H200)
    assert a100.internode_bandwidth * 8 == 200e9 and h100.internode_bandwidth * 8 == 400e9
    # NCCL's ring on NVLink, as its maintainers give it: ~230 GB/s on A100 (nccl-tests#149), 370 GB/s on
    # NVLink 4 (nccl-tests#212)
    assert a100.nvlink_bus_bandwidth == 230e9 and h100.nvlink_bus_bandwidth == 370e9 == h200.nvlink_bus_bandwidth
    assert "priced at NCCL's measured 230" in a100.summary() and "priced at line rate, an assumption" in a100.summary()
    assert all(hw.gpus_per_node == 8 and hw.sources for hw in HARDWARE.values())
    with pytest.raises(ValueError, match="hardware='V100' is unknown: use one of A100, H100, H200"):
        get_hardware("V100")


def test_pure_compute_runs_at_peak_times_gemm_efficiency():
    # a constant GEMM efficiency, no element-wise traffic, no optimizer, one GPU: the step is the FLOPs at
    # peak x efficiency: Eq. 7 without recomputation, Eq. 3 with full; selective runs the attention core's
    # forward once more (4Bs^2hL FLOPs, Korthikanti §5), less than Eq. 8's printed 12Bs^2hL
    model = ModelSpec("m", 4, 1024, 16, 32000, 1024)
    B, s, L, h = 4, 1024, 4, 1024
    expected = {"none": flops_per_iteration(B, s, L, h, 32000, recompute="none"),
                "full": flops_per_iteration(B, s, L, h, 32000, recompute="full")}
    expected["selective"] = expected["none"] + 4 * B * s * s * h * L
    for recompute, flops in expected.items():
        proj = project(model, recompute=recompute, global_batch_size=B, micro_batch_size=2, hardware="H100",
                       elementwise_traffic=0.0, optimizer_bytes_per_param=0.0, gemm_efficiency=0.6)
        assert proj.step_time == pytest.approx(flops / (989.4e12 * 0.6), rel=1e-12)
        assert proj.layer_gemm_efficiency == pytest.approx(0.6, rel=1e-12)
        assert proj.groups == {} and proj.bubble == 0
        assert proj.gemm_model_text().startswith("GEMMs at a constant 60% of peak")


def test_pipeline_busy_time_is_the_model_split_over_ranks():
    # TP x PP x DP, interleaved: every rank's busy time, summed over ranks, is Eq. 3's FLOPs at the rate
    model = ModelSpec("m", 8, 1024, 16, 32000, 1024)
    kw = dict(tp=2, pp=2, dp=2, vp=2, recompute="full", global_batch_size=16, hardware="H100",
              elementwise_traffic=0.0, optimizer_bytes_per_param=0.0, gemm_efficiency=0.5)
    proj = project(model, tp_overlap=1.0, pp_overlap=1.0, **kw)
    busy = sum(proj.timeline.busy(r) for r in range(2)) * 2 * 2  # x tp x dp ranks
    flops = flops_per_iteration(16, 1024, 8, 1024, 32000, recompute="full")
    assert busy == pytest.approx(flops / (989.4e12 * 0.5), rel=1e-12)


def test_groups_on_nvlink_or_network_by_where_their_ranks_sit():
    # 16 GPUs = 2 nodes of 8, Megatron order tp-cp-ep-dp-pp: TP2 [0,1], DP4 [0,2,4,6] in node 0,
    # PP2 [0,8] across the nodes
    model = ModelSpec("m", 8, 2048, 16, 32000, 2048)
    proj = project(model, tp=2, pp=2, dp=4, global_batch_size=32, hardware="H100", num_nodes=2)
    assert {k: (g.group_size, g.link) for k, g in proj.groups.items()} == {
        "tp": (2, "NVLink"), "pp": (2, "network"), "dp": (4, "NVLink"), "embedding": (2, "network")}
    assert proj.num_nodes == 2
    one_node = project(model, tp=8, global_batch_size=8, hardware="H100")
    assert one_node.groups["tp"].link == "NVLink" and one_node.num_nodes == 1


def test_dp_time_is_the_ring_all_reduce_on_k_nics():
    # 2 nodes, DP 16 / tp: 2 (g-1)/g x params x 2 bytes, + one start-up latency. A DP group with k GPUs on
    # each node runs k rings, each through its own GPU's 400 Gb/s HCA: k x 50 GB/s, at most NVLink's 370
    model = ModelSpec("m", 4, 1024, 16, 32000, 1024)
    for tp, k, bandwidth in ((1, 8, 370e9), (2, 4, 200e9), (8, 1, 50e9)):
        dp = 16 // tp
        proj = project(model, tp=tp, dp=dp, global_batch_size=dp, hardware="H100", num_nodes=2)
        g = proj.groups["dp"]
        assert (g.link, g.group_size, g.nics) == ("network", dp, k)
        assert g.seconds == pytest.approx(proj.plan.comm["dp"] / bandwidth + 20e-6, rel=1e-12)
        assert g.exposed == g.seconds
    proj = project(model, dp=16, global_batch_size=16, hardware="H100", num_nodes=2)
    assert proj.plan.comm["dp"] == pytest.approx(2 * 15 / 16 * model.num_parameters * 2, rel=1e-12)
    proj = project(model, dp=16, global_batch_size=16, hardware="H100", num_nodes=2)
    hidden = project(model, dp=16, global_batch_size=16, hardware="H100", num_nodes=2, dp_overlap=1.0)
    assert proj.step_time - hidden.step_time == pytest.approx(proj.groups["dp"].seconds, rel=1e-9)


def test_tp_on_nvlink_at_the_nccl_bus_bandwidth():
    # TP 8 in one A100 node, no SP: 4 all-reduces of [s, b, h] per layer and micro-batch, 2 (t-1)/t of
    # them sent per rank, at 230 GB/s (NCCL's ring on A100 NVLink), + 10 us each
    model = ModelSpec("m", 4, 4096, 32, 51200, 2048)
    proj = project(model, tp=8, global_batch_size=1, hardware="A100")
    per_layer = 4 * (2 * 7 / 8 * 2048 * 4096 * 2 / 230e9 + 10e-6)
    assert proj.groups["tp"].seconds == pytest.approx(4 * per_layer, rel=1e-12)
    assert proj.groups["tp"].nics == 0


def test_bubble_approaches_p_minus_1_over_m_when_compute_dominates():
    # equal stages (a small vocabulary: the logit layer is ~nothing) and a big model on NVLink
    model = ModelSpec("m", 16, 8192, 64, 1024, 2048)
    for m in (8, 16, 32):
        proj = project(model, pp=4, dp=1, global_batch_size=m, hardware="H100")
        assert proj.bubble == pytest.approx(3 / m, rel=0.05)  # the last stage adds a little: logits
    # the seed's tiny model: comm start-ups are a larger share, but the schedule still bounds it
    seed = ModelSpec("seed", 8, 512, 8, 50304, 1024)
    proj = project(seed, pp=2, dp=4, global_batch_size=64, micro_batch_size=4, hardware="H100")
    assert proj.bubble >= 1 / 4 * 0.99  # p=2, m=4 (+ the last stage's 50304-way logits)


def test_bad_inputs_fail_in_one_line():
    model = ModelSpec("m", 4, 1024, 16, 32000, 1024)
    with pytest.raises(ValueError, match=r"num_nodes=3 does not hold tp\*pp\*dp\*cp = 8 GPUs"):
        project(model, dp=8, global_batch_size=8, num_nodes=3)
    with pytest.raises(ValueError, match="gemm_eff= is not an assumption"):
        project(model, gemm_eff=0.5)
    with pytest.raises(ValueError, match=r"gemm_efficiency=1.5 must be in \(0, 1\]"):
        Assumptions(gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="tensor-model-parallel-size"):
        project(model, tp=3)


def test_cli_prints_the_projection_and_refuses_in_one_line(capsys):
    assert main(["project", "--model", "GPT-3 175B", "--hardware", "A100", "--num-nodes", "128"]) == 0
    out = capsys.readouterr().out
    assert "A100-80GB SXM" in out and "TP=8 PP=8 DP=16" in out and "1024 GPUs = 128 node(s)" in out
    assert "TFLOP/s per GPU" in out and "MFU" in out
    for group, link in (("tp", "NVLink"), ("pp", "network"), ("dp", "network")):
        assert any(line.split()[:1] == [group] and link in line for line in out.splitlines()), out
    assert main(["project", "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
                 "--seq-length", "1024", "--vocab-size", "50304", "--tp", "2", "--pp", "2",
                 "--micro-batch-size", "4", "--global-batch-size", "64", "--dp-overlap", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "TP=2 PP=2 DP=2" in out and "50% hidden behind backward" in out
    assert main(["project", "--model", "1T"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:")
    assert main(["project", "--hidden-size", "512"]) == 2
    assert "--num-layers, --num-attention-heads missing" in capsys.readouterr().err
    # the fit and the out-of-sample errors, in one line
    assert main(["project", "--model", "tiny GPT (seed)", "--num-nodes", "1", "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert FIT_SUMMARY in out.splitlines() and "its GEMMs run at" in out


def test_cli_applies_the_shape_flags_to_a_preset_or_refuses_them(capsys):
    # --model NAME with --seq-length / --num-attention-heads / --vocab-size (and --num-layers / --hidden-size):
    # the preset's shape with those changed, validated as any shape is
    base = ["project", "--model", "GPT-3 175B", "--hardware", "A100", "--num-nodes", "128"]
    assert main(base) == 0
    plain = capsys.readouterr().out.splitlines()[1]
    assert "(96 layers, hidden 12288, 96 heads, seq 2048, vocab 51200)" in plain
    assert main(base + ["--seq-length", "4096", "--num-attention-heads", "48", "--vocab-size", "32000"]) == 0
    changed = capsys.readouterr().out.splitlines()[1]
    assert changed.startswith("GPT-3 175B with num_heads=48, vocab_size=32000, seq_length=4096".replace(
        "num_heads", "num_attention_heads"))
    assert "(96 layers, hidden 12288, 48 heads, seq 4096, vocab 32000)" in changed
    for flags, message in ((["--seq-length", "0"], "seq_length=0 must be an integer >= 1"),
                           (["--vocab-size", "-3"], "vocab_size=-3 must be an integer >= 1"),
                           (["--num-attention-heads", "-8"], "num_attention_heads=-8 must be an integer >= 1"),
                           (["--num-attention-heads", "100"], "num_attention_heads=100 is not divisible by "
                                                               "tensor-model-parallel-size=8")):
        assert main(base + flags) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_breakdown_sums_to_the_step_and_configs_derive_dp():
    from course_lib.topology.seed import SEED_SWEEP
    from course_lib.sizing.projection import project_configs

    seed = ModelSpec("seed", 8, 512, 8, 50304, 1024)
    projected = project_configs(seed, SEED_SWEEP, micro_batch_size=4, global_batch_size=64)
    assert {n: p.plan.config["dp"] for n, p in projected.items()} == {
        n: 8 // (tp * pp * cp) for n, (tp, pp, cp) in SEED_SWEEP.items()}
    for proj in projected.values():
        parts = proj.breakdown()
        assert sum(parts.values()) == pytest.approx(proj.step_time, rel=1e-12)
        assert min(parts.values()) >= -1e-15
    assert projected["A"].breakdown()["tp"] == 0 < projected["B"].breakdown()["tp"]
    assert projected["E"].breakdown()["bubble"] > projected["D"].breakdown()["bubble"] > 0
    assert projected["A"].breakdown()["bubble"] == pytest.approx(0, abs=1e-15)
