# shim: removed once notebooks import course_lib.topology.*
from course_lib.topology.cli import *  # noqa: F401,F403
from course_lib.topology.cli import add_arguments, check_size, run  # noqa: F401
