"""megatron-core itself beside the course trainer: the cross-check that the course computes what Megatron computes.

* :mod:`~course_lib.mcore.cpu` -- a shim that runs megatron-core 0.16.1 on CPU gloo ranks
  (its CUDA calls land on the CPU; the arithmetic is megatron-core's);
* :mod:`~course_lib.mcore.reference` -- megatron-core's GPT trained from the course's master weights
  and batches, its losses and gradient norms set beside :func:`course_lib.train.pretrain`'s (Lab 05).

Above the trainer (it runs it); megatron-core is imported only inside the functions that run it
(``pip install .[megatron]``).
"""
