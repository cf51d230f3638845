"""``python -m course_lib grade``: a synthetic class, built in a temporary folder from the official Lab 01, is
graded, and the gradebook is right for every student.

The class: a right solution, a right one written differently (the checkers' own alternates), the cheats
of the checkers' meta-test (tests/classroom/checks/test_proofs.py, test_lab01_checks.py: a wrapped
reference, a patch of the library, the course's own RankGrid), a faked "✓" output, an edited checker
cell, a hanging exercise, a crashing kernel, a notebook that deletes and writes files outside and reads
the solutions, one that leaves processes behind, a deleted lab, malformed JSON, a zip file, a stamp of no
release, copies of two older releases (one graded against its release, one refused), the cheats that pass a
checker running in the student's kernel -- setprofile(None), a thread, patched checker helpers, the checker's
frames, forged verdict records and forged requests to the judge (hex) -- and the reference read from disk (rex); a
fork bomb (bo) and memory spread over 8 processes (mo). To stay fast the official lab is cut to its graded cells (the
exercises and their checkers, unchanged): grading runs exactly as on the whole lab. The class is graded with a run's
caps lowered to what Lab 01 needs (``tasks_max`` 256, 2 GiB), so that the fork bomb and the memory hog reach
them without loading the machine (2,048 tasks on 2 cores are a load of ~1,000 for seconds).
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import socket
import subprocess
import zipfile
from pathlib import Path

import mini_labs  # this folder is on sys.path (no __init__.py): rootdir-relative import mode
import pytest

from course_lib.classroom.grading import grade_class, landlock
from course_lib.classroom.grading.cgroups import RunGroup, remove_groups_of_ended
from course_lib.classroom.grading.grader import FORGED
from course_lib.classroom.grading.official import source_of
from course_lib.classroom.grading.sandbox import namespaces_available
from course_lib.classroom.notebooks.generator import lab_text

ROOT = Path(__file__).resolve().parents[2]
OFFICIAL = ROOT / "solutions" / "01_topology.ipynb"
TIMEOUT_S = 8.0  # a student-lab takes 3 s on an idle 2-core machine, up to 10 s when it is shared
LEFT_BEHIND = "7777.25"  # the argument of the `sleep` a student's code leaves running


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem + "_for_grading", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAB01 = _load(ROOT / "tests" / "classroom" / "checks" / "test_lab01_checks.py")


def _sources(*fns) -> str:
    return "\n\n".join(inspect.getsource(fn) for fn in fns)


RIGHT_DIFFERENTLY = {
    "derive_dp": "def derive_dp(world_size, tp, pp, cp=1):\n"
                 "    dp, rest = divmod(world_size, tp * pp * cp)\n"
                 "    if rest:\n"
                 "        raise ValueError(f'world_size={world_size} is not divisible by tp*pp*cp')\n"
                 "    return dp\n",
    "groups_of": "import numpy as np\nimport torch\n\n" + _sources(LAB01._coords, LAB01._groups, LAB01._megatron,
                                                               LAB01.groups_right, LAB01.groups_as_arrays_tuples_tensors)
                 + "\n\ngroups_of = groups_as_arrays_tuples_tensors\n",
    "rank_of": "import numpy as np\n\ndef rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):\n"
               "    return int(np.ravel_multi_index((pp_rank, dp_rank, cp_rank, tp_rank), (pp, dp, cp, tp)))\n",
}
CHEATS = {  # the meta-test's cheats, as a student writes them
    "derive_dp": "from course_lib import rules\n\ndef derive_dp(world_size, tp, pp, cp=1):\n"
                 "    return rules.data_parallel_size(world_size, tp, pp, cp)\n",
    "groups_of": "import numpy as np\nimport torch\nimport course_lib.topology as topology\n\n"
                 + _sources(LAB01._coords, LAB01._groups, LAB01._megatron, LAB01.groups_right,
                            LAB01.groups_patch_rankgrid) + "\n\ngroups_of = groups_patch_rankgrid\n",
    "rank_of": "from course_lib.topology import RankGrid\n\ndef rank_of(t, k, d, p, tp, cp, dp, pp):\n"
               "    return RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(tp=t, cp=k, dp=d, pp=p)\n",
}


FORGED_VERDICT = "{'ok': True, 'exercise': 'derive_dp', 'hint': '', 'evidence': {'calls': 11}}"
JUDGE_CHEATS = {  # the cheats that pass a checker running in the student's kernel (issue 32), through grade
    "derive_dp": (  # forged verdicts: kernel's record file, a thread during the checker cell, requests to the judge
        "import json, sys, threading, time\n"
        "from course_lib.classroom.checks import judge_client, records\n"
        f"FORGED = {FORGED_VERDICT}\n"
        "here = judge_client.RUNNING['cell']\n"
        "for cell in range(here, here + 4):  # the judge asked to run write_record, 'from' the checker cell\n"
        "    line = {'id': -cell, 'checker': 'course_lib.classroom.checks.records:write_record',\n"
        "            'args': [{'verdict': FORGED}], 'kwargs': {}, 'cell': cell}\n"
        "    judge_client._CLIENT.proc.stdin.write((json.dumps(line) + '\\n').encode())\n"
        "    judge_client._CLIENT.proc.stdin.flush()\n\n"
        "def forge():\n"
        "    for _ in range(200):\n"
        "        records.write_record({'verdict': FORGED})\n"
        "        time.sleep(0.05)\n\n"
        "threading.Thread(target=forge, daemon=True).start()\n\n"
        "def derive_dp(world_size, tp, pp, cp=1):\n"
        "    records.write_record({'verdict': FORGED})\n"
        "    print('✓ derive_dp: all cases right')\n"
        "    frame = sys._getframe(1)\n"
        "    while frame is not None:  # the expected value off the checker's frames\n"
        "        for key in ('expected', 'want', 'truth', 'dp'):\n"
        "            if isinstance(frame.f_locals.get(key), int):\n"
        "                return frame.f_locals[key]\n"
        "        frame = frame.f_back\n"
        "    return 0\n"),
    "groups_of": (  # the course's RankGrid in a thread
        "import threading\nfrom course_lib.topology import RankGrid\n\n"
        "def groups_of(rank, layout):\n"
        "    box = []\n"
        "    def run():\n"
        "        grid = RankGrid(layout['world_size'], tp=layout['tp'], pp=layout['pp'], cp=layout['cp'])\n"
        "        box.append({k: list(v) for k, v in grid.groups_of(rank).items()})\n"
        "    thread = threading.Thread(target=run)\n"
        "    thread.start()\n"
        "    thread.join()\n"
        "    return box[0] if box else {}\n"),
    "rank_of": (  # sys.setprofile(None) and the course's RankGrid; the checker's helpers patched from the cell
        "import sys\nimport course_lib.classroom.checks.rank_grid as checker\n"
        "from course_lib.topology import RankGrid\n"
        "sys.setprofile(None)\n"
        "checker.same_number = lambda *args, **kwargs: True\n\n"
        "def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):\n"
        "    sys.setprofile(None)\n"
        "    return RankGrid(tp * cp * dp * pp, tp=tp, pp=pp, cp=cp).rank_of(tp=tp_rank, cp=cp_rank, dp=dp_rank, "
        "pp=pp_rank)\n"),
}


def _mini_solution(folder: Path) -> Path:
    """Lab 01's solution cut to its graded cells (exercises and checkers, as they are: they need no other cell)."""
    return mini_labs.mini_solution(OFFICIAL, folder)


_student, _write = mini_labs.student, mini_labs.write


def _checker_cells(notebook: dict) -> list[dict]:
    return [c for c in notebook["cells"] if c["cell_type"] == "code" and "check_" in source_of(c)
            and "exercise" not in c.get("metadata", {}).get("tags", [])]


def _snapshot(folder: Path, skip: Path) -> dict:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() and skip not in p.parents}


def _releases(course: Path, solution_path: Path) -> tuple[dict, dict]:
    """Make ``course`` a git repository with two releases of the lab: A, whose checker cells differ from
    today's, and B, whose do not; today's solution gains a markdown cell. The students' copies of A and B."""
    def git(*args):
        subprocess.run(["git", "-C", str(course), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    today = json.loads(solution_path.read_text())
    released = {}
    git("init", "-q")
    for release in ("A", "B"):
        solution = json.loads(json.dumps(today))
        if release == "A":
            _checker_cells(solution)[0]["source"] = "# an older checker cell\n" + source_of(_checker_cells(solution)[0])
        solution_path.write_text(json.dumps(solution, indent=1))
        _write(course / "labs" / OFFICIAL.name, lab_text(solution_path))
        git("add", "-A")
        git("commit", "-qm", release)
        released[release] = _student(json.loads(lab_text(solution_path)), solution)
    today["cells"].append({"cell_type": "markdown", "id": "today", "metadata": {}, "source": "Added today."})
    solution_path.write_text(json.dumps(today, indent=1))
    return released["A"], released["B"]


HOPPER = "7777.31"  # the argument of the `sleep`s a pid-hopping daemon keeps starting
LISTENERS: dict = {}


def _reaching_out() -> str:
    """A derive_dp cell that reads the grader's environment, signals the grader, connects to the grader's TCP and
    abstract unix listeners, looks for an unbounded folder to write, and leaves a daemon that keeps forking;
    derive_dp is right only when every one was refused."""
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(f"\0course-grade-test-{os.getpid()}")
    unix.listen()
    LISTENERS.update(tcp=tcp, unix=unix)
    return (
        "import os, socket\nbroke = []\n\n"
        "def attempt(what, action):\n    try:\n        action()\n        broke.append(what)\n    except OSError:\n"
        "        pass\n\n"
        f"attempt('the environ of the grader', lambda: open('/proc/{os.getpid()}/environ', 'rb').read())\n"
        f"attempt('a signal to the grader', lambda: os.kill({os.getpid()}, 0))  # its pid is outside the run's\n"
        f"attempt('the TCP listener', lambda: socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), 2))\n"
        f"attempt('the unix listener', lambda: socket.socket(socket.AF_UNIX).connect({unix.getsockname()!r}))\n"
        "home = os.statvfs(os.environ['HOME'])  # a folder of bounded size and files: many small ones fill no disk\n"
        "if home.f_files > 100_000 or home.f_blocks * home.f_frsize > 2 ** 30:\n    broke.append('the disk')\n"
        "if os.fork() == 0:\n    os.setsid()\n"
        f"    os.execvp('sh', ['sh', '-c', 'while :; do (sleep {HOPPER} &); sleep 0.1; done'])\n\n"
        "def derive_dp(world_size, tp, pp, cp=1):\n"
        "    if broke or world_size % (tp * pp * cp):\n        raise ValueError(f'not divisible {broke}')\n"
        "    return world_size // (tp * pp * cp)\n")


TASKS_MAX, MEMORY_GIB = 256, 2.0   # a run's caps for this class: Lab 01 needs far less (grade_class's defaults are
                                   # 2,048 tasks and 8 GiB)


def _bomb_is_capped() -> bool:
    """Whether a fork bomb in a run would meet a cap: an ordinary user's RLIMIT_NPROC, or as root a pids group the
    grader can make (a root without one -- a chroot whose /sys/fs/cgroup is not mounted -- has no cap at all)."""
    if os.geteuid() != 0:
        return True
    probe = RunGroup(f"course-pids-probe-{os.getpid()}", memory_bytes=2 ** 30, tasks=TASKS_MAX)
    try:
        return "pids" in probe.controllers
    finally:
        probe.kill()


BOMB_IS_CAPPED = _bomb_is_capped()


def _memory_hog() -> str:
    """A derive_dp cell that first checks the per-process limit (70% of the cap fits in one process, 110% does not),
    then starts 8 processes each holding a quarter of the run's memory cap (each far below the per-process
    address-space limit, twice the cap together) and waits for them; derive_dp is right only when the per-process
    limit held as said and the run's memory cap (the whole group's, not a process's) killed one.

    The processes fill their blocks one after another, each holding its block until the cell lets go, so that when
    the cap is reached the holders are the run's largest processes (a forked child's RSS also counts the kernel's
    pages it shares): the OOM killer takes one of them, never the kernel. Filled all at once, as they were, a busy
    machine could leave every block partly filled at that moment and the kernel the largest process."""
    cap = int(MEMORY_GIB * 2 ** 30)
    quarter = cap // 4
    return (
        # One process: 70% of the cap in one block fits (the budget comes on top of what the imports map: torch's CPU
        # build ~0.6 GiB, its CUDA build ~3.1 GiB), 110% is refused at once (RLIMIT_AS, before a page is touched).
        "import os\n"
        f"try:\n    block = b'x' * {int(cap * 0.7)}\n    fits = True\n    del block\nexcept MemoryError:\n    fits = False\n"
        f"try:\n    bytearray({int(cap * 1.1)})\n    over = True\nexcept MemoryError:\n    over = False\n"
        "let_go_r, let_go_w = os.pipe()\nkids, statuses = [], []\n"
        "for _ in range(8):\n    filled_r, filled_w = os.pipe()\n    pid = os.fork()\n    if pid == 0:\n        try:\n"
        "            os.close(let_go_w)\n"
        f"            block = b'x' * {quarter}\n"
        "            os.write(filled_w, b'.')\n            os.read(let_go_r, 1)  # hold the block\n"
        "        finally:\n            os._exit(0)\n"
        "    os.close(filled_w)\n    kids.append(pid)\n"
        "    filled = os.read(filled_r, 1)\n    os.close(filled_r)\n"
        "    if not filled:  # it died filling its block\n        statuses.append(os.waitpid(pid, 0)[1])\n"
        "        kids.remove(pid)\n"
        "    for other in list(kids):  # or a holder died\n        done, status = os.waitpid(other, os.WNOHANG)\n"
        "        if done:\n            statuses.append(status)\n            kids.remove(other)\n"
        "    if statuses:\n        break\n"
        "os.close(let_go_w)\nstatuses += [os.waitpid(pid, 0)[1] for pid in kids]\n"
        "contained = any(os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9 for s in statuses)\n\n"
        "def derive_dp(world_size, tp, pp, cp=1):\n"
        "    if not (fits and contained) or over or world_size % (tp * pp * cp):\n"
        "        raise ValueError(f'fits={fits}, over={over}, contained={contained}: 8 processes held twice the cap')\n"
        "    return world_size // (tp * pp * cp)\n")


def _class(tmp: Path) -> tuple[Path, Path]:
    course = tmp / "course"
    solution_path = _mini_solution(course)
    subs = tmp / "submissions"
    name = OFFICIAL.name
    release_a, release_b = _releases(course, solution_path)
    _write(subs / "nia" / name, release_b)
    _write(subs / "oto" / name, release_a)
    solution = json.loads(solution_path.read_text())
    lab = json.loads(lab_text(solution_path))
    _write(subs / "ada" / "my-labs" / name, _student(lab, solution))
    _write(subs / "bea" / name, _student(lab, solution, RIGHT_DIFFERENTLY))
    _write(subs / "cy" / name, _student(lab, solution, CHEATS))
    _write(subs / "hex" / name, _student(lab, solution, JUDGE_CHEATS))
    _write(subs / "rex" / name, _student(lab, solution, {"rank_of": (  # the reference's source, read in the worker
        "import course_lib.topology.grid as grid\n\n"
        "def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):\n"
        "    space = {}\n"
        "    exec(open(grid.__file__.replace('.pyc', '.py')).read(), space)\n"
        "    made = space['RankGrid'](tp * cp * dp * pp, tp=tp, pp=pp, cp=cp)\n"
        "    return made.rank_of(tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)\n")}))

    faked = _student(lab, solution, solved=False)  # stubs, with the solution's "✓" lines pasted in as outputs
    for cell, solved in zip(_checker_cells(faked), _checker_cells(solution)):
        cell["outputs"] = solved["outputs"]
        assert "✓" in json.dumps(cell["outputs"], ensure_ascii=False)
    _write(subs / "dee" / name, faked)

    edited = _student(lab, solution, {"derive_dp": "def derive_dp(world_size, tp, pp, cp=1):\n"
                                                   "    return world_size // (tp * pp)\n"})
    for cell in _checker_cells(edited):
        cell["source"] = "print('✓ all right')\n"
    _write(subs / "eli" / name, edited)

    _write(subs / "fay" / name, _student(lab, solution, {  # a hang that waits: the grader's clock is the wall's, and
        # a busy loop would cost TIMEOUT_S of CPU for the same verdict (the run is killed whole either way)
        "groups_of": "import time\n\ndef groups_of(rank, layout):\n    while True:\n        time.sleep(1)\n"}))
    _write(subs / "gus" / "README.txt", "I deleted the lab")
    _write(subs / "hal" / name, '{"cells": [')
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr(f"my-labs/{name}", json.dumps(_student(lab, solution)))
        z.writestr("../../escape.ipynb", "{}")
    (subs / "ivy.zip").write_bytes(archive.getvalue())

    victim, outside = tmp / "victim.txt", tmp / "outside.txt"
    victim.write_text("keep me")
    _write(subs / "jo" / name, _student(lab, solution, {"derive_dp": (
        "import os\nbroke = []\n"
        f"for attempt in (lambda: os.remove({str(victim)!r}), lambda: open({str(outside)!r}, 'w').write('x'),\n"
        f"                lambda: open({str(solution_path)!r}).read()):\n"
        "    try:\n        attempt()\n        broke.append(attempt)\n    except OSError:\n        pass\n\n"
        "def derive_dp(world_size, tp, pp, cp=1):\n"
        "    if broke or world_size % (tp * pp * cp):\n        raise ValueError('not divisible')\n"
        "    return world_size // (tp * pp * cp)\n")}))
    _write(subs / "kai" / name, _student(lab, solution, {
        "rank_of": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)  # the kernel itself crashes\n\n"
                   "def rank_of(*coordinates):\n    return 0\n"}))
    _write(subs / "lee" / name, _student(lab, solution, {"derive_dp": (
        "import os, subprocess\n\ndef derive_dp(world_size, tp, pp, cp=1):\n"
        f"    subprocess.Popen(['sleep', '{LEFT_BEHIND}'], start_new_session=True)\n"
        "    if os.fork() == 0:  # an orphan in a session of its own\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        f"            os.execvp('sleep', ['sleep', '{LEFT_BEHIND}'])\n"
        "        os._exit(0)\n"
        "    if world_size % (tp * pp * cp):\n        raise ValueError('not divisible')\n"
        "    return world_size // (tp * pp * cp)\n")}))
    _write(subs / "zed" / name, _student(lab, solution, {"derive_dp": _reaching_out()}))
    if BOMB_IS_CAPPED:  # uncapped (root without a pids group), a fork bomb would take the machine, not test the grader
        _write(subs / "bo" / name, _student(lab, solution, {"derive_dp": (  # a fork bomb that outlasts its time limit
            "import subprocess, time\nsubprocess.Popen(['sh', '-c', 'b() { b | b & }; b'])\ntime.sleep(60)\n\n"
            "def derive_dp(world_size, tp, pp, cp=1):\n    if world_size % (tp * pp * cp):\n"
            "        raise ValueError('not divisible')\n    return world_size // (tp * pp * cp)\n")}))
    _write(subs / "mo" / name, _student(lab, solution, {"derive_dp": _memory_hog()}))
    (subs / "pat").mkdir()
    os.mkfifo(subs / "pat" / name)  # a notebook that is a FIFO: opening it would wait for a writer
    stale = _student(lab, solution)
    stale["metadata"]["course_lib"]["generated_sha256"] = "0" * 64
    _write(subs / "max" / name, stale)
    return subs, solution_path.parent


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grading")
    subs, solutions = _class(tmp)
    out = tmp / "grades"
    before = _snapshot(tmp, out)
    lines = []
    grades = grade_class(subs, out, ["01"], timeout=TIMEOUT_S, solutions=solutions, log=lines.append,
                         tasks_max=TASKS_MAX, memory_gib=MEMORY_GIB)
    rows = list(csv.DictReader(io.StringIO((out / "grades.csv").read_text(encoding="utf-8"))))
    return dict(tmp=tmp, out=out, subs=subs, solutions=solutions, grades=grades, lines=lines, before=before,
                rows={(r["student"], r["exercise"]): r for r in rows})


def _passed(graded, student) -> dict:
    return {ex: graded["rows"][(student, ex)]["passed"] == "true" for ex in ("derive_dp", "groups_of", "rank_of")}


ALL = {"derive_dp": True, "groups_of": True, "rank_of": True}
NONE = {"derive_dp": False, "groups_of": False, "rank_of": False}


def test_right_solutions_pass_however_written_and_however_submitted(graded):
    for student in ("ada", "bea", "ivy"):
        assert _passed(graded, student) == ALL, [graded["rows"][(student, e)] for e in ALL]
    assert re.fullmatch(r"\d+ calls", graded["rows"][("ada", "groups_of")]["evidence"])  # cases drawn per run
    students = "ada bea cy dee eli fay gus hal hex ivy jo kai lee max mo nia oto pat rex zed".split()
    students += ["bo"] * BOMB_IS_CAPPED
    assert set(graded["rows"]) == {(s, e) for s in students
                                   for e in ALL}


def test_the_meta_tests_cheats_fail_with_the_checkers_own_hint(graded):
    assert _passed(graded, "cy") == NONE
    # through the judge (as in the notebook): the course's function is refused where the student's code runs
    hint = graded["rows"][("cy", "derive_dp")]["hint"]
    assert "course_lib.rules.data_parallel_size" in hint and "write it yourself" in hint, hint
    # the judge refuses the patch where the function runs (replacing RankGrid.groups_of reaches for RankGrid)
    assert "course_lib.topology.RankGrid" in graded["rows"][("cy", "groups_of")]["hint"]
    assert "course_lib.topology.RankGrid" in graded["rows"][("cy", "rank_of")]["hint"]


def test_cheats_that_switch_a_checker_off_or_forge_its_verdict_fail_through_the_judge(graded):
    """The checkers run in the run's judge (a process the kernel forked before the student's first cell, fenced
    apart): setprofile(None), threads, patched checker helpers and the checker's frames reach nothing there,
    and the grade is read from the judge's own record file, not from what the kernel writes."""
    rows = graded["rows"]
    assert _passed(graded, "hex") == NONE, [rows[("hex", e)] for e in ALL]
    assert "RankGrid" in rows[("hex", "rank_of")]["hint"], rows[("hex", "rank_of")]
    assert "RankGrid" in rows[("hex", "groups_of")]["hint"], rows[("hex", "groups_of")]
    assert "derive_dp" in rows[("hex", "derive_dp")]["hint"] and rows[("hex", "derive_dp")]["evidence"] != "", \
        rows[("hex", "derive_dp")]
    # the judge's workers inside the sandbox read what the run may, less the exercise's references
    assert _passed(graded, "rex") == {"derive_dp": True, "groups_of": True, "rank_of": False}
    assert "Permission denied" in rows[("rex", "rank_of")]["hint"] and "grid.py" in rows[("rex", "rank_of")]["hint"]
    feedback = (graded["out"] / "feedback" / "hex.md").read_text(encoding="utf-8")
    assert FORGED in feedback, feedback  # the feedback says the forged records were ignored
    assert FORGED not in (graded["out"] / "feedback" / "ada.md").read_text(encoding="utf-8")


def test_faked_outputs_and_edited_checker_cells_change_nothing(graded):
    assert _passed(graded, "dee") == NONE
    assert graded["rows"][("dee", "derive_dp")]["hint"].startswith("not attempted yet: write derive_dp")
    assert _passed(graded, "eli") == {"derive_dp": False, "groups_of": True, "rank_of": True}
    assert "context parallelism is a factor" in graded["rows"][("eli", "derive_dp")]["hint"]


def test_a_hang_or_a_crash_costs_only_its_own_exercise(graded):
    assert _passed(graded, "fay") == {"derive_dp": True, "groups_of": False, "rank_of": True}
    assert graded["rows"][("fay", "groups_of")]["hint"] == f"timed out: its cells and its checker ran over {TIMEOUT_S:g} s"
    assert _passed(graded, "kai") == {"derive_dp": True, "groups_of": True, "rank_of": False}
    assert graded["rows"][("kai", "rank_of")]["hint"] == ("crashed: the notebook's process was killed by signal SIGSEGV "
                                                          "(a crash in native code) while its cells and its checker ran")


def test_missing_unreadable_and_stale_notebooks_get_one_line_each(graded):
    rows = graded["rows"]
    assert {rows[("gus", e)]["hint"] for e in ALL} == {"not submitted"}
    assert rows[("hal", "derive_dp")]["hint"].startswith("not graded: hal/01_topology.ipynb: not valid JSON")
    assert rows[("max", "rank_of")]["hint"].startswith("refused: its stamp names no release of labs/01_topology")
    assert rows[("pat", "rank_of")]["hint"] == ("not graded: pat/01_topology.ipynb is not a regular file (a FIFO, a "
                                                "device or a socket); submit the notebook file itself")
    assert all(not passed for s in ("gus", "hal", "max", "oto") for passed in _passed(graded, s).values())
    assert rows[("oto", "groups_of")]["hint"].startswith("refused: it is the lab released in commit ")
    assert "whose exercise or checker cells differ from today's" in rows[("oto", "groups_of")]["hint"]


def test_a_copy_of_an_older_release_is_graded_against_that_release(graded):
    assert _passed(graded, "nia") == ALL
    feedback = (graded["out"] / "feedback" / "nia.md").read_text(encoding="utf-8")
    assert "your notebook is the lab released in commit " in feedback and "graded against that version" in feedback


@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_nothing_outside_the_output_folder_is_touched_and_no_process_outlives_grading(graded):
    tmp = graded["tmp"]
    assert _passed(graded, "jo") == ALL  # each of its attempts was refused (else its derive_dp fails)
    assert (tmp / "victim.txt").read_text() == "keep me" and not (tmp / "outside.txt").exists()
    assert _snapshot(tmp, graded["out"]) == graded["before"]
    assert sorted(p.name for p in graded["out"].iterdir()) == [".course_outputs.json", "feedback", "grades.csv",
                                                               "totals.csv"]
    assert _passed(graded, "lee") == ALL
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            left += [pid] if LEFT_BEHIND in cmdline or HOPPER in cmdline else []
        except OSError:
            pass
    assert left == []


@pytest.mark.skipif(not namespaces_available(), reason="a run gets namespaces of its own only when grading as root")
def test_the_graders_environment_its_listeners_and_a_pid_hopping_daemon_are_out_of_reach(graded):
    # zed read /proc/<grader>/environ, signalled the grader, connected to a TCP and an abstract unix listener of the
    # grader's and left a daemon that keeps forking: its derive_dp passes only if all were refused (daemon: above)
    assert graded["rows"][("zed", "derive_dp")]["passed"] == "true", graded["rows"][("zed", "derive_dp")]


@pytest.mark.skipif(os.geteuid() != 0, reason="as an ordinary user RLIMIT_NPROC stops a fork bomb")
@pytest.mark.skipif(not BOMB_IS_CAPPED, reason="grading as root without a writable pids cgroup: nothing would cap it")
def test_a_fork_bomb_is_capped_by_its_group_and_killed_whole(graded):
    # bo's cell starts a shell fork bomb and sleeps past the time limit: the grader kept answering, the bomb costs
    # only that exercise (the run again without it grades the others), no run's control group is left
    assert _passed(graded, "bo") == {"derive_dp": False, "groups_of": True, "rank_of": True}
    assert graded["rows"][("bo", "derive_dp")]["hint"] == f"timed out: its cells and its checker ran over {TIMEOUT_S:g} s"
    assert not any(line.startswith("warning: grading as root") for line in graded["lines"]), graded["lines"]
    assert not _orphaned_run_groups()


@pytest.mark.skipif(os.geteuid() != 0 or not BOMB_IS_CAPPED, reason="no writable pids cgroup")
def test_the_groups_of_a_killed_grader_are_removed_when_the_next_zygote_starts():
    # a grader killed with SIGKILL leaves its runs' groups (a CI run of `make test` interrupted by hand left one,
    # and the fork bomb's test then found it); the next zygote removes those whose maker has ended, and no other
    ended = subprocess.Popen(["true"])
    ended.wait()
    left, alive = RunGroup(f"course-grade-{ended.pid}-1", 2 ** 30), RunGroup(f"course-grade-{os.getpid()}-1", 2 ** 30)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for folder in left.folders.values():
            (folder / "cgroup.procs").write_text(str(sleeper.pid))
        remove_groups_of_ended("course-grade-")
        assert sleeper.wait(timeout=10) == -9
        assert not any(folder.exists() for folder in left.folders.values())
        assert all(folder.exists() for folder in alive.folders.values())
    finally:
        sleeper.kill()
        alive.kill()
        left.kill()


@pytest.mark.skipif(os.geteuid() != 0, reason="as an ordinary user memory is limited per process only")
def test_memory_spread_over_8_processes_is_capped_for_the_run_as_a_whole(graded):
    # mo's cell: 8 processes of a quarter of the cap each, none over the per-process limit: the run's memory group
    # killed one (derive_dp passes only then), and the rest of the run went on
    assert _passed(graded, "mo") == ALL, [graded["rows"][("mo", e)] for e in ALL]


def _orphaned_run_groups() -> list[Path]:
    """Run groups (``course-grade-<zygote pid>-<n>``) whose grader's zygote has ended: another grading may be
    running in the other xdist worker, and its groups are alive with it."""
    groups = [*Path("/sys/fs/cgroup").glob("*/course-grade-*"), *Path("/sys/fs/cgroup").glob("*/*/*/course-grade-*")]
    return [g for g in groups if not Path(f"/proc/{g.name.split('-')[2]}").exists()]


def test_feedback_summary_and_a_rerun_that_writes_the_same_bytes(graded, tmp_path):
    out = graded["out"]
    feedback = (out / "feedback" / "fay.md").read_text(encoding="utf-8")
    assert "## Lab 01 (01_topology.ipynb): 2 of 3 passed" in feedback and "✗ `groups_of`: timed out" in feedback
    assert "- ✓ `derive_dp`" in feedback
    table = next(line for line in graded["lines"] if line.startswith("lab  exercise")).splitlines()
    passed, students = ((11, 12, 11), 21) if BOMB_IS_CAPPED else ((11, 11, 10), 20)  # bo passes 2 of 3
    # where the grader cannot contain them, zed's listeners are reachable (no network namespace: an ordinary user, or
    # root without CAP_SYS_ADMIN) and mo's processes share no memory cap (an ordinary user): their derive_dp fails
    uncontained = (not namespaces_available()) + (os.geteuid() != 0)
    passes = [f"{n - uncontained * (i == 0)}/{students}" for i, n in enumerate(passed)]
    assert [line.split()[:3] for line in table[1:]] == [["01", e, n] for e, n in zip(ALL, passes)]
    assert re.search(r" \(\d+\)$", table[3]), table  # the most common hint of rank_of, and how many got it
    seconds = [float(line.rsplit("(", 1)[1].split()[0]) for line in graded["lines"] if " passed (" in line]
    print(f"\nseconds per student-lab: {sorted(seconds)}")

    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    small = tmp_path / "small"
    for name in ("ada", "gus", "hal"):
        shutil.copytree(graded["subs"] / name, small / name)
    again = tmp_path / "again"   # the same students graded again, in a class of their own
    grade_class(small, again, ["01"], timeout=TIMEOUT_S, solutions=graded["solutions"], log=lambda _: None)
    def without_evidence(folder, students):  # the checkers draw their cases per run: how many calls they took varies
        rows = list(csv.DictReader(io.StringIO((folder / "grades.csv").read_text(encoding="utf-8"))))
        return [{k: v for k, v in row.items() if k != "evidence"} for row in rows if row["student"] in students]

    assert without_evidence(again, {"ada", "gus", "hal"}) == without_evidence(out, {"ada", "gus", "hal"})
    assert before["ada.md"] == (again / "feedback" / "ada.md").read_bytes()


def test_bad_command_lines_are_one_line_errors(tmp_path, capsys):
    from course_lib.__main__ import main

    subs = tmp_path / "subs"
    subs.mkdir()
    (tmp_path / "grades").mkdir()
    (tmp_path / "grades" / "grades.csv").write_text("mine")
    cases = [(["grade", str(subs), "--labs", "42", "--out", str(tmp_path / "o")], "--labs='42' names no lab"),
             (["grade", str(subs), "--out", str(subs / "grades")], "is inside SUBMISSIONS"),
             (["grade", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "is not a folder"),
             (["grade", str(subs), "--timeout", "0.01", "--out", str(tmp_path / "o")], "--timeout=0.01"),
             (["grade", str(subs), "--out", str(tmp_path / "grades")], "was not written by this command")]
    for argv, words in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "grades" / "grades.csv").read_text() == "mine"
