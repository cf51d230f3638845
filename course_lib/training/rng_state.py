"""The random number generators of one rank: the seed set-up, and the state that saves itself.

:func:`set_random_seed` seeds a rank's torch generator with Megatron-LM's ``_set_random_seed`` offset
(``megatron/training/initialize.py``: seed + 100 x PP rank). :class:`RNGState` (torchtitan's ``Stateful`` shape) captures and restores Python's,
NumPy's, torch's CPU (and, when initialised, CUDA's) generators under Megatron-LM's key names
(``megatron/training/checkpointing.py`` ``get_rng_state``: ``random_rng_state``, ``np_rng_state``,
``torch_rng_state``, ``cuda_rng_state``); checkpointing stores them as Megatron does, one ``rng_state`` list per
(PP, TP) rank -- the course's with an entry per DP x CP replica, Megatron's with one entry, or one per DP
replica (gathered over DP, not CP) under ``--data-parallel-random-init``.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int, pp_rank: int) -> None:
    """Seed torch's generator with ``seed + 100 * pp_rank`` (Megatron's offset per pipeline stage). It drives
    dropout only: the weights came from the seeded master model (:mod:`course_lib.model`). Megatron also
    seeds ``random`` and NumPy; the course's training draws nothing from them."""
    torch.manual_seed(seed + 100 * pp_rank)


class RNGState:
    """This rank's generators: ``state_dict()`` reads them now, ``load_state_dict(d)`` sets them."""

    def state_dict(self) -> dict:
        state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                 "torch_rng_state": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda_rng_state"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["random_rng_state"])
        np.random.set_state(state["np_rng_state"])
        torch.set_rng_state(state["torch_rng_state"])
        if "cuda_rng_state" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng_state"])
