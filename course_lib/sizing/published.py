"""Published training runs, as printed, each with its source (paper, table, row).

Data only: what the projection (:mod:`.projection`) is fitted to and checked against. Every number
is copied from the paper named beside it; nothing here is computed. All runs are GPT models on
DGX A100 80 GB nodes (8 GPUs on NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node), vocabulary
51,200 and sequence length 2048 (Narayanan §5.1; Korthikanti §6).

* :data:`NARAYANAN_TABLE1` -- Narayanan et al. 2021 (SC21, arXiv:2104.04473), Table 1: ten runs,
  1.7B to 1T, full recomputation (§5.1). What the table does not print -- each run's micro-batch
  size and interleaving -- is :data:`NARAYANAN_TABLE1_SCRIPT`, from the authors' script for it. The
  projection's model (:mod:`.gemm`) is fitted to these rows and to nothing else. Checked cell by
  cell against the same table as Megatron-LM's README showed it in 2021
  (``images/cases_april2021.png`` in Megatron-LM's history, e.g. at commit ``937571cfd4^``): hidden
  size, layers, parameters, model-parallel size (= TP x PP here), GPUs, batch, TFLOP/s per GPU, % of
  peak and aggregate PFLOP/s all agree; the heads (not in that table) agree with the script above,
  which also gives the micro-batch sizes and interleaving.
* Korthikanti's present-work times (Table 5, §6.3) reproduce, to the printed rounding, the authors'
  MFU / HFU table in Megatron-LM's README (``32132c6e84``) and the abstract's 54.2% MFU
  (tests/sizing/test_projection.py). The other numbers of :data:`OUT_OF_SAMPLE` and
  :data:`KORTHIKANTI_TABLE4` are checked only against what the abstracts say (no copy of the papers
  is reachable from this machine).
* :data:`OUT_OF_SAMPLE` -- runs nothing was fitted to:

  - Korthikanti et al. 2022 (MLSys 2023, arXiv:2205.05198), Table 3 (layouts, micro-batch) and
    Table 5 (iteration time of the "full recompute" baseline and of "present work" = sequence
    parallelism + selective recomputation); §6: three interleaved stages for the 175B and 530B
    models; §6.3: the 530B run with 8-way data parallelism on 2240 GPUs. Megatron-LM of 2022: its 530B
    and 1T full-recompute runs are Table 1's pipelines at DP 1, 10.3% and 8.7% faster per GPU. Of that, the projection prices the 2022 code's
    asynchronous column-parallel backward (``async_tensor_model_parallel_allreduce``, on by default since
    Megatron-LM 3f65246911, merged 2021-09-02; Table 1's code, 6985e58, predates it), set on these rows:
    about 2 points; the rest it misses (tests/sizing/test_projection.py
    ``test_korthikanti_residual_is_the_2022_code_on_table1_pipelines``).
  - Narayanan et al. 2021, Table 2, its six PTD-P rows (model-parallel size 96 = TP 8 x PP 12 for
    GPT-3 175B, 280 = 8 x 35 for 530B; micro-batch 1; batch 1536 and 2240): the same paper and
    cluster as the fit, other layouts and data-parallel sizes (the schedule is not printed: 1F1B).

* :data:`KORTHIKANTI_TABLE4` -- Korthikanti Table 4: forward and backward time of one transformer
  layer of the 22B model (TP 8, micro-batch 4) under the five recomputation / SP settings.

Not used: BLOOM-176B (Megatron-DeepSpeed: ZeRO-1 and DeepSpeed's pipeline engine, ALiBi, a
250,880-token vocabulary) and OPT-175B (FSDP with TP 8, no pipeline): neither is a layout
:func:`.projection.project` prices, so an error there would measure the layout model rather than
the GEMM fit.
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB, SEQ = 51200, 2048

# Narayanan Table 1: params (B), heads, hidden, layers, TP, PP, GPUs, batch,
# achieved TFLOP/s per GPU, % of peak, aggregate PFLOP/s.
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
]


# The authors' script for Table 1, Megatron-LM ``examples/academic_paper_scripts/sc21/run_table_1.sh`` (its
# README: "use Megatron-LM commit 6985e58938d4"): per model, --micro-batch-size and
# --num-layers-per-virtual-pipeline-stage (None: the plain 1F1B schedule); every run has
# --activations-checkpoint-method uniform (full recomputation) and --fp16.
NARAYANAN_TABLE1_SCRIPT = {
    1.7: (16, None), 3.6: (16, None), 7.5: (16, None), 18.4: (8, None), 39.1: (4, None), 76.1: (2, 5),
    145.6: (2, 5), 310.1: (1, 3), 529.6: (1, 1), 1008.0: (1, None),
}


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: the model's shape, its layout and what the paper reports for it (an
    iteration time in seconds, or achieved TFLOP/s per GPU as Narayanan counts them)."""

    source: str
    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    recompute: str              # "full", "selective" or "none"
    sequence_parallel: bool
    vp: int = 1                 # interleaved model chunks per pipeline rank
    seconds: float | None = None
    tflops: float | None = None
    # the code's asynchronous column-parallel backward (projection.Assumptions): False for Megatron-LM 6985e58, the
    # 2021 runs' code (its README), before 3f65246911 (merged 2021-09-02) made it the default; True in the 2022 code
    async_tensor_model_parallel_allreduce: bool = False

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def table1_runs() -> list[PublishedRun]:
    """:data:`NARAYANAN_TABLE1` as :class:`PublishedRun` rows, each with its script's micro-batch size and
    interleaving (:data:`NARAYANAN_TABLE1_SCRIPT`; ``vp`` = layers per stage / layers per virtual stage),
    full recomputation."""
    runs = []
    for i, r in enumerate(NARAYANAN_TABLE1, 1):
        micro_batch, layers_per_virtual_stage = NARAYANAN_TABLE1_SCRIPT[r[0]]
        layers, pp = r[3], r[5]
        vp = 1 if layers_per_virtual_stage is None else layers // pp // layers_per_virtual_stage
        runs.append(PublishedRun(f"Narayanan 2021 Table 1 row {i}", f"{r[0]}B", *r[1:8], micro_batch=micro_batch,
                                 recompute="full", sequence_parallel=False, vp=vp, tflops=r[8]))
    return runs


_K3 = "Korthikanti 2022 Table 3"
# Korthikanti Table 3 (heads, hidden, layers, TP, PP, GPUs, global batch, micro-batch) and the §6
# interleaving (3 chunks for 175B and 530B); Table 5's two iteration times (s) per model.
_KORTHIKANTI = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
]

# Narayanan Table 2, the PTD-P rows: params, heads, hidden, layers, PP (model-parallel size / TP 8), GPUs,
# batch, achieved TFLOP/s per GPU (micro-batch 1)
_NARAYANAN_TABLE2_PTDP = [
    ("174.6B", 96, 12288, 96, 12, 384, 1536, 153), ("174.6B", 96, 12288, 96, 12, 768, 1536, 149),
    ("174.6B", 96, 12288, 96, 12, 1536, 1536, 141), ("529.6B", 128, 20480, 105, 35, 560, 2240, 171),
    ("529.6B", 128, 20480, 105, 35, 1120, 2240, 167), ("529.6B", 128, 20480, 105, 35, 2240, 2240, 159),
]

OUT_OF_SAMPLE: list[PublishedRun] = [
    *(PublishedRun(f"{_K3} + Table 5 row {i} (full recompute)", name, a, h, l, tp, pp, g, batch, mb, "full",
                   False, vp, seconds=full, async_tensor_model_parallel_allreduce=True)
      for i, (name, a, h, l, tp, pp, g, batch, mb, vp, full, _) in enumerate(_KORTHIKANTI, 1)),
    *(PublishedRun(f"{_K3} + Table 5 row {i} (present work: SP + selective)", name, a, h, l, tp, pp, g, batch, mb,
                   "selective", True, vp, seconds=present, async_tensor_model_parallel_allreduce=True)
      for i, (name, a, h, l, tp, pp, g, batch, mb, vp, _, present) in enumerate(_KORTHIKANTI, 1)),
    PublishedRun("Korthikanti 2022 §6.3 (530B, 8-way data parallel)", "530B", 128, 20480, 105, 8, 35, 2240, 2240, 1,
                 "selective", True, 3, seconds=39.15, async_tensor_model_parallel_allreduce=True),
    *(PublishedRun(f"Narayanan 2021 Table 2 PTD-P row {i}", name, a, h, l, 8, pp, gpus, batch, 1, "full", False,
                   tflops=tflops)
      for i, (name, a, h, l, pp, gpus, batch, tflops) in enumerate(_NARAYANAN_TABLE2_PTDP, 1)),
]

# Korthikanti Table 4: one transformer layer of the 22B model (Table 3's layout: TP 8, micro-batch 4),
# forward and backward milliseconds (the backward includes any recomputed forward).
KORTHIKANTI_TABLE4 = [
    ("baseline, no recompute", "none", False, 7.7, 11.9),
    ("sequence parallelism", "none", True, 7.2, 11.8),
    ("baseline with full recompute", "full", False, 7.7, 19.5),
    ("selective recompute", "selective", False, 7.7, 13.2),
    ("selective recompute + sequence parallelism", "selective", True, 7.2, 13.1),
]
