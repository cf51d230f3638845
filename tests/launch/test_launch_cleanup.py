"""No rank outlives its launch, however the launching process ends.

Each case runs a launch in a stand-in kernel (tests/fixtures/launch_kernel.py) whose 2
ranks (per launch: the SIGKILL case runs a fork, a polling fork, a torchrun and a ``train`` launch in one kernel)
record their pids and sleep, then kills it (SIGKILL: a killed kernel),
interrupts it (SIGINT: Ctrl-C or a Jupyter interrupt), terminates it (SIGTERM)
or makes it raise (SIGUSR1), and checks that every process it started -- ranks,
torchrun, its helpers: the kernel's own process tree, read from /proc, never
processes found by name -- is gone within 10 s, and that no file is left in its
temporary folder (each kernel has its own $TMPDIR): no job folder, no output
file, no torch elastic ``torchelastic_*``. The interrupt, error and ``train`` cases run one after another in
one kernel that, like Jupyter's, shows each error and lives on (one fresh interpreter instead of four).
The kernels start together (a module fixture), so the torchrun start-ups overlap. A stopped ``train``
says so in one line, with no traceback from any of its processes.
"""

import os
import signal
import subprocess
import sys
import time
from multiprocessing import connection
from pathlib import Path

import pytest

from course_lib.launch import TorchrunAgent, torchrun_command

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process trees from /proc")

# (launch kind, signal, processes in its kernel's tree besides itself, what the kernel must say of the launch)
CASES = [
    # one SIGKILLed kernel running four launches at once: a fork launch and one whose ranks poll for their
    # parent, as where there is no parent-death signal (macOS) (2 ranks each), a torchrun launch and
    # `python -m course_lib train` (torchrun and its 2 ranks each, at least)
    ("fork+fork-polling+torchrun+train", signal.SIGKILL, 2 + 2 + 3 + 3, None),
    ("fork", signal.SIGUSR1, 2, "RuntimeError: an error in the launching process"),
    ("fork", signal.SIGINT, 2, "KeyboardInterrupt: interrupted: all 2 rank processes were stopped"),
    ("cell", signal.SIGINT, 3, "KeyboardInterrupt: interrupted: torchrun and all its rank processes were stopped"),
    ("train", signal.SIGTERM, 3, "terminated: torchrun and all its rank processes were stopped"),
]
IN_ONE_KERNEL = [CASES[i][:2] for i in (1, 2, 3, 4)]   # one after another, the kernel living on after each
START_TIMEOUT_S = 240   # every kernel starts at once on a 2-core machine
GONE_WITHIN_S = 10


def _stat(pid):
    """(state, parent pid) of ``pid`` from /proc, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1])


def _running(pid):
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _descendants(pid):
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None:
            parents[int(name)] = stat[1]
    found = [pid]
    for p in found:
        found += [child for child, parent in parents.items() if parent == p]
    return found[1:]


class Kernel:
    def __init__(self, steps, folder: Path):
        """``steps``: the (kind, signal) of each launch, one after another (a kernel that lives on after each)."""
        self.steps = steps
        self.kind = ",".join(kind for kind, _ in steps)
        self.pid_dir = folder / "pids"
        self.pid_dir.mkdir(parents=True)
        self.log = folder / "kernel.log"
        self.tmp = folder / "tmp"
        self.tmp.mkdir()
        self.tree, self.done, self.stopped = [], 0, set()
        env = dict(os.environ, TMPDIR=str(self.tmp), PYTHONPATH=os.pathsep.join(
            p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p))
        with open(self.log, "wb") as log:  # a file, not a pipe: surviving ranks would hold a pipe open
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import sys, launch_kernel; sys.exit(launch_kernel.kernel(*sys.argv[1:]))",
                 self.kind, str(self.pid_dir)], stdout=log, stderr=subprocess.STDOUT, env=env)

    def step_dir(self, step):
        return self.pid_dir / f"{step}-{self.steps[step][0]}" if len(self.steps) > 1 else self.pid_dir

    def rank_pids(self, step=0):
        return [int(p.read_text()) for p in sorted(self.step_dir(step).glob("**/rank*.pid"))]

    def wait_for_ranks(self, step=0):
        kind = self.steps[step][0]
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.rank_pids(step)) < 2 * len(kind.split("+")):
            assert self.proc.poll() is None, f"the {self.kind} kernel ended early:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"the {kind} launch's ranks never started"
            time.sleep(0.2)

    def stop(self, step):
        """Signal launch ``step`` once its ranks run; (its tree, its ranks, what the kernel said since)."""
        self.wait_for_ranks(step)
        self.tree += (tree := _descendants(self.proc.pid))
        ranks = self.rank_pids(step)
        said = self.log.stat().st_size
        self.stopped.add(step)
        os.kill(self.proc.pid, self.steps[step][1])
        if step == len(self.steps) - 1:
            self.proc.wait(timeout=30)
        else:           # the kernel lives on: as long for its report of the launch as for a kernel's end
            ended = f"launch {step} ended".encode()
            deadline = time.monotonic() + 30
            while ended not in self.log.read_bytes()[said:] and time.monotonic() < deadline:
                assert self.proc.poll() is None, f"the {self.kind} kernel ended:\n{self.log.read_text()}"
                time.sleep(0.05)
        deadline = time.monotonic() + GONE_WITHIN_S
        while (any(map(_running, tree)) or any(self.tmp.iterdir())) and time.monotonic() < deadline:
            time.sleep(0.05)
        return tree, ranks, self.log.read_bytes()[said:].decode(errors="replace")

    def go_on(self, step):
        """Let the kernel start the launch after ``step`` (the test has checked ``step``)."""
        self.done = step + 1
        if self.done < len(self.steps):
            (self.pid_dir / f"go{self.done}").touch()


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    singles = [Kernel([(kind, sig)], tmp_path_factory.mktemp(f"{kind}-{sig.name}"))
               for kind, sig, _, _ in CASES if (kind, sig) not in IN_ONE_KERNEL]
    shared = Kernel(IN_ONE_KERNEL, tmp_path_factory.mktemp("one-after-another"))
    started = {k.steps[0]: (k, 0) for k in singles} | {case: (shared, i) for i, case in enumerate(IN_ONE_KERNEL)}
    yield started
    for k in [*singles, shared]:  # whatever a failed test left behind
        for pid in {k.proc.pid, *k.tree, *_descendants(k.proc.pid)}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        k.proc.wait()


@pytest.mark.parametrize("kind, sig, tree_size, message", CASES, ids=[f"{c[0]}-{c[1].name}" for c in CASES])
def test_no_process_outlives_the_launching_process(kernels, kind, sig, tree_size, message):
    kernel, step = kernels[kind, sig]
    for earlier in range(kernel.done, step):      # a launch this run skipped (-k) or that failed: on to the next
        if earlier not in kernel.stopped:
            kernel.stop(earlier)
        kernel.go_on(earlier)
    tree, ranks, said = kernel.stop(step)
    assert set(ranks) <= set(tree) and len(tree) >= tree_size, (tree, ranks)
    survivors = [pid for pid in tree if _running(pid)]
    assert not survivors, (f"{kind} launch after {sig.name}: {len(survivors)} of its kernel's {len(tree)} processes "
                           f"still run ({survivors}; ranks {ranks})")
    left = sorted(p.name for p in kernel.tmp.iterdir())
    assert not left, f"{kind} launch after {sig.name} left temporary files: {left}"
    if message:
        assert message in said, kernel.log.read_text()
    if kind == "train":
        assert "Traceback" not in said and "Error" not in said, said
        assert f"ended: returned {128 + sig}" in said, said       # python -m course_lib train's exit code
    if step < len(kernel.steps) - 1:
        assert kernel.proc.poll() is None, kernel.log.read_text()     # the kernel lives on, like Jupyter's
    kernel.go_on(step)


def test_an_agent_let_go_before_its_exit_code_was_read_ends_quietly(tmp_path):
    """What an interrupted ``train`` does at random: the launcher stops the tree and lets go of the
    agent while torchrun's exit code is still unread on the channel, which resets the connection.
    Here always: torchrun --help ends at once, and its exit code is left unread."""
    log = tmp_path / "agent.log"
    with open(log, "wb") as out, TorchrunAgent(torchrun_command(1, ["--help"]), stdout=out,
                                               stderr=subprocess.STDOUT) as agent:
        agent.start()
        assert connection.wait([agent._channel], timeout=START_TIMEOUT_S), "torchrun --help never ended"
    assert agent.proc.returncode == 0 and "Traceback" not in log.read_text(), log.read_text()
