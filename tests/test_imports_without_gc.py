"""course_lib.imports_without_gc: the cyclic GC paused while a block imports, what it made moved to the oldest
generation (still listed by gc.get_objects) or kept frozen, the collector left as it was."""

import gc

from course_lib.imports_without_gc import imports_without_gc


def _generation_of(obj) -> int | None:
    return next((g for g in range(3) if any(o is obj for o in gc.get_objects(generation=g))), None)


def test_the_collector_is_paused_inside_then_what_was_made_is_old_and_still_listed():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with imports_without_gc():
        assert not gc.isenabled()
        made = [[]]
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    assert _generation_of(made) == 2               # moved to the oldest generation without a collection
    gc.disable()
    try:
        with imports_without_gc():
            pass
        assert not gc.isenabled()                  # off before: off after
    finally:
        gc.enable()


def test_kept_frozen_it_is_out_of_every_collection_until_thawed():
    frozen = gc.get_freeze_count()
    with imports_without_gc(keep_frozen=True):
        made = [[]]
    try:
        assert gc.get_freeze_count() > frozen and _generation_of(made) is None     # gc.get_objects() misses it
    finally:
        gc.unfreeze()                              # what a fork server's child does before a student's code
    assert _generation_of(made) == 2


def test_the_collector_comes_back_on_when_the_import_fails():
    try:
        with imports_without_gc():
            raise ImportError("no such module")
    except ImportError:
        pass
    assert gc.isenabled()


def test_in_a_process_that_keeps_objects_frozen_what_is_imported_joins_them():
    with imports_without_gc(keep_frozen=True):
        first = [[]]
    try:
        with imports_without_gc():             # e.g. DeepSpeed imported later in a fork server
            second = [[]]
        assert _generation_of(first) is None and _generation_of(second) is None
    finally:
        gc.unfreeze()
