"""The tests mirror the package: ``tests/pipeline/`` tests ``course_lib/pipeline/``, ``tests/classroom/``
the course machinery, and the top level the top-level modules. The shared helpers (``helpers.py``,
``sharding_cases.py``, ``lab00_answers.py``) and ``fixtures/`` stay here; pytest puts this folder on
``sys.path`` because this file is here, so ``from helpers import ...`` works from every subfolder."""
