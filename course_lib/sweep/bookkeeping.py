"""The sweep's bookkeeping: the state of every run, and which files are the sweep's own.

* **Run state.** ``<out>/runs/<run>/day22_sweep.json`` is written when the run starts
  (``"status": "running"``), again as each config finishes (``"done"``), and last of all with
  ``"finished"`` or ``"interrupted"`` (``"stopped_by"``: Ctrl-C, SIGTERM, a config's error). A
  process killed outright (SIGKILL, a killed kernel) writes nothing more, so a run that still
  says ``running`` while its process is gone was killed: :func:`settled` reports it as
  interrupted, and :func:`settle_killed_runs` writes that down on the next sweep.
* **Own files.** The sweep replaces a fixed name (``<out>/A.log``, ``record_table.md``,
  ``figures/day22_megatron_3d4d.md``...) only when the file is exactly what was written there
  (its SHA-256 is in the folder's :class:`course_lib.safe_files.OutputLedger`); a file a person
  put there or edited since (the deliverable's conclusions!) needs ``--force``
  (:func:`check_replaceable`).

Temporary files are not the sweep's business: :func:`course_lib.launch.launch` leaves none,
however it ends (a killed sweep included).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

from course_lib.safe_files import OutputLedger, check_output_file, read_json, write_atomic
from course_lib.sweep.runs import SUMMARY_NAME


def now() -> str:
    """The local time, to the second, ISO 8601 (what run summaries record)."""
    return datetime.datetime.now().isoformat(timespec="seconds")


# ============================================================================ run state


def _process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` in clock ticks since boot (Linux), so a reused pid is not
    mistaken for the sweep's; ``None`` where ``/proc`` cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]          # field 22; the name before ")" may hold spaces


def this_process() -> dict:
    """Who runs this sweep (recorded in the run summary, to tell later whether it still runs)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid())}


def _still_running(process: dict) -> Optional[bool]:
    """Whether the process a run summary names is alive; ``None`` when it ran on another machine."""
    if process.get("host") != socket.gethostname():
        return None
    pid = process["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                             # alive, someone else's
        pass
    return process.get("start") is None or _process_start(pid) == process["start"]


def settled(summary: dict) -> dict:
    """The run summary as it stands now: one that says ``running`` while its process is gone was
    killed, and is returned as ``interrupted`` (a copy; the file is not touched)."""
    if summary.get("status") != "running" or _still_running(summary.get("process", {})) is not False:
        return summary
    return {**summary, "status": "interrupted",
            "stopped_by": "the process was killed (it ended without marking the run finished)"}


def read_run(run_dir: Path) -> Optional[dict]:
    """The settled summary of the run in ``run_dir``, or ``None`` if it has none (or one that cannot be read)."""
    try:
        return settled(read_json(Path(run_dir) / SUMMARY_NAME))
    except (OSError, ValueError):
        return None


def settle_killed_runs(out: Path) -> list[tuple[Path, dict]]:
    """Mark every killed run under ``out/runs`` as interrupted in its summary; return their
    folders and settled summaries."""
    settled_runs = []
    for summary_path in sorted(Path(out).glob(f"runs/*/{SUMMARY_NAME}")):
        run_dir = summary_path.parent
        try:
            written = read_json(summary_path)
        except (OSError, ValueError):
            continue
        summary = settled(written)
        if summary is written:
            continue
        summary = {**summary, "settled": now()}
        write_atomic(summary_path, json.dumps(summary, indent=1) + "\n")
        settled_runs.append((run_dir, summary))
    return settled_runs


class Terminated(SystemExit):
    """The sweep got SIGTERM; left uncaught it ends the process quietly with status 143, as SIGTERM would."""


def stop_reason(exc: BaseException) -> str:
    """What stopped a run, in a few words (recorded as ``stopped_by``)."""
    lines = str(exc).strip().splitlines()
    if isinstance(exc, KeyboardInterrupt):             # the launcher may say what it stopped
        return "KeyboardInterrupt (Ctrl-C or a notebook interrupt)" + (f"; {lines[0]}" if lines else "")
    if isinstance(exc, Terminated):
        return "SIGTERM"
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@contextmanager
def sigterm_raises():
    """While the block runs (in the main thread), SIGTERM raises :class:`Terminated` instead of
    ending the process on the spot, so the run can be marked interrupted; the old handler is restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ============================================================================ own files


def check_replaceable(ledger: OutputLedger, names: Iterable[str], *, force: bool = False,
                      what: str = "--out") -> None:
    """Before any work: refuse (``OutputPathError``, one line) a name in ``ledger``'s folder that
    holds a file not written there as recorded (a person's, or edited since), unless ``force``."""
    for name in names:
        check_output_file(ledger.folder / name, force=force or ledger.is_own(name), what=what)
