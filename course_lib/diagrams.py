# shim: removed once notebooks import course_lib.topology.*
from course_lib.topology.rankmap import *  # noqa: F401,F403
from course_lib.topology.boundaries import boundary_sketch  # noqa: F401
