"""The judge: cheats written in the exercise cell fail with a hint that names them; right answers written
differently pass. Each answer is a notebook cell (its text in linecache, its names in ``__main__``), checked
through the lab's real checker, which runs in the judge (:mod:`course_lib.classroom.checks.judge`). The cheats
that search ``gc.get_objects()`` call ``gc.unfreeze()`` first: the judge and the processes it forks freeze what
they inherit (:func:`course_lib.launch.process_tree.freeze_inherited_objects`), which hides it from
``get_objects``; a student can undo that, so the refusal must hold with everything listed."""

from __future__ import annotations

import itertools
import linecache
import sys

import pytest
import torch

from course_lib.classroom.checks import plain
from course_lib.classroom.checks.rank_grid import check_rank_of

_CELLS = itertools.count()


@pytest.fixture(autouse=True)
def _through_the_judge(monkeypatch):
    monkeypatch.setenv("COURSE_JUDGE", "1")  # as in a notebook's kernel


def cell(source: str) -> dict:
    """Run ``source`` as a notebook cell would: its functions belong to ``__main__`` and keep their text."""
    filename = f"/tmp/ipykernel_0/{next(_CELLS)}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    space = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), space)  # noqa: S102 - the test's own cell
    return space


RIGHT = '''
def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
'''

CHEATS = {
    "setprofile(None), then the course's RankGrid": ('''
import sys
from course_lib.topology.grid import RankGrid

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    sys.setprofile(None)
    return RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)
''', "RankGrid"),
    "the course's RankGrid in a thread": ('''
import threading
from course_lib.topology.grid import RankGrid

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    box = []
    run = lambda: box.append(RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(
        tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank))
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return box[0] if box else 0
''', "RankGrid"),
    "a renamed copy of a reference's code object": ('''
import types
from course_lib.topology import grid

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    mine = types.FunctionType(grid.RankGrid.rank_of.__code__, vars(grid), "mine")
    return mine(grid.RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp), tp=tp_rank, cp=cp_rank, dp=dp_rank,
                pp=pp_rank)
''', "RankGrid"),
    "the course's RankGrid found with gc.get_objects()": ('''
import gc

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    grid = next(o for o in (gc.unfreeze() or gc.get_objects()) if isinstance(o, type) and o.__name__ == "RankGrid")
    return grid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)
''', "RankGrid"),
    "megatron-core's RankGenerator": ('''
def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    from megatron.core.parallel_state import RankGenerator
    return RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp").get_ranks("tp")[0][tp_rank]
''', "megatron"),
    "the checker's helpers monkeypatched from inside the function": ('''
def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    import course_lib.classroom.checks.rank_grid as checker
    checker.same_number = lambda *args, **kwargs: True
    return 0
''', "checker's own code"),
    "the checker's module imported, its refusal caught, then a right answer": ('''
import importlib

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    try:
        importlib.import_module("course_lib.classroom.checks.rank_" + "grid")
    except ImportError:
        pass
    return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
''', "reached into the checker"),
    "the reference's source read from disk": ('''
import course_lib.topology.grid as grid

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    space = {}
    exec(open(grid.__file__.replace(".pyc", ".py")).read(), space)
    return space["RankGrid"](tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(tp=tp_rank, cp=cp_rank, dp=dp_rank,
                                                                          pp=pp_rank)
''', "Permission denied"),
    "the expected value read off the checker's frames": ('''
import sys

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    frame = sys._getframe(1)
    while frame is not None:
        for key in ("expected", "want", "truth", "answer"):
            if isinstance(frame.f_locals.get(key), int):
                return frame.f_locals[key]
        frame = frame.f_back
    return -1
''', "returned -1"),  # no frame of the checker is on the worker's stack: nothing found
    "RankGrid found with gc and only constructed (its strides are Megatron's order)": ('''
import gc

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    cls = next(o for o in (gc.unfreeze() or gc.get_objects()) if isinstance(o, type) and o.__name__ == "RankGrid")
    grid = cls(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp)
    coords = {"tp": tp_rank, "cp": cp_rank, "ep": 0, "dp": dp_rank, "pp": pp_rank}
    return sum(coords[a] * s for a, s in zip(grid.order, grid._stride))
''', "RankGrid"),
    "the reference's source from the repository's git objects": ('''
import subprocess

def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    import course_lib, os
    repo = os.path.dirname(os.path.dirname(course_lib.__file__))
    source = subprocess.run(["git", "-C", repo, "show", "HEAD:course_lib/topology/grid.py"], capture_output=True,
                            text=True).stdout
    space = {}
    exec(source, space)
    return space["RankGrid"](tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(tp=tp_rank, cp=cp_rank, dp=dp_rank,
                                                                            pp=pp_rank)
''', "KeyError"),
}


@pytest.mark.parametrize("what", list(CHEATS))
def test_a_cheat_fails_with_a_hint_that_names_it(what):
    source, named = CHEATS[what]
    verdict = check_rank_of(cell(source)["rank_of"])
    assert not verdict.ok, what
    assert named in verdict.hint, (what, verdict.hint)


LIBRARY_CHEATS = {
    "megatron-core's zigzag split handed chunk ids": (
        "course_lib.classroom.checks.context_parallel:check_chunks_for_rank", '''
import torch
import torch.distributed as dist

def chunks_for_rank(rank, cp):
    from megatron.core.utils import get_batch_on_this_cp_rank
    class Group:
        size = lambda self: cp
        rank = lambda self: rank
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    got = get_batch_on_this_cp_rank({"tokens": torch.arange(2 * cp).view(1, -1)}, cp_group=Group())
    return tuple(got["tokens"][0].tolist())
''', "megatron"),
    "megatron-core's count of the 1F1B warm-up": ("course_lib.classroom.checks.pipeline_schedules:check_warmup", '''
def warmup_1f1b(pp_size, num_microbatches, pp_rank):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches
    parallel_state.get_pipeline_model_parallel_world_size = lambda *a, **k: pp_size
    parallel_state.get_pipeline_model_parallel_rank = lambda *a, **k: pp_rank
    return get_pp_rank_microbatches(num_microbatches, 1, None)[2]
''', "megatron"),
    "megatron-core's switch_load_balancing_loss_func": ("course_lib.classroom.checks.moe:check_aux_loss", '''
import torch

def aux_loss(scores, indices, num_experts, coeff):
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
    counts = torch.bincount(indices.flatten(), minlength=num_experts)
    return switch_load_balancing_loss_func(scores, counts, indices.shape[0] * indices.shape[1], indices.shape[1],
                                           coeff)
''', "megatron"),
    "torch's DCP planner helpers": ("course_lib.classroom.checks.checkpoints:check_read_plan", '''
import torch.distributed.checkpoint as dcp

def read_plan(saved, want):
    helpers = dcp.planner_helpers
    return helpers.create_read_items_for_chunk_list("w", want, saved)
''', "torch.distributed.checkpoint.planner_helpers"),
    "torch's context-parallel merger": ("course_lib.classroom.checks.context_parallel:check_merge", '''
def merge(out1, lse1, out2, lse2):
    from torch.distributed.tensor.experimental._context_parallel._attention import _SDPAMerger
    merger = _SDPAMerger(False, seq_dim=2)
    merger.step(out1, lse1, False)
    merger.step(out2, lse2, False)
    return merger.results()
''', "torch.distributed.tensor.experimental"),
    "torch's head-tail load balancer": ("course_lib.classroom.checks.context_parallel:check_chunks_for_rank", '''
def chunks_for_rank(rank, cp):
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer
    order = _HeadTailLoadBalancer(2 * cp, cp, "cpu")._generate_indices()[0].tolist()
    return tuple(sorted(order[2 * rank:2 * rank + 2]))
''', "torch.distributed.tensor.experimental"),
    "DeepSpeed's DeepSpeedZeroConfig": ("course_lib.classroom.checks.zero_stages:check_what_it_shards", '''
def what_it_shards(config):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    zero = DeepSpeedZeroConfig(**config.get("zero_optimization", {}))
    return {"sharded": set(), "offloaded": set()}
''', "deepspeed"),
    "megatron-core's compiled build_sample_idx, imported at the top of the cell": (
        "course_lib.classroom.checks.data_pipeline:check_sample_index", '''
from megatron.core.datasets import helpers

def build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch):
    return helpers.build_sample_idx(sizes, document_index, seq_length, num_epochs, tokens_per_epoch, True, True)
''', "megatron"),
    "megatron-core's compiled build_blending_indices, imported at the top of the cell": (
        "course_lib.classroom.checks.data_pipeline:check_blending_indices", '''
import numpy as np
from megatron.core.datasets.helpers import build_blending_indices as blend

def build_blending_indices(weights, size):
    dataset_index, sample_index = np.zeros(size, np.int16), np.zeros(size, np.int64)
    blend(dataset_index, sample_index, np.asarray(weights, np.float64), len(weights), size, False)
    return dataset_index, sample_index
''', "megatron"),
    "setprofile(None), then the course's ring on the ranks": (
        "course_lib.classroom.checks.collectives:check_ring_all_reduce", '''
import sys
from course_lib.communication_patterns import ring_all_reduce

def my_ring_all_reduce(x):
    sys.setprofile(None)
    return ring_all_reduce(x)
''', "ring_all_reduce"),
    "torch DCP's resharding helpers from a module kept alive after its removal": (
        "course_lib.classroom.checks.checkpoints:check_read_plan", '''
import gc, types

def read_plan(saved, want):
    res = next(o for o in (gc.unfreeze() or gc.get_objects()) if isinstance(o, types.ModuleType)
               and o.__name__ == "torch.distributed.checkpoint.resharding")
    md = next(o for o in (gc.unfreeze() or gc.get_objects()) if isinstance(o, types.ModuleType)
              and o.__name__ == "torch.distributed.checkpoint.metadata")
    cur = md.ChunkStorageMetadata(offsets=list(want[0]), sizes=list(want[1]))
    plan = []
    for i, (off, size) in enumerate(saved):
        chunk = md.ChunkStorageMetadata(offsets=list(off), sizes=list(size))
        if res._check_shard_metadata_pair_overlap(chunk, cur):
            narrow = res._shards_get_overlap_region_wrt_saved_tensor(chunk, cur)
            plan.append((i, [n[1] for n in narrow], [n[2] for n in narrow], [n[3] for n in narrow]))
    return plan
''', "torch.distributed.checkpoint.resharding"),
    "megatron-core imported once the import hook is removed (a namespace package: its folders are denied)": (
        "course_lib.classroom.checks.moe:check_aux_loss", '''
import sys
import torch

def aux_loss(scores, indices, num_experts, coeff):
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_Finder"]
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
    counts = torch.bincount(indices.flatten(), minlength=num_experts)
    return switch_load_balancing_loss_func(scores, counts, indices.shape[0] * indices.shape[1], indices.shape[1],
                                           coeff)
''', "megatron"),
    "megatron-core's compiled helpers loaded by the path of their .so, under another name": (
        "course_lib.classroom.checks.data_pipeline:check_sample_index", '''
import glob, importlib.machinery, importlib.util, os, sys
import numpy as np

def build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch):
    for base in sys.path:
        for so in glob.glob(os.path.join(base, "megatron", "core", "datasets", "helpers_cpp*.so")):
            loader = importlib.machinery.ExtensionFileLoader("helpers_cpp", so)
            module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("helpers_cpp", so,
                                                                                            loader=loader))
            loader.exec_module(module)
            return module.build_sample_idx_int32(np.asarray(sizes, np.int32), np.asarray(document_index, np.int32),
                                                 seq_length, num_epochs, tokens_per_epoch, True, 1)
    return None
''', "reading megatron"),
    # on a rank the student process has forgotten the checker module's helpers (refusals.apply): nothing to
    # replace, and the value is judged
    "the checker's helpers sought through the frames on a rank": (
        "course_lib.classroom.checks.collectives:check_ring_all_reduce", '''
import sys

def my_ring_all_reduce(x):
    frame = sys._getframe(1)
    while frame is not None:
        for name in list(frame.f_globals):
            if name.endswith("problems") or name.startswith("same"):
                frame.f_globals[name] = lambda *args, **kwargs: []
        frame = frame.f_back
    return x
''', "wrong with 2 ranks"),
}


RING_INTO_ITS_CELLS_BUFFER = '''
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

SCRATCH = torch.zeros(64 * 512 * 512, dtype=torch.float64)  # 128 MiB made by the cell: it travels to the judge

def ring_attention_forward(q, k, v, group):
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    after, before = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
    keys, values = [k], [v]
    for _ in range(cp - 1):
        k, v = torch.empty_like(k), torch.empty_like(v)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, keys[-1], after, group),
                                            dist.P2POp(dist.isend, values[-1], after, group),
                                            dist.P2POp(dist.irecv, k, before, group),
                                            dist.P2POp(dist.irecv, v, before, group)]):
            work.wait()
        keys.append(k)
        values.append(v)
    with _disable_current_modes():
        keys, values = torch.cat(keys, 2), torch.cat(values, 2)
        shape = (*q.shape[:3], keys.shape[2])
        n = shape[0] * shape[1] * shape[2] * shape[3]
        scores = SCRATCH[:n].view(shape)
        torch.matmul(q, keys.transpose(-1, -2) / q.shape[-1] ** 0.5, out=scores)
        scores.sub_(scores.amax(-1, keepdim=True)).exp_()   # the softmax in place: one score matrix in all
        scores.div_(scores.sum(-1, keepdim=True))
        return scores @ values
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rank reads the memory from /proc")
def test_a_dense_ring_written_into_a_buffer_of_its_cell_is_refused_by_its_memory():
    """Lab 04's memory case through the judge: the cell's buffer is decoded in the student process before the call
    (no growth when the dense scores are written into it), and counts: the rank adds the bytes of the values the
    function uses to how far the call grew."""
    from course_lib.classroom.checks.context_parallel import MEMORY_ROWS, VIRTUAL_CP, check_ring_attention

    assert f"zeros({VIRTUAL_CP} * {MEMORY_ROWS} * {MEMORY_ROWS}," in RING_INTO_ITS_CELLS_BUFFER  # one whole score matrix
    verdict = check_ring_attention(cell(RING_INTO_ITS_CELLS_BUFFER)["ring_attention_forward"])
    assert not verdict.ok
    assert "grew its memory" in verdict.hint and "never holds the whole sequence" in verdict.hint, verdict.hint


_CALLING = '''
class {name}(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        {first}
        return {owner}{course}.forward(ctx, x, group{more})

    @staticmethod
    def backward(ctx, grad):
        {first}
        return {owner}{course}.backward(ctx, grad){cut}
'''


def _f_and_g_calling(header: str, owner: str, first: str = "pass", more: str = "", cut: str = "") -> str:
    """A cell whose f and g are autograd Functions calling ``owner``'s _CopyTo/_ReduceFromModelParallelRegion."""
    pairs = (("CopyToTensorParallelRegion", "_CopyToModelParallelRegion"),
             ("ReduceFromTensorParallelRegion", "_ReduceFromModelParallelRegion"))
    return header + "".join(_CALLING.format(name=name, owner=owner, course=course, first=first, more=more, cut=cut)
                            for name, course in pairs)


F_AND_G_DELEGATED = {  # what f and g call -> (the cell, what the hint names)
    "megatron-core's mappings called": (_f_and_g_calling(
        "import torch\nfrom megatron.core.tensor_parallel.mappings import _CopyToModelParallelRegion, "
        "_ReduceFromModelParallelRegion\n", ""), "megatron"),
    "megatron-core's mappings subclassed": ('''
from megatron.core.tensor_parallel import mappings

class CopyToTensorParallelRegion(mappings._CopyToModelParallelRegion):
    pass

class ReduceFromTensorParallelRegion(mappings._ReduceFromModelParallelRegion):
    pass
''', "megatron"),
    # the course's: methods of autograd Functions (staticmethods on their class), replaced there by stand-ins
    "the course's mappings called with the course-code watcher off": (_f_and_g_calling(
        "import sys\nimport torch\nfrom course_lib.tensor_parallel import mappings\n", "mappings.",
        first="sys.setprofile(None)", more=', "tp"', cut="[:2]"), "course_lib.tensor_parallel.mappings"),
}


@pytest.mark.parametrize("what", list(F_AND_G_DELEGATED))
def test_f_and_g_that_delegate_to_megatron_core_or_the_course_are_refused(what):
    from course_lib.classroom.checks.tp_communication import check_f_g

    source, named = F_AND_G_DELEGATED[what]
    space = cell(source)
    verdict = check_f_g(space["CopyToTensorParallelRegion"], space["ReduceFromTensorParallelRegion"])
    assert not verdict.ok, what
    assert named in verdict.hint, (what, verdict.hint)


@pytest.mark.parametrize("what", list(LIBRARY_CHEATS))
def test_the_library_that_computes_the_answer_is_refused(what):  # and a rank's patch is undone
    from course_lib.classroom.checks.student_code import resolve

    checker, source, named = LIBRARY_CHEATS[what]
    space = cell(source)
    fn = [v for k, v in space.items() if callable(v) and getattr(v, "__module__", None) == "__main__"][-1]
    verdict = resolve(checker)(fn)
    assert not verdict.ok, what
    assert named in verdict.hint, (what, verdict.hint)


def test_the_answer_key_of_the_review_checker_is_not_in_the_worker():
    """The review's checker module is alive in the worker (removed from sys.modules, found through gc), but its
    answer key is not: the data of the checker modules is forgotten there."""
    from course_lib.classroom.checks.review import check_review_answers

    answers = cell('''
import gc, types

def my_answers():
    review = next(o for o in (gc.unfreeze() or gc.get_objects()) if isinstance(o, types.ModuleType)
                  and o.__name__ == "course_lib.classroom.checks.review")
    return {key: getattr(spec, "value", "lorem ipsum dolor sit amet consectetur adipiscing elit sed do")
            for key, spec in review.QUESTIONS["07"].items()}
''')
    verdict = check_review_answers(answers["my_answers"], "07")
    assert not verdict.ok and "QUESTIONS" in verdict.hint, verdict.hint


def test_a_table_of_the_fixed_cases_fails_on_the_cases_drawn_for_the_run():
    from course_lib.classroom.checks.checkpoints import RESHARDINGS, check_read_plan

    right = cell('''
def read_plan(saved, want):
    (w_off, w_size), plan = want, []
    for i, (c_off, c_size) in enumerate(saved):
        lo = [max(c, w) for c, w in zip(c_off, w_off)]
        hi = [min(c + cs, w + ws) for c, cs, w, ws in zip(c_off, c_size, w_off, w_size)]
        if all(a < b for a, b in zip(lo, hi)):
            plan.append((i, [a - c for a, c in zip(lo, c_off)], [a - w for a, w in zip(lo, w_off)],
                         [b - a for a, b in zip(lo, hi)]))
    return plan
''')["read_plan"]
    assert check_read_plan(right).ok
    table = {(repr([tuple(c) for c in saved]), repr(tuple(want))): right([tuple(c) for c in saved], tuple(want))
             for _, _, saved, pieces in RESHARDINGS for want in pieces}
    cheat = cell(f"TABLE = {table!r}\n\ndef read_plan(saved, want):\n    return TABLE.get((repr(saved), repr(want)), [])\n")
    verdict = check_read_plan(cheat["read_plan"])
    assert not verdict.ok and "a random" in verdict.hint, verdict.hint


def test_patching_the_checker_in_the_kernel_changes_nothing(monkeypatch):
    from course_lib.classroom.checks import tamper_guard

    def always(*_args, **_kwargs):
        print("✓ passed")
        return True

    monkeypatch.setattr(check_rank_of.__wrapped__, "__code__", always.__code__)
    monkeypatch.setattr(tamper_guard, "run_student", lambda *args, **kwargs: tamper_guard.StudentRun(value=0))
    wrong = cell("def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):\n    return tp_rank\n")
    assert not check_rank_of(wrong["rank_of"]).ok


def test_a_kernel_that_says_it_is_the_judge_still_asks_the_judge(monkeypatch):
    """The judge's flag set from a notebook cell (``judge_client._INSIDE``) would make the checker run in the
    kernel, where the cell has patched it; in a kernel the checker asks the judge whatever the flag says."""
    from course_lib.classroom.checks import judge_client

    monkeypatch.setattr(judge_client, "_in_a_kernel", lambda: True)
    monkeypatch.setitem(judge_client._INSIDE, "judge", True)
    assert judge_client.wanted() and not judge_client.inside()

    def always(*_args, **_kwargs):
        print("✓ passed")
        return True

    monkeypatch.setattr(check_rank_of.__wrapped__, "__code__", always.__code__)
    wrong = cell("def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):\n    return tp_rank\n")
    assert not check_rank_of(wrong["rank_of"]).ok


def test_right_answers_written_differently_pass(capsys):
    assert check_rank_of(cell(RIGHT)["rank_of"]).ok
    helpers = cell('''
import numpy as np
ORDER = ("tp", "cp", "dp", "pp")

def strides(sizes):
    return np.cumprod([1] + [sizes[a] for a in ORDER[:-1]]).tolist()
''')
    answer = cell('''
def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):
    print("my strides", strides(dict(tp=tp, cp=cp, dp=dp, pp=pp)))
    coords = (tp_rank, cp_rank, dp_rank, pp_rank)
    return int(sum(c * s for c, s in zip(coords, strides(dict(tp=tp, cp=cp, dp=dp, pp=pp)))))
''')
    answer["strides"], answer["ORDER"], answer["np"] = helpers["strides"], helpers["ORDER"], helpers["np"]
    answer["rank_of"].__globals__.update(strides=helpers["strides"])
    assert check_rank_of(answer["rank_of"]).ok
    assert "my strides" in capsys.readouterr().out  # the student's print output reaches the notebook


def test_plain_data_round_trip():
    from fractions import Fraction

    import numpy as np

    value = {"t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "n": np.arange(3.0), "f": Fraction(1, 3),
             (1, 2): {3, 4}, "x": [None, True, 2.5, "s"], "np": np.int64(7), "r": range(16, 32, 2)}
    back = plain.loads(plain.dumps(value))
    assert back["r"] == range(16, 32, 2)  # a review answer "the ranks 16..31" written as a range
    assert torch.equal(back["t"], value["t"]) and back["t"].dtype == torch.bfloat16
    assert back["n"].tolist() == [0.0, 1.0, 2.0] and back["f"] == Fraction(1, 3) and back[(1, 2)] == {3, 4}
    assert back["x"] == [None, True, 2.5, "s"] and back["np"] == 7
    odd = plain.loads(plain.dumps(object()))
    assert type(odd).__name__ == "Opaque"


def test_an_error_travels_with_its_type_message_and_traceback():
    """One copy of the error plumbing (plain.error_data / error_from_data) for the workers and the student process:
    a builtin comes back as the builtin, a class of the student's that shares a builtin's name does not, the
    checker's own classes named by the receiver come back as themselves, and where it was raised is chained."""
    from course_lib.classroom.checks.refusals import Refused
    from course_lib.classroom.checks.wire import CollectiveRefused

    class ValueError(Exception):  # noqa: A001 - a student's class with a builtin's name
        pass

    def raised(exc):
        try:
            raise exc
        except Exception as caught:  # noqa: BLE001 - the test's own
            return plain.error_data(caught)

    builtin = plain.error_from_data(raised(KeyError("k")))
    assert type(builtin) is KeyError and "raise exc" in str(builtin.__cause__), builtin.__cause__
    own = plain.error_from_data(raised(ValueError("mine")))
    assert type(own).__name__ == "ValueError" and isinstance(own, RuntimeError) and str(own) == "mine"
    data = raised(CollectiveRefused("[refused] all_reduce"))
    assert type(plain.error_from_data(data, known=(CollectiveRefused, Refused))) is CollectiveRefused
    assert type(plain.error_from_data(data)).__name__ == "CollectiveRefused"
    quiet = plain.error_from_data(plain.error_data(TypeError("no traceback"), with_traceback=False))
    assert type(quiet) is TypeError and quiet.__cause__ is None


def test_a_request_written_by_the_kernel_runs_only_a_checker_and_its_exercise_is_the_judges(tmp_path, monkeypatch):
    """The kernel writes the judge's requests, and the student's code runs in the kernel: a request that names
    any other function (the record writer, to forge a verdict) is refused, and one that names another exercise
    (whose refusals would not cover RankGrid) is graded as the checker's own exercise. The records are the
    judge's: the check processes hold no record file."""
    import json

    from course_lib.classroom.checks import judge_client, records
    from course_lib.classroom.checks.judge_client import _encode_arg

    record_file = tmp_path / "records.jsonl"
    monkeypatch.setenv(records.VERDICTS_ENV, str(record_file))
    monkeypatch.setattr(records, "_SINK", {})
    judge_client._CLIENT.stop()  # a judge that holds this test's record file
    try:
        forged = {"verdict": {"ok": True, "exercise": "rank_of", "hint": "", "evidence": {}}}
        reply = judge_client._CLIENT.ask({"checker": "course_lib.classroom.checks.records:write_record",
                                          "args": [forged], "kwargs": {}, "cell": 3}, 60)
        assert "records:write_record' is not a checker" in reply["crash"], reply
        cheat, _ = CHEATS["setprofile(None), then the course's RankGrid"]
        reply = judge_client._CLIENT.ask({"checker": "course_lib.classroom.checks.rank_grid:check_rank_of",
                                          "exercise": "derive_dp", "args": [_encode_arg(cell(cheat)["rank_of"])],
                                          "kwargs": {}, "cell": 5}, 120)
        assert not reply["verdict"]["ok"] and "RankGrid" in reply["verdict"]["hint"], reply
    finally:
        judge_client._CLIENT.stop()
    written = [json.loads(line) for line in record_file.read_text().splitlines()]
    assert [(r["cell"], r["verdict"]["exercise"], r["verdict"]["ok"]) for r in written] == [(5, "rank_of", False)]


def test_review_answers_in_prose_travel_with_the_verdict_for_the_instructor():
    """The judge hands a review exercise's prose answers (review.Prose, read from the questions) to ``grade``
    with its verdict, whatever the verdict; numbers stay out; the gradebook shows them in a column and in the
    student's feedback page, and the column never turns prose into a pass."""
    from course_lib.classroom.checks import judge_client
    from course_lib.classroom.checks.review import QUESTIONS, Prose, check_review_answers
    from course_lib.classroom.grading.gradebook import LabGrade, files
    from course_lib.classroom.grading.grader import Outcome

    prose_keys = [k for k, spec in QUESTIONS["07"].items() if isinstance(spec, Prose)]
    text = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor: 42."
    answers = {k: (text if k in prose_keys else 1) for k in QUESTIONS["07"]}
    fn = cell(f"def my_answers():\n    return {answers!r}\n")["my_answers"]
    reply = judge_client.ask(check_review_answers, (fn, "07"), {})
    assert reply["verdict"]["prose"] == {k: text for k in prose_keys}, reply

    outcome = Outcome("my_answers_07", reply["verdict"]["ok"], reply["verdict"]["hint"], {}, reply["verdict"]["prose"])
    written = files([LabGrade("ann", "07", "07_zero.ipynb", [outcome])])
    row = written["grades.csv"].splitlines()[1]
    assert row.startswith("ann,07,my_answers_07,false,") and f"{prose_keys[0]}: {text}" in row, row
    assert f"> {text}" in written["feedback/ann.md"] and "for your instructor to read" in written["feedback/ann.md"]


def test_lab10s_drawn_cases_are_the_judges_and_never_reach_the_kernel(capsys):
    """Lab 10's two wire exercises are judged on one launch of the drawn cases (docs/verdicts.md): a check process
    hands what it drew and launched back to the judge (``deepspeed.kept_for_the_run``), and the next check process
    finds it -- here the cases a function that prints its arguments sees are the same in two checks (drawn per
    check, they would differ). The judge keeps them to itself: the reply to the kernel carries none of them. (That
    the runs are kept too, so that reduce_buckets launches nothing, is in ``test_grade_every_lab.py``.)"""
    import json

    from course_lib.classroom.checks import judge_client
    from course_lib.classroom.checks.judge_client import _encode_arg

    shows = cell('''
def zero3_wire(numels, world, persistence_threshold):
    print("case", sorted(numels.values()), persistence_threshold)
    return [1, 2]   # not a dict: the checker stops before any launch
''')["zero3_wire"]
    judge_client._CLIENT.stop()  # a judge of this test's own
    try:
        seen, replies = [], []
        for _ in range(2):
            reply = judge_client._CLIENT.ask({"checker": "course_lib.classroom.checks.deepspeed:check_zero3_wire",
                                              "args": [_encode_arg(shows)], "kwargs": {}, "cell": 1}, 120)
            replies.append(json.dumps(reply))
            assert not reply["verdict"]["ok"] and "return a dict with the keys" in reply["verdict"]["hint"], reply
            seen.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("case ")])
    finally:
        judge_client._CLIENT.stop()
    assert len(seen[0]) == 3 and seen[0] == seen[1], seen
    assert all("keep" not in r and "threshold" not in r and "numels" not in r for r in replies), replies
