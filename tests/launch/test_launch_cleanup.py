"""No rank outlives its launch, however the launching process ends.

Each case starts a stand-in kernel (tests/fixtures/launch_kernel.py) whose 2
ranks (per launch: the SIGKILL case runs a fork, a polling fork, a torchrun and a ``train`` launch in one kernel)
record their pids and sleep, then kills it (SIGKILL: a killed kernel),
interrupts it (SIGINT: Ctrl-C or a Jupyter interrupt), terminates it (SIGTERM)
or makes it raise (SIGUSR1), and checks that every process it started -- ranks,
torchrun, its helpers: the kernel's own process tree, read from /proc, never
processes found by name -- is gone within 10 s, and that no file is left in its
temporary folder (each kernel has its own $TMPDIR): no job folder, no output
file, no torch elastic ``torchelastic_*``. The kernels start together (a module
fixture), so the torchrun start-ups overlap. A stopped ``train`` says so in one line, with no
traceback from any of its processes.
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

# (kernel kind, signal, processes in its tree besides itself, what it must say on its way out)
CASES = [
    # one SIGKILLed kernel running four launches at once: a fork launch and one whose ranks poll for their
    # parent, as where there is no parent-death signal (macOS) (2 ranks each), a torchrun launch and
    # `python -m course_lib train` (torchrun and its 2 ranks each, at least)
    ("fork+fork-polling+torchrun+train", signal.SIGKILL, 2 + 2 + 3 + 3, None),
    ("fork", signal.SIGINT, 2, "KeyboardInterrupt: interrupted: all 2 rank processes were stopped"),
    ("fork", signal.SIGUSR1, 2, "RuntimeError: an error in the launching process"),
    ("cell", signal.SIGINT, 3, "KeyboardInterrupt: interrupted: torchrun and all its rank processes were stopped"),
    ("train", signal.SIGTERM, 3, "terminated: torchrun and all its rank processes were stopped"),
]
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
    def __init__(self, kind, sig, folder: Path):
        self.kind, self.sig = kind, sig
        self.pid_dir = folder / "pids"
        self.pid_dir.mkdir(parents=True)
        self.log = folder / "kernel.log"
        self.tmp = folder / "tmp"
        self.tmp.mkdir()
        self.tree = []
        env = dict(os.environ, TMPDIR=str(self.tmp), PYTHONPATH=os.pathsep.join(
            p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p))
        with open(self.log, "wb") as log:  # a file, not a pipe: surviving ranks would hold a pipe open
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import sys, launch_kernel; sys.exit(launch_kernel.kernel(*sys.argv[1:]))",
                 kind, str(self.pid_dir)], stdout=log, stderr=subprocess.STDOUT, env=env)

    def rank_pids(self):
        return [int(p.read_text()) for p in sorted(self.pid_dir.glob("**/rank*.pid"))]

    def wait_for_ranks(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.rank_pids()) < 2 * len(self.kind.split("+")):
            assert self.proc.poll() is None, f"the {self.kind} kernel ended early:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"the {self.kind} kernel's ranks never started"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    started = {(kind, sig): Kernel(kind, sig, tmp_path_factory.mktemp(f"{kind}-{sig.name}"))
               for kind, sig, _, _ in CASES}
    yield started
    for k in started.values():  # whatever a failed test left behind
        for pid in {k.proc.pid, *k.tree, *_descendants(k.proc.pid)}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        k.proc.wait()


@pytest.mark.parametrize("kind, sig, tree_size, message", CASES, ids=[f"{c[0]}-{c[1].name}" for c in CASES])
def test_no_process_outlives_the_launching_process(kernels, kind, sig, tree_size, message):
    kernel = kernels[kind, sig]
    kernel.wait_for_ranks()
    kernel.tree = tree = _descendants(kernel.proc.pid)
    ranks = kernel.rank_pids()
    assert set(ranks) <= set(tree) and len(tree) >= tree_size, (tree, ranks)

    os.kill(kernel.proc.pid, sig)
    kernel.proc.wait(timeout=30)
    deadline = time.monotonic() + GONE_WITHIN_S
    while (any(map(_running, tree)) or any(kernel.tmp.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid in tree if _running(pid)]
    assert not survivors, (f"{kind} kernel after {sig.name}: {len(survivors)} of its {len(tree)} processes "
                           f"still run ({survivors}; ranks {ranks})")
    left = sorted(p.name for p in kernel.tmp.iterdir())
    assert not left, f"{kind} kernel after {sig.name} left temporary files: {left}"
    if message:
        assert message in kernel.log.read_text(), kernel.log.read_text()
    if kind == "train":
        assert "Traceback" not in kernel.log.read_text() and "Error" not in kernel.log.read_text(), \
            kernel.log.read_text()


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
