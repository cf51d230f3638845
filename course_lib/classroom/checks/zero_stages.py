"""Checkers for what each ZeRO stage shards (Lab 07): bytes per rank, and a ``ds_config.json`` read.

* :func:`check_zero_bytes` -- bytes per rank of ZeRO's model states for a stage, against
  :func:`course_lib.sizing.model_state_bytes` (Rajbhandari et al. 2020, §3.1, §5).
* :func:`check_what_it_shards` -- read a ``ds_config.json`` and name what it shards and what it
  offloads, against DeepSpeed's stage definitions (stage 1: optimizer states, 2: + gradients,
  3: + parameters; ``offload_*`` moves state to the host, it shards nothing).

The ZeRO-1 step itself runs on ranks in :mod:`course_lib.classroom.checks.distributed_optimizer`.
Every checker prints one verdict line (and a hint when wrong), returns True/False and never raises;
the stub's ``NotImplementedError`` gives "not attempted yet"; numbers of any real type are accepted.
"""

from __future__ import annotations

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted
from course_lib.classroom.checks.verdicts import as_real, safe_repr
from course_lib.sizing import model_state_bytes

# ------------------------------------------------------------------ bytes per rank, by stage

BYTES_CASES = [(7.5e9, 64, s) for s in range(4)] + [(1.3e9, 8, s) for s in range(4)] + \
              [(10_000, 4, s) for s in range(4)] + [(6e6, 1, 2)]
STAGE_SHARDS = {0: "nothing", 1: "the K = 12 bytes of optimizer state", 2: "optimizer state and the 2 bytes of "
                "gradients", 3: "optimizer state, gradients and the 2 bytes of parameters"}


def _bytes_hint(got: float, n: float, dp: int, stage: int) -> str:
    want = model_state_bytes(n, dp, stage).total
    for other in range(4):
        if other != stage and abs(got - model_state_bytes(n, dp, other).total) <= 1e-6 * want:
            return f"that is stage {other}'s count; stage {stage} shards {STAGE_SHARDS[stage]} over N_d"
    for k in (14, 16):        # Megatron's bf16 (fp32 grads: 2 + 4 + 12) and fp16 (2 + 2 + 16) counts
        if abs(got - model_state_bytes(n, dp, stage, k=k).total) <= 1e-6 * want:
            return "you counted Megatron's optimizer bytes; ZeRO's mixed-precision Adam is K = 12 (2 + 2 + 12)"
    for scale, unit in ((1e9, "GB"), (2 ** 30, "GiB"), (2 ** 20, "MiB")):
        if abs(got * scale - want) <= 1e-6 * want:
            return f"return bytes, not {unit}"
    if abs(got - want * dp) <= 1e-6 * want * dp:
        return "that is the whole data-parallel group's bytes; return one rank's"
    return "(2 + 2 + K) bytes per parameter, K = 12; stage 1 divides K by N_d, stage 2 also the gradients' 2, " \
           "stage 3 also the parameters' 2"


def check_zero_bytes(fn) -> bool:
    """``fn(num_params, dp, stage) -> bytes of model states on one rank`` (ZeRO's 2 + 2 + K, K = 12)."""
    if is_course_answer(fn):
        return False
    for n, dp, stage in BYTES_CASES:
        got, problem = checked_call(fn, n, dp, stage)
        if problem == "todo":
            return not_attempted("zero_bytes_per_rank")
        if problem:
            print(f"✗ num_params={n:g}, dp={dp}, stage={stage}: {problem}")
            return False
        value, reason = as_real(got)
        want = model_state_bytes(n, dp, stage).total
        if reason:
            print(f"✗ num_params={n:g}, dp={dp}, stage={stage}: {reason}")
            return False
        if abs(value - want) > 1e-6 * want:
            print(f"✗ num_params={n:g}, dp={dp}, stage={stage}: got {value:,.0f}, expected {want:,.0f}\n"
                  f"  hint: {_bytes_hint(value, n, dp, stage)}")
            return False
    print(f"✓ zero_bytes_per_rank matches ZeRO's (2 + 2 + 12) Ψ for stages 0-3 on {len(BYTES_CASES)} cases "
          f"(7.5B on 64 ranks: 120, 31.4, 16.6, 1.9 GB -- ZeRO Figure 1)")
    return True


# ------------------------------------------------------------------ what a ds_config shards

NAMES = ("optimizer states", "gradients", "parameters")
_ALIASES = {"optimizer states": ("optimizer", "optimizer states", "optimizer_states", "optimizer state", "os",
                                 "optim", "adam", "optimizer_state"),
            "gradients": ("gradients", "gradient", "grads", "grad", "g"),
            "parameters": ("parameters", "parameter", "params", "param", "weights", "p")}


def _normalize(names):
    """A set of :data:`NAMES` from a list/set/tuple of strings in any spelling, or None if unreadable."""
    if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)):
        return None
    out = set()
    for n in names:
        if not isinstance(n, str):
            return None
        key = n.strip().lower().replace("-", " ")
        match = [name for name, aliases in _ALIASES.items() if key in aliases]
        if not match:
            return None
        out.add(match[0])
    return out


def ds_truth(config: dict) -> dict:
    """What a DeepSpeed config shards and offloads (DeepSpeed's stage definitions; the checker's reference)."""
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    offloaded = set()
    if zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme") or zero.get("cpu_offload"):
        offloaded.add("optimizer states")
    if zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme"):
        offloaded.add("parameters")
    return {"sharded": set(NAMES[:stage]), "offloaded": offloaded}


DS_CASES = [
    {"zero_optimization": {"stage": 0}},
    {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}},
    {"zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}},
    {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7}},
    {"bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 4},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
    {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                           "offload_param": {"device": "cpu"}}},
    {"zero_optimization": {"stage": 1, "cpu_offload": True}},
    {"zero_optimization": {"stage": 3, "offload_param": {"device": "none"}}},
]


def _shards_hint(config, got, want) -> str:
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if got["sharded"] != want["sharded"]:
        if (want["sharded"] - got["sharded"]) & want["offloaded"]:
            return ("offloaded states are still sharded: each rank moves its own 1/N_d of them to the host; "
                    "what is sharded is the stage's")
        return (f"stage {stage} shards {', '.join(NAMES[:stage]) or 'nothing'} over the data-parallel ranks "
                f"(1: optimizer states, 2: + gradients, 3: + parameters)")
    if got["offloaded"] - want["offloaded"]:
        return "a device of \"none\" (or no offload_* block) keeps that state on the GPU"
    return ("offload_optimizer (or the old cpu_offload: true) moves optimizer states off the GPU, to CPU or NVMe; "
            "offload_param moves parameters")


def check_what_it_shards(fn) -> bool:
    """``fn(config: dict) -> {"sharded": names, "offloaded": names}`` with names from
    ``"optimizer states"``, ``"gradients"``, ``"parameters"`` (any spelling: "grads", "params", ...)."""
    if is_course_answer(fn):
        return False
    for config in DS_CASES:
        got, problem = checked_call(fn, config)
        if problem == "todo":
            return not_attempted("what_it_shards")
        if problem:
            print(f"✗ {config}: {problem}")
            return False
        if not isinstance(got, dict) or set(got) != {"sharded", "offloaded"}:
            print(f"✗ {config}: return a dict with the keys 'sharded' and 'offloaded'; got {safe_repr(got)}")
            return False
        norm = {k: _normalize(v) for k, v in got.items()}
        if any(v is None for v in norm.values()):
            print(f"✗ {config}: each value is a set (or list) of names from {', '.join(NAMES)}; "
                  f"got {safe_repr(got)}")
            return False
        want = ds_truth(config)
        if norm != want:
            print(f"✗ {config}\n  got {safe_repr(got)}\n  hint: {_shards_hint(config, norm, want)}")
            return False
    print(f"✓ what_it_shards reads all {len(DS_CASES)} configs: the stage says what is sharded over DP, the "
          f"offload blocks what leaves the GPU")
    return True
