# shim: removed once notebooks import course_lib.topology.*
from course_lib.topology.widget import *  # noqa: F401,F403
from course_lib.topology.widget import ORDERS, RankMapWidget, group_table_html, render  # noqa: F401
