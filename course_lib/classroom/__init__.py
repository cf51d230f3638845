"""The course machinery: what turns the parallelism library into a course.

==========================  ==============================================================
:mod:`.checks`              exercise checkers (one verdict line, a hint that names the mistake)
:mod:`.notebooks`           ``solutions/`` -> ``labs/`` generator, the student workspace, the
                            generated-notebook stamp, theory pictures, the nbval plugin
:mod:`.widgets`             the interactive rank map, pipeline explorer, sizing explorer
                            (thin ipywidgets over the library's pure, tested functions)
:mod:`.site`                the course as a static website
:mod:`.figures`             ``python -m course_lib figures``: regenerate ``figures/``
:mod:`.gpu_check`           ``make gpu-check``: the CUDA/NCCL path on a GPU machine
==========================  ==============================================================

This package imports the library (``course_lib.*``); the library never imports it
(``tests/test_layout.py`` enforces the direction).
"""
