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
``megatron/arguments.py`` of ``core_v0.5.0`` (0acc240ebd28). ``tests/test_megatron_bridge.py`` keeps this table
and the generated commands in sync, and re-checks the table against a Megatron-LM
checkout when ``MEGATRON_LM_DIR`` points to one.
"""

from __future__ import annotations

VERIFIED_AT = {
    "core_v0.15.3": "309ffca6a40553362d44fd17efc56b772fa1aa44",
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
