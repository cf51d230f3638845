"""Checkers for what each ZeRO stage shards (Lab 07): bytes per rank, and a ``ds_config.json`` read.

* :func:`check_zero_bytes` -- bytes per rank of each part of ZeRO's model states (params, grads,
  optimizer) for a stage, against :func:`course_lib.sizing.model_state_bytes` (Rajbhandari et al. 2020,
  §3.1, §5): asked for part by part, so a wrongly sharded part or a forgotten fp32 master copy shows.
* :func:`check_what_it_shards` -- read a ``ds_config.json`` and name what it shards and what it
  offloads, against DeepSpeed's stage definitions (stage 1: optimizer states, 2: + gradients,
  3: + parameters; ``offload_*`` moves state to the host, it shards nothing).

The ZeRO-1 step itself runs on ranks in :mod:`course_lib.classroom.checks.distributed_optimizer`.
Every checker prints one verdict line (and a hint when wrong), returns True/False and never raises;
the stub's ``NotImplementedError`` gives "not attempted yet"; numbers of any real type are accepted.
"""

from __future__ import annotations

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import as_real, drawn_rng, safe_repr
from course_lib.sizing import model_state_bytes

# ------------------------------------------------------------------ bytes per rank, by stage

BYTES_CASES = [(7.5e9, 64, s) for s in range(4)] + [(1.3e9, 8, s) for s in range(4)] + \
              [(10_000, 4, s) for s in range(4)] + [(6e6, 1, 2)]
PARTS = ("params", "grads", "optimizer")
_PART_ALIASES = {"params": ("params", "parameters", "weights", "param", "p"),
                 "grads": ("grads", "gradients", "grad", "g"),
                 "optimizer": ("optimizer", "optimizer states", "optimizer_states", "optimizer state", "os", "optim")}
_SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}   # the first stage that divides each part by N_d


def drawn_bytes_cases(rng) -> list:
    """One model and DP size drawn for this run, at every stage (so each part is seen whole and sharded)."""
    n, dp = rng.randint(10**6, 10**11), rng.randint(2, 512)
    return [(n, dp, stage) for stage in range(4)]


def _parts(got) -> tuple[dict | None, str | None]:
    """The answer as ``{"params", "grads", "optimizer": float}`` (a dict in any spelling, or a triple in
    that order), or ``(None, reason)``."""
    if isinstance(got, dict):
        out = {}
        for key, value in got.items():
            name = next((n for n, aliases in _PART_ALIASES.items()
                         if isinstance(key, str) and key.strip().lower().replace("-", " ") in aliases), None)
            if name is None:
                return None, f"unknown key {key!r}: the keys are {', '.join(map(repr, PARTS))}"
            out[name] = value
        if set(out) != set(PARTS):
            return None, f"return the three parts {', '.join(map(repr, PARTS))}; got the keys {sorted(out)}"
    elif isinstance(got, (tuple, list)) and len(got) == 3:
        out = dict(zip(PARTS, got))
    else:
        number, _ = as_real(got)
        if number is not None:
            return None, ("returned one number: return the three parts -- {'params': ..., 'grads': ..., "
                          "'optimizer': ...} in bytes -- so a mistake in one of them shows")
        return None, f"return a dict {{'params': ..., 'grads': ..., 'optimizer': ...}}; got {safe_repr(got)}"
    for name, value in out.items():
        number, reason = as_real(value)
        if reason:
            return None, f"{name!r}: {reason}"
        out[name] = number
    return out, None


def _part_hint(part: str, got: float, n: float, dp: int, stage: int) -> str:
    """Why one part of the model states is wrong: sharded when it is not (or the reverse), the wrong
    bytes per parameter (the K = 8 of a forgotten fp32 master copy among them), units, the whole group."""
    per = {"params": 2, "grads": 2, "optimizer": 12}[part]
    sharded = stage >= _SHARDED_FROM[part]
    divide = dp if sharded else 1
    want = per * n / divide

    def near(value):
        return abs(got - value) <= 1e-6 * max(abs(value), 1.0)

    if dp > 1 and near(per * n / (1 if sharded else dp)):
        first = _SHARDED_FROM[part]
        return (f"stage {stage} {'shards' if sharded else 'keeps whole'} the {part}: "
                f"{'from' if sharded else 'only from'} stage {first} on are they divided by N_d = {dp}")
    if part == "optimizer":
        for k, hint in ((8, "K = 8 counts Adam's two fp32 moments but forgets the fp32 master copy of the "
                            "parameters the optimizer steps (4 more bytes): mixed-precision Adam is K = 12"),
                        (4, "K = 4 is only the fp32 master copy: Adam's two fp32 moments add 8 bytes, K = 12"),
                        (14, "that is Megatron's bf16 count (its fp32 grads move 2 bytes into the optimizer's "
                             "share); ZeRO's mixed-precision Adam is K = 12"),
                        (16, "that is Megatron's fp16 count (with an fp32 grad copy); ZeRO's mixed-precision "
                             "Adam is K = 12")):
            if near(k * n / divide):
                return hint
    if part in ("params", "grads") and near(4 * n / divide):
        return (f"the {part} are 16-bit in mixed precision: 2 bytes each (the fp32 copy of the parameters is "
                f"part of the optimizer's K = 12)")
    for scale, unit in ((1e9, "GB"), (2 ** 30, "GiB"), (2 ** 20, "MiB")):
        if near(want / scale):
            return f"return bytes, not {unit}"
    if dp > 1 and near(want * dp):
        return "that is the whole data-parallel group's bytes; return one rank's"
    return (f"{part}: {per} bytes per parameter{', divided by N_d' if sharded else ''} at stage {stage} "
            f"(stage 1 shards the optimizer's K = 12, stage 2 also the grads' 2, stage 3 also the params' 2)")


@exercise("zero_bytes_per_rank")
def check_zero_bytes(fn) -> bool:
    """``fn(num_params, dp, stage) -> {"params", "grads", "optimizer"}``: the bytes of each part of the model
    states on one rank (ZeRO's 2 + 2 + K, K = 12), checked part by part."""
    if is_course_answer(fn):
        return False
    for n, dp, stage in BYTES_CASES + drawn_bytes_cases(drawn_rng()):
        call = f"num_params={n:g}, dp={dp}, stage={stage}"
        got, problem = checked_call(fn, n, dp, stage, references=references_for("zero_bytes_per_rank"))
        if problem == "todo":
            return not_attempted("zero_bytes_per_rank")
        if problem:
            print(f"✗ {call}: {problem}")
            return False
        parts, reason = _parts(got)
        if reason:
            print(f"✗ {call}: {reason}")
            return False
        want = dict(zip(PARTS, model_state_bytes(n, dp, stage)))
        for part in PARTS:
            if abs(parts[part] - want[part]) > 1e-6 * max(want[part], 1.0):
                print(f"✗ {call}: {part} = {parts[part]:,.0f} bytes is not ZeRO's count for this stage\n"
                      f"  hint: {_part_hint(part, parts[part], n, dp, stage)}")
                return False
    print(f"✓ zero_bytes_per_rank gives ZeRO's params, grads and optimizer bytes, part by part, for stages 0-3 on "
          f"{len(BYTES_CASES) + 4} cases (4 drawn for this run; 7.5B on 64 ranks: 120, 31.4, 16.6, 1.9 GB in all -- "
          f"ZeRO Figure 1)")
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


def _cpu_offload_off(zero: dict) -> None:
    zero.pop("offload_optimizer", None)
    zero["cpu_offload"] = False


def _optimizer_on_no_device(zero: dict) -> None:
    zero.pop("cpu_offload", None)
    zero["offload_optimizer"] = {"device": "none"}


def _params_to_nvme(zero: dict) -> None:
    zero["offload_param"] = {"device": "nvme"}


SPECIAL_OFFLOADS = (_cpu_offload_off, _optimizer_on_no_device, _params_to_nvme)
"""What the first drawn configs always hold, one each: the old switch present but off (``cpu_offload: false``), an
optimizer block whose device is ``none``, parameters to NVMe -- cases no fixed config shows, so that an answer that
reads a key's presence, or the optimizer's device but not the parameters' (or the reverse), fails every run; drawn
alone they came up in only 17%, 49% and 42% of runs."""


def drawn_ds_configs(rng, count: int = 3) -> list:
    """``count`` ds_configs drawn for this run: a stage (or none), each offload block present or not (with a
    device of cpu, nvme or none), the old ``cpu_offload`` switch, and keys that change nothing here; the first
    ones carry the :data:`SPECIAL_OFFLOADS`, one each."""
    configs = []
    for i in range(count):
        zero = {"stage": rng.randint(0, 3)} if rng.random() < 0.9 else {}
        if rng.random() < 0.6:
            zero["offload_optimizer"] = {"device": rng.choice(("cpu", "nvme", "none"))}
        elif rng.random() < 0.3:
            zero["cpu_offload"] = rng.choice((True, False))
        if rng.random() < 0.5:
            zero["offload_param"] = {"device": rng.choice(("cpu", "nvme", "none"))}
        if rng.random() < 0.5:
            zero[rng.choice(("overlap_comm", "contiguous_gradients"))] = rng.choice((True, False))
        if i < len(SPECIAL_OFFLOADS):
            SPECIAL_OFFLOADS[i](zero)
        configs.append({"train_micro_batch_size_per_gpu": rng.randint(1, 8), "zero_optimization": zero})
    return configs


def _shards_hint(config, got, want) -> str:
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if got["sharded"] != want["sharded"]:
        if (want["sharded"] - got["sharded"]) & want["offloaded"]:
            return ("offloaded states are still sharded: each rank moves its own 1/N_d of them to the host; "
                    "what is sharded is the stage's")
        return (f"stage {stage} shards {', '.join(NAMES[:stage]) or 'nothing'} over the data-parallel ranks "
                f"(1: optimizer states, 2: + gradients, 3: + parameters)")
    if got["offloaded"] - want["offloaded"]:
        if "optimizer states" in got["offloaded"] - want["offloaded"] and \
                config.get("zero_optimization", {}).get("cpu_offload") is False:
            return ("cpu_offload: false is the old switch turned off: the optimizer states stay on the GPU (read the "
                    "switch's value, not only whether the key is there)")
        return "a device of \"none\" (or no offload_* block) keeps that state on the GPU"
    return ("offload_optimizer (or the old cpu_offload: true) moves optimizer states off the GPU, to CPU or NVMe; "
            "offload_param moves parameters")


@exercise("what_it_shards")
def check_what_it_shards(fn) -> bool:
    """``fn(config: dict) -> {"sharded": names, "offloaded": names}`` with names from
    ``"optimizer states"``, ``"gradients"``, ``"parameters"`` (any spelling: "grads", "params", ...)."""
    if is_course_answer(fn):
        return False
    for config in DS_CASES + drawn_ds_configs(drawn_rng()):
        got, problem = checked_call(fn, config, references=references_for("what_it_shards"))
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
    print(f"✓ what_it_shards reads all {len(DS_CASES) + 3} configs (3 drawn for this run): the stage says what is "
          f"sharded over DP, the "
          f"offload blocks what leaves the GPU")
    return True
