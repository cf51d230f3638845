"""One reference registry: for every exercise of every lab, the course code that computes its answer.

An exercise asks the student to write something the course already implements (and tests against
Megatron-LM or the papers). Calling that implementation proves nothing, so every checker runs the
student's function with :func:`references_for` its exercise: the functions and classes named here,
*and* every function of the checker modules themselves (the checker's truth tables, its input
generators -- see :func:`course_lib.classroom.checks.tamper_guard.run_student`), are refused when they
run inside the student's call -- called directly, through an alias or a wrapper, a
``functools.partial``, a copy of their code object, or an ``exec`` of their source (the same
bytecode under the same name).

The table names what a *student* could call instead of the algorithm; pieces the labs hand out
as building blocks stay allowed (``attention_block`` in the ring, the student's own ``merge``,
``torch.optim.Adam`` in ZeRO-1). Entries are ``"module:qualname"`` strings, resolved on first use;
``tests/classroom/checks/test_proofs.py`` resolves every one and checks that every exercise of every lab
has an entry.
"""

from __future__ import annotations

import importlib

__all__ = ["REFERENCES", "LIBRARIES", "references_for"]

_COLLECTIVES = ("course_lib.communication_patterns:ring_all_reduce",
                "course_lib.communication_patterns:apply_collective")
_GRID = ("course_lib.topology.grid:RankGrid", "course_lib.topology.config:ParallelConfig",
         "course_lib.topology.grid:rank_groups", "course_lib.topology.grid:rank_group_array",
         "course_lib.topology.grid:_group_offsets")
_LAYOUT = ("course_lib.rules:data_parallel_size", "course_lib.rules:num_microbatches",
           "course_lib.topology.config:ParallelConfig", "course_lib.topology.grid:RankGrid")
_ENGINE = ("course_lib.distributed.engine:ShardedDataParallel", "course_lib.distributed.engine:wrap",
           "course_lib.distributed.engine:OptimizerPiece", "course_lib.distributed.buffer:size_buckets")
_ZERO_BYTES = ("course_lib.sizing.memory:model_state_bytes", "course_lib.sizing.memory:megatron_optimizer_bytes_per_param",
               "course_lib.sizing.memory:megatron_state_bytes", "course_lib.deepspeed.config:state_bytes",
               "course_lib.deepspeed.memory:paper_bytes", "course_lib.deepspeed.memory:megatron_bytes",
               "course_lib.deepspeed.memory:deepspeed_estimate")
_SCHEDULES = ("course_lib.pipeline.schedules:schedule_1f1b", "course_lib.pipeline.schedules:build_schedule",
              "course_lib.pipeline.schedules:schedule_interleaved_1f1b", "course_lib.pipeline.schedules:PipelineSchedule",
              "course_lib.pipeline.schedules:schedule_gpipe", "course_lib.pipeline.schedules:_zero_bubble",
              "course_lib.pipeline.schedules:schedule_zero_bubble_h1",
              "course_lib.pipeline.schedules:schedule_zero_bubble_h2", "course_lib.pipeline.schedules:_passes",
              "course_lib.pipeline.schedules:from_orders")
_MODELS = ("course_lib.model:GPTModel", "course_lib.model:GPTChunk", "course_lib.model:TransformerBlock",
           "course_lib.model:LanguageModelEmbedding", "course_lib.model:ParallelLanguageModelEmbedding")
"""The course's models: built at small sizes, their parameters counted, they give the parameter formula away."""
_BUBBLES = ("course_lib.pipeline.bubbles:bubble_fraction", "course_lib.pipeline.bubbles:bubble_share",
            "course_lib.pipeline.bubbles:pipeline_bubble_time", "course_lib.sizing.planner:plan")

REFERENCES: dict[str, tuple[str, ...]] = {
    # Lab 00
    "my_ring_all_reduce": _COLLECTIVES,
    "my_all_reduce_rs_ag": _COLLECTIVES,
    "sync_gradients": ("course_lib.training.finalize_model_grads:allreduce_dp_grads",
                       "course_lib.training.finalize_model_grads:_coalesced_sum_then_divide",
                       "course_lib.training.finalize_model_grads:finalize_model_grads", *_ENGINE),
    # Lab 01
    "derive_dp": _LAYOUT,
    "groups_of": _GRID,
    "rank_of": _GRID,
    # Lab 02
    "column_parallel_forward": ("course_lib.tensor_parallel.layers:ColumnParallelLinear",),
    "row_parallel_forward": ("course_lib.tensor_parallel.layers:RowParallelLinear",),
    "f_and_g": ("course_lib.tensor_parallel.mappings:_CopyToModelParallelRegion.forward",
                "course_lib.tensor_parallel.mappings:_CopyToModelParallelRegion.backward",
                "course_lib.tensor_parallel.mappings:_ReduceFromModelParallelRegion.forward",
                "course_lib.tensor_parallel.mappings:_ReduceFromModelParallelRegion.backward",
                "course_lib.tensor_parallel.mappings:copy_to_tensor_model_parallel_region",
                "course_lib.tensor_parallel.mappings:reduce_from_tensor_model_parallel_region"),
    "tp_mlp_from_dense": ("course_lib.tensor_parallel.sharding:copy_dense_to_parallel",),
    "predict_collectives": ("course_lib.sizing.comm:tp_comm_per_layer", "course_lib.sizing.measured:tp_layer_volume",
                            # a prediction, not a measurement: the lab's measuring cell run inside the function
                            "course_lib.tensor_parallel.transformer:ParallelTransformerLayer",
                            "course_lib.tensor_parallel.transformer:ParallelMLP",
                            "course_lib.tensor_parallel.transformer:ParallelSelfAttention",
                            "course_lib.comm:CommRecorder", "course_lib.launch:launch"),
    "vocab_parallel_cross_entropy": ("course_lib.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
                                     "course_lib.tensor_parallel.cross_entropy:_VocabParallelCrossEntropy.forward",
                                     "course_lib.tensor_parallel.cross_entropy:_VocabParallelCrossEntropy.backward"),
    # Lab 03
    "warmup_1f1b": ("course_lib.pipeline.schedules:num_warmup_microbatches",
                    "course_lib.pipeline.schedules:interleaved_num_warmup", *_SCHEDULES),
    "order_1f1b": _SCHEDULES,
    "bubble": _BUBBLES,
    "peak_activations": ("course_lib.pipeline.simulate:simulate", "course_lib.pipeline.simulate:live_activations",
                         "course_lib.pipeline.bubbles:inflight_microbatches", *_SCHEDULES),
    "orders_1f1b_by_hand": _SCHEDULES,
    # Lab 04
    "merge": ("course_lib.context_parallel.ring:merge_partials",),
    "ring_attention_forward": ("course_lib.context_parallel.ring:ring_attention",
                               "course_lib.context_parallel.ring:RingAttention",
                               "course_lib.context_parallel.ring:reference_attention",
                               "course_lib.context_parallel.ring:_exchange"),
    "chunks_for_rank": ("course_lib.context_parallel.zigzag:chunks_for_rank",
                        "course_lib.context_parallel.zigzag:rank_chunk_ids",
                        "course_lib.context_parallel.zigzag:token_positions",
                        "course_lib.context_parallel.zigzag:shard_sequence"),
    # Lab 05
    "derive_layout": _LAYOUT,
    "distributed_optimizer_step": _ENGINE,
    "largest_bubble": (*_BUBBLES, *_LAYOUT),
    "predict_gpu_winner": ("course_lib.sizing.projection:project", "course_lib.sizing.projection:project_configs",
                           "course_lib.sizing.planner:plan"),
    "my_conclusions": (),
    "parse_iteration_line": ("course_lib.training.logs:parse_log", "course_lib.training.logs:_parse_lines",
                             "course_lib.training.logs:_fields"),
    # Lab 06
    "gpt_parameters": ("course_lib.sizing.flops:num_parameters", "course_lib.sizing.flops:parameter_breakdown",
                       "course_lib.sizing.flops:parameters_per_stage", "course_lib.sizing.flops:parameters_per_rank",
                       "course_lib.sizing.moe:moe_parameter_counts", *_MODELS),
    "model_state_bytes_per_gpu": _ZERO_BYTES,
    # Lab 07
    "zero_bytes_per_rank": _ZERO_BYTES,
    "zero1_step": _ENGINE,
    "what_it_shards": ("course_lib.deepspeed.config:parse", "course_lib.deepspeed.config:translate",
                       "course_lib.deepspeed.config:state_bytes", "course_lib.deepspeed.config:report"),
    "my_answers_07": (),
    # Lab 08
    "expert_groups_of": _GRID,
    "dispatch": ("course_lib.moe.layer:MoELayer", "course_lib.moe.mappings:all_to_all_uneven",
                 "course_lib.moe.mappings:_all_to_all", "course_lib.moe.transformer:MoEMLP",
                 "course_lib.moe.alltoall_plan:plan_alltoall"),
    "aux_loss": ("course_lib.moe.router:switch_load_balancing_loss", "course_lib.moe.router:route",
                 "course_lib.moe.layer:MoELayer"),
    "my_answers_08": (),
    # Lab 09 (check_read_plan also refuses torch's own overlap planner)
    "mlp_sharded_state_dict": ("course_lib.training.checkpointing:sharded_state_dict",
                               "course_lib.training.checkpointing:global_spec",
                               "course_lib.training.checkpointing:expert_global_spec"),
    "read_plan": ("course_lib.training.dcp_io:PieceLoadPlanner", "course_lib.training.dcp_io:load_pieces"),
    "my_answers_09": (),
    # Lab 10
    "zero3_wire": ("course_lib.deepspeed.engine:held_bytes",),
    "reduce_buckets": ("course_lib.distributed.buffer:size_buckets",),
    "fitting_config": ("course_lib.deepspeed.config:translate", "course_lib.deepspeed.memory:deepspeed_estimate",
                       "course_lib.deepspeed.memory:spend_device_budget",
                       "course_lib.deepspeed.memory:zero3_device_at_rest"),
    "my_answers_10": (),
    # Lab 11
    "build_sample_index": ("course_lib.data.gpt_dataset:build_sample_index", "course_lib.data.gpt_dataset:MegatronGPTDataset",
                           "course_lib.data.blend:build_datasets"),
    "build_blending_indices": ("course_lib.data.blend:blending_indices", "course_lib.data.blend:BlendedSamples",
                               "course_lib.data.blend:build_datasets"),
    "my_answers_11": (),
}
"""exercise (the name of the function the student writes) -> ``"module:qualname"`` of the course code
that computes its answer."""

_MCORE = ("megatron",)
_DCP_PLANNERS = ("torch.distributed.checkpoint.planner_helpers", "torch.distributed.checkpoint.resharding",
                 "torch.distributed.checkpoint.default_planner", "torch.distributed.checkpoint._dedup_save_plans",
                 "torch.distributed._shard.sharding_spec._internals")  # its own copy of the overlap test
_RANK_GRIDS = (*_MCORE, "deepspeed")  # DeepSpeed's pipe.topology.ProcessTopology orders ranks for any axis order
_SCHEDULERS = (*_MCORE, "deepspeed")  # megatron-core's get_pp_rank_microbatches counts the warm-up; DeepSpeed's
                                      # pipe.schedule.TrainSchedule lists each stage's 1F1B steps
_TORCH_CP = ("torch.distributed.tensor.experimental",)  # torch's context parallel: _SDPAMerger merges partial
                                                        # attentions, _templated_ring_attention rings them,
                                                        # _HeadTailLoadBalancer is the zigzag split
LIBRARIES: dict[str, tuple[str, ...]] = {
    "derive_dp": _RANK_GRIDS, "groups_of": _RANK_GRIDS, "rank_of": _RANK_GRIDS, "derive_layout": _RANK_GRIDS,
    "expert_groups_of": _RANK_GRIDS, "dispatch": _MCORE, "aux_loss": _MCORE,
    "distributed_optimizer_step": (*_MCORE, "deepspeed"), "zero1_step": (*_MCORE, "deepspeed"),
    "mlp_sharded_state_dict": _MCORE, "read_plan": (*_MCORE, *_DCP_PLANNERS),
    "zero_bytes_per_rank": ("deepspeed",), "what_it_shards": ("deepspeed",), "zero3_wire": ("deepspeed",),
    "reduce_buckets": ("deepspeed",), "fitting_config": ("deepspeed",),
    "f_and_g": _MCORE, "build_sample_index": _MCORE, "build_blending_indices": _MCORE,
    "sync_gradients": _MCORE, "column_parallel_forward": _MCORE, "row_parallel_forward": _MCORE,
    "tp_mlp_from_dense": _MCORE, "vocab_parallel_cross_entropy": _MCORE,
    "merge": _TORCH_CP, "ring_attention_forward": _TORCH_CP, "chunks_for_rank": (*_MCORE, *_TORCH_CP),
    "warmup_1f1b": _SCHEDULERS, "order_1f1b": _SCHEDULERS, "orders_1f1b_by_hand": _SCHEDULERS,
}
"""exercise -> the real libraries (module names, with their submodules) that compute its answer: megatron-core's
``parallel_state``/``RankGenerator``, its tensor-parallel mappings (``_CopyToModelParallelRegion``), MoE utilities
(``switch_load_balancing_loss_func``), compiled dataset helpers (``helpers.build_sample_idx``), tensor-parallel
layers and ``vocab_parallel_cross_entropy``, ``get_batch_on_this_cp_rank`` (the zigzag split) and
``get_pp_rank_microbatches`` (the 1F1B warm-up), DeepSpeed's ``DeepSpeedZeroConfig``, bucketing, ``ProcessTopology``
(its rank grid) and ``TrainSchedule`` (its 1F1B steps), torch's DCP planner helpers and its context parallel
(``torch.distributed.tensor.experimental``: the merge of partial attentions, ring attention, the head-tail split).
The judge refuses them inside the student's function (:mod:`course_lib.classroom.checks.refusals`)."""

_RESOLVED: dict[str, tuple] = {}


def resolve(path: str):
    """The object ``"module:qualname"`` names (``ValueError`` when it does not exist)."""
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"references: {path} does not exist (no {part!r} in {obj!r})")
        obj = getattr(obj, part)
    return obj


def references_for(exercise: str) -> tuple:
    """The course functions and classes that compute ``exercise``'s answer (see :data:`REFERENCES`)."""
    if exercise not in _RESOLVED:
        if exercise not in REFERENCES:
            raise ValueError(f"exercise={exercise!r} has no entry in the reference registry: add it to REFERENCES")
        _RESOLVED[exercise] = tuple(resolve(path) for path in REFERENCES[exercise])
    return _RESOLVED[exercise]
