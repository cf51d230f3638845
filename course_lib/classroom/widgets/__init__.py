"""Interactive explorers for the labs: thin ipywidgets over the library's pure, tested functions.

=================  ===========================================================
:mod:`.topology`   the rank map (``RankMapWidget``, over :mod:`course_lib.topology.rankmap`)
:mod:`.pipeline`   the schedule explorer (``pipeline_widget``, over the pipeline package)
:mod:`.sizing`     the sizing explorer (``explorer``, over :mod:`course_lib.sizing.planner`)
=================  ===========================================================
"""
