"""course_lib.classroom.notebooks.nbval_plugin: in one ``pytest --nbval`` session, labs/ is compared laxly and solutions/ strictly."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat


def _notebook(path, checked_output):
    stale = nbformat.v4.new_code_cell("print(2)", execution_count=1)
    stale.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]  # not what it prints
    marked = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(3)", execution_count=2)
    marked.outputs = [nbformat.v4.new_output("stream", name="stdout", text=checked_output)]
    independent = nbformat.v4.new_code_cell("print(5)", execution_count=3)   # skipped in labs/ only
    independent.outputs = [nbformat.v4.new_output("stream", name="stdout", text="5\n")]
    independent.metadata["tags"] = ["labs-pass-skip"]
    # What a kernel makes and removes at exit (a lab's temporary folder): nbval's SIGKILL would leave it behind.
    folder = f"{path.parent.name}-{path.stem}.tmp"
    # The .made file records the transport the kernel's connection uses, and what says it is a fork of the kernel
    # zygote: torch there though no cell imported it, and a session of its own.
    cleanup = nbformat.v4.new_code_cell(f"import atexit, json, os, shutil, sys\nfrom ipykernel.connect import get_connection_info\n"
                                        f"os.mkdir({folder!r})\n"
                                        f"_ = open({folder!r} + '.made', 'w').write(json.dumps(dict(\n"
                                        f"    transport=json.loads(get_connection_info())['transport'], preloaded='torch' in sys.modules,\n"
                                        f"    session=os.getsid(0) == os.getpid(), zygote=os.getppid())))\n"
                                        f"_ = atexit.register(shutil.rmtree, {folder!r})", execution_count=4)
    # What a kernel keeps for its reader after it ends (Lab 09's checkpoints, Lab 05's runs): in the temporary folder
    # the plugin gives the kernel, removed with the notebook.
    kept = nbformat.v4.new_code_cell("import tempfile\n_ = open(tempfile.mkdtemp(prefix='kept_') + '/run.log', 'w').write('x')",
                                     execution_count=5)
    nb = nbformat.v4.new_notebook()
    nb.cells = [stale, marked, independent, cleanup, kept]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


def test_labs_cells_are_lax_solutions_cells_strict_in_one_session(tmp_path):
    _notebook(tmp_path / "labs" / "good.ipynb", "3\n")
    _notebook(tmp_path / "labs" / "marked_wrong.ipynb", "4\n")   # NBVAL_CHECK_OUTPUT is still compared
    _notebook(tmp_path / "solutions" / "strict.ipynb", "3\n")
    # Where jupyter_client writes connection files and the plugin socket files: short enough for a socket's path.
    kernel_files = Path(tempfile.mkdtemp(prefix="nbk"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "course_lib.classroom.notebooks.nbval_plugin", "labs", "solutions",
                           "--nbval", "-q", "-p", "no:cacheprovider", "-rf"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(kernel_files)})
    failed = sorted(line[len("FAILED "):].split(" - ")[0] for line in done.stdout.splitlines()
                    if line.startswith("FAILED"))
    assert failed == ["labs/marked_wrong.ipynb::Cell 1", "solutions/strict.ipynb::Cell 0"], done.stdout
    assert "2 failed, 11 passed, 2 skipped" in done.stdout
    assert "test time by area, summed over 1 worker(s): " in done.stdout and "  notebooks: labs/ (lax)" in done.stdout
    made = sorted(p.name for p in tmp_path.glob("**/*.made"))
    assert made == ["labs-good.tmp.made", "labs-marked_wrong.tmp.made", "solutions-strict.tmp.made"], made
    assert not list(tmp_path.glob("**/*.tmp")), "a kernel's atexit handlers did not run (nbval killed it)"
    kernels = [json.loads(p.read_text()) for p in tmp_path.glob("**/*.made")]
    # Unix socket files, not TCP ports another process can take between jupyter_client's pick and the kernel's bind.
    assert {k["transport"] for k in kernels} == {"ipc"}
    # Each kernel forked from the session's one zygote (kernel_zygote), which ended with the session.
    assert [(k["preloaded"], k["session"]) for k in kernels] == [(True, True)] * 3, kernels
    assert len({k["zygote"] for k in kernels}) == 1 and not Path(f"/proc/{kernels[0]['zygote']}").exists()
    left = list(kernel_files.iterdir())
    shutil.rmtree(kernel_files)
    assert not left, f"a kernel's connection or socket files, or its temporary folder, were left behind: {left}"


def _cells(*sources, tagged=()):
    cells = [nbformat.v4.new_code_cell(s) for s in sources]
    for i in tagged:
        cells[i].metadata["tags"] = ["labs-pass-skip"]
    return cells


def test_a_tagged_cell_is_skipped_in_labs_only_when_no_exercise_reaches_it_and_nothing_later_needs_it():
    from course_lib.classroom.notebooks.independent_cells import skip_problems

    exercise = "def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n"
    assert skip_problems(_cells("import math", exercise, "y = math.pi\nfor k in range(2):\n    z = k\nprint(y, z)",
                                "print(math.e)", tagged=[2])) == {}
    assert skip_problems(_cells(exercise, "y = f(1)", tagged=[1])) == {1: "it reads ['f'], which depend on an exercise"}
    # a cell using a checker's result depends on the exercise too, through the name it reads
    assert 2 in skip_problems(_cells(exercise, "r = check(f)", "print(r)", tagged=[2]))
    assert skip_problems(_cells("y = 1", "print(y)", tagged=[0])) == {
        0: "it defines ['y'], which a later cell that runs reads"}
    assert skip_problems(_cells("y = 1", "print(y)", tagged=[0, 1])) == {}       # skipped together
    assert 0 in skip_problems(_cells("d['k'] = 1", "print(d)", tagged=[0]))      # changing an object defines it
    assert 0 in skip_problems(_cells("y = 1", "if c:\n    y = 2\nprint(y)", tagged=[0]))   # y may be cell 0's
    assert skip_problems(_cells("x = 0", "x = 1", "x = 2\nprint(x)", tagged=[1])) == {}   # rebound before it is read
    assert 0 in skip_problems(_cells(exercise, tagged=[0]))
    # cell 2 must run (it reads the exercise's f), so cell 0, whose y it reads, must run too
    assert set(skip_problems([*_cells("y = 1", tagged=[0]), *_cells(exercise), *_cells("print(f(y))", tagged=[0])])) \
        == {0, 2}


def test_every_cell_tagged_labs_pass_skip_is_proven_skippable():
    from pathlib import Path

    from course_lib.classroom.notebooks.independent_cells import SKIP_TAG, skip_problems

    tagged = 0
    for path in sorted(Path(__file__).parents[2].joinpath("solutions").glob("[0-9][0-9]_*.ipynb")):
        cells = nbformat.read(str(path), as_version=4).cells
        tagged += sum(SKIP_TAG in c.metadata.get("tags", []) for c in cells)
        assert skip_problems(cells) == {}, path.name
    assert tagged >= 5          # Lab 05's loss parity and megatron-core side-by-side, Lab 03's measured bubbles


def test_the_longest_files_are_handed_out_first_and_stay_whole():
    from pathlib import Path
    from types import SimpleNamespace

    from course_lib.classroom.notebooks.nbval_plugin import LONGEST_FIRST, _longest_first

    root = Path(__file__).parents[2]
    assert [p for p in LONGEST_FIRST if not (root / p).is_file()] == []       # a renamed file would lose its place
    items = [SimpleNamespace(nodeid=n) for n in ("a.py::t1", LONGEST_FIRST[1] + "::x", "a.py::t2",
                                                 LONGEST_FIRST[0] + "::y", LONGEST_FIRST[1] + "::z")]
    _longest_first(items)
    assert [i.nodeid for i in items] == [LONGEST_FIRST[0] + "::y", LONGEST_FIRST[1] + "::x", LONGEST_FIRST[1] + "::z",
                                         "a.py::t1", "a.py::t2"]


def test_grade_runs_no_cell_that_no_exercise_depends_on():
    """`grade` leaves out what the labs pass leaves out, proved on the notebook that is run (the official
    cells with the student's exercise cells in): a student's cell can make a tagged cell necessary, never
    unnecessary."""
    from course_lib.classroom.grading.official import OfficialLab, graded_cells

    stub = nbformat.v4.new_code_cell("def f(x):\n    raise NotImplementedError")
    stub.metadata["tags"] = ["exercise"]
    stub.id = "ex1"
    cells = [*_cells("import math", "heavy = math.pi", "print(heavy)", tagged=[1, 2]), stub, *_cells("check(f)")]
    lab = OfficialLab("99", "99_x.ipynb", {"cells": cells}, "v")

    def run_of(source):
        mine = nbformat.v4.new_code_cell(source)
        mine.id = "ex1"
        return [i for i, _ in graded_cells(lab, {"cells": [mine]})[0]]

    assert run_of("def f(x):\n    return x") == [0, 3, 4]
    assert run_of("def f(x):\n    return heavy * x") == [0, 1, 3, 4]   # this exercise reads heavy: cell 1 runs
    assert run_of("def f(x:\n    return x") == [0, 1, 2, 3, 4]          # does not parse: nothing is proved


def test_a_kernel_the_zygote_cannot_fork_as_asked_is_started_as_before():
    """Another interpreter's kernel (even one linked to the same binary), another module, a pipe for its output or
    its input: no fork (None), and jupyter_client starts the kernel itself."""
    from course_lib.classroom.notebooks import kernel_zygote

    kernel = [sys.executable, "-m", "ipykernel_launcher", "-f", "kernel.json"]
    elsewhere = os.path.join(tempfile.mkdtemp(prefix="nbk"), "python")
    os.symlink(sys.executable, elsewhere)
    try:
        assert kernel_zygote.fork_kernel([elsewhere, *kernel[1:]], {}) is None
    finally:
        shutil.rmtree(os.path.dirname(elsewhere))
    assert kernel_zygote.fork_kernel([sys.executable, "-m", "other_kernel", "-f", "kernel.json"], {}) is None
    assert kernel_zygote.fork_kernel(kernel, {"stdout": subprocess.PIPE}) is None
    assert kernel_zygote.fork_kernel(kernel, {"stdin": subprocess.PIPE}) is None
    assert kernel_zygote.fork_kernel(kernel, {"independent": True}) is None


def test_a_zygote_that_does_not_answer_in_time_is_stopped_and_the_kernel_started_as_before():
    """A request the zygote answers too late is given up (None: jupyter_client starts the kernel) and the zygote is
    killed, so that no fork of that request comes later, a second kernel on the same connection file's sockets."""
    done = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom course_lib.classroom.notebooks import kernel_zygote as z\n"
        "z.WAIT_S = 0.01  # the zygote is still importing torch\n"
        "cmd = [sys.executable, '-m', 'ipykernel_launcher', '-f', 'kernel.json']\n"
        "print(z.fork_kernel(cmd, {}), z.fork_kernel(cmd, {}), z._ZYGOTE['proc'].wait(timeout=30))\n")],
        capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["None", "None", str(-signal.SIGKILL)], (done.stdout, done.stderr)


def test_the_session_ends_with_its_time_by_area():
    from types import SimpleNamespace

    from course_lib.classroom.notebooks.nbval_plugin import time_by_area

    reports = [SimpleNamespace(nodeid=n, duration=d) for n, d in (
        ("solutions/05_x.ipynb::Cell 14", 20.0), ("labs/05_x.ipynb::Cell 3", 1.5), ("solutions/00_y.ipynb::Cell 0", 2.0),
        ("tests/classroom/test_grade_every_lab.py::test_all", 40.0), ("tests/classroom/checks/test_lab00_checks.py::t", 3.0),
        ("tests/classroom/test_judge.py::t", 1.0), ("tests/test_two_nodes.py::t[static]", 5.0), ("tests/test_rules.py::t", 0.5),
        ("tests/test_train_moe.py::t", 4.0))]
    assert time_by_area(reports) == [("grade, in the sandbox", 40.0), ("notebooks: solutions/ (strict)", 22.0),
                                     ("launch, torchrun, two nodes", 5.0),
                                     ("training, MoE, DeepSpeed, megatron-core", 4.0), ("checkers' tables", 3.0),
                                     ("notebooks: labs/ (lax)", 1.5), ("judge, sandbox, site, widgets", 1.0),
                                     ("the other tests", 0.5)]
