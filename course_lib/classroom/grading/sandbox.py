"""Where a student's notebook runs: a forked kernel that is fenced, limited, timed and killed whole.

One trusted process, the *zygote* (:func:`serve`), imports what every lab needs (torch, IPython,
matplotlib, the checkers' machinery) once, then forks one kernel per run -- a run starts in
milliseconds instead of the second and more a fresh ``import torch`` costs. It never runs a
student's code itself. The grader talks to it over a pipe (:class:`Sandbox`): start a run, poll it,
stop it.

A run's kernel, before it executes the first cell (:func:`_child`):

* leaves the zygote's session (``setsid``) and keeps every process started under it in its tree
  (:func:`course_lib.launch.process_tree.adopt_orphans`), and dies with the zygote;
* gets its limits: address space (``RLIMIT_AS``, per process: what the zygote mapped plus the run's budget), the size of any file it writes
  (``RLIMIT_FSIZE``, so a print loop fills no disk), no core dumps, and, when the grader is not
  root (the kernel exempts root from it), a cap on new processes (``RLIMIT_NPROC``: a fork bomb
  stops at it);
* as root, enters a control group of its own (:mod:`course_lib.classroom.grading.cgroups`: a cap on its
  processes and on their memory together) and new network, pid and mount namespaces (:func:`_into_namespaces`:
  a loopback of its own, a ``/proc`` of its own, an init whose end kills every process left, a home that is a
  bounded tmpfs);
* forks the run's judge (:func:`_start_judge`), where every checker cell's verdict is computed and
  recorded, out of the student's reach;
* gets a fresh environment whose ``HOME`` and ``TMPDIR`` are its own folder inside the grading
  output, so nothing it writes by habit (caches, histories) lands anywhere else;
* is fenced by Landlock (:mod:`course_lib.classroom.grading.landlock`): it reads only the system,
  Python and ``course_lib`` itself -- not ``solutions/``, not the submissions, not other students'
  runs --, writes only its own folder and signals no process outside its tree;
* then runs the cells (:mod:`course_lib.classroom.grading.driver`), writing what happens to the
  events file it opened before the fence went up.

Stopping a run kills its whole tree (:func:`course_lib.launch.process_tree.kill_tree`), then every
other process the zygote holds: the zygote is a child subreaper too, so a process whose kernel died
first is re-parented to it, never to init. When the grader ends, the zygote ends, and with it
everything.

DeepSpeed's C++ ops are loaded by the zygote itself when a graded lab trains with DeepSpeed
(:func:`_load_deepspeed_ops`): loading one takes a lock in the venv, which no run may write.

The limits of the fence: without Landlock (not Linux, or a kernel older than 5.13) the student's
code can read and write what the instructor can (the grader says so once); without Landlock's
signal scope (Linux < 6.12) it could signal the zygote (and the judge); code that inspects its own
file descriptors can write to the events file, where no verdict counts.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from course_lib.classroom.grading import landlock
from course_lib.classroom.grading.cgroups import PIDS_MAX, RunGroup, remove_groups_of_ended
from course_lib.launch.process_tree import (adopt_orphans, die_with_parent, freeze_inherited_objects, kill_tree,
                                            parent_pids, take_std_streams)

FILE_LIMIT_BYTES = 64 << 20
"""The largest file a run may write (its printed output included)."""
HOME_BYTES = 1 << 30
"""As root, the run's home (the one folder it may write) is a tmpfs of this size ..."""
HOME_FILES = 100_000
"""... and of this many files and folders."""
_PRELOAD = ("torch", "torch.distributed", "IPython.core.interactiveshell", "matplotlib.pyplot",
            "course_lib.classroom.checks.verdicts", "course_lib.classroom.checks.tamper_guard",
            "course_lib.classroom.checks.exercise", "course_lib.launch")
_SYSTEM_READ = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys", "/opt", "/dev/null",
                "/dev/zero", "/dev/random", "/dev/urandom")
_START_TIMEOUT_S = 300
JUDGE_RECORDS = "judge.jsonl"
"""The file of a run's folder where the run's judge writes its verdicts (the grade's one source)."""
_DEEPSPEED_ENV = "COURSE_GRADE_DEEPSPEED"


# ----------------------------------------------------------------------------------- the zygote


def _user_tasks() -> int:
    """Processes and threads of this real user: what RLIMIT_NPROC counts."""
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{name}/status").read_text().splitlines()
                          if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
_MS_REC, _MS_PRIVATE, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x4000, 0x40000, 0x2, 0x4, 0x8


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


_CAP_SYS_ADMIN = 21  # linux/capability.h


def namespaces_available() -> bool:
    """Whether a run can get namespaces of its own: Linux, with ``CAP_SYS_ADMIN`` in this process's effective set
    (``CapEff`` of ``/proc/self/status``), which root has unless its container dropped it (Docker does by default);
    unprivileged user namespaces are not used."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            effective = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    return bool(effective >> _CAP_SYS_ADMIN & 1)


def _into_namespaces() -> bool:
    """Move the run into new network, pid and mount namespaces (``unshare(2)``): its network is a loopback of its
    own (the ranks' TCP works, nothing outside or on the grader's loopback is reachable, abstract unix sockets are
    per namespace), its first process is the init of a pid namespace (when it ends, the kernel kills every process
    left in it: no daemon outlives its run), and its ``/proc`` shows only its own processes (not the grader's
    ``environ``). False, nothing changed, where the kernel refuses."""
    if not namespaces_available():
        return False
    return _libc().unshare(_CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET) == 0


def _relay(inner: int, report: int) -> None:
    """The run's first process, outside its pid namespace: wait for the namespace's init and end as the
    notebook's kernel ended (its wait status, which the init writes to ``report``)."""
    while True:
        try:
            _, code = os.waitpid(inner, 0)
            break
        except InterruptedError:
            continue
    data = os.read(report, 32)
    code = int(data) if data.strip().isdigit() else code
    if os.WIFSIGNALED(code):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(os.WTERMSIG(code), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(code))
    os._exit(os.WEXITSTATUS(code) if os.WIFEXITED(code) else 1)


def _init(kernel: int, report: int) -> None:
    """The pid namespace's init (pid 1, which ignores the signals it has no handler for -- so the kernel is its
    child, not itself): reap every orphan until the kernel ends, report its status, end; the kernel of Linux
    then kills whatever is left in the namespace."""
    while True:
        try:
            pid, code = os.wait()
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(1)
        if pid == kernel:
            os.write(report, str(code).encode())
            os._exit(0)


def _set_up_namespaces(home: str) -> None:
    """In the pid namespace's init: die with the relay, a private ``/proc`` of this namespace, loopback up, and
    the run's home a tmpfs of :data:`HOME_BYTES` and :data:`HOME_FILES` (many small files fill it, not the disk)."""
    import fcntl
    import socket
    import struct

    libc = _libc()
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: getppid() is 0 here, the relay is outside
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        raise OSError("the sandbox could not make the run's mounts private: / is not a mount point here (a chroot? "
                      "enter it through a mount namespace: unshare -m, mount --rbind ROOT ROOT, chroot ROOT)")
    if libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) != 0:
        raise OSError("the sandbox could not mount the run's own /proc")
    options = f"size={HOME_BYTES},nr_inodes={HOME_FILES},mode=0700".encode()
    if libc.mount(b"tmpfs", home.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        raise OSError("could not mount the run's home")
    os.mkdir(os.path.join(home, "tmp"))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1))  # SIOCSIFFLAGS, IFF_UP


def _limit(which: int, value: int) -> None:
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def _mapped_bytes() -> int:
    """The address space this process maps now (``VmSize``; 0 where there is no ``/proc``): in a run's kernel, just
    forked, what the zygote's imports mapped. A run's ``memory_bytes`` of address space come on top of it, so the
    student's budget does not depend on the torch build: PyTorch's CPU wheel maps ~0.6 GiB once imported, its
    CUDA wheel (what pip installs where PyTorch's CPU index is out of reach) ~3.1 GiB -- more than the 2 GiB the
    tests give a run, where every new thread's stack failed and the kernel hung (measured, Python 3.13)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _child(spec: dict, zygote: int, group) -> None:
    """The kernel of one run, in the forked child: isolate, limit, fence, run the cells; never returns."""
    from course_lib.classroom.checks import exercise
    from course_lib.classroom.grading import driver
    from course_lib.launch.output import redirect_output

    status, redirected = 1, False
    try:
        os.setsid()
        group.enter()  # as root: every process of the run counts against its caps and dies with the group
        adopt_orphans()
        die_with_parent(zygote)
        if _into_namespaces():
            report, reported = os.pipe()
            inner = os.fork()
            if inner:
                os.close(reported)
                _relay(inner, report)
            os.close(report)
            _set_up_namespaces(spec["home"])
            kernel = os.fork()
            if kernel:
                _init(kernel, reported)
            os.close(reported)
            libc_prctl = _libc().prctl
            libc_prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the kernel dies with the init
        cells = json.loads(Path(spec["cells"]).read_text(encoding="utf-8"))
        out = os.open(spec["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        redirect_output(out)
        redirected = True
        os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        os.chdir(spec["home"])
        os.environ.clear()
        os.environ.update(spec["env"])
        tempfile.tempdir = None  # the zygote's imports may have cached its own: the run's TMPDIR is its home's
        sys.path[:] = [p for p in sys.path if p not in ("", spec["home"])]
        _limits(spec)
        _start_judge(spec)
        exercise.verdict_file()  # opened before the fence: the kernel cannot reach it by name afterwards
        abi = landlock.restrict(spec["read"], [spec["home"]], [os.devnull])
        exercise.write_record({"sandbox": {"landlock": abi}})
        driver.run_cells(cells, exercise.write_record)
        status = 0
        while True:  # stay, so that whatever it started stays in this tree until the grader stops it
            signal.pause()
    except BaseException:  # noqa: BLE001 - the grader reads the run's output to say why it ended
        if redirected:
            traceback.print_exc()
        else:   # set-up failed before the output was the run's: say why there, not only in the zygote's log
            try:
                with open(spec["output"], "a", encoding="utf-8") as output:
                    output.write(traceback.format_exc())
            except OSError:
                traceback.print_exc()
    finally:
        os._exit(status)


def _limits(spec: dict) -> None:
    """A run's limits on this process and what it starts: address space, file size, no core, and (not as root)
    the number of processes: ``tasks_max`` more than the grader's user already runs (the pids group's cap, for the
    same reason: threads count)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails (EFBIG) instead of killing
    _limit(resource.RLIMIT_AS, _mapped_bytes() + spec["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, FILE_LIMIT_BYTES)
    _limit(resource.RLIMIT_CORE, 0)
    if os.geteuid() != 0:
        _limit(resource.RLIMIT_NPROC, spec["tasks"] + spec["tasks_max"])


def _start_judge(spec: dict) -> None:
    """Fork the run's judge (:mod:`course_lib.classroom.checks.judge`) from the kernel before the kernel runs
    anything -- a fork of the zygote's imports, started in no time and outside any exercise's clock -- and
    attach the kernel's checkers to it (:func:`~course_lib.classroom.checks.judge_client.attach`).

    The judge gets the run's limits and its own Landlock fence (the run's rules, a domain of its own: the
    kernel can neither signal nor trace it), and the run's record file ``spec["judge_records"]``, opened here
    in the judge only: the grade comes from that file, which no process of the student's ever holds (a verdict
    the kernel writes to the events file counts for nothing, :mod:`course_lib.classroom.grading.grader`)."""
    from course_lib.classroom.checks import judge, judge_client, records

    requests_r, requests_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    reply_r, reply_w = os.pipe()
    kernel = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            die_with_parent(kernel)
            record = os.open(spec["judge_records"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            take_std_streams(requests_r, out_w, err_w)
            keep = sorted({0, 1, 2, reply_w, record})
            for low, high in zip(keep, keep[1:] + [resource.getrlimit(resource.RLIMIT_NOFILE)[0]]):
                os.closerange(low + 1, high)
            os.environ.pop(records.VERDICTS_ENV, None)
            os.environ[records.VERDICTS_FD_ENV] = str(record)
            landlock.restrict(spec["read"], [spec["home"]], [os.devnull])
            judge.serve(reply_w)
        except BaseException:  # noqa: BLE001 - said in the run's output; the checkers then say the judge ended
            traceback.print_exc()
        finally:
            os._exit(0)
    for fd in (requests_r, out_w, err_w, reply_w):
        os.close(fd)
    judge_client.attach(pid, requests_w, out_r, err_r, reply_r)


def _load_deepspeed_ops() -> None:
    """Load DeepSpeed's JIT-built C++ ops here, outside the fence. Loading one takes a lock file in its build
    folder (torch's ``FileBaton`` in ``TORCH_EXTENSIONS_DIR``, the venv's by default), which a fenced run may
    not write; DeepSpeed keeps every loaded op (``OpBuilder._loaded_ops``), so a run forked from here, and the
    ranks it forks, find them loaded and take no lock. An op that cannot be built is left to the run (its
    cell then says why)."""
    from course_lib.deepspeed.engine import preload
    from course_lib.deepspeed.ops import build_ops

    try:
        preload()
        build_ops()
    except (ImportError, OSError, RuntimeError, SystemExit) as err:
        print(f"DeepSpeed's ops were not loaded before the runs: {err}", file=sys.stderr)


def _reap_all(timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def _stop_everything(me: int) -> None:
    """Kill every process under the zygote (runs and the orphans re-parented to it) and reap them."""
    for child in [c for c, parent in (parent_pids() or {}).items() if parent == me]:
        kill_tree(child)
    _reap_all()


def _status(pid: int, block: bool) -> int | None:
    """The run's exit status as ``subprocess`` words it (negative: the signal), None while it runs."""
    try:
        done, code = os.waitpid(pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        return None
    if done == 0:
        return None
    return -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def serve() -> None:
    """The zygote's loop: one JSON request per line on stdin, one JSON answer per line on stdout."""
    import importlib

    grader, me = os.getppid(), os.getpid()
    die_with_parent(grader)
    adopt_orphans()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the grader's: it stops the runs, then closes us
    for module in _PRELOAD:
        importlib.import_module(module)
    from course_lib.launch.fork import import_before_the_forks

    import_before_the_forks()  # what every launch of a run's checkers and cells would import again
    if os.environ.get(_DEEPSPEED_ENV) == "1":
        _load_deepspeed_ops()
    from course_lib.classroom.grading import landlock

    freeze_inherited_objects()  # every run's kernel (and judge) walks only what it allocates itself

    replies = sys.stdout
    sys.stdout = sys.stderr
    exited: dict[int, int | None] = {}
    groups: dict = {}  # pid -> its RunGroup
    started = 0
    remove_groups_of_ended("course-grade-")

    def reply(obj) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"ready": True, "landlock": landlock.abi_version()})
    for line in sys.stdin:
        request = json.loads(line)
        if "start" in request:
            spec = dict(request["start"], tasks=_user_tasks() if os.geteuid() != 0 else 0)
            started += 1
            group = RunGroup(f"course-grade-{me}-{started}", spec["memory_bytes"], spec["tasks_max"])
            pid = os.fork()
            if pid == 0:
                _child(spec, me, group)
            groups[pid] = group
            reply({"pid": pid, "cgroups": group.controllers})
        elif "poll" in request:
            pid = request["poll"]
            if pid not in exited:
                code = _status(pid, block=False)
                if code is not None:
                    exited[pid] = code
            reply({"status": exited.get(pid)})
        elif "stop" in request:
            pid = request["stop"]
            if pid not in exited:
                kill_tree(pid)
                exited[pid] = _status(pid, block=True)
            _stop_everything(me)
            if pid in groups:
                groups.pop(pid).kill()
            reply({"status": exited.pop(pid)})
    _stop_everything(me)
    for group in groups.values():
        group.kill()


# ----------------------------------------------------------------------------------- the client


class Sandbox:
    """The grader's end of the zygote (:func:`serve`): ``start`` a run, ``poll`` it, ``stop`` it.

    ``root``: a folder of the grading output for the zygote's own files (the shared, read-only
    ``pkg/`` through which runs import ``course_lib``, matplotlib's cache); ``deny``: what no run may
    read (the solutions, the submissions, the grading output); ``memory_bytes``: each process's address space (and
    as root the memory of all of a run's processes together); ``tasks_max``: the processes and threads a run may
    have at once (as root its pids group's cap, else ``RLIMIT_NPROC`` above what the user runs); ``deepspeed``: load DeepSpeed and its ops in the zygote (:func:`_load_deepspeed_ops`)."""

    def __init__(self, root: Path, deny: list[Path], memory_bytes: int, deepspeed: bool = False,
                 tasks_max: int = PIDS_MAX):
        import course_lib

        self.root, self.memory_bytes, self.tasks_max = Path(root).resolve(), memory_bytes, tasks_max
        package = Path(course_lib.__file__).resolve().parent
        self.pkg = self.root / "pkg"
        self.pkg.mkdir(parents=True, exist_ok=True)
        link = self.pkg / "course_lib"
        if not link.is_symlink():
            link.symlink_to(package, target_is_directory=True)
        (self.root / "mpl").mkdir(exist_ok=True)
        # Python's own folders (the venv's site-packages are in them), not the other entries of sys.path: those
        # are checkouts of the course (its solutions, tests, history), of which only course_lib is readable.
        python = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(sys.executable).resolve().parent)}
        readable = landlock.allowed_except([*_SYSTEM_READ, *python], [*deny, self.root])
        self.read = readable + [str(self.pkg), str(package)]
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(self.pkg),
                    "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1",
                    "LANG": os.environ.get("LANG", "C.UTF-8")}
        if "TORCH_EXTENSIONS_DIR" in os.environ:  # where the instructor's DeepSpeed ops were built
            self.env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
        env = dict(self.env, MPLCONFIGDIR=str(self.root / "mpl"), **{_DEEPSPEED_ENV: "1" if deepspeed else "0"})
        self._log = open(self.root / "zygote.log", "w")
        # cwd = pkg/: the zygote imports course_lib through it, as the runs' own Python processes will.
        self.proc = subprocess.Popen([sys.executable, "-c", "from course_lib.classroom.grading.sandbox import serve; "
                                      "serve()"], cwd=self.pkg, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)
        hello = self._answer(_START_TIMEOUT_S)
        self.landlock = hello["landlock"]
        self.cgroups: list[str] = []  # the controllers the last run got a group of its own in (as root)

    def _answer(self, timeout: float = 60) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            # a zygote loading DeepSpeed's ops may build them first (minutes, seen in a copied venv): a time limit
            # reached is not a process that ended
            raise RuntimeError("the grading sandbox stopped answering (its process ended)" if ready else
                               f"the grading sandbox did not answer within {timeout:g} s")
        return json.loads(line)

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def start(self, cells: Path, run_dir: Path) -> int:
        """Start a run of the cells in ``cells`` (``[[index, source], ...]``) in ``run_dir``; its pid. The run
        writes ``run_dir/events.jsonl`` and ``output.txt``; its home, the one folder it may write, is
        ``run_dir/home``."""
        run_dir = Path(run_dir).resolve()
        home = run_dir / "home"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        env = dict(self.env, HOME=str(home), TMPDIR=str(home / "tmp"), IPYTHONDIR=str(home / ".ipython"),
                   MPLCONFIGDIR=str(home / ".matplotlib"))
        env["COURSE_VERDICTS"] = str(run_dir / "events.jsonl")
        spec = dict(cells=str(Path(cells).resolve()), output=str(run_dir / "output.txt"), home=str(home), env=env,
                    read=self.read, memory_bytes=self.memory_bytes, tasks_max=self.tasks_max,
                    judge_records=str(run_dir / JUDGE_RECORDS))
        answer = self._ask({"start": spec})
        self.cgroups = answer.get("cgroups", [])
        return answer["pid"]

    def poll(self, pid: int) -> int | None:
        """The run's exit status (negative: killed by that signal), None while it runs."""
        return self._ask({"poll": pid})["status"]

    def stop(self, pid: int) -> int | None:
        """Kill the run's whole tree (and any process it left behind); its exit status if it had ended."""
        return self._ask({"stop": pid})["status"]

    def close(self) -> None:
        """End the zygote and everything under it."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc.pid)
                self.proc.wait()
        self._log.close()
