# shim: removed once notebooks import course_lib.topology.*
from course_lib.topology.figures import *  # noqa: F401,F403
from course_lib.topology.figures import SEED_LAYOUTS, main, write_figures  # noqa: F401
