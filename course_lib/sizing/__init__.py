"""Sizing calculators: the papers' closed forms for parameters, FLOPs, memory, communication.

Pure Python (no torch): import is instant, and every number can be checked by hand.

==========================  =====================================================================
module                      what it computes (source)
==========================  =====================================================================
:mod:`.flops`               parameters (Narayanan 2021 Eq. 2), FLOPs per iteration (Eq. 3;
                            Korthikanti 2022 Eq. 7, 8), MFU/HFU, training time (Eq. 4)
:mod:`.memory`              activation bytes (Korthikanti Table 2, Eq. 1-6), model states (ZeRO
                            §5; Megatron's distributed optimizer)
:mod:`.comm`                the ring cost model; elements sent per rank by TP/SP, PP, DP (ZeRO),
                            CP (Narayanan §3)
:mod:`.planner`             one configuration end to end (validated once, then bytes and FLOPs)
:mod:`.hardware`            GPU profiles (A100, H100, H200): peak FLOP/s, HBM, NVLink, network;
                            each number with its datasheet (NVLink at NCCL's measured rate)
:mod:`.gemm`                the GEMMs of one layer on one rank, with their shapes, and a GEMM's
                            time (a roofline at a fitted fraction of the peak; with the
                            element-wise HBM passes, fitted to Narayanan 2021 Table 1)
:mod:`.published`           published A100 runs, as printed, with their sources: Narayanan 2021
                            Tables 1-2, Korthikanti 2022 Tables 3-5 and §6.3
:mod:`.projection`          a plan timed on a named GPU cluster: step time, tokens/s, MFU, each
                            group's communication on NVLink or the network (fitted to Narayanan
                            2021 Table 1, checked on the other published runs);
                            ``python -m course_lib project``
:mod:`.moe`                 Mixture-of-Experts parameters, active parameters, bytes per rank
==========================  =====================================================================

The pipeline-bubble functions (``bubble_fraction``, ``pipeline_bubble_time``,
``inflight_microbatches``) live with the pipeline lab in :mod:`course_lib.pipeline.bubbles` and
are re-exported here (one implementation, shared).
"""

from course_lib.sizing.comm import (
    cp_comm_per_layer,
    dp_comm_per_iteration,
    pp_comm_per_iteration,
    pp_send_elements,
    ring_elements_sent,
    tp_comm_per_layer,
)
from course_lib.sizing.flops import (
    achieved_flops_per_gpu,
    flops_per_iteration,
    flops_utilization,
    iteration_time,
    mfu_hfu,
    model_flops_per_iteration,
    num_parameters,
    parameter_breakdown,
    parameters_per_rank,
    parameters_per_stage,
    training_time,
    training_time_approx,
)
from course_lib.sizing.memory import (
    ModelStateBytes,
    activation_breakdown_per_layer,
    activation_bytes_first_stage,
    activation_bytes_outside_layers,
    activation_bytes_per_layer,
    interleaving_factor,
    megatron_optimizer_bytes_per_param,
    model_state_bytes,
    output_activation_terms,
)
from course_lib.sizing.planner import PRESETS, ModelSpec, Plan, plan, validate_config
from course_lib.sizing.hardware import HARDWARE, Hardware, get_hardware
from course_lib.sizing.projection import Assumptions, Projection, project

from course_lib.pipeline.bubbles import bubble_fraction, inflight_microbatches, pipeline_bubble_time

__all__ = [name for name in dir() if not name.startswith("_")]
