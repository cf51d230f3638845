"""Every Megatron-LM flag the course prints, and where Megatron-LM defines it.

Checked by reading NVIDIA/Megatron-LM at two points (``git show <rev>:<file>``):

* ``core_v0.15.3`` (309ffca6a405, 2026-02-06): flags still written out as
  ``group.add_argument('--flag', ...)`` in ``megatron/training/arguments.py``;
  the entry names the function that adds the flag;
* ``main`` at d98e8a64ddf3 (2026-08-22): many flags are now generated from
  dataclass fields by ``ArgumentGroupFactory`` (``megatron/training/argument_utils.py``:
  ``field_name`` -> ``--field-name``); the entry names the dataclass field, or the
  ``arguments.py`` function for flags still written out.

All of them but the flags of an uneven pipeline split (``--decoder-first-pipeline-num-layers``,
``--decoder-last-pipeline-num-layers`` and ``--num-virtual-stages-per-pipeline-rank``, the
spelling of interleaving such a split needs) also exist, as ``add_argument`` calls, in
``megatron/arguments.py`` of ``core_v0.5.0`` (0acc240ebd28). ``tests/megatron/test_megatron_bridge.py`` keeps this table
and the generated commands in sync, and re-checks the table against a Megatron-LM
checkout when ``MEGATRON_LM_DIR`` points to one -- by reading its source, and by building the
parser Megatron-LM itself builds (``add_megatron_arguments``): every flag here is one of its
option strings at core_v0.16.1 and at main. The tables below this one (``SHARDING_FLAGS``,
``MOE_FLAGS``, ``MCORE_FIELDS``, ``TORCHRUN_FLAGS``) say where each newer flag is defined;
``MAIN_ONLY_FLAGS`` holds the few the course prints that exist at main only.
"""

from __future__ import annotations

VERIFIED_AT = {
    "core_v0.15.3": "309ffca6a40553362d44fd17efc56b772fa1aa44",
    "core_v0.16.1": "55ac7082517c3878ae653c07c09c534b8aed49f6",
    "main": "d98e8a64ddf34856e74b24714e3bedb2f5a39553",
}

# flag -> (where at core_v0.15.3, where at main d98e8a6)
PRETRAIN_FLAGS: dict[str, tuple[str, str]] = {
    "--tensor-model-parallel-size": ("megatron/training/arguments.py::_add_distributed_args",
                                     "megatron/core/model_parallel_config.py::ModelParallelConfig.tensor_model_parallel_size"),
    "--pipeline-model-parallel-size": ("megatron/training/arguments.py::_add_distributed_args",
                                       "megatron/core/model_parallel_config.py::ModelParallelConfig.pipeline_model_parallel_size"),
    "--context-parallel-size": ("megatron/training/arguments.py::_add_distributed_args",
                                "megatron/core/model_parallel_config.py::ModelParallelConfig.context_parallel_size"),
    "--sequence-parallel": ("megatron/training/arguments.py::_add_training_args",
                            "megatron/core/model_parallel_config.py::ModelParallelConfig.sequence_parallel"),
    "--num-layers-per-virtual-pipeline-stage": ("megatron/training/arguments.py::_add_distributed_args",
                                                "megatron/training/arguments.py::_add_distributed_args"),
    "--num-virtual-stages-per-pipeline-rank": ("megatron/training/arguments.py::_add_distributed_args",
                                               "megatron/training/arguments.py::_add_distributed_args"),
    "--decoder-first-pipeline-num-layers": ("megatron/training/arguments.py::_add_distributed_args",
                                            "megatron/training/arguments.py::_add_distributed_args"),
    "--decoder-last-pipeline-num-layers": ("megatron/training/arguments.py::_add_distributed_args",
                                           "megatron/training/arguments.py::_add_distributed_args"),
    "--use-distributed-optimizer": ("megatron/training/arguments.py::_add_distributed_args",
                                    "megatron/training/arguments.py::_add_distributed_args"),
    "--num-layers": ("megatron/training/arguments.py::_add_network_size_args",
                     "megatron/core/transformer/transformer_config.py::TransformerConfig.num_layers"),
    "--hidden-size": ("megatron/training/arguments.py::_add_network_size_args",
                      "megatron/core/transformer/transformer_config.py::TransformerConfig.hidden_size"),
    "--num-attention-heads": ("megatron/training/arguments.py::_add_network_size_args",
                              "megatron/core/transformer/transformer_config.py::TransformerConfig.num_attention_heads"),
    "--group-query-attention": ("megatron/training/arguments.py::_add_network_size_args",
                                "megatron/training/arguments.py::_add_network_size_args"),
    "--num-query-groups": ("megatron/training/arguments.py::_add_network_size_args",
                           "megatron/core/transformer/transformer_config.py::TransformerConfig.num_query_groups"),
    "--seq-length": ("megatron/training/arguments.py::_add_data_args",
                     "megatron/training/arguments.py::_add_data_args"),
    "--max-position-embeddings": ("megatron/training/arguments.py::_add_network_size_args",
                                  "megatron/training/arguments.py::_add_network_size_args"),
    "--micro-batch-size": ("megatron/training/arguments.py::_add_training_args",
                           "megatron/training/config/training_config.py::TrainingConfig.micro_batch_size"),
    "--global-batch-size": ("megatron/training/arguments.py::_add_training_args",
                            "megatron/training/config/training_config.py::TrainingConfig.global_batch_size"),
    "--train-iters": ("megatron/training/arguments.py::_add_training_args",
                      "megatron/training/config/training_config.py::TrainingConfig.train_iters"),
    "--lr": ("megatron/training/arguments.py::_add_learning_rate_args",
             "megatron/training/arguments.py::_add_learning_rate_args"),
    "--min-lr": ("megatron/training/arguments.py::_add_learning_rate_args",
                 "megatron/training/arguments.py::_add_learning_rate_args"),
    "--lr-decay-style": ("megatron/training/arguments.py::_add_learning_rate_args",
                         "megatron/training/config/training_config.py::SchedulerConfig.lr_decay_style"),
    "--lr-warmup-iters": ("megatron/training/arguments.py::_add_learning_rate_args",
                          "megatron/training/config/training_config.py::SchedulerConfig.lr_warmup_iters"),
    "--weight-decay": ("megatron/training/arguments.py::_add_regularization_args",
                       "megatron/training/arguments.py::_add_regularization_args"),
    "--clip-grad": ("megatron/training/arguments.py::_add_regularization_args",
                    "megatron/training/arguments.py::_add_regularization_args"),
    "--hidden-dropout": ("megatron/training/arguments.py::_add_regularization_args",
                         "megatron/core/transformer/transformer_config.py::TransformerConfig.hidden_dropout"),
    "--attention-dropout": ("megatron/training/arguments.py::_add_regularization_args",
                            "megatron/core/transformer/transformer_config.py::TransformerConfig.attention_dropout"),
    "--seed": ("megatron/training/arguments.py::_add_initialization_args",
               "megatron/training/config/common_config.py::RNGConfig.seed"),
    "--bf16": ("megatron/training/arguments.py::_add_mixed_precision_args",
               "megatron/core/model_parallel_config.py::ModelParallelConfig.bf16"),
    "--fp16": ("megatron/training/arguments.py::_add_mixed_precision_args",
               "megatron/core/model_parallel_config.py::ModelParallelConfig.fp16"),
    "--data-path": ("megatron/training/arguments.py::_add_data_args",
                    "megatron/training/arguments.py::_add_data_args"),
    "--split": ("megatron/training/arguments.py::_add_data_args",
                "megatron/training/arguments.py::_add_data_args"),
    "--vocab-file": ("megatron/training/arguments.py::_add_tokenizer_args",
                     "megatron/training/config/training_config.py::TokenizerConfig.vocab_file"),
    "--merge-file": ("megatron/training/arguments.py::_add_tokenizer_args",
                     "megatron/training/config/training_config.py::TokenizerConfig.merge_file"),
    "--tokenizer-type": ("megatron/training/arguments.py::_add_tokenizer_args",
                         "megatron/training/config/training_config.py::TokenizerConfig.tokenizer_type"),
    "--log-interval": ("megatron/training/arguments.py::_add_training_args",
                       "megatron/training/config/training_config.py::LoggerConfig.log_interval"),
    "--log-throughput": ("megatron/training/arguments.py::_add_logging_args",
                         "megatron/training/config/training_config.py::LoggerConfig.log_throughput"),
    "--eval-interval": ("megatron/training/arguments.py::_add_validation_args",
                        "megatron/training/config/training_config.py::ValidationConfig.eval_interval"),
    "--eval-iters": ("megatron/training/arguments.py::_add_validation_args",
                     "megatron/training/config/training_config.py::ValidationConfig.eval_iters"),
    "--transformer-impl": ("megatron/training/arguments.py::_add_transformer_engine_args",
                           "megatron/core/transformer/transformer_config.py::TransformerConfig.transformer_impl"),
}

# tools/preprocess_data.py: get_args() writes out --input/--json-keys/--append-eod/
# --output-prefix/--workers; the tokenizer flags come from arguments.py's
# _add_tokenizer_args (core_v0.15.3 and main; written out in get_args() in core_v0.5.0).
PREPROCESS_FLAGS: dict[str, str] = {
    "--input": "tools/preprocess_data.py::get_args",
    "--output-prefix": "tools/preprocess_data.py::get_args",
    "--json-keys": "tools/preprocess_data.py::get_args",
    "--append-eod": "tools/preprocess_data.py::get_args",
    "--workers": "tools/preprocess_data.py::get_args (required=True since before core_v0.5.0; default 1 in v2.6)",
    "--tokenizer-type": "megatron/training/arguments.py::_add_tokenizer_args",
    "--vocab-file": "megatron/training/arguments.py::_add_tokenizer_args",
    "--merge-file": "megatron/training/arguments.py::_add_tokenizer_args",
}

# Flags people expect that Megatron-LM does not have (or that mean something else).
NOT_MEGATRON_FLAGS: dict[str, str] = {
    "--data-parallel-size": "no such flag: DP is derived as world_size / (TP x PP x CP)",
    "--virtual-pipeline-model-parallel-size": (
        "no CLI flag (it existed for four days in Feb 2021, dd88906..dcef906); main lists "
        "virtual_pipeline_model_parallel_size under 'no CLI argument exists for these' in "
        "_add_network_size_args. Use --num-layers-per-virtual-pipeline-stage or "
        "--num-virtual-stages-per-pipeline-rank"),
    "--model-parallel-size": "deprecated: validate_args asserts it is unset; use --tensor-model-parallel-size",
    "--num-workers": "data-loader worker processes per rank, not the number of GPUs",
}


# ---- the sharding variants (issue 14) and MoE (issue 15) ------------------------------------------
#
# Checked at core_v0.16.1 (55ac7082517c, 2026-03-16; the 0.16 release the course installs as
# megatron-core 0.16.1) and main d98e8a6 in two ways: the place that defines each flag (below), and
# Megatron's own parser -- megatron/training/arguments.py::add_megatron_arguments built on an
# argparse.ArgumentParser from `git archive <rev> megatron` (877 option strings at main, 681 at core_v0.16.1;
# imports it cannot satisfy here, triton/regex/pydantic, stubbed): every flag below is an option
# string of both parsers. flag -> (where at core_v0.16.1, where at main).

SHARDING_FLAGS: dict[str, tuple[str, str]] = {
    "--overlap-grad-reduce": ("megatron/training/arguments.py::_add_distributed_args",
                              "megatron/training/arguments.py::_add_distributed_args"),
    "--overlap-param-gather": ("megatron/training/arguments.py::_add_distributed_args",
                               "megatron/training/arguments.py::_add_distributed_args"),
    "--use-megatron-fsdp": ("megatron/training/arguments.py::_add_distributed_args",
                            "megatron/training/config/common_config.py::DistributedInitConfig.use_megatron_fsdp"),
    # default 'no_shard' at core_v0.16.1, 'optim_grads_params' at main: the commands always spell it out
    "--data-parallel-sharding-strategy": ("megatron/training/arguments.py::_add_distributed_args",
                                          "megatron/training/arguments.py::_add_distributed_args"),
    # validate_args: Megatron-FSDP asserts ckpt_format == 'fsdp_dtensor' (both revisions)
    "--ckpt-format": ("megatron/training/training_config.py::CheckpointConfig.ckpt_format",
                      "megatron/training/config/training_config.py::CheckpointConfig.ckpt_format"),
    # validate_args: --optimizer-cpu-offload asserts --use-precision-aware-optimizer
    "--optimizer-cpu-offload": ("megatron/training/arguments.py::_add_training_args",
                                "megatron/training/arguments.py::_add_training_args"),
    "--optimizer-offload-fraction": ("megatron/training/arguments.py::_add_training_args",
                                     "megatron/training/arguments.py::_add_training_args"),
    "--use-precision-aware-optimizer": ("megatron/training/arguments.py::_add_experimental_args",
                                        "megatron/training/arguments.py::_add_experimental_args"),
}

# Flags of main d98e8a6 that core_v0.16.1 does not have (its parser lacks them; printed only when asked):
# flag -> where at main.
MAIN_ONLY_FLAGS: dict[str, str] = {
    # Megatron-FSDP's grad buffer dtype: default auto = the param dtype (_resolve_group_grad_dtype in
    # megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py); core_v0.16.1's FSDP
    # reduced in fp32 under bf16 through grad_reduce_in_fp32 instead
    "--megatron-fsdp-main-grads-dtype": "megatron/training/arguments.py::_add_experimental_args",
}

MOE_FLAGS: dict[str, tuple[str, str]] = {
    "--num-experts": ("megatron/training/arguments.py::_add_moe_args",
                      "megatron/training/arguments.py::_add_moe_args"),
    "--expert-model-parallel-size": (
        "megatron/core/model_parallel_config.py::ModelParallelConfig.expert_model_parallel_size",
        "megatron/core/model_parallel_config.py::ModelParallelConfig.expert_model_parallel_size"),
    "--expert-tensor-parallel-size": (
        "megatron/core/model_parallel_config.py::ModelParallelConfig.expert_tensor_parallel_size",
        "megatron/core/model_parallel_config.py::ModelParallelConfig.expert_tensor_parallel_size"),
    "--moe-router-topk": ("megatron/core/transformer/transformer_config.py::TransformerConfig.moe_router_topk",
                          "megatron/core/transformer/transformer_config.py::TransformerConfig.moe_router_topk"),
    "--moe-router-load-balancing-type": ("megatron/training/arguments.py::_add_moe_args",
                                         "megatron/training/arguments.py::_add_moe_args"),
    "--moe-aux-loss-coeff": ("megatron/training/arguments.py::_add_moe_args",
                             "megatron/training/arguments.py::_add_moe_args"),
    "--moe-token-dispatcher-type": (
        "megatron/core/transformer/transformer_config.py::TransformerConfig.moe_token_dispatcher_type",
        "megatron/core/transformer/transformer_config.py::TransformerConfig.moe_token_dispatcher_type"),
    "--moe-ffn-hidden-size": (
        "megatron/core/transformer/transformer_config.py::TransformerConfig.moe_ffn_hidden_size",
        "megatron/core/transformer/transformer_config.py::TransformerConfig.moe_ffn_hidden_size"),
    # validate_args asserts compute capability >= 8 (Ampere); TE's GroupedLinear (transformer_engine impl)
    "--moe-grouped-gemm": ("megatron/core/transformer/transformer_config.py::TransformerConfig.moe_grouped_gemm",
                           "megatron/core/transformer/transformer_config.py::TransformerConfig.moe_grouped_gemm"),
    # Mixtral's dense parts: SwiGLU, RMSNorm, RoPE, no linear biases, untied embeddings
    "--swiglu": ("megatron/training/arguments.py::_add_network_size_args",
                 "megatron/training/arguments.py::_add_network_size_args"),
    "--normalization": ("megatron/core/transformer/transformer_config.py::TransformerConfig.normalization",
                        "megatron/core/transformer/transformer_config.py::TransformerConfig.normalization"),
    "--position-embedding-type": ("megatron/training/arguments.py::_add_network_size_args",
                                  "megatron/training/arguments.py::_add_network_size_args"),
    "--disable-bias-linear": (
        "megatron/core/transformer/transformer_config.py::TransformerConfig.add_bias_linear (argparse_meta)",
        "megatron/core/transformer/transformer_config.py::TransformerConfig.add_bias_linear (argparse_meta)"),
    "--untie-embeddings-and-output-weights": ("megatron/training/arguments.py::_add_network_size_args",
                                              "megatron/training/arguments.py::_add_network_size_args"),
}

# The checkpoint flags (issue 26), checked the same two ways at core_v0.16.1 and main d98e8a6; --ckpt-format is
# in SHARDING_FLAGS. Most are CheckpointConfig fields turned into flags by ArgumentGroupFactory (--save-interval
# by its argparse_meta arg_names, with the alias --persistent-save-interval); --no-load-optim and
# --no-load-rng are still written out (CheckpointConfig's load_optim/load_rng are excluded from the factory).
CHECKPOINT_FLAGS: dict[str, tuple[str, str]] = {
    "--save": ("megatron/training/training_config.py::CheckpointConfig.save",
               "megatron/training/config/training_config.py::CheckpointConfig.save"),
    "--save-interval": ("megatron/training/training_config.py::CheckpointConfig.save_interval (argparse_meta)",
                        "megatron/training/config/training_config.py::CheckpointConfig.save_interval (argparse_meta)"),
    "--load": ("megatron/training/training_config.py::CheckpointConfig.load",
               "megatron/training/config/training_config.py::CheckpointConfig.load"),
    "--exit-interval": ("megatron/training/training_config.py::TrainingConfig.exit_interval",
                        "megatron/training/config/training_config.py::TrainingConfig.exit_interval"),
    "--no-load-optim": ("megatron/training/arguments.py::_add_checkpointing_args",
                        "megatron/training/arguments.py::_add_checkpointing_args"),
    "--no-load-rng": ("megatron/training/arguments.py::_add_checkpointing_args",
                      "megatron/training/arguments.py::_add_checkpointing_args"),
    "--finetune": ("megatron/training/training_config.py::CheckpointConfig.finetune",
                   "megatron/training/config/training_config.py::CheckpointConfig.finetune"),
}

# The installed megatron-core's own config dataclasses hold what these flags set (checked with
# dataclasses.fields in tests/megatron/test_megatron_bridge.py): flag -> "Class.field" under megatron.core.
MCORE_FIELDS: dict[str, str] = {
    "--use-distributed-optimizer": "DistributedDataParallelConfig.use_distributed_optimizer",
    "--overlap-grad-reduce": "DistributedDataParallelConfig.overlap_grad_reduce",
    "--overlap-param-gather": "DistributedDataParallelConfig.overlap_param_gather",
    "--use-megatron-fsdp": "DistributedDataParallelConfig.use_megatron_fsdp",
    "--data-parallel-sharding-strategy": "DistributedDataParallelConfig.data_parallel_sharding_strategy",
    "--optimizer-cpu-offload": "OptimizerConfig.optimizer_cpu_offload",
    "--optimizer-offload-fraction": "OptimizerConfig.optimizer_offload_fraction",
    "--use-precision-aware-optimizer": "OptimizerConfig.use_precision_aware_optimizer",
    "--bf16": "OptimizerConfig.bf16",
    "--num-experts": "TransformerConfig.num_moe_experts",          # the one renamed field
    "--expert-model-parallel-size": "TransformerConfig.expert_model_parallel_size",
    "--expert-tensor-parallel-size": "TransformerConfig.expert_tensor_parallel_size",
    "--moe-router-topk": "TransformerConfig.moe_router_topk",
    "--moe-router-load-balancing-type": "TransformerConfig.moe_router_load_balancing_type",
    "--moe-aux-loss-coeff": "TransformerConfig.moe_aux_loss_coeff",
    "--moe-token-dispatcher-type": "TransformerConfig.moe_token_dispatcher_type",
    "--moe-ffn-hidden-size": "TransformerConfig.moe_ffn_hidden_size",
    "--moe-grouped-gemm": "TransformerConfig.moe_grouped_gemm",
    "--normalization": "TransformerConfig.normalization",
    "--disable-bias-linear": "TransformerConfig.add_bias_linear",
    "--swiglu": "TransformerConfig.gated_linear_unit",
}

# torchrun's own options (torch.distributed.run.get_args_parser; checked against the installed torch).
TORCHRUN_FLAGS: tuple[str, ...] = ("--nnodes", "--nproc-per-node", "--node-rank", "--master-addr", "--master-port",
                                   "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--max-restarts",
                                   "--standalone")
