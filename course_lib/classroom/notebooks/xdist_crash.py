"""pytest-xdist's ``--dist loadfile``, with a worker that dies failing its file instead of hanging the session.

In pytest-xdist 3.8.0 (the newest release), a worker that dies under ``loadfile`` can leave the session waiting
forever ("node down: Not properly terminated", then no progress), because ``LoadScopeScheduling.remove_node``
puts the dead worker's whole workload back on the queue:

- the files it had already finished, too: a replacement worker handed one gets an empty list of tests, never
  reports a test done, and so is never given more work (pytest-dev/pytest-xdist#1323, #1378);
- the file it died in, from the test it died on: the replacement runs that test again, dies again, until
  ``--max-worker-restart`` is spent (#1371); for a notebook the rerun starts mid-notebook in a fresh kernel,
  which proves nothing;
- a replacement is given one file at a time, while a worker runs a test only once it holds the next one
  (or is told to stop): a file of one test waits forever (#1327);
- and when two workers die, the replacement whose collection comes in first makes ``schedule`` hand work to the
  other, whose collection is not in yet: ``KeyError`` in ``_assign_work_unit``, an INTERNALERROR that ends the
  session.

:class:`CrashSafeLoadFile` keeps ``loadfile`` and mends the four: a dead worker's finished files are dropped,
its crash fails the test it died on (xdist's report), the rest of that file is not run and the report says
which, a worker is topped up to two pending tests whenever more work waits, and a worker still collecting is
given work only once its collection is in (``worker_collectionfinish`` calls ``schedule`` for it then). Loaded by
``course_lib.classroom.notebooks.nbval_plugin``.
"""

from __future__ import annotations

import pytest

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:                       # xdist is a dev dependency: without it nothing here is used
    LoadFileScheduling = object


class CrashSafeLoadFile(LoadFileScheduling):
    """xdist's ``LoadFileScheduling``: whole files per worker, a crash ends its file (see the module)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.not_run: dict[str, list[str]] = {}        # crashed test -> the later tests of its file, not run

    def remove_node(self, node):
        """Forget ``node`` (finished or dead); for a dead one, the test it died on (xdist reports it failed)."""
        workload = self.assigned_work.pop(node)
        pending = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not pending:
            return None
        scope, unit = next(iter(pending.items()))       # a worker runs its files in the order it got them
        left = [nodeid for nodeid, done in unit.items() if not done]
        crashitem, self.not_run[left[0]] = left[0], left[1:]
        del pending[scope]
        for scope, unit in reversed(pending.items()):   # files it never started: first in line again
            self.workqueue[scope] = unit
            self.workqueue.move_to_end(scope, last=False)
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _reschedule(self, node) -> None:
        if node not in self.registered_collections:
            return                                     # still collecting: its own collection's schedule() serves it
        try:
            super()._reschedule(node)
            while not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                self._assign_work_unit(node)           # one pending test would wait for a next one (#1327)
        except OSError:
            # The worker died after its last report and before its "node down" reached us: execnet cannot send
            # to it. The unit it was just given is pending in its workload, so remove_node puts it back in line.
            pass


@pytest.hookimpl(optionalhook=True, tryfirst=True)        # before xdist's own
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadfile":
        return CrashSafeLoadFile(config, log)
    return None


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    not_run = getattr(sched, "not_run", {}).get(crashitem)
    if not_run:
        report.longrepr = (f"{report.longrepr}; the {len(not_run)} later tests of its file were not run "
                           f"(a crashed file is not re-run): {', '.join(n.split('::', 1)[1] for n in not_run)}")
