"""The tests mirror the package: ``tests/pipeline/`` tests ``course_lib/pipeline/``, ``tests/classroom/``
the course machinery, and the top level the top-level modules. The shared helpers (``helpers.py``,
``sharding_cases.py``, ``lab00_answers.py``) and ``fixtures/`` stay here; pytest puts this folder on
``sys.path`` because this file is here, so ``from helpers import ...`` works from every subfolder."""

import pytest

from course_lib.classroom.notebooks.nbval_plugin import LONGEST_FIRST

# The other test files that took 9 s or more summed in one `pytest -n 2 -m "not slow" tests` session
# (junit times, 2026-12-05, 2 cores under a load of 15-75: inflated several times, the order is what counts).
# Most launch ranks (fork or torchrun) or a kernel for every check; together with LONGEST_FIRST they were ~90%
# of that session's time.
INNER_LOOP_LEAVES_OUT = (
    "tests/classroom/checks/test_lab10_checks.py",
    "tests/test_two_nodes.py",
    "tests/classroom/test_nbval_labs.py",
    "tests/pipeline/test_pipeline_executor.py",
    "tests/deepspeed/test_ds_schema.py",
    "tests/data/test_megatron_data.py",
    "tests/classroom/checks/test_lab08_checks.py",
    "tests/classroom/test_judge.py",
    "tests/classroom/checks/test_lab04_checks.py",
    "tests/distributed/test_megatron_fsdp.py",
    "tests/test_train_sharded.py",
    "tests/moe/test_moe_grid.py",
    "tests/topology/test_topology_pictures.py",
    "tests/test_mixed_precision.py",
    "tests/classroom/test_widgets.py",
    "tests/classroom/checks/test_verdicts.py",
    "tests/classroom/checks/test_lab05_checks.py",
    "tests/test_model.py",
    "tests/classroom/checks/test_lab09_checks.py",
    "tests/test_activation_memory.py",
    "tests/distributed/test_distributed_optimizer.py",
    "tests/sizing/test_sizing_measured.py",
    "tests/context_parallel/test_context_parallel_ring.py",
    "tests/classroom/checks/test_lab07_checks.py",
    "tests/test_communication_patterns.py",
    "tests/test_layout.py",
)


def pytest_collection_modifyitems(config, items):
    """``make test-fast`` (``-m "not slow"``, the inner loop: under a minute on 2 cores) leaves out, besides the
    tests marked ``slow``, every test of the files measured longest: the nbval plugin's ``LONGEST_FIRST`` (25 s
    or more each in a ``make test`` session) and :data:`INNER_LOOP_LEAVES_OUT`. ``make test`` runs them all."""
    longest = {*LONGEST_FIRST, *INNER_LOOP_LEAVES_OUT}
    for item in items:
        if item.nodeid.split("::")[0] in longest:
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    """What a test process holds once its tests are collected (torch, the course, the test modules) goes to the
    garbage collector's permanent generation: its own collections, and those of every process it forks (ranks,
    student processes), walk only what the tests allocate (:func:`course_lib.launch.process_tree.freeze_inherited_objects`)."""
    import gc

    from course_lib.launch.process_tree import freeze_inherited_objects

    gc.collect()
    freeze_inherited_objects()
