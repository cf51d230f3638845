"""Checkers for the collectives built by hand (Lab 00, exercises 1-2), proven by what ran on real ranks.

Every rank draws its inputs from ``os.urandom`` (no rank can rebuild another's, so the sum needs
real messages), and the checker computes the truth with its own all-reduce after the student's call.

* ``check_ring_all_reduce(fn)``: ``fn(x) -> sum over ranks``, built from point-to-point
  messages only. Runs on 2, 3 and 4 ranks whose process group refuses collectives
  (:func:`course_lib.classroom.checks.verdicts.point_to_point_only`: however they are reached) and
  records every send: a ring sends to one neighbour only, ``2(W-1)·N`` elements over all
  ranks (``2(W-1)/W·N`` each) -- a "ring" that forwards whole tensors gets the right sum
  with ``(W-1)·N`` per rank and is rejected. Wrong sums are matched against simulated
  buggy rings, so each bug gets its own hint (an all-gather bug is not told to fix its
  reduce-scatter).
* ``check_all_reduce_from_halves(fn)``: all-reduce written as one reduce-scatter and one
  all-gather; the recorded collectives must be exactly those two, the reduce-scatter carrying the
  rank's input and the all-gather the summed shard it received.

:func:`launch_trials`, :func:`student_trial` and :func:`course_code_used` run such trials on checked
ranks; :mod:`course_lib.classroom.checks.grad_sync` uses them too.

Each prints one verdict line ("not attempted yet" while the stub raises
NotImplementedError) and, when wrong, the most specific hint it can find.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from course_lib.classroom.checks import not_attempted, plain
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.student_process import run_on_rank
from course_lib.classroom.checks.tamper_guard import LibraryPatched, course_code_hint
from course_lib.classroom.checks.verdicts import (collectives as collective_events, describe_ops, drawn_rng,
                                                  launch_checked, point_to_point_only, refused_collective, safe_repr,
                                                  secret_generator, wire_recorder)
from course_lib.launch import LaunchTimeout, RankError

WORLD_SIZES = (2, 3, 4)
NUMELS = (4, 12, 10, 1)  # multiples of W first, then not divisible, then fewer elements than ranks


def drawn_numels(rng) -> tuple:
    """This run's tensor sizes, in :data:`NUMELS`' four kinds: a multiple of every W in :data:`WORLD_SIZES`,
    another multiple, one that no W > 1 divides, and fewer elements than the largest W."""
    return 12 * rng.randint(1, 3), 12 * rng.randint(4, 6), 12 * rng.randint(1, 4) + rng.choice((1, 5, 7, 11)), \
        rng.randint(1, 3)
P2P_RULE = ("this exercise builds all-reduce from point-to-point messages only (dist.send/recv, isend/irecv, "
            "batch_isend_irecv); collectives are switched off in the process group itself")


# ------------------------------------------------------------------- trials on checked ranks


def _as_picklable(value):
    """A tensor as it is; anything else as its type and repr (it travels back from a rank)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return {"type": plain.type_name(value), "repr": safe_repr(value)}


def student_trial(fn, *args, references=()) -> dict:
    """Run the student's code for this rank in a student process of its own
    (:func:`~course_lib.classroom.checks.student_process.run_on_rank`), recording here every op it put on
    the wire and what it carried. An exception (a refused collective too) is raised again, so that the launch
    fails at once and names the first rank that failed."""
    with wire_recorder() as rec:
        run = run_on_rank(fn, *args, references=references)
    if run.error is not None:
        raise run.error
    if run.patched:
        raise LibraryPatched(run.problem())
    return dict(got=_as_picklable(run.value), course_code=run.course_code, events=rec.events, carried=rec.carried)


def launch_trials(rank_fn, world: int, timeout: float, name: str, **kwargs):
    """Launch ``rank_fn`` on checked ranks; (per-rank results, None) or (None, verdict already printed)."""
    try:
        return launch_checked(rank_fn, world, timeout=timeout, **kwargs), None
    except LaunchTimeout:
        print(f"✗ with {world} ranks the ranks waited for each other until the timeout ({timeout:g} s): a deadlock.\n"
              f"  hint: if every rank first calls a blocking dist.send, nobody is receiving. Use "
              f"dist.isend + dist.recv (then wait), batch_isend_irecv, or let even ranks send first; "
              f"and wait() for every request you start.")
        return None, False
    except RankError as err:
        if err.exc_type == "NotImplementedError":
            return None, not_attempted(name)
        print(f"✗ with {world} ranks, {_rank_failure(err)}")
        hint = _failure_hint(err)
        if hint:
            print(f"  hint: {hint}")
        return None, False


def _rank_failure(err: RankError) -> str:
    refusal = refused_collective(err.traceback)
    if refusal:
        return f"rank {err.rank} ran a collective: {refusal}"
    last = err.traceback.strip().splitlines()[-1] if err.traceback.strip() else err.exc_type
    if err.exc_type == "LibraryPatched":
        return f"rank {err.rank}'s function changed the library: {last.split(': ', 1)[-1]}"
    return f"rank {err.rank} failed: {last}"


def _failure_hint(err: RankError) -> Optional[str]:
    text = err.traceback
    if refused_collective(text):
        return ("collectives are refused however they are reached (dist.*, distributed_c10d, object "
                "collectives, gather/scatter, new groups); exchange chunks with your neighbours using send/recv")
    if any("doesn't match expected size" in out for out in err.outputs):
        return ("a message arrived into a receive buffer of another size (gloo then aborts the process): the "
                "chunk a rank receives must be the one its neighbour sends -- check the chunk indices (with N "
                "not a multiple of W the chunks differ in size)")
    if "must match the size of tensor" in text:
        return ("chunks differ in size when W does not divide N: combine a chunk only with the same-index chunk "
                "arriving from your neighbour")
    if "itself" in text:
        return "the right neighbour is (rank + 1) % W, the left one (rank - 1) % W"
    if "Connection closed" in text or "Timed out" in text or "Connection reset" in text:
        return "every send needs a matching recv on the neighbour in the same step"
    return None


def course_code_used(per_rank: list) -> bool:
    """Print the verdict when a trial ran the course's own implementation; True if printed."""
    for trials in per_rank:
        for t in trials:
            if t["course_code"]:
                print(f"✗ {course_code_hint(t['course_code'][0])}")
                return True
    return False


# ------------------------------------------------------------- exercise 1: the ring


def _secret_inputs(numels) -> list:
    """This rank's inputs, small whole numbers drawn from ``os.urandom`` (exact sums; no rank can rebuild another's)."""
    g = secret_generator()
    return [torch.randint(-9, 10, (numel,), generator=g).float() for numel in numels]


def _summed(x: torch.Tensor) -> torch.Tensor:
    """The checker's own all-reduce of ``x``, run after the student's call."""
    y = x.clone()
    dist.all_reduce(y)
    return y


def _rank_ring_trial(fn, numels):
    results = []
    for x in _secret_inputs(numels):
        with point_to_point_only(P2P_RULE):
            trial = student_trial(fn, x.clone(), references=references_for("my_ring_all_reduce"))
        results.append(dict(trial, numel=x.numel(), x=x, want=_summed(x)))
    return results


def simulate_ring(inputs: list, *, rs_send=lambda r, s, w: (r - s) % w, rs_recv=lambda r, s, w: (r - s - 1) % w,
                  rs_combine: str = "add", rs_steps: Optional[int] = None, ag_send=lambda r, s, w: (r + 1 - s) % w,
                  ag_recv=lambda r, s, w: (r - s) % w, ag_combine: str = "replace",
                  ag_steps: Optional[int] = None) -> Optional[list]:
    """Every rank's result of a ring all-reduce run in one process, with the given chunk rules.

    The defaults are the correct ring (:func:`course_lib.communication_patterns.ring_all_reduce`); the
    checker changes one rule at a time to reproduce a student's bug. ``*_combine``: "add",
    "replace" or "add_own" (add the chunk one *sent*). Returns None when the rules send a
    chunk into a slot of another size (such a program would fail before giving a result)."""
    w = len(inputs)
    chunks = [[c.clone() for c in torch.tensor_split(x, w)] for x in inputs]
    phases = (("rs", rs_send, rs_recv, rs_combine, w - 1 if rs_steps is None else rs_steps),
              ("ag", ag_send, ag_recv, ag_combine, w - 1 if ag_steps is None else ag_steps))
    for _, send, recv, combine, steps in phases:
        for s in range(steps):
            outgoing = [chunks[r][send(r, s, w)].clone() for r in range(w)]
            for r in range(w):
                slot, incoming = recv(r, s, w), outgoing[(r - 1) % w]
                own = outgoing[r]
                if chunks[r][slot].shape != incoming.shape:
                    return None
                if combine == "add":
                    chunks[r][slot] = chunks[r][slot] + incoming
                elif combine == "add_own":
                    chunks[r][slot] = chunks[r][slot] + own
                else:
                    chunks[r][slot] = incoming
    return [torch.cat(c) for c in chunks]


RING_BUGS: dict[str, tuple[dict, str]] = {
    "all-gather adds": (dict(ag_combine="add"),
                        "the reduce-scatter phase is right; in the all-gather phase *replace* your chunk with the "
                        "incoming one -- it is already the full sum, adding counts partial sums again"),
    "no all-gather": (dict(ag_steps=0),
                      "after the reduce-scatter phase each rank holds one finished chunk only: add the all-gather "
                      "phase, W-1 more steps that pass the finished chunks on"),
    "all-gather one step short": (dict(ag_steps=-1),
                                  "the all-gather phase needs W-1 steps: one is missing, so the last chunk to arrive "
                                  "is still a partial sum"),
    "all-gather sends the wrong chunk": (dict(ag_send=lambda r, s, w: (r - s) % w,
                                              ag_recv=lambda r, s, w: (r - s - 1) % w),
                                         "the reduce-scatter phase is right; in the all-gather phase rank r starts with "
                                         "the chunk it finished, (r + 1) % W: in step s send chunk (r + 1 - s) % W and "
                                         "replace chunk (r - s) % W with the incoming one"),
    "reduce-scatter one step short": (dict(rs_steps=-1),
                                      "the reduce-scatter phase needs W-1 steps for a chunk to collect all W "
                                      "contributions: one is missing"),
    "reduce-scatter replaces": (dict(rs_combine="replace"),
                                "in the reduce-scatter phase *add* the incoming chunk to your own (replacing it drops "
                                "your contribution)"),
}


def _bug_steps(spec: dict, world: int) -> dict:
    """Negative step counts in :data:`RING_BUGS` mean "W-1 minus that many"."""
    spec = dict(spec)
    for key in ("rs_steps", "ag_steps"):
        if key in spec and spec[key] < 0:
            spec[key] = max(0, world - 1 + spec[key])
    return spec


def _matching_bug(runs: dict) -> Optional[str]:
    """The hint of each simulated bug whose results equal the student's on every rank, for every
    tensor size and world size that ran (``runs``: world -> per-rank trials); None when none does.
    Several bugs give the same wrong sums on 2 ranks, few on 2, 3 and 4; when two still agree
    (replacing in the reduce-scatter phase, or sending the reduce-scatter's chunks again in the
    all-gather phase) both are named."""
    hints = [hint for spec, hint in RING_BUGS.values()
             if all(_bug_reproduces(spec, per_rank) for per_rank in runs.values())]
    if len(hints) > 1:
        return "two mistakes give exactly these sums -- either " + "; or ".join(hints)
    return hints[0] if hints else None


def _bug_reproduces(spec: dict, per_rank: list) -> bool:
    world = len(per_rank)
    for i in range(len(per_rank[0])):
        simulated = simulate_ring([per_rank[r][i]["x"] for r in range(world)], **_bug_steps(spec, world))
        if simulated is None:
            return False
        for r, want in enumerate(simulated):
            got = per_rank[r][i]["got"]
            if not (isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)):
                return False
    return True


def _phase_hint(x_all: list, want: torch.Tensor, got_all: list) -> str:
    """When no known bug matches: which phase went wrong, judged by which chunks each rank got right."""
    world = len(x_all)
    finished = []
    for got in got_all:
        right = [i for i, (g, w) in enumerate(zip(torch.tensor_split(got, world), torch.tensor_split(want, world)))
                 if w.numel() and torch.equal(g, w)]
        finished.append(right)
    if all(finished) and len({i for f in finished for i in f}) == world:
        return ("every rank finishes a chunk, so the reduce-scatter phase works; the all-gather phase passes the "
                "finished chunks wrong: in step s rank r sends chunk (r + 1 - s) % W and replaces chunk (r - s) % W")
    return ("in reduce-scatter step s rank r sends chunk (r - s) % W to (r + 1) % W and adds the incoming one "
            "to chunk (r - s - 1) % W; after W-1 steps chunk (r + 1) % W holds the full sum")


def diagnose(x: torch.Tensor, want: torch.Tensor, got, world: int) -> Optional[str]:
    """The hint for one rank's wrong result judged alone, or None when it is right."""
    if not isinstance(got, torch.Tensor):
        kind = got.get("type") if isinstance(got, dict) else type(got).__name__
        return f"return the reduced tensor (got {kind}); e.g. `return torch.cat(chunks)`"
    if got.shape != want.shape:
        return (f"the result has shape {tuple(got.shape)} but the input had {tuple(want.shape)}: "
                f"join the W chunks back together (torch.cat) in chunk order")
    if torch.equal(got, want):
        return None
    if torch.equal(got, x):
        return "the result equals this rank's input: add the chunk you receive to your own chunk"
    if torch.allclose(got, x * world):
        return "the result is your own input times W: add the chunk you *received*, not the one you sent"
    return None


def _ring_traffic_hint(per_rank: list, trial_index: int, world: int) -> Optional[str]:
    """None when the sends of one trial form a ring moving 2(W-1)·N elements in all; else the hint."""
    n = per_rank[0][trial_index]["numel"]
    sends = [[e for e in trials[trial_index]["events"] if e.op == "send"] for trials in per_rank]
    directions = set()
    for rank, events in enumerate(sends):
        peers = sorted({e.peer for e in events if e.numel})
        if len(peers) > 1:
            return (f"rank {rank} sent to ranks {peers}: in a ring every rank sends only to its right neighbour "
                    f"(rank + 1) % W and receives only from its left one")
        for peer in peers:
            directions.add((peer - rank) % world)
    if len(directions) > 1:
        return "some ranks send right and others left: a ring passes chunks in one direction"
    if world > 2 and directions and directions != {1} and directions != {world - 1}:
        return "each rank must send to a neighbour, (rank + 1) % W (or consistently (rank - 1) % W)"
    total = sum(e.numel for events in sends for e in events)
    ring_total = 2 * (world - 1) * n
    per_rank_max = 2 * (world - 1) * math.ceil(n / world)
    heaviest = max(sum(e.numel for e in events) for events in sends)
    if total == ring_total and heaviest <= per_rank_max:
        return None
    if total == world * (world - 1) * n:
        return (f"the sum is right, but each rank sent (W-1)·N = {(world - 1) * n} elements: whole tensors "
                f"passed around the ring. A ring all-reduce sends chunks of N/W: 2(W-1)/W·N = "
                f"{2 * (world - 1) * n / world:g} per rank. Split x into W chunks: reduce-scatter them, then "
                f"all-gather them")
    return (f"the sum is right, but the ranks sent {total} elements in all ({heaviest} on the busiest rank); a "
            f"ring all-reduce sends exactly 2(W-1)·N = {ring_total} (each of the W chunks travels W-1 hops in "
            f"each of the two phases)")


def _right(t: dict) -> bool:
    got, want = t["got"], t["want"]
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)


def _shown(got) -> object:
    return got.tolist()[:6] if isinstance(got, torch.Tensor) else got.get("repr")


def ring_problems(runs: dict) -> Optional[list]:
    """The verdict lines for the first wrong sum, else for the first trial whose messages are not a ring;
    None when every trial is right. ``runs``: world size -> per-rank lists of trials (dicts with ``x``,
    ``want``, ``got``, ``numel`` and the recorded ``events``)."""
    for world, per_rank in runs.items():
        for i, numel in enumerate(t["numel"] for t in per_rank[0]):
            trials = [per_rank[r][i] for r in range(world)]
            wrong = [r for r, t in enumerate(trials) if not _right(t)]
            if not wrong:
                continue
            t = trials[wrong[0]]
            hint = diagnose(t["x"], t["want"], t["got"], world) or _matching_bug(runs) or _phase_hint(
                [tr["x"] for tr in trials], t["want"], [tr["got"] for tr in trials])
            lines = [f"✗ wrong with {world} ranks on rank {wrong[0]} for a tensor of {numel} elements "
                     f"(your result starts {_shown(t['got'])}; it must be the elementwise sum over the ranks)",
                     f"  hint: {hint}"]
            if numel < world or numel % world:
                lines.append("  (N is not a multiple of W here: torch.tensor_split gives chunks of unequal "
                             "size, some possibly empty)")
            return lines
    for world, per_rank in runs.items():
        for i in range(len(per_rank[0])):
            hint = _ring_traffic_hint(per_rank, i, world)
            if hint:
                return [f"✗ not a ring all-reduce with {world} ranks for a tensor of {per_rank[0][i]['numel']} "
                        f"elements", f"  hint: {hint}"]
    return None


@exercise("my_ring_all_reduce")
def check_ring_all_reduce(fn, timeout: float = 20) -> bool:
    """Print a verdict on ``fn`` (``fn(x: Tensor[N]) -> Tensor[N]``, the sum over ranks, point-to-point only)."""
    runs, numels = {}, drawn_numels(drawn_rng())
    for world in WORLD_SIZES:
        per_rank, verdict = launch_trials(_rank_ring_trial, world, timeout, "my_ring_all_reduce", fn=fn,
                                           numels=numels)
        if per_rank is None:
            return verdict
        if course_code_used(per_rank):
            return False
        runs[world] = per_rank
    problems = ring_problems(runs)
    if problems:
        print("\n".join(problems))
        return False
    print(f"✓ my_ring_all_reduce equals dist.all_reduce for world sizes {list(WORLD_SIZES)} on tensor sizes drawn "
          f"for this run (multiples of W, not multiples, fewer elements than ranks); it used only point-to-point "
          f"messages, each rank sending to one neighbour, "
          f"2(W-1)/W·N elements per rank")
    return True


# ------------------------------------------- exercise 2: reduce-scatter + all-gather


HALVES_WORLDS = (2, 4)
HALVES_NUMELS = (8, 24)  # multiples of 2 and 4: the kinds of size drawn per run (see drawn_halves_numels)


def drawn_halves_numels(rng) -> tuple:
    """This run's sizes for the reduce-scatter + all-gather exercise: two multiples of 4 (so of every W)."""
    return 4 * rng.randint(1, 3), 4 * rng.randint(4, 9)


def _rank_halves_trial(fn, numels):
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for x in _secret_inputs(numels):
        trial = student_trial(fn, x.clone(), references=references_for("my_all_reduce_rs_ag"))
        results.append(dict(trial, numel=x.numel(), x=x, want=_summed(x), own_chunk=torch.tensor_split(x, world)[rank]))
    return results


def _halves_carried_hint(t: dict, world: int, rank: int) -> str | None:
    """The hint when the reduce-scatter did not carry this rank's input, or the all-gather not the summed
    shard it received (None when both did)."""
    for e, c in zip(t["events"], t["carried"]):
        if c is None:
            continue
        flat = torch.cat([p.reshape(-1) for p in c]) if isinstance(c, list) else c.reshape(-1)
        if e.op == "reduce_scatter" and not torch.equal(flat, t["x"].reshape(-1)):
            return "the reduce-scatter must carry your input x itself: each rank contributes all of its N elements"
        if e.op == "all_gather" and not torch.equal(flat, torch.tensor_split(t["want"], world)[rank].reshape(-1)):
            return ("the all-gather must carry the shard the reduce-scatter gave you (the sum of chunk `rank` over "
                    "every rank), so that every rank ends with every summed chunk")
    return None


def _halves_value_hint(t: dict, world: int, per_rank_trials: list) -> str:
    got, want, x = t["got"], t["want"], t["x"]
    if not isinstance(got, torch.Tensor):
        return f"return the all-gathered tensor (got {got.get('type')})"
    if got.numel() == want.numel() // world:
        return ("that is the reduce-scattered shard (N/W elements): all-gather the shards of every rank to get "
                "the full sum back")
    if got.shape != want.shape:
        return f"the result must have the input's shape {tuple(want.shape)}, not {tuple(got.shape)}"
    if torch.allclose(got * world, want):
        return "W times too small: all-reduce sums (ReduceOp.SUM, the default); averaging is a separate step"
    gathered_inputs = torch.cat([tr["own_chunk"] for tr in per_rank_trials])
    if torch.equal(got, gathered_inputs):
        return ("you all-gathered each rank's own input chunk, not the reduce-scattered sums: gather the output "
                "of reduce_scatter")
    return ("reduce_scatter_tensor(shard, x) leaves on rank r the sum of chunk r (N/W elements); "
            "all_gather_into_tensor(out, shard) puts the W shards back together in rank order")


@exercise("my_all_reduce_rs_ag")
def check_all_reduce_from_halves(fn, timeout: float = 20) -> bool:
    """``fn(x: Tensor[N]) -> Tensor[N]`` must all-reduce ``x`` with exactly one reduce-scatter and one all-gather."""
    numels = drawn_halves_numels(drawn_rng())
    for world in HALVES_WORLDS:
        per_rank, verdict = launch_trials(_rank_halves_trial, world, timeout, "my_all_reduce_rs_ag", fn=fn,
                                           numels=numels)
        if per_rank is None:
            return verdict
        if course_code_used(per_rank):
            return False
        for i, numel in enumerate(numels):
            trials = [per_rank[r][i] for r in range(world)]
            events = trials[0]["events"]
            ops = collective_events(events)
            used = {e.op for e in ops}
            right = all(isinstance(t["got"], torch.Tensor) and t["got"].shape == t["want"].shape
                        and torch.equal(t["got"], t["want"]) for t in trials)
            if "all_reduce" in used:
                print(f"✗ with {world} ranks it ran {describe_ops(ops)}")
                print("  hint: all-reduce is what this exercise builds: use one reduce-scatter, then one all-gather "
                      "(no all_reduce)")
                return False
            if not right:
                rank = next(r for r, t in enumerate(trials) if not (
                    isinstance(t["got"], torch.Tensor) and t["got"].shape == t["want"].shape
                    and torch.equal(t["got"], t["want"])))
                t = trials[rank]
                print(f"✗ wrong with {world} ranks on rank {rank} for a tensor of {numel} elements "
                      f"(your result starts {_shown(t['got'])}; it must be the elementwise sum over the ranks)")
                print(f"  hint: {_halves_value_hint(t, world, trials)}")
                return False
            wanted = [("reduce_scatter", numel), ("all_gather", numel)]
            got = [(e.op, e.numel) for e in ops]
            carried = next(((r, h) for r, h in ((r, _halves_carried_hint(t, world, r)) for r, t in enumerate(trials))
                            if h), None)
            if got == wanted and carried:
                print(f"✗ the sum is right with {world} ranks, but rank {carried[0]}'s collectives did not carry what "
                      f"the algorithm moves\n  hint: {carried[1]}")
                return False
            if got != wanted:
                print(f"✗ the sum is right with {world} ranks, but it ran {describe_ops(ops) if ops else 'no collective'}")
                if got == [("all_gather", numel * world)]:
                    print(f"  hint: you gathered every rank's whole tensor ({numel * world} elements) and summed "
                          f"locally: each rank receives (W-1)·N elements instead of 2(W-1)/W·N. Reduce-scatter "
                          f"first, so each rank only gathers the N/W finished elements of the others")
                else:
                    print(f"  hint: exactly one reduce_scatter of the {numel} elements, then one all_gather of the "
                          f"N/W-element shards (all-gather's full size is {numel} again)")
                return False
    print(f"✓ my_all_reduce_rs_ag equals all_reduce on {list(HALVES_WORLDS)} ranks using exactly one reduce-scatter "
          f"and one all-gather: each moves (W-1)/W·N per rank, 2(W-1)/W·N together -- a ring all-reduce's traffic")
    return True
