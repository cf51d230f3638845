"""The trainer's parts that are not its loop (the loop and the entry points: :mod:`course_lib.train`).

* :mod:`course_lib.training.arguments` -- Megatron's flags, their value and layout checks
  (``validate_args``), the memory estimate, the model config and the command line the flags
  make (``megatron/training/arguments.py``);
* :mod:`course_lib.training.run_config` -- the one frozen ``RunConfig`` ``validate_args`` returns, which
  everything below the entry point reads (no flag is read from a namespace there);
* :mod:`course_lib.training.setup` -- ``TrainingSetup``, what every iteration uses, and ``setup_training``
  that builds it (Megatron's ``setup_model_and_optimizer``);
* :mod:`course_lib.training.finalize_model_grads` -- the gradients after backward: the dp-cp
  average, the sequence-parallel and tied-embedding sums, the norm that clipping reads
  (``megatron/core/distributed/finalize_model_grads.py``);
* :mod:`course_lib.training.state_sharding` -- the same steps on :mod:`course_lib.distributed`'s buckets
  when a state-sharding flag is on (``--use-distributed-optimizer``, ``--use-megatron-fsdp``, ...);
* :mod:`course_lib.training.checkpointing` -- ``--save``/``--load``: the exact resume, the ``torch_dist``
  checkpoint that reshards on load, the legacy ``torch`` one (``megatron/training/checkpointing.py``);
  :mod:`course_lib.training.checkpoint_inspect` -- ``python -m course_lib checkpoint inspect DIR``.

* :mod:`course_lib.training.logs` -- the log lines the trainer prints, Megatron-LM's format, written and
  read in one module (``parse_log``); :mod:`course_lib.training.training_log` -- ``TrainingLog``, the
  cadence, series and iteration line every loop that logs shares.

The bridges sit above these parts: :mod:`course_lib.deepspeed` (DeepSpeed's engine and config) and
:mod:`course_lib.mcore` (megatron-core beside the trainer).
"""
