"""DeepSpeed's ops are built on first use, once, by one process at a time (course_lib/deepspeed/ops.py)."""

import multiprocessing
import os
import shutil
import sysconfig

import pytest

from course_lib.deepspeed import ops as ds_ops
from course_lib.deepspeed import schema as ds_schema

pytestmark = pytest.mark.skipif(not ds_schema.deepspeed_installed(), reason="DeepSpeed 0.19.8 is not installed")


def _first_use(log: str) -> None:
    def slow_build():
        with open(log, "a") as f:
            f.write(f"start {os.getpid()}\n")
        import time

        time.sleep(0.5)  # long enough for the other process to arrive while this one builds
        with open(log, "a") as f:
            f.write(f"end {os.getpid()}\n")
        return ["shm_comm"]

    ds_ops.build_ops = slow_build
    ds_ops.ensure_built()


def test_two_first_users_build_once_in_turn(tmp_path, monkeypatch, capfd):
    ds_schema.import_deepspeed()                         # DeepSpeed on its CPU accelerator (and its real ops built)
    capfd.readouterr()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not ds_ops.built()
    log = tmp_path / "builds.log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_first_use, args=(str(log),)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    lines = log.read_text().split()
    assert lines[0::2] == ["start", "end"] and len(lines) == 4, lines    # one build, not two, not interleaved
    assert ds_ops.built()
    err = capfd.readouterr().err
    assert err.count("building DeepSpeed's C++ ops") == 1 and "DeepSpeed's ops are ready (shm_comm;" in err
    ds_ops.ensure_built()                                # built: nothing to do, nothing said
    assert capfd.readouterr().err == ""


def _killed_build(lock: str, ready) -> None:
    """A first user whose build is killed midway: it holds torch's lock of one op (``FileBaton``, as
    ``torch.utils.cpp_extension.load`` does) and our build lock, until SIGKILL."""
    import time

    from torch.utils.file_baton import FileBaton

    def build_until_killed():
        assert FileBaton(lock).try_acquire()
        ready.set()
        time.sleep(120)

    ds_ops.build_ops = build_until_killed
    ds_ops.ensure_built()


def _next_build(lock: str, log: str) -> None:
    """The next user: it builds only if torch would not wait (its lock of the op can be taken)."""
    from torch.utils.file_baton import FileBaton

    def build():
        baton = FileBaton(lock)
        with open(log, "w") as f:
            f.write("acquired" if baton.try_acquire() else "torch would wait forever")
        baton.release()
        return ["shm_comm"]

    ds_ops.build_ops = build
    ds_ops.ensure_built()


def test_a_killed_build_leaves_no_lock_that_blocks_the_next(tmp_path, monkeypatch, capfd):
    ds_schema.import_deepspeed()
    capfd.readouterr()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock, log = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "next.log"
    lock.parent.mkdir()
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    first = ctx.Process(target=_killed_build, args=(str(lock), ready))
    first.start()
    assert ready.wait(30)
    second = ctx.Process(target=_next_build, args=(str(lock), str(log)))
    second.start()                                       # it finds torch's lock held, and waits for our build lock
    assert ds_ops.clear_stale_locks(settle=0) == [] and lock.exists()     # a live build's lock stays
    os.kill(first.pid, 9)
    first.join(10)
    second.join(30)
    assert second.exitcode == 0 and log.read_text() == "acquired"
    assert ds_ops.built() and not lock.exists()
    err = capfd.readouterr().err
    assert err.count(f"note: removed {lock}, torch's build lock left by a DeepSpeed op build or load that was "
                     "killed") == 1, err
    lock.write_text("")                                  # killed while loading the built ops: the next import clears it
    ds_ops.ensure_built()
    assert not lock.exists() and f"note: removed {lock}" in capfd.readouterr().err


def test_the_ops_are_built_and_loaded_by_the_environments_own_ninja(monkeypatch):
    # torch runs the ninja on PATH; another version rejects the build log and rebuilds every op: Debian 13's
    # /usr/bin/ninja 1.11 beside pip's 1.13 rebuilt the venv's ops whenever pytest ran without make's PATH
    scripts = sysconfig.get_path("scripts")
    if not os.access(os.path.join(scripts, "ninja"), os.X_OK):
        pytest.skip("this environment has no ninja of its own")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", scripts, "/bin"]))
    ds_ops.set_environment()
    assert os.environ["PATH"].split(os.pathsep) == [scripts, "/usr/bin", "/bin"]
    assert shutil.which("ninja") == os.path.join(scripts, "ninja")
    ds_ops.set_environment()                              # once is enough: nothing added twice
    assert os.environ["PATH"].split(os.pathsep) == [scripts, "/usr/bin", "/bin"]


def test_the_cpu_is_asked_once_and_its_answer_kept_beside_the_ops(tmp_path, monkeypatch):
    """py-cpuinfo's answer (a Python subprocess, ~1.2 s of CPU, twice per op load) is asked once per CPU: kept in
    the process and in TORCH_EXTENSIONS_DIR, asked again when /proc/cpuinfo names another CPU."""
    import json

    import cpuinfo

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(ds_ops, "_cpu_identity", lambda: "model name : the course's CPU")
    asked = []

    def install():
        def ask():
            asked.append(1)
            return {"arch": "X86_64", "flags": ["avx2"]}
        monkeypatch.setattr(cpuinfo, "get_cpu_info", ask)
        ds_ops._remember_cpu_info()

    install()
    first = cpuinfo.get_cpu_info()
    first["flags"].append("changed by a caller")
    assert cpuinfo.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]} and len(asked) == 1
    assert json.loads((tmp_path / ".course_cpuinfo.json").read_text())["cpu"] == "model name : the course's CPU"
    install()                                                 # another process: the file answers
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and len(asked) == 1
    monkeypatch.setattr(ds_ops, "_cpu_identity", lambda: "model name : another CPU")
    install()                                                 # a copied environment on another CPU asks again
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and len(asked) == 2
