"""Lab 09's checkers (course_lib.classroom.checks.checkpoints): right answers written differently from the
notebook's pass, each wrong answer fails with its own hint and without the right value, a lookup table of the
lab's case fails on the drawn one, the stub says "not attempted yet", the course's (and torch's) own functions are
refused. Exercise 1 runs on 4 real ranks (one launch per answer, the lab's case and a drawn one, ~1 s)."""

from __future__ import annotations

import pytest
import torch

from course_lib.classroom.checks import checkpoints as C
from course_lib.training.checkpointing import global_spec


# ------------------------------------------------------------------ Exercise 1: the sharded state dict


def by_partition_dim(mlp, tp_rank, tp_size):
    """Right, differently from the notebook: from the parameters' own TP attributes, lists for tuples."""
    out = {}
    for name, p in mlp.named_parameters():
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        shape = [n * tp_size if d == dim else n for d, n in enumerate(p.shape)]
        offsets = [tp_rank * n if d == dim else 0 for d, n in enumerate(p.shape)]
        out[name] = [p.detach(), shape, offsets]
    return out


def every_shard_at_the_origin(mlp, tp_rank, tp_size):
    return {n: (p, s, [0] * len(s)) for n, (p, s, _) in by_partition_dim(mlp, tp_rank, tp_size).items()}


def tp_two_only(mlp, tp_rank, tp_size):
    return by_partition_dim(mlp, tp_rank, 2)


def copies(mlp, tp_rank, tp_size):
    return {n: (p.clone(), s, o) for n, (p, s, o) in by_partition_dim(mlp, tp_rank, tp_size).items()}


def courses_own(mlp, tp_rank, tp_size):
    return {n: (p, *global_spec(p, p, tp_size, tp_rank)) for n, p in mlp.named_parameters()}


def stub(mlp, tp_rank, tp_size):
    raise NotImplementedError


# the lab's MLP (hidden 6, ffn 8) under TP2 and TP4, as printed by the notebook's table: the checker's one case until
# it drew a second
LAB_TABLE = {(name, tp, r): ([8, 6] if "fc1" in name else [6, 8] if name == "linear_fc2.weight" else [6],
                             [r * 8 // tp if "fc1" in name else 0] + ([0] if name == "linear_fc1.weight" else [])
                             if name != "linear_fc2.weight" else [0, r * 8 // tp])
             for name in ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
             for tp in (2, 4) for r in range(tp)}
LAB_TABLE.update({("linear_fc1.bias", tp, r): ([8], [r * 8 // tp]) for tp in (2, 4) for r in range(tp)})


def looked_up(mlp, tp_rank, tp_size):
    return {n: (p, *LAB_TABLE.get((n, tp_size, tp_rank), LAB_TABLE[(n, 2, 0)])) for n, p in mlp.named_parameters()}


@pytest.mark.parametrize("fn, expected", [
    (by_partition_dim, ["✓ by_partition_dim: under TP2 x DP2 the 4 ranks' 16 pieces were written as 7 chunks",
                        "rank 1                      [2:4, 0:6] <- __0_0.distcp"]),
    (every_shard_at_the_origin, ["✗ every_shard_at_the_origin under TP2 (the save), rank 1: linear_fc1.weight: TP "
                                 "rank 1 gave offsets [0, 0]", "starts at r x the shard's size along the split"]),
    (tp_two_only, ["✗ tp_two_only under TP4 (the reload), rank 0: linear_fc1.weight: global shape [4, 6] under TP=4 "
                   "is not the whole tensor's"]),
    (looked_up, ["✗ looked_up (an MLP of hidden ", "drawn for this run) under TP"]),
    (copies, ["✗ copies: your tensors were filled, not the MLP's parameters"]),
    (courses_own, ["✗ your function runs the course's own course_lib.training.checkpointing.global_spec"]),
    (stub, ["not attempted yet: write stub above"]),
])
def test_sharded_state_dict_on_ranks(fn, expected, capsys):
    verdict = C.check_sharded_state_dict(fn)
    ok, out = verdict.ok, capsys.readouterr().out
    assert ok == expected[0].startswith("✓") and all(e in out for e in expected), out
    if ok:  # the evidence is what ran on the 4 ranks (the grader's column), not "0 calls": 2 cases, 2 stages each
        assert verdict.evidence["ranks"] == [4] and verdict.evidence["calls"] == 16, verdict.evidence
    if not ok:
        assert "[8, 6] at [4, 0]" not in out and "whole tensor is [" not in out, out   # never the right spec


@pytest.mark.parametrize("name, local, got, want, hint", [
    ("linear_fc1.weight", (4, 6), ((4, 6), (0, 0)), ((8, 6), (4, 0)), "you gave the shard's own shape [4, 6]; the "
                                                                      "global shape is the whole tensor's"),
    ("linear_fc1.weight", (4, 6), ((6, 8), (4, 0)), ((8, 6), (4, 0)), "linear_fc1 is column-parallel"),
    ("linear_fc2.weight", (6, 4), ((6, 8), (4, 0)), ((6, 8), (0, 4)), "move along the wrong dimension (linear_fc2 is "
                                                                      "row-parallel"),
    ("linear_fc2.bias", (6,), ((12,), (6,)), ((6,), (0,)), "linear_fc2.bias is replicated on every TP rank"),
    ("linear_fc1.bias", (4,), ((8,), (2,)), ((8,), (4,)), "starts at [2]: the offset along the split dimension is "
                                                          "tp_rank x"),
])
def test_spec_hints_name_the_mistake(name, local, got, want, hint):
    text = C.spec_hint(name, local, got, want, 2, 1)
    assert hint in text
    for right, given in zip(want, got):   # the right shape or offsets appear only as the student's or the rank's own
        assert right in (given, local) or str(list(right)) not in text, text
    assert C.spec_hint(name, local, want, want, 2, 1) is None


# ------------------------------------------------------------------ Exercise 2: the read plan


def plan_with_ranges(saved, want):
    """Right, differently: one dimension at a time, whole chunks outside the piece skipped first."""
    w_off, w_size = want
    out = []
    for i, (c_off, c_size) in enumerate(saved):
        spans = [(max(c, w), min(c + cs, w + ws)) for c, cs, w, ws in zip(c_off, c_size, w_off, w_size)]
        if any(lo >= hi for lo, hi in spans):
            continue
        out.append([i, tuple(lo - c for (lo, _), c in zip(spans, c_off)),
                    tuple(lo - w for (lo, _), w in zip(spans, w_off)), tuple(hi - lo for lo, hi in spans)])
    return out


def global_starts(saved, want):
    return [(i, [a + c for a, c in zip(cs, saved[i][0])], ps, n) for i, cs, ps, n in plan_with_ranges(saved, want)]


def whole_chunks(saved, want):
    return [(i, [0] * len(z), [0] * len(z), list(z)) for i, (_, z) in enumerate(saved)]


def first_chunk_only(saved, want):
    return plan_with_ranges(saved, want)[:1]


def twice(saved, want):
    return plan_with_ranges(saved, want) * 2


def through_torch(saved, want):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    md = TensorStorageMetadata(None, torch.Size([sum(z[0] for _, z in saved)]),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in saved])
    create_read_items_for_chunk_list("t", md, [ChunkStorageMetadata(torch.Size(want[0]), torch.Size(want[1]))])
    return plan_with_ranges(saved, want)


def plan_stub(saved, want):
    raise NotImplementedError


@pytest.mark.parametrize("fn, expected", [
    (plan_with_ranges, "✓ plan_with_ranges fills every rank's piece in 6 reshardings"),
    (global_starts, "✗ global_starts (linear_fc1.weight [8, 6], TP2 -> TP4, rank 2): item 0 reads [4:6, 0:6] of chunk 1, "
                    "which has shape [4, 6]: it runs past the chunk's end along dimension 0 -- a start in the chunk is relative"),
    (whole_chunks, "item 0 copies all of chunk 0 ([4, 6]) into a piece of shape [2, 6]: read only the part"),
    (first_chunk_only, "✗ first_chunk_only: linear_fc2.weight [6, 8], TP4 -> TP2, rank 0 (piece [0:6, 0:4]): 12 of "
                       "its elements were never read, the first at global [0, 2], which chunk 1 [0:6, 2:4] holds"),
    (twice, "elements were read more than once"),
    (through_torch, "✗ through_torch runs torch's own torch.distributed.checkpoint.planner_helpers."
                    "create_read_items_for_chunk_list"),
    (plan_stub, "not attempted yet: write plan_stub above"),
])
def test_read_plan(fn, expected, capsys):
    ok = C.check_read_plan(fn).ok
    out = capsys.readouterr().out
    assert ok == expected.startswith("✓") and expected in out, out


def test_read_plan_hint_for_a_shifted_piece(capsys):
    def shifted(saved, want):        # the piece's start measured from the chunk: values land in the wrong place
        return [(i, cs, cs, n) if sum(cs) else (i, cs, ps, n) for i, cs, ps, n in plan_with_ranges(saved, want)]

    assert not C.check_read_plan(shifted)
    out = capsys.readouterr().out
    assert "holds the global element" in out or "relative to the piece" in out, out


# ------------------------------------------------------------------ Exercise 3: the review answers

RUNS = {"straight": [5.935508, 5.954694, 5.571479, 5.394357, 5.178067, 5.072365], "consumed": 24}
ANSWERS = {
    "resume": "Adam's moments, the scheduler and the random generators came back with the weights, and the data "
              "continued at sample 24: iteration 4 was 5.3944 both times.",
    "reshard": "Every chunk was saved with its global offsets, so the TP4 ranks read the overlaps of the saved chunks.",
    "crash": "The tracker still named iteration 2 because it is written last, so the incomplete folder was ignored.",
}


@pytest.mark.parametrize("change, expected", [
    ({}, "✓ your answers are recorded for your instructor, who reads them (not graded here; resume cites 24, "
         "5.3944)"),
    ({"crash": "it was fine"}, "'crash': answer after the save killed at iteration 4"),
    # what an answer says is the instructor's to read: no word list passes or fails it
    ({"reshard": "The TP4 run loaded it because it is a newer and better format than the other one."},
     "✓ your answers are recorded for your instructor"),
    ({"resume": "Adam's moments, the learning-rate scheduler, the random generators and the consumed samples were "
                "saved along with the weights of the model."},
     "'resume': cite a loss or a size"),
])
def test_review_answers(change, expected, capsys):
    ok = C.check_checkpoint_answers(lambda: {**ANSWERS, **change}, RUNS).ok
    assert ok == expected.startswith("✓") and expected in capsys.readouterr().out
    C.print_course_answers(ok)
    assert ("latest_checkpointed_iteration.txt" in capsys.readouterr().out) == ok


def test_review_answers_stub_and_wrong_type(capsys):
    def my_answers():
        raise NotImplementedError

    assert not C.check_checkpoint_answers(my_answers, RUNS)
    assert "not attempted yet: write my_answers above" in capsys.readouterr().out
    assert not C.check_checkpoint_answers(lambda: ["resume"], RUNS)
    assert "return a dict with the keys resume, reshard, crash" in capsys.readouterr().out
