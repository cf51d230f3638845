"""The Megatron-LM bridge: real commands for a configuration, and training logs read back.

* ``command`` -- ``megatron_command(config)`` (``torchrun ... pretrain_gpt.py``), ``preprocess_command``,
  ``setup_commands``, ``run_tiny_gpt_script`` (the seed's ``run_tiny_gpt.sh``), ``sweep_script``,
  ``gpu_config``; CLI ``python -m course_lib megatron-cmd``.
* ``flags``   -- every flag printed, with the Megatron-LM file/function that defines it.
* ``logs``    -- ``parse_log(text) -> ParsedLog`` for every Megatron log era and the course's logs.
* ``report``  -- ``record_table``, ``to_markdown``, ``to_csv``; CLI ``python -m course_lib report``.

No torch import here: reading logs and printing commands is instant.
"""

from course_lib.megatron.command import (SEED_MODEL, SEED_SWEEP, MegatronRun, describe, gpu_config,
                                         megatron_command, preprocess_command, pretrain_args, run_tiny_gpt_script,
                                         setup_commands, sweep_script)
from course_lib.megatron.flags import NOT_MEGATRON_FLAGS, PREPROCESS_FLAGS, PRETRAIN_FLAGS
from course_lib.megatron.logs import ParsedLog, parse_log
from course_lib.megatron.report import COLUMNS, STEP_TIME_NOTE, record_row, record_table, to_csv, to_markdown

__all__ = [
    "megatron_command", "preprocess_command", "setup_commands", "run_tiny_gpt_script", "sweep_script",
    "pretrain_args", "describe", "gpu_config", "MegatronRun", "SEED_MODEL", "SEED_SWEEP",
    "PRETRAIN_FLAGS", "PREPROCESS_FLAGS", "NOT_MEGATRON_FLAGS",
    "parse_log", "ParsedLog", "record_table", "record_row", "to_markdown", "to_csv", "COLUMNS", "STEP_TIME_NOTE",
]
