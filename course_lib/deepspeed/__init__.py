"""The DeepSpeed bridge: a ``ds_config.json`` read as DeepSpeed 0.19.8 reads it, and the course GPT run by DeepSpeed.

* :mod:`~course_lib.deepspeed.schema` -- the mirror of DeepSpeed's config parser (``deepspeed/runtime/config.py``):
  one-line verdicts naming the key, and DeepSpeed's own verdict when it is installed;
* :mod:`~course_lib.deepspeed.memory` -- ZeRO's model-state bytes as DeepSpeed's estimators compute them;
* :mod:`~course_lib.deepspeed.config` -- a ``ds_config.json`` translated to Megatron-LM flags;
  CLI ``python -m course_lib ds-config``;
* :mod:`~course_lib.deepspeed.engine` -- ``python -m course_lib train --deepspeed-config FILE``:
  the course GPT under ``deepspeed.initialize``, printing the trainer's Megatron log lines;
* :mod:`~course_lib.deepspeed.plots` -- Lab 10's figures.

Above the trainer's parts (:mod:`course_lib.training`: its flags, its log lines), below its entry
point (:mod:`course_lib.train` runs :func:`course_lib.deepspeed.engine.pretrain` when a config is given).
DeepSpeed itself is imported only inside the functions that run it (``pip install .[deepspeed]``).
"""
