"""Loaded first by :mod:`.nbval_plugin`: every pytest process of ``make test`` starts ~1.3 s of CPU faster.

pytest loads nbval's entry point in every process (the session and each xdist worker); nbval imports
nbformat, nbformat imports jsonschema, and jsonschema (4.26) imports ``rfc3987_syntax`` when it is
installed (jupyterlab's jupyter-events asks for jsonschema[format-nongpl]) -- which builds a lark parser
of the RFC 3987 grammar at import: 1.2-1.4 s CPU of the 1.85 s a bare ``pytest`` takes to start here.
It only adds jsonschema's ``iri``/``iri-reference`` format checks, which nothing the course validates
uses (nbformat's v4 schemas have no format keyword: their one "format" is a raw cell's metadata field).
``sys.modules[name] = None`` is the import system's documented way to make an import fail
(ModuleNotFoundError), and jsonschema then leaves those two checks out; nothing is done when the module
is already imported. ``pytest -p`` plugins load before the entry points, in the session and in each
worker, so this runs first there. Measured: ``pytest -n 2`` of one empty test with the plugin,
7.66 -> 3.02 s CPU (session + 2 workers).
"""

import sys

SKIPPED = "rfc3987_syntax"

sys.modules.setdefault(SKIPPED, None)
