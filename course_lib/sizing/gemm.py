"""The GEMMs one transformer layer runs on one rank, and how long each takes on a GPU.

For: the projection's compute time. Main names: :func:`layer_gemms` (one layer's forward GEMMs on one
TP/CP rank, with their shapes), :func:`gemm_seconds` (a roofline with a fixed cost per kernel), the
fitted constants :data:`GEMM_PEAK_EFFICIENCY`, :data:`ELEMENTWISE_TRAFFIC`, :data:`GEMM_HALF_FLOPS`
and :data:`FIT_SUMMARY`.
Follows: Narayanan et al. 2021 (Appendix FLOPs, Table 1), Korthikanti et al. 2022 (Eq. 7, Table 2);
``megatron/core/transformer/attention.py``, ``mlp.py``, ``tensor_parallel/layers.py``.
Manual (the GEMM table, the timing model, the fit and its errors): docs/internals/sizing_gemm.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.sizing.hardware import Hardware

GEMM_PEAK_EFFICIENCY = 0.66
"""``eta_max``: fraction of the dense bf16 peak a large GEMM sustains (fitted to Narayanan Table 1)."""
ELEMENTWISE_TRAFFIC = 2.0
"""HBM passes over a layer's stored activation bytes per forward pass (backward: twice that), fitted
to Narayanan Table 1 together with ``eta_max``; the projection's ``elementwise_traffic`` default."""
GEMM_HALF_FLOPS = 0.0
"""``W_half``: the GEMM size (FLOPs per kernel) that runs at half of ``eta_max``; the fixed cost of
every kernel is the time of this many FLOPs at ``eta_max``. 0: Table 1 does not determine it."""

FIT_SUMMARY = ("GEMMs: roofline at 0.66 x peak, element-wise bytes through HBM 2.0 times (course_lib/sizing/gemm.py), "
               "fitted to Narayanan 2021 Table 1 (10 runs): -4.6%..+5.3%; out of sample, Korthikanti 2022 Tables "
               "3-5 + §6.3 (9 runs): -10.4%..+7.6%, Narayanan Table 2 PTD-P (6): -3.8%..+1.8%")
"""One line for ``project``'s output: the fit and the out-of-sample errors, projected throughput over the
published one minus 1 (tests/sizing/test_projection.py recomputes every number in it)."""


@dataclass(frozen=True)
class Gemm:
    """``count`` kernels, each ``batch`` independent ``[m, k] x [k, n]`` products moving ``bytes``."""

    name: str
    count: int
    batch: int
    m: int
    k: int
    n: int
    bytes: int     # HBM bytes of one kernel (bf16 operands read once, result written once)

    @property
    def flops(self) -> int:
        """FLOPs of all ``count`` kernels (a multiply-add is 2 FLOPs)."""
        return 2 * self.count * self.batch * self.m * self.k * self.n


def _gemm(name: str, count: int, batch: int, m: int, k: int, n: int, unread: int = 0) -> Gemm:
    return Gemm(name, count, batch, m, k, n, 2 * batch * (m * k + k * n + m * n - unread))


def layer_gemms(seq_length: int, micro_batch_size: int, hidden_size: int, num_heads: int, tp: int = 1, cp: int = 1,
                flash_attention: bool = False) -> list[Gemm]:
    """The forward GEMMs of one transformer layer, one micro-batch, on one rank (table above).

    ``flash_attention``: the attention core is one fused kernel (Dao 2022) that keeps the ``s x s``
    scores on chip, so neither GEMM moves them through HBM (their FLOPs are unchanged).
    """
    s, b, h, a = seq_length, micro_batch_size, hidden_size, num_heads
    rows, d, heads, chunk = b * s // cp, h // a, b * a // tp, s // cp
    return [
        _gemm("qkv", 1, 1, rows, h, 3 * h // tp),
        _gemm("scores", cp, heads, chunk, d, chunk, unread=chunk * chunk if flash_attention else 0),
        _gemm("attention_values", cp, heads, chunk, chunk, d, unread=chunk * chunk if flash_attention else 0),
        _gemm("projection", 1, 1, rows, h // tp, h),
        _gemm("mlp_up", 1, 1, rows, h, 4 * h // tp),
        _gemm("mlp_down", 1, 1, rows, 4 * h // tp, h),
    ]


ATTENTION_CORE = ("scores", "attention_values")
"""The GEMMs selective recomputation runs again (Korthikanti §5: the attention core)."""


def logits_gemm(seq_length: int, micro_batch_size: int, hidden_size: int, vocab_size: int, tp: int = 1,
                cp: int = 1) -> Gemm:
    """The output layer's forward GEMM on one rank of the last pipeline stage (vocab-parallel)."""
    return _gemm("logits", 1, 1, micro_batch_size * seq_length // cp, hidden_size, vocab_size // tp)


def gemm_seconds(gemm: Gemm, hw: Hardware, peak_efficiency: float = GEMM_PEAK_EFFICIENCY,
                 half_flops: float = GEMM_HALF_FLOPS) -> float:
    """Seconds of ``gemm``'s kernels on ``hw``: roofline at ``peak_efficiency`` plus the fixed cost."""
    rate = peak_efficiency * hw.peak_flops
    per_kernel = gemm.flops / gemm.count
    return gemm.count * (max(per_kernel / rate, gemm.bytes / hw.hbm_bandwidth) + half_flops / rate)
