"""The notebooks' machinery: ``solutions/`` is the single source, ``labs/`` is generated from it.

=====================  ===============================================================
:mod:`.generator`      ``python -m course_lib labs``: solutions -> labs (stubs, hints)
:mod:`.stamp`          the SHA-256 stamp that proves a generated notebook was never edited
:mod:`.workspace`      ``python -m course_lib workspace``: the student's ``my-labs/``
:mod:`.figures`        ``![caption](../figures/NAME.png)`` resolved for each reader
:mod:`.nbval_plugin`   one pytest session: strict nbval over solutions, lax over labs
=====================  ===============================================================
"""
