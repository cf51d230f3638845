"""The GEMMs one transformer layer runs on one rank, and how long each takes on a GPU.

:func:`layer_gemms` lists the matrix multiplications of one layer's forward pass for one
micro-batch on one tensor- (and context-) parallel rank, with their shapes: the same GEMMs whose
FLOPs Narayanan's Appendix and Korthikanti's Eq. 7 add up (``24bsh^2 + 4bs^2h`` per layer; the
tests check that the shapes add up to :func:`.flops.flops_per_iteration`). Megatron's layer
(``megatron/core/transformer/attention.py``, ``mlp.py``; ``tensor_parallel/layers.py``):

=================  ================================  =============================================
GEMM               shape on one rank ``[m,k] x [k,n]``  why
=================  ================================  =============================================
QKV                ``[bs, h] x [h, 3h/t]``              column-parallel, one fused GEMM
scores ``QK^T``    ``b a/t`` x ``[s, h/a] x [h/a, s]``  one batched GEMM per head and sequence
attention x V      ``b a/t`` x ``[s, s] x [s, h/a]``    (with CP: ``cp`` ring steps of ``s/cp`` keys)
projection         ``[bs, h/t] x [h/t, h]``             row-parallel
MLP up, down       ``[bs, h] x [h, 4h/t]``, ``[bs, 4h/t] x [4h/t, h]``
logits (last)      ``[bs, h] x [h, V/t]``               vocab-parallel output layer
=================  ================================  =============================================

(``bs`` is ``b s / cp`` tokens: with sequence parallelism the GEMM's input is all-gathered first,
so it still multiplies all ``b s / cp`` rows.) The backward pass of each GEMM is two GEMMs of the
same three sizes (input gradient ``[m,n] x [n,k]``, weight gradient ``[k,m] x [m,n]``), so it
costs twice the forward under any model that depends only on the sizes.

**How long a GEMM takes** (:func:`gemm_seconds`): a roofline with a fixed cost per kernel,

    ``t = max(W / (eta_max * peak),  bytes / hbm_bandwidth) + W_half / (eta_max * peak)``

per kernel of ``W = 2 batch m k n`` FLOPs that reads its two bf16 operands and writes its result
once (``bytes = 2 batch (mk + kn + mn)``). ``eta_max`` is the fraction of the dense peak the
Tensor Cores sustain on a large GEMM; the fixed cost, the time of ``W_half`` FLOPs, is what every
kernel pays whatever its size (launch, filling and draining the tile pipeline, the last partial
wave of tiles). A compute-bound GEMM thus runs at ``eta_max * W / (W + W_half)`` of the peak.
Attention's two batched GEMMs have an inner size of one head (``h/a``) and an ``s x s`` matrix per
head, so their arithmetic intensity is low (88 FLOP/byte at ``h/a`` = 96, 114 at 128, 138 at 160,
for ``s`` = 2048), under the ``eta_max`` x 153 FLOP/byte where an A100 (312 TFLOP/s over 2.039 TB/s)
stops being bound by compute: there HBM sets their time.

**The fit.** Narayanan Table 1 reaches 135-142 TFLOP/s per GPU up to 76B, 148 at 146B and 155-163
from 310B on. Run with the micro-batch sizes and interleaving of the authors' own script
(:data:`.published.NARAYANAN_TABLE1_SCRIPT`: micro-batch 16 for the small models, 1 for the largest),
every model's GEMMs are large (the 1.7B model's QKV GEMM alone is 1e12 FLOPs), so a per-kernel cost
cannot be what holds the small models back. What does is element-wise work: the attention scores'
``5as^2b`` bytes against the GEMMs' ``24bsh^2`` FLOPs grow as ``a s / h^2``, so a 2304-wide model moves
far more HBM bytes per FLOP than a 25600-wide one. The projection moves Korthikanti Table 2's stored
activation bytes through HBM ``elementwise_traffic`` times per forward pass (twice that backward), and
that count is the second number fitted.

So two numbers are fitted once, to Table 1's ten rows only: :data:`GEMM_PEAK_EFFICIENCY` (``eta_max``
0.66) and :data:`ELEMENTWISE_TRAFFIC` (2.0 passes), the pair on a grid of 0.01 x 0.1 that minimises the
summed squared log-error of the projected TFLOP/s per GPU (``tests/sizing/test_projection.py::
test_gemm_model_is_the_table1_fit`` checks it against its neighbours): -4.6%..+5.3% on the ten rows.
The per-kernel cost :data:`GEMM_HALF_FLOPS` is left at 0: Table 1 does not pin it down (adding it
lowers the summed error only along a flat valley, from 0.0072 to 0.0042 at ``W_half`` = 28e9 with
``eta_max`` 0.73 -- three numbers from ten rows), though it stays an assumption one can set.
Checked out of sample on :data:`.published.OUT_OF_SAMPLE` (:data:`FIT_SUMMARY` says the errors). The
fit is of A100 runs of the 2021 code; on Hopper the same numbers are an assumption.
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
               "3-5 + §6.3 (9 runs): -12.0%..+0.2%, Narayanan Table 2 PTD-P (6): -3.8%..+1.8%")
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
