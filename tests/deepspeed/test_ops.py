"""DeepSpeed's ops are built on first use, once, by one process at a time (course_lib/deepspeed/ops.py)."""

import multiprocessing
import os

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
