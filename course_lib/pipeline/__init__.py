"""Pipeline parallelism (流水线并行): schedules as data, a checker, a simulator and a real executor.

==================  ==========================================================
:mod:`.schedules`   ``Action`` (F/B/W, micro-batch, chunk); GPipe, 1F1B and
                    interleaved 1F1B in Megatron-LM's order; ZB-H1/ZB-H2
:mod:`.check`       proves per-rank schedules executable and deadlock-free
:mod:`.bubbles`     bubble and in-flight micro-batch formulas (pure functions)
:mod:`.simulate`    discrete-event timeline of a schedule (a simulation)
:mod:`.stages`      a small LM cut into stages between its blocks
:mod:`.executor`    runs a schedule on real ranks (P2P, autograd, timings)
:mod:`.plots`       Gantt charts, bubble-vs-m and memory pictures
==================  ==========================================================

The pure modules (schedules, check, bubbles, simulate) never import torch; the
rest load on first use. The interactive explorer is course machinery:
:mod:`course_lib.classroom.widgets.pipeline`.
"""

from course_lib.pipeline.bubbles import (bubble_fraction, bubble_share, inflight_microbatches,
                                         pipeline_bubble_time)
from course_lib.pipeline.check import check_schedule, choose_p2p, comm_plan
from course_lib.pipeline.schedules import (SCHEDULE_NAMES, Action, PipelineSchedule, build_schedule,
                                           from_orders, get_schedule_table, interleaved_num_warmup,
                                           num_warmup_microbatches, parse_action, schedule_1f1b,
                                           schedule_gpipe, schedule_interleaved_1f1b, schedule_zero_bubble_h1,
                                           schedule_zero_bubble_h2)
from course_lib.pipeline.simulate import Event, Timeline, live_activations, simulate

_LAZY = {
    "execute": "executor", "run_rank_schedule": "executor", "PipelineRun": "executor",
    "StackConfig": "stages", "StackModel": "stages", "build_stages": "stages", "layer_split": "stages",
    "reference_gradients": "stages",
    "gantt": "plots", "gantt_compare": "plots", "bubble_vs_microbatches": "plots", "memory_bars": "plots",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"course_lib.pipeline.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'course_lib.pipeline' has no attribute {name!r}")

__all__ = [
    "Action", "PipelineSchedule", "SCHEDULE_NAMES", "build_schedule", "from_orders", "parse_action",
    "schedule_gpipe", "schedule_1f1b", "schedule_interleaved_1f1b", "schedule_zero_bubble_h1",
    "schedule_zero_bubble_h2", "get_schedule_table", "num_warmup_microbatches", "interleaved_num_warmup",
    "check_schedule", "choose_p2p", "comm_plan",
    "bubble_fraction", "bubble_share", "pipeline_bubble_time", "inflight_microbatches",
    "Event", "Timeline", "simulate", "live_activations", *_LAZY,
]
