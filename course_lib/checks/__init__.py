"""Exercise checkers, one module per lab: they print a specific hint when an answer is wrong.

Every checker prints one verdict line and never raises: when the student's
function still raises ``NotImplementedError`` it prints "not attempted yet",
so the student notebook runs top to bottom before any exercise is solved.
"""


def call_student(fn, *args):
    """``(value, None)``, or ``(None, message)`` when ``fn`` raised; ``NotImplementedError`` -> ``(None, "todo")``."""
    try:
        return fn(*args), None
    except NotImplementedError:
        return None, "todo"
    except Exception as exc:  # noqa: BLE001 - reported to the student
        return None, f"{type(exc).__name__}: {exc}"


def not_attempted(name: str) -> bool:
    """Print the "not attempted yet" verdict for exercise ``name``; return False."""
    print(f"not attempted yet: write {name} above, then re-run this cell")
    return False
