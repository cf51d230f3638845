"""The Megatron-LM bridge: real commands for a configuration, and the record table of training logs.

* ``command`` -- ``megatron_command(config)`` (``torchrun ... pretrain_gpt.py``), ``preprocess_command``,
  ``setup_commands``, ``run_tiny_gpt_script`` (the seed's ``run_tiny_gpt.sh``), ``sweep_script``,
  ``gpu_config``; CLI ``python -m course_lib megatron-cmd``.
* ``flags``   -- every flag printed, with the Megatron-LM file/function that defines it.
* ``report``  -- ``record_table``, ``to_markdown``, ``to_csv``; CLI ``python -m course_lib report``.

The log format it reads is the trainer's output, written and read in :mod:`course_lib.training.logs`;
the multi-node launch text in :mod:`course_lib.launch.cluster`.
No torch import here: reading logs and printing commands is instant.
"""

from course_lib.megatron.command import (SEED_MODEL, MegatronRun, describe, gpu_config,
                                         megatron_command, preprocess_command, pretrain_args, run_tiny_gpt_script,
                                         setup_commands, sweep_script)
from course_lib.megatron.flags import NOT_MEGATRON_FLAGS, PREPROCESS_FLAGS, PRETRAIN_FLAGS
from course_lib.megatron.report import COLUMNS, STEP_TIME_NOTE, record_row, record_table, to_csv, to_markdown

__all__ = [
    "megatron_command", "preprocess_command", "setup_commands", "run_tiny_gpt_script", "sweep_script",
    "pretrain_args", "describe", "gpu_config", "MegatronRun", "SEED_MODEL",
    "PRETRAIN_FLAGS", "PREPROCESS_FLAGS", "NOT_MEGATRON_FLAGS",
    "record_table", "record_row", "to_markdown", "to_csv", "COLUMNS", "STEP_TIME_NOTE",
]
