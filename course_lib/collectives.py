"""The old name of :mod:`course_lib.communication_patterns`, kept so Lab 00 notebooks copied before the rename still run."""

from course_lib.communication_patterns import *  # noqa: F401,F403
