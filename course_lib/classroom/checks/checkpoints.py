"""Lab 09's exercises: the sharded state dict of a TP layer, the read plan of a resharding load, the review answers.

Exercise 1, :func:`check_sharded_state_dict`
    ``fn(mlp, tp_rank, tp_size) -> {name: (local tensor, global shape, global offsets)}`` for the
    course's ``ParallelMLP`` (``linear_fc1`` column-parallel, ``linear_fc2`` row-parallel): Megatron's
    ``sharded_state_dict`` in miniature. Proven on 4 real ranks by what they wrote and read, in one launch,
    for the lab's MLP (hidden 6, ffn 8: TP2 x DP2 -> TP4, the case the notebook prints) and for one drawn
    per run (:func:`drawn_mlp_case`: other sizes, other TP sizes for the save and the reload):
    ``torch.distributed.checkpoint`` saves the pieces under TP2 x DP2 *at the offsets fn gives*
    (:mod:`course_lib.training.dcp_io` writes any offsets, so a wrong one lands where it says), the ``.metadata``
    is read back (each tensor's chunks and the file that holds each) and the files' values are
    compared with the master MLP's; then every rank rebuilds the MLP under TP4, asks fn for its new
    pieces and loads them: what each rank read (file and region, recorded by the storage reader) must be
    exactly its part, and the values the master's. The course's own ``sharded_state_dict`` and
    ``global_spec`` are refused; a failing hint shows the student's spec and the rule it breaks, never the
    right spec.

Exercise 2, :func:`check_read_plan`
    ``fn(saved, want) -> [(chunk index, start in the chunk, start in the piece, lengths)]``: the reads
    that fill one rank's new piece ``want = (offsets, sizes)`` from a checkpoint's chunks ``saved =
    [(offsets, sizes)]`` -- what DCP's load planner computes when the layout changed. The checker
    executes the plan on every rank of six reshardings (TP2->TP4, TP4->TP2, TP2->one process, uneven
    chunks, 2-d blocks, a replicated bias) against chunks that can only be read through it, and counts
    what each rank read: every element of the piece read exactly once, nothing outside the chunks.
    torch's own overlap planner and the course's ``PieceLoadPlanner`` are refused.

Exercise 3, :func:`check_checkpoint_answers`
    the student's answers to the lab's review questions; checked only as written (a few sentences each,
    ``resume`` citing a number from the runs), never by the words they use: the instructor reads them. Then
    :func:`print_course_answers`.

Every checker prints one verdict and never raises; the stub prints "not attempted yet".
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp  # imported here once: forked ranks inherit it (seconds each otherwise)
from torch.distributed.checkpoint import resharding
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted
from course_lib.classroom.checks.conclusions import cited_numbers, measured_numbers
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.student_process import run_on_rank
from course_lib.classroom.checks.tamper_guard import course_code_hint, run_student
from course_lib.classroom.checks.verdicts import drawn_rng, safe_repr, whole_numbers
from course_lib.training.dcp_io import RecordingReader, SafeFileSystemReader, load_pieces, save_pieces, written_chunks

__all__ = ["check_sharded_state_dict", "check_read_plan", "check_checkpoint_answers", "print_course_answers",
           "MLP_SIZES", "RESHARDINGS", "REVIEW_QUESTIONS"]

MLP_SIZES = {"hidden_size": 6, "ffn_hidden_size": 8}   # fc1 [8, 6], fc2 [6, 8]: shapes that show a transpose
SAVE_TP, LOAD_TP, WORLD = 2, 4, 4                       # saved under TP2 x DP2, reloaded under TP4, on 4 ranks
LAB_CASE = (MLP_SIZES, SAVE_TP, LOAD_TP)
_FAILED = (Exception, CheckpointException)              # DCP gathers every rank's failure into a BaseException


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:200]


def _region(start, lengths) -> str:
    return "[" + ", ".join(f"{a}:{a + n}" for a, n in zip(start, lengths)) + "]"


# ------------------------------------------------------------------ Exercise 1: what a TP layer writes


def drawn_mlp_case(rng) -> tuple:
    """``(sizes, save TP, reload TP)`` drawn for this run: an MLP other than the lab's (ffn a multiple of 4, so every
    TP size of 4 ranks divides it), saved under one of TP 1, 2, 4 and reloaded under another."""
    while True:
        sizes = {"hidden_size": rng.randint(3, 10), "ffn_hidden_size": 4 * rng.randint(1, 4)}
        if sizes != MLP_SIZES:
            return (sizes, *rng.sample((1, 2, 4), 2))


def _mlp_parts(sizes: dict = MLP_SIZES):
    from course_lib.tensor_parallel import DenseMLP, ParallelMLP, TransformerConfig, copy_dense_to_parallel

    config = TransformerConfig(num_attention_heads=1, **sizes)
    torch.manual_seed(0)               # the same master MLP on every rank
    dense = DenseMLP(config)
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(torch.randn(p.shape))      # biases too: every value tells where it came from
    return config, dense, ParallelMLP, copy_dense_to_parallel


def _entries(value, mlp) -> tuple[dict | None, str | None]:
    """The student's dict as ``{name: (tensor, shape tuple, offsets tuple)}``, or a problem in words."""
    params = dict(mlp.named_parameters())
    if not isinstance(value, dict):
        return None, f"returned {safe_repr(value)}: return a dict {{parameter name: (tensor, global shape, offsets)}}"
    missing, extra = sorted(set(params) - set(value)), sorted(set(value) - set(params))
    if missing or extra:
        return None, (f"its keys should be the MLP's parameter names {sorted(params)}"
                      + (f"; missing {missing}" if missing else "") + (f"; not parameters: {extra}" if extra else ""))
    out = {}
    for name, p in params.items():
        entry = value[name]
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            return None, f"{name}: give a (tensor, global shape, offsets) triple, got {safe_repr(entry)}"
        local, shape, offsets = entry[0], whole_numbers(entry[1]), whole_numbers(entry[2])
        if not isinstance(local, torch.Tensor):
            return None, f"{name}: the first item is this rank's tensor (the parameter), got {safe_repr(local)}"
        if tuple(local.shape) != tuple(p.shape):
            return None, (f"{name}: the tensor has shape {list(local.shape)} but this rank's parameter has "
                          f"{list(p.shape)}: give the rank's own shard (the parameter itself), not the full tensor")
        if shape is None or offsets is None or len(shape) != p.dim() or len(offsets) != p.dim():
            return None, (f"{name}: the global shape and the offsets are {p.dim()} whole numbers each (one per "
                          f"dimension), got {safe_repr(entry[1])} and {safe_repr(entry[2])}")
        out[name] = (local.detach(), tuple(shape), tuple(offsets))
    return out, None


def _pieces_as_data(mlp, value) -> dict:
    """In the student process, after the call: the returned dict as plain data (``value``) and, per parameter
    name, whether its entry's tensor *is* that parameter (``own``: the same storage, offset and strides), which
    a copy that travels back could not show."""
    params, own = dict(mlp.named_parameters()), {}
    if isinstance(value, dict):
        for name, entry in value.items():
            local = entry[0] if isinstance(entry, (tuple, list)) and entry else None
            p = params.get(name) if isinstance(name, str) else None
            own[name] = bool(isinstance(local, torch.Tensor) and p is not None and local.shape == p.shape
                             and local.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                             and local.storage_offset() == p.storage_offset() and local.stride() == p.stride())
    return {"value": value, "own": own}


def _own_parameters(returned: dict, mlp):
    """The student's dict with each tensor that was the parameter itself in the student process replaced by this
    rank's parameter (what DCP then fills in place)."""
    value, params = returned.get("value"), dict(mlp.named_parameters())
    if not isinstance(value, dict):
        return value
    return {name: (params[name], *entry[1:]) if returned["own"].get(name) else entry for name, entry in value.items()}


def _anyone(flag: bool) -> bool:
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _stage(fn, mlp, tp: int, tp_rank: int, action, report: dict) -> bool:
    """Ask ``fn`` for this rank's pieces and run ``action(pieces)`` (a DCP save or load, each piece under
    its parameter's name as key) on every rank;
    ``report`` receives the specs, a problem, a DCP error. False (on every rank) when a rank failed."""
    from course_lib.training.checkpointing import global_spec

    report["tp_rank"] = tp_rank
    report["want"] = {n: global_spec(p, p, tp, tp_rank) for n, p in mlp.named_parameters()}
    report["local"] = {n: tuple(p.shape) for n, p in mlp.named_parameters()}
    run = run_on_rank(fn, mlp, tp_rank, tp, references=references_for("mlp_sharded_state_dict"),
                      summarize=functools.partial(_pieces_as_data, mlp))
    pieces, problem = (None, "todo") if run.todo else (None, run.problem())
    report["course_code"] = run.course_code
    if problem is None:
        pieces, problem = _entries(_own_parameters(run.value, mlp), mlp)
    report["problem"] = problem
    if pieces is not None:
        report["specs"] = {n: (shape, offsets) for n, (_, shape, offsets) in pieces.items()}
        report["same_values"] = {n: bool(torch.equal(pieces[n][0], p.detach())) for n, p in mlp.named_parameters()}
    if _anyone(problem is not None):
        return False
    try:
        action({n: (local, n, shape, offsets) for n, (local, shape, offsets) in pieces.items()})  # sharded_io's
    except _FAILED as exc:
        report["error"] = _last_line(exc)
    return not _anyone("error" in report)


def _tp_group(tp: int):
    """This rank's TP group and TP rank when the :data:`WORLD` ranks run TP ``tp`` x DP (every rank makes every group)."""
    from course_lib.topology import RankGrid

    rank, grid = dist.get_rank(), RankGrid(WORLD, tp=tp)
    groups = {tuple(g): dist.new_group(g) for g in grid.groups("tp")}
    return groups[tuple(grid.group_of(rank, "tp"))], grid.coords(rank)["tp"]


def _sharded_state_dict_rank(fn, cases: list) -> list:
    """On each rank, per ``(sizes, save TP, reload TP, folder)`` of ``cases``: the MLP saved under the first layout
    and reloaded under the second with ``fn``'s pieces; stops (on every rank) after a case that failed."""
    outs = []
    for sizes, save_tp, load_tp, root in cases:
        config, dense, ParallelMLP, copy_dense_to_parallel = _mlp_parts(sizes)
        out = {"save": {}, "load": {}}
        outs.append(out)
        group, tp_rank = _tp_group(save_tp)
        mlp = copy_dense_to_parallel(dense, ParallelMLP(config, group), group)

        def save(pieces):
            save_pieces({}, pieces, root)

        if not _stage(fn, mlp, save_tp, tp_rank, save, out["save"]):
            break
        group, tp_rank = _tp_group(load_tp)
        mlp = copy_dense_to_parallel(dense, ParallelMLP(config, group), group)
        want = {n: p.detach().clone() for n, p in mlp.named_parameters()}
        with torch.no_grad():
            for p in mlp.parameters():
                p.fill_(float("nan"))
        reader = RecordingReader(root)
        filled: dict = {}

        def load(pieces):
            load_pieces({}, pieces, root, reader)
            filled.update({k: v[0] for k, v in pieces.items()})

        if not _stage(fn, mlp, load_tp, tp_rank, load, out["load"]):
            break
        out["reads"] = reader.reads
        out["loaded"] = {n: bool(torch.equal(filled[n], want[n])) for n in want}
        out["in_module"] = all(torch.equal(p.detach(), want[n]) for n, p in mlp.named_parameters())
    return outs


def _layer_rule(name: str) -> str:
    if "linear_fc1" in name:
        return "linear_fc1 is column-parallel: its weight [ffn/t, h] and bias [ffn/t] are cut along dim 0"
    return "linear_fc2 is row-parallel: its weight [h, ffn/t] is cut along dim 1, its bias [h] is whole on every rank"


def spec_hint(name: str, local, got, want, tp: int, tp_rank: int) -> str | None:
    """The mistake in one rank's ``(global shape, offsets)`` of ``name`` (``got``) against the right one
    (``want``), in words; None when right. ``local``: the rank's own shape."""
    (got_shape, got_off), (want_shape, want_off) = got, want
    if (tuple(got_shape), tuple(got_off)) == (tuple(want_shape), tuple(want_off)):
        return None
    split = [d for d in range(len(local)) if want_shape[d] != local[d]]
    if not split:
        return (f"{name} is replicated on every TP rank (each holds the whole {list(local)}): its global shape is its "
                f"own, offsets all 0 -- DCP then writes it once; you gave {list(got_shape)} at {list(got_off)} "
                f"({_layer_rule(name)})")
    dim = split[0]
    if tuple(got_shape) == tuple(local):
        return (f"{name}: you gave the shard's own shape {list(got_shape)}; the global shape is the whole tensor's "
                f"-- TP={tp} shards like this rank's {list(local)} put together ({_layer_rule(name)})")
    if tuple(got_shape) != tuple(want_shape):
        return (f"{name}: global shape {list(got_shape)} under TP={tp} is not the whole tensor's: the TP shards "
                f"put together along the split dimension ({_layer_rule(name)})")
    if not any(got_off):
        return (f"{name}: TP rank {tp_rank} gave offsets {list(got_off)}, as if every shard started at the origin; "
                f"rank r's shard starts at r x the shard's size along the split dimension")
    moved = [d for d in range(len(local)) if got_off[d] != 0]
    if moved != [dim]:
        return f"{name}: TP rank {tp_rank}'s offsets {list(got_off)} move along the wrong dimension ({_layer_rule(name)})"
    return (f"{name}: TP rank {tp_rank} of {tp} starts at {list(got_off)}: the offset along the split dimension "
            f"is tp_rank x the shard's size there ({_layer_rule(name)})")


def _stage_problem(results: list, stage: str, tp: int) -> str | None:
    """The first wrong thing a rank of ``stage`` reported, in words."""
    where = {"save": f"under TP{tp} (the save)", "load": f"under TP{tp} (the reload)"}[stage]
    for rank, res in enumerate(results):
        rep = res[stage]
        if rep.get("problem"):
            return f"{where}, rank {rank}: {rep['problem']}"
        for name, spec in rep.get("specs", {}).items():
            hint = spec_hint(name, rep["local"][name], spec, rep["want"][name], tp, rep["tp_rank"])
            if hint:
                return f"{where}, rank {rank}: {hint}"
        if stage == "save" and not all(rep.get("same_values", {}).values()):
            name = next(n for n, same in rep["same_values"].items() if not same)
            return f"{where}, rank {rank}: {name}: the tensor holds other values than this rank's parameter"
    for rank, res in enumerate(results):
        if res[stage].get("error"):
            return f"{where}: torch.distributed.checkpoint refused it: {res[stage]['error']}"
    return None


def _files_hold_the_master(root: Path, sizes: dict) -> str | None:
    """Read every tensor whole in this process; compare with the master MLP of ``sizes``."""
    import warnings

    _, dense, _, _ = _mlp_parts(sizes)
    full = {n: torch.full_like(p, float("nan")) for n, p in dense.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # "assuming the intent is to load in a single process"
        dcp.load(full, checkpoint_id=str(root), no_dist=True)
    for n, p in dense.named_parameters():
        if not torch.equal(full[n], p.detach()):
            return f"the files' {n} is not the master MLP's: a piece was written with the wrong values"
    return None


@exercise("mlp_sharded_state_dict")
def check_sharded_state_dict(fn) -> bool:
    """Exercise 1 (see the module doc): ``fn(mlp, tp_rank, tp_size)`` on 4 ranks, for :data:`LAB_CASE` (saved under
    TP2 x DP2, reloaded under TP4) and a case drawn for this run, each in a temporary folder."""
    import tempfile

    from course_lib.classroom.checks.wire import launch_checked
    from course_lib.launch import RankError

    name = getattr(fn, "__name__", "your function")
    if is_course_answer(fn):
        return False
    with tempfile.TemporaryDirectory(prefix="course_ex1_") as root:
        cases = [(*case, str(Path(root) / f"case{i}")) for i, case in enumerate([LAB_CASE, drawn_mlp_case(drawn_rng())])]
        try:
            # launch_checked: the ranks' calls and what they put on the wire are the verdict's evidence
            results = launch_checked(_sharded_state_dict_rank, WORLD, timeout=120, fn=fn, cases=cases)
        except RankError as err:
            print(f"✗ {name}: a rank failed outside your function ({err.exc_type}); re-run the cell")
            return False
        if any(case[stage].get("problem") == "todo" for r in results for case in r for stage in ("save", "load")):
            return not_attempted(name)
        verdict = _sharded_state_dict_verdict(name, results, cases)
    print(verdict)
    return verdict.startswith("✓")


def _sharded_state_dict_verdict(name: str, results: list, cases: list) -> str:
    """``results[rank][case]``: what each rank reported per case (a failed case is the last one)."""
    reports = [case[stage] for r in results for case in r for stage in ("save", "load")]
    used = next((rep["course_code"][0] for rep in reports if rep.get("course_code")), None)
    if used:
        return f"✗ {course_code_hint(used)}"
    for c, (sizes, save_tp, load_tp, root) in enumerate(cases):
        of_case = [r[c] for r in results]
        what = "" if c == 0 else (f" (an MLP of hidden {sizes['hidden_size']}, ffn {sizes['ffn_hidden_size']} drawn "
                                  f"for this run)")
        for stage, tp in (("save", save_tp), ("load", load_tp)):
            problem = _stage_problem(of_case, stage, tp)
            if problem:
                return f"✗ {name}{what} {problem}"
        problem = _files_hold_the_master(Path(root), sizes)
        if problem:
            return f"✗ {name}{what}: {problem}"
        for rank, res in enumerate(of_case):
            bad = [n for n, ok in res["loaded"].items() if not ok]
            if bad:
                return f"✗ {name}{what}: under TP{load_tp} rank {rank} read wrong values into {bad[0]}"
        if not all(r["in_module"] for r in of_case):
            return (f"✗ {name}: your tensors were filled, not the MLP's parameters: give the parameters themselves "
                    f"(as Megatron's sharded_state_dict does), so that a load lands in the model")
    lab = [r[0] for r in results]
    written = written_chunks(SafeFileSystemReader(cases[0][3]).read_metadata())
    pieces = sum(len(r["save"]["specs"]) for r in lab)
    return (f"✓ {name}: under TP2 x DP2 the {WORLD} ranks' {pieces} pieces were written as "
            f"{sum(len(v) for v in written.values())} chunks (a replica's equal piece once), and under TP4 every "
            f"rank read only its quarter; so it did for an MLP and TP sizes drawn for this run\n"
            + _reads_table(lab, written))


def _reads_table(results: list, written: dict) -> str:
    keys = ("linear_fc1.weight", "linear_fc2.weight")
    lines = ["  saved (file: global region)   " + "   ".join(f"{k:<34}" for k in keys)]
    files = sorted({f for k in keys for f, _, _ in written[k]})
    for f in files:
        cells = [", ".join(_region(o, z) for g, o, z in written[k] if g == f) or "-" for k in keys]
        lines.append(f"    {f:<28}" + "   ".join(f"{c:<34}" for c in cells))
    lines.append("  TP4 rank reads (global region <- file)")
    for rank, res in enumerate(results):
        cells = [", ".join(f"{_region(s, n)} <- {f}" for key, f, s, n in res["reads"] if key == k) for k in keys]
        lines.append(f"    rank {rank:<23}" + "   ".join(f"{c:<34}" for c in cells))
    return "\n".join(lines)


# ------------------------------------------------------------------ Exercise 2: the read plan


def _tp_cut(shape, dim: int, parts: int) -> list[tuple]:
    step = shape[dim] // parts
    return [(tuple(r * step if d == dim else 0 for d in range(len(shape))),
             tuple(step if d == dim else shape[d] for d in range(len(shape)))) for r in range(parts)]


RESHARDINGS = [  # (name, global shape, the checkpoint's chunks, the new layout's pieces: one per rank)
    ("linear_fc1.weight [8, 6], TP2 -> TP4", (8, 6), _tp_cut((8, 6), 0, 2), _tp_cut((8, 6), 0, 4)),
    ("linear_fc2.weight [6, 8], TP4 -> TP2", (6, 8), _tp_cut((6, 8), 1, 4), _tp_cut((6, 8), 1, 2)),
    ("linear_fc1.weight [8, 6], TP2 -> one process", (8, 6), _tp_cut((8, 6), 0, 2), [((0, 0), (8, 6))]),
    ("a [10] tensor, uneven chunks 4+3+3 -> 5+5", (10,), [((0,), (4,)), ((4,), (3,)), ((7,), (3,))],
     [((0,), (5,)), ((5,), (5,))]),
    ("a [6, 4] tensor, 2 x 2 blocks -> 3 row strips", (6, 4),
     [((0, 0), (3, 2)), ((0, 2), (3, 2)), ((3, 0), (3, 2)), ((3, 2), (3, 2))], _tp_cut((6, 4), 0, 3)),
    ("linear_fc2.bias [6], replicated, saved once -> 2 ranks", (6,), [((0,), (6,))], [((0,), (6,))] * 2),
]


def _grid_cut(shape: tuple, cuts: list) -> list:
    """The blocks of ``shape`` cut at ``cuts`` (per dimension, the sorted inner cut points): (offsets, sizes)."""
    edges = [[0, *c, n] for c, n in zip(cuts, shape)]
    blocks = [((), ())]
    for e in edges:
        blocks = [(o + (a,), z + (b - a,)) for o, z in blocks for a, b in zip(e, e[1:])]
    return blocks


def drawn_reshardings(rng, count: int = 2) -> list:
    """``count`` reshardings drawn from ``rng`` (an ``os.urandom``-seeded ``random.Random``): a 1-d or 2-d
    tensor saved in uneven blocks, read back in another uneven layout -- no table of fixed cases answers them."""
    cases = []
    for _ in range(count):
        shape = tuple(rng.randint(5, 12) for _ in range(rng.choice((1, 2))))

        def cuts():
            return [sorted(rng.sample(range(1, n), rng.randint(1, min(3, n - 1)))) for n in shape]

        saved, pieces = _grid_cut(shape, cuts()), _grid_cut(shape, cuts())
        cases.append((f"a random {list(shape)} tensor, {len(saved)} uneven chunks -> {len(pieces)} pieces", shape,
                      saved, pieces))
    return cases


_RELATIVE = ("a start in the {where} is relative to the {where} (the overlap's global start - the {where}'s "
             "offsets), and a length is the overlap's end - its start (the end itself excluded)")


def _plan_items(plan, saved, want) -> tuple[list | None, str | None]:
    """The plan as ``[(chunk index, chunk start, piece start, lengths)]`` of ints, bounds checked."""
    if not isinstance(plan, (list, tuple)):
        return None, f"returned {safe_repr(plan)}: return a list of (chunk index, chunk start, piece start, lengths)"
    ndim, items = len(want[1]), []
    for k, item in enumerate(plan):
        if not isinstance(item, (list, tuple)) or len(item) != 4:
            return None, f"item {k} is {safe_repr(item)}: each item is (chunk index, chunk start, piece start, lengths)"
        index = whole_numbers([item[0]])
        starts = [whole_numbers(item[i]) for i in (1, 2, 3)]
        if index is None or any(s is None or len(s) != ndim for s in starts):
            return None, (f"item {k} is {safe_repr(item)}: the chunk index is a whole number, the three others "
                          f"{ndim} whole numbers each (one per dimension)")
        i, (cs, ps, n) = index[0], starts
        if not 0 <= i < len(saved):
            return None, f"item {k} names chunk {i}; there are {len(saved)} (0 to {len(saved) - 1})"
        if any(x < 0 for x in cs + ps + n):
            return None, f"item {k} has a negative start or length: {safe_repr(item)}"
        size = saved[i][1]
        past = next((d for d, (a, b, c) in enumerate(zip(cs, n, size)) if a + b > c), None)
        if past is not None:
            return None, (f"item {k} reads {_region(cs, n)} of chunk {i}, which has shape {list(size)}: it runs past "
                          f"the chunk's end along dimension {past} -- " + _RELATIVE.format(where="chunk"))
        past = next((d for d, (a, b, c) in enumerate(zip(ps, n, want[1])) if a + b > c), None)
        if past is not None:
            if tuple(n) == tuple(size):
                return None, (f"item {k} copies all of chunk {i} ({list(size)}) into a piece of shape {list(want[1])}: "
                              f"read only the part of the chunk that overlaps the piece")
            return None, (f"item {k} writes {_region(ps, n)} of a piece of shape {list(want[1])}: it runs past the "
                          f"piece's end along dimension {past} -- " + _RELATIVE.format(where="piece"))
        items.append((i, tuple(cs), tuple(ps), tuple(n)))
    return items, None


def _run_plan(items, saved, want, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Execute ``items``: the piece, how often each element was written, elements read per chunk."""
    piece = torch.full(want[1], float("nan"), dtype=torch.float64)
    writes = torch.zeros(want[1], dtype=torch.int64)
    read = [0] * len(saved)
    chunks = [full[tuple(slice(o, o + z) for o, z in zip(*c))] for c in saved]
    for i, cs, ps, n in items:
        src = tuple(slice(a, a + b) for a, b in zip(cs, n))
        dst = tuple(slice(a, a + b) for a, b in zip(ps, n))
        piece[dst] = chunks[i][src]
        writes[dst] += 1
        read[i] += math.prod(n)
    return piece, writes, read


def _global_index(flat: int, shape) -> tuple:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def _piece_problem(case: str, rank: int, saved, want, full, piece, writes) -> str | None:
    where = f"{case}, rank {rank} (piece {_region(*want)})"
    holes = (writes == 0).nonzero()
    if len(holes):
        first = tuple(int(x) for x in holes[0])
        at = tuple(a + b for a, b in zip(first, want[0]))
        chunk = next(i for i, (o, z) in enumerate(saved) if all(o[d] <= at[d] < o[d] + z[d] for d in range(len(at))))
        return (f"{where}: {int(holes.shape[0])} of its elements were never read, the first at global {list(at)}, "
                f"which chunk {chunk} {_region(*saved[chunk])} holds: read the overlap of every chunk that meets the "
                f"piece (per dimension: start = max of the starts, end = min of the ends)")
    twice = (writes > 1).nonzero()
    if len(twice):
        return (f"{where}: {int(twice.shape[0])} elements were read more than once: read each overlap once "
                f"(the chunks do not overlap each other)")
    expect = full[tuple(slice(o, o + z) for o, z in zip(*want))]
    wrong = (piece != expect).nonzero()
    if len(wrong):
        at = tuple(int(x) for x in wrong[0])
        got = _global_index(int(piece[at].item()), full.shape)
        return (f"{where}: its element {list(at)} holds the global element {list(got)}, not "
                f"{[a + b for a, b in zip(at, want[0])]}: the start in the chunk is the overlap's start minus the "
                f"chunk's offsets, the start in the piece the overlap's start minus the piece's offsets")
    return None


def _torch_planners():
    return (create_read_items_for_chunk_list, resharding._shards_get_overlap_region_wrt_saved_tensor,
            resharding._check_shard_metadata_pair_overlap)


@exercise("read_plan")
def check_read_plan(fn) -> bool:
    """Exercise 2 (see the module doc): ``fn(saved, want)`` on every rank of :data:`RESHARDINGS`."""
    name = getattr(fn, "__name__", "your function")
    if is_course_answer(fn):
        return False
    shown = None
    for case, shape, saved, pieces in RESHARDINGS + drawn_reshardings(drawn_rng()):
        full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
        for rank, want in enumerate(pieces):
            run = run_student(fn, [tuple(c) for c in saved], tuple(want),
                              references=(*references_for("read_plan"), *_torch_planners()))
            if run.todo:
                return not_attempted(name)
            if run.course_code:
                used = run.course_code[0]
                print("✗ " + (course_code_hint(used) if used.startswith("course_lib") else
                              f"{name} runs torch's own {used}: the exercise is to compute the overlaps "
                              f"yourself (reading it is fine)"))
                return False
            if run.problem():
                print(f"✗ {name} ({case}, rank {rank}): {run.problem()}")
                return False
            items, problem = _plan_items(run.value, saved, want)
            if problem:
                print(f"✗ {name} ({case}, rank {rank}): {problem}")
                return False
            piece, writes, read = _run_plan(items, saved, want, full)
            problem = _piece_problem(case, rank, saved, want, full, piece, writes)
            if problem:
                print(f"✗ {name}: {problem}")
                return False
            if shown is None and rank == 1:
                shown = (case, rank, want, [(i, _region(tuple(a + b for a, b in zip(saved[i][0], cs)), n), _region(ps, n))
                                            for i, cs, ps, n in items])
    case, rank, want, reads = shown
    print(f"✓ {name} fills every rank's piece in {len(RESHARDINGS)} reshardings (TP2->TP4, TP4->TP2, TP2->one "
          f"process, uneven chunks, 2-d blocks, a replicated bias) and 2 drawn for this run, reading each element "
          f"it needs exactly once")
    print(f"  e.g. {case}, rank {rank} (piece {_region(*want)}): "
          + "; ".join(f"chunk {i} global {g} -> piece {p}" for i, g, p in reads))
    return True


# ------------------------------------------------------------------ Exercise 3: review questions

REVIEW_QUESTIONS = {
    "resume": "what a checkpoint must hold, besides the weights, for iterations 4-6 to repeat the straight run's "
              "losses exactly (cite the losses)",
    "reshard": "why the TP4 and one-process runs could load the TP2 x PP2 x DP2 checkpoint, and the legacy one "
               "could not",
    "crash": "after the save killed at iteration 4, which file told the next run what to load, and why the "
             "half-written folder was harmless",
}


def _answer_problem(key: str, text, numbers) -> str | None:
    if not isinstance(text, str) or len(text.split()) < 8 or text.strip().strip(".…").upper() in ("", "TODO"):
        return f"{key!r}: answer {REVIEW_QUESTIONS[key]} -- a few sentences (got {safe_repr(text, 40)})"
    if key == "resume" and not cited_numbers(text, numbers):
        return f"{key!r}: cite a loss or a size from this notebook's runs, as it was printed"
    return None


@exercise("my_answers_09")
def check_checkpoint_answers(fn, *sources) -> bool:
    """``fn() -> {"resume", "reshard", "crash": str}``: each answered in a few sentences, "resume" citing a number
    of ``sources`` (the runs' results). Checked only as written: what they say is the instructor's to read
    (``grade`` exports it), never judged by the words they use."""
    answers, problem = checked_call(fn, references=references_for("my_answers_09"))
    if problem == "todo":
        return not_attempted("my_answers")
    if problem is None and not isinstance(answers, dict):
        problem = f"returned {safe_repr(answers)}: return a dict with the keys {', '.join(REVIEW_QUESTIONS)}"
    numbers = measured_numbers(*sources)
    problems = [problem] if problem else [p for p in (_answer_problem(k, answers.get(k), numbers)
                                                      for k in REVIEW_QUESTIONS) if p]
    if problems:
        print("✗ my_answers: " + "\n  also ".join(problems))
        return False
    print(f"✓ your answers are recorded for your instructor, who reads them (not graded here; resume cites "
          f"{', '.join(cited_numbers(answers['resume'], numbers)[:3])}); now read the course's")
    return True


COURSE_ANSWERS = {
    "resume": "Everything the next step reads: the weights, Adam's two moments and its step count, the "
              "learning-rate scheduler's step, the loss scaler, every random generator (Python, numpy, torch, CUDA) "
              "and the data position (consumed samples = iteration x global batch). Drop one and iteration 5 "
              "differs: --no-load-optim keeps iteration 4's loss and changes the next ones.",
    "reshard": "torch_dist stores each tensor under its global name and shape, every chunk with its global offsets; "
               "a new layout asks for its own pieces and reads the overlapping parts of the saved chunks, so any "
               "TP x PP x DP that divides the shapes loads it. The legacy format stores mp_rank_TT_PPP files of local "
               "shapes with no offsets: only the layout that wrote them can read them.",
    "crash": "latest_checkpointed_iteration.txt, written last and atomically after every rank finished and the "
             "folder was renamed from .iter_XXXXXXX.incomplete (the course's step; Megatron writes iter_XXXXXXX "
             "directly and marks it complete with metadata.json, written last): it still named iteration 2, so the "
             "next run loaded iteration 2 and ignored the incomplete folder.",
}


def print_course_answers(unlocked: bool) -> None:
    """The course's answers to :data:`REVIEW_QUESTIONS`, once the student's pass (``unlocked``)."""
    if not unlocked:
        print("(the course's answers appear here once yours above pass the check)")
        return
    for key, text in COURSE_ANSWERS.items():
        print(f"{key}: {text}")
