"""Megatron-style 3D/4D parallelism you can run on a laptop.

Concepts live in their own modules: ``launch`` (run real ranks from a notebook),
``communication_patterns`` (Lab 00), and one module or package per later lab. Nothing here
imports torch, so ``import course_lib`` is instant.

In a notebook, ``%load_ext course_lib`` adds the ``%%torchrun`` cell magic.
"""

__version__ = "0.1.0"


def load_ipython_extension(ipython):
    from course_lib.launch.magic import load_ipython_extension as _load

    _load(ipython)
