"""Checkers for Lab 07's exercises (state sharding: ZeRO, Megatron's distributed optimizer, Day 23).

* :func:`check_zero1_step` -- the student's ZeRO-1 step (flatten, pad to a multiple of d,
  reduce-scatter the grads, Adam on the own shard, all-gather the params) runs on 2 and 4 real ranks
  whose process group records every op (:mod:`course_lib.classroom.checks.wire`). It must equal two steps of
  single-process ``torch.optim.Adam`` on the averaged gradient, keep Adam state for its shard only,
  and send exactly one reduce-scatter and one all-gather of the padded buffer per step over the DP
  group (no all-reduce: plain data parallelism gives the same numbers and is refused by its traffic
  and its state).
* :func:`check_zero_bytes` -- bytes per rank of ZeRO's model states for a stage, against
  :func:`course_lib.sizing.model_state_bytes` (Rajbhandari et al. 2020, §3.1, §5).
* :func:`check_what_it_shards` -- read a ``ds_config.json`` and name what it shards and what it
  offloads, against DeepSpeed's stage definitions (stage 1: optimizer states, 2: + gradients,
  3: + parameters; ``offload_*`` moves state to the host, it shards nothing).

Every checker prints one verdict line (and a hint when wrong), returns True/False and never raises;
the stub's ``NotImplementedError`` gives "not attempted yet"; numbers of any real type are accepted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.lab05 import _tensor_close
from course_lib.classroom.checks.verdicts import as_real, course_code_hint, describe_ops, launch_checked, run_student, \
    safe_repr, wire_recorder
from course_lib.distributed import ShardedDataParallel
from course_lib.launch import LaunchTimeout, RankError
from course_lib.sizing import model_state_bytes

# ------------------------------------------------------------------ (a) the ZeRO-1 step

SHAPES = ((3, 5), (6,), (4, 2))        # 29 elements: the flat buffer needs padding for d = 2 and d = 4
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-3)   # eps ~ |grad|: Adam sees the gradient's scale
STEPS = 2
ALGORITHM = ("flatten params and grads into one buffer padded to a multiple of d, reduce-scatter the grads "
             "(each rank receives the sum of its shard) and divide by d, step Adam on your shard only, "
             "all-gather the updated shards in rank order, cut the buffer back into the params' shapes")


def padded(n: int, d: int) -> int:
    """``n`` rounded up to a multiple of ``d`` (the buffer every rank reduce-scatters and all-gathers)."""
    return -(-n // d) * d


def _adam_steps(params, grads_per_step, *, fresh: bool = False):
    """Single-process torch.optim.Adam on the flat params, one step per gradient (the reference).
    ``fresh``: a new optimizer every step (the mistake of not keeping the state)."""
    p = torch.cat([t.reshape(-1) for t in params]).clone().requires_grad_()
    opt = torch.optim.Adam([p], **ADAM)
    for g in grads_per_step:
        if fresh:
            opt = torch.optim.Adam([p], **ADAM)
        p.grad = torch.cat([t.reshape(-1) for t in g]).clone()
        opt.step()
    return p.detach()


def _state_elements(obj, seen=None) -> int:
    """Elements of every non-scalar tensor reachable from the student's ``state`` (dicts, lists,
    optimizers' ``.state`` and their parameters), each storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(obj.untyped_storage().data_ptr())
        return obj.numel()
    if isinstance(obj, dict):
        return sum(_state_elements(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(_state_elements(v, seen) for v in obj)
    if isinstance(obj, torch.optim.Optimizer):
        return _state_elements(list(obj.state.values()), seen) + _state_elements(
            [p for g in obj.param_groups for p in g["params"]], seen)
    return 0


def _rank_zero1(fn):
    d, r = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(23)
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    grads = [[[1e-3 * torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES] for _ in range(d)]
             for _ in range(STEPS)]
    mean = [[sum(g[k][i] for k in range(d)) / d for i in range(len(SHAPES))] for g in grads]
    summed = [[sum(g[k][i] for k in range(d)) for i in range(len(SHAPES))] for g in grads]
    info = dict(rank=r, d=d, want=_adam_steps(params, mean), summed=_adam_steps(params, summed),
                fresh=_adam_steps(params, mean, fresh=True), events=[], new=None, returned=None, state=None,
                patched=[], course_code=[])
    state, current = {}, [p.clone() for p in params]
    for step in range(STEPS):
        with wire_recorder() as rec:
            run = run_student(fn, [p.clone() for p in current], [g.clone() for g in grads[step][r]],
                              dist.group.WORLD, state, references=(ShardedDataParallel.step,))
        if run.error is not None:
            raise run.error
        info["events"].append(list(rec.events))
        info["patched"] += list(run.patched)
        info["course_code"] += list(run.course_code)
        value = run.value
        info["returned"] = safe_repr(value)
        ok = (isinstance(value, (list, tuple)) and len(value) == len(SHAPES)
              and all(isinstance(v, torch.Tensor) and tuple(v.shape) == s for v, s in zip(value, SHAPES)))
        if not ok:
            info["new"] = None
            info["flat_returned"] = isinstance(value, torch.Tensor)
            return info
        current = [v.detach().clone() for v in value]
    info["new"] = torch.cat([t.reshape(-1).double() for t in current])
    info["state"] = _state_elements(state)
    return info


def _zero1_hint(o: dict) -> str | None:
    """The one hint for a rank: patches or course code, the return value, the traffic that skips the
    algorithm, the numbers (averaged? Adam state kept?), the state's size, then the exact traffic."""
    d = o["d"]
    n_pad = padded(NUMEL, d)
    if o["patched"]:
        return f"it replaced {', '.join(o['patched'][:3])} (undone by the checker)"
    if o["course_code"]:
        return course_code_hint(o["course_code"][0])
    if o["new"] is None:
        if o.get("flat_returned"):
            return "you returned the flat buffer: cut it back into tensors shaped like params (drop the padding)"
        return f"return a list of {len(SHAPES)} tensors shaped like params {list(SHAPES)}; got {o['returned']}"
    ops = {e.op for step in o["events"] for e in step}
    if "all_reduce" in ops:
        return ("an all-reduce gives every rank the whole gradient: that is plain data parallelism. ZeRO-1 "
                "reduce-scatters, so each rank receives only the N/d it updates (half the traffic of an "
                "all-reduce per rank), and all-gathers the updated shards")
    if ops - {"reduce_scatter", "all_gather"}:
        return f"it ran {describe_ops([e for step in o['events'] for e in step])}: {ALGORITHM}"
    if not _tensor_close(o["new"], o["want"]):
        if _tensor_close(o["new"], o["summed"]):
            return ("the step used the *sum* of the d gradients: the reduce-scatter adds them; divide your shard "
                    "by d (with eps ~ |grad| Adam sees the difference)")
        if _tensor_close(o["new"], o["fresh"]):
            return ("the second step forgot the first one's Adam moments: keep your shard's optimizer (or its "
                    "exp_avg / exp_avg_sq) in `state` between calls")
        return ("the params differ from two single-process Adam steps on the averaged gradient: rank r owns "
                "elements [r·N/d, (r+1)·N/d) of the padded flat buffer, updates exactly those, and the "
                "all-gather puts the shards back in rank order")
    limit = 3 * n_pad // d + 8          # fp32 main shard + two moments (+ a few scalars)
    if o["state"] is not None and o["state"] > limit:
        return (f"your `state` holds {o['state']} elements; ZeRO-1's point is Adam state for your shard only: "
                f"at most the shard ({n_pad // d}) and its two moments, {3 * n_pad // d} elements")
    for step in o["events"]:
        counts = {op: [e.numel for e in step if e.op == op] for op in ("reduce_scatter", "all_gather")}
        if counts != {"reduce_scatter": [n_pad], "all_gather": [n_pad]}:
            return (f"per step it ran {describe_ops(step)}: one reduce-scatter and one all-gather of the padded "
                    f"buffer ({NUMEL} elements padded to {n_pad} for d = {d})")
        if any(e.kind != "world" or e.group_size != d for e in step):
            return "run both collectives on dp_group (here the whole world)"
    return None


def check_zero1_step(fn, world_sizes=(2, 4), timeout: float = 30) -> bool:
    """``fn(params, grads, dp_group, state) -> new params``: one ZeRO-1 step (Adam, ``ADAM``), called twice
    with the same ``state`` dict, on 2 and 4 real ranks; against two single-process Adam steps."""
    if is_course_answer(fn):
        return False
    _adam_steps([torch.zeros(2)], [[torch.zeros(2)]])   # import torch.optim's machinery once, not per rank
    for d in world_sizes:
        try:
            res = launch_checked(_rank_zero1, world_size=d, timeout=timeout, fn=fn)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                return not_attempted("zero1_step")
            print(f"✗ with {d} DP ranks, rank {err.rank} raised {raised_line(err)}")
            if any(w in err.traceback.lower() for w in ("size", "shape", "divisible", "numel")):
                print(f"  hint: {NUMEL} elements do not split into {d} equal shards: pad the flat buffers with "
                      f"zeros to {padded(NUMEL, d)} (a multiple of d) before the reduce-scatter")
            return False
        except LaunchTimeout:
            print(f"✗ with {d} DP ranks the ranks waited for each other: every rank must run the same "
                  f"collectives in the same order")
            return False
        for o in res:
            hint = _zero1_hint(o)
            if hint:
                print(f"✗ {d} DP ranks, rank {o['rank']}\n  hint: {hint}")
                return False
    sent = {d: padded(NUMEL, d) * (d - 1) // d for d in world_sizes}
    print(f"✓ zero1_step equals two single-process Adam steps on the averaged gradient for "
          f"{' and '.join(map(str, world_sizes))} DP ranks, with Adam state for 1/d of the params, one "
          f"reduce-scatter and one all-gather of the padded buffer per step (each sends N(d-1)/d = "
          f"{', '.join(f'{v} (d={k})' for k, v in sent.items())} elements per rank)")
    return True


# ------------------------------------------------------------------ (b) bytes per rank

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


# ------------------------------------------------------------------ (c) what a ds_config shards

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
