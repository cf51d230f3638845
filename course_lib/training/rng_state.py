"""The random number generators of one rank as state that saves itself (torchtitan's ``Stateful`` shape).

:class:`RNGState` captures and restores Python's, NumPy's, torch's CPU (and, when initialised, CUDA's)
generators under Megatron-LM's key names (``megatron/training/checkpointing.py`` ``get_rng_state``:
``random_rng_state``, ``np_rng_state``, ``torch_rng_state``, ``cuda_rng_state``). Checkpointing stores
the dict as Megatron does (``rng_state``: one entry per DP x CP replica); the run's seed itself is
``--seed`` (``RunConfig.schedule.seed``), which the model's initialisation and the data order read.
"""

from __future__ import annotations

import random

import numpy as np
import torch


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
