"""The course website (course_lib.classroom.site): built from solutions/, checked in a real headless Chromium.

Fast tests check the pieces: what a page shows of a notebook (stubs, never the solution,
no outputs of exercise cells), the solution-leak check (a planted solution line is
caught), the README's tables, widgets' default views, and the ``site`` command's file
policy. The browser tests build the whole site once (~10 s) and open every page in one
Chromium: no console errors, no request leaving file://, the lab's title, at least two
pictures, every image decoded, the Chinese terms drawn with a CJK font of the page's
font stack, no solution line in the text a reader sees, and an index linking every lab.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from course_lib.__main__ import main
from course_lib.classroom.notebooks.generator import make_lab, stub_source
from course_lib.classroom.notebooks.stamp import read_notebook
from course_lib.classroom.site import pictures, readme
from course_lib.classroom.site.browser import Chromium, find_chromium
from course_lib.classroom.site.reader import SUCCESS_LABEL, leaked_lines, reader_notebook, solution_lines

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _code(source, outputs=(), tags=None):
    cell = {"cell_type": "code", "execution_count": 3, "id": f"c{len(source)}", "metadata": {},
            "outputs": list(outputs), "source": source}
    if tags:
        cell["metadata"]["tags"] = tags
    return cell


def _stream(text):
    return {"output_type": "stream", "name": "stdout", "text": text}


EXERCISE = "def double(x):\n    ### BEGIN SOLUTION\n    ### HINT: twice x\n    secret_answer = x * 2\n" \
           "    return secret_answer\n    ### END SOLUTION\n"


def _tiny_solution():
    return {"nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                         "widgets": {"state": {}}},
            "cells": [{"cell_type": "markdown", "id": "title", "metadata": {},
                       "source": "# Lab 00 — Tiny (张量并行)\n\nTheory."},
                      _code("# NBVAL_IGNORE_OUTPUT\nprint('shown')", [_stream("shown\n")]),
                      _code(EXERCISE + "print(double(2))", [_stream("4\n")]),
                      _code("_ = check(double)", [_stream("✓ double is right\n")])]}


# ---------------------------------------------------------------------------------------
# What a page shows of a notebook
# ---------------------------------------------------------------------------------------

def test_reader_notebook_shows_the_stub_and_drops_the_exercise_outputs():
    solution = _tiny_solution()
    cells = reader_notebook(solution)["cells"]
    assert cells[1]["source"] == "print('shown')" and cells[1]["outputs"] == [_stream("shown\n")]
    assert cells[2]["source"] == stub_source(EXERCISE + "print(double(2))")[0]
    assert "secret_answer" not in cells[2]["source"] and "raise NotImplementedError('twice x')" in cells[2]["source"]
    assert cells[2]["outputs"] == [] and cells[2]["execution_count"] is None   # the printed answer is gone
    # the checker's verdict was printed for the solution: under the stub it is shown only as what success looks like
    assert cells[3]["outputs"] == [_stream(SUCCESS_LABEL + "✓ double is right\n")]
    assert "widgets" not in reader_notebook(solution)["metadata"]
    assert solution == _tiny_solution()                                       # the input is untouched


def test_solution_lines_are_the_hidden_lines_and_a_planted_one_is_caught():
    secret = solution_lines(_tiny_solution())
    assert secret == {"secret_answer = x * 2", "return secret_answer"}
    lab_text = "\n".join(c["source"] for c in make_lab(_tiny_solution())["cells"])
    assert leaked_lines(lab_text, secret) == []
    planted = lab_text + "\n        return secret_answer   \n"
    assert leaked_lines(planted, secret) == ["return secret_answer"]
    assert leaked_lines("return secret_answer_not", secret) == []  # lines, not substrings


def test_no_page_shows_a_verdict_under_a_stub_unlabelled():
    """Every stored "✓ ..." line of every lab reaches its page only under the label (the first output of a cell
    that holds a verdict begins with it; the outputs after it are shown under it)."""
    for path in SOLUTIONS:
        for cell in reader_notebook(read_notebook(path))["cells"]:
            texts = ["".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream"]
            first = next((t for t in texts if any(line.startswith("✓") for line in t.splitlines())), None)
            assert first is None or first.startswith(SUCCESS_LABEL), (path.name, first[:80])


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_no_page_of_a_real_lab_keeps_solution_code(path):
    """Every real exercise's hidden lines are absent from the notebook a page renders (sources and outputs)."""
    solution = read_notebook(path)
    notebook = reader_notebook(solution)
    assert leaked_lines(_all_text(notebook), solution_lines(solution)) == []


def _all_text(notebook) -> str:
    """Every source and every output text of a notebook, lines joined."""
    def joined(value):
        return "".join(value) if isinstance(value, list) else str(value)

    parts = []
    for cell in notebook["cells"]:
        parts.append(joined(cell["source"]))
        for output in cell.get("outputs", []):
            parts += [joined(output.get("text", ""))] + [joined(v) for v in output.get("data", {}).values()]
    return "\n".join(parts)


@pytest.fixture(scope="module")
def renderer():
    """One nbconvert exporter for the page tests (building it is the slow part)."""
    from course_lib.classroom.site import build

    return build.Renderer("Course")


def test_a_page_that_would_show_the_solution_stops_the_build(monkeypatch, tmp_path, renderer):
    from course_lib.classroom.site import build

    monkeypatch.setattr(build, "reader_notebook", copy.deepcopy)  # a bug: the solution itself is rendered
    lab = build.Lab(tmp_path / "00_tiny.ipynb", "Lab 00 — Tiny")
    with pytest.raises(ValueError, match=r"00_tiny.html would show solution code .*'secret_answer = x \* 2'"):
        build.lab_page_files(lab, _tiny_solution(), ROOT / "figures", renderer,
                             previous=None, following=None)


def test_a_theory_picture_of_the_notebook_is_copied_beside_the_page(renderer):
    """``../figures/NAME`` in a markdown cell becomes ``assets/figures/NAME`` with the file copied; a missing
    figure stops the build in one line."""
    from course_lib.classroom.site import build

    solution = _tiny_solution()
    solution["cells"][0]["source"] += "\n\n![8 ranks](../figures/rankmap_8_tp2_pp2_dp2.png)"
    lab = build.Lab(ROOT / "solutions/00_tiny.ipynb", "Lab 00 — Tiny")
    files = build.lab_page_files(lab, solution, ROOT / "figures", renderer, previous=None, following=None)
    assert sorted(files) == ["00_tiny.html", "assets/figures/rankmap_8_tp2_pp2_dp2.png"]
    assert files["assets/figures/rankmap_8_tp2_pp2_dp2.png"] == (ROOT / "figures/rankmap_8_tp2_pp2_dp2.png").read_bytes()
    page = files["00_tiny.html"].decode()
    assert 'src="assets/figures/rankmap_8_tp2_pp2_dp2.png"' in page and "../figures" not in page
    solution["cells"][0]["source"] += "\n\n![gone](../figures/gone.png)"
    with pytest.raises(ValueError, match=r"00_tiny.ipynb: cell 0 \(id title\): ../figures/gone.png: no such figure"):
        build.lab_page_files(lab, solution, ROOT / "figures", renderer, previous=None, following=None)


# ---------------------------------------------------------------------------------------
# The README's tables, the widgets' default views
# ---------------------------------------------------------------------------------------

def test_the_readme_course_map_and_glossary_are_read_not_retyped():
    course_map = readme.section_table(README, "Course map")
    stems = [readme.notebook_stem(row[course_map.column("notebook", "README")]) for row in course_map.rows]
    assert stems[:2] == ["00_collectives", "01_topology"] and None not in stems
    hours = [readme.hours(row[course_map.column("time", "README")]) for row in course_map.rows]
    assert None not in hours and sum(hours) > 0
    glossary = readme.section_table(README, "Glossary")
    assert any("张量并行" in row for row in glossary.rows)
    assert readme.split_row("| `a | b` | c \\| d |") == ["`a | b`", "c \\| d"]
    assert readme.hours("30 min") == 0.5 and readme.hours("soon") is None
    with pytest.raises(ValueError, match="README.md: no heading 'Timetable'"):
        readme.section_table(README, "Timetable")
    with pytest.raises(ValueError, match="no table under the heading 'Intro'"):
        readme.section_table("# T\n\n## Intro\n\ntext\n\n## Next\n\n| a |\n|---|\n| 1 |\n", "Intro")


def test_widget_cells_become_their_default_view():
    assert pictures._widget_call("from x import RankMapWidget\nRankMapWidget(world_size=8, tp=2, pp=2, highlight=5)") \
        == ("RankMapWidget", [], {"world_size": 8, "tp": 2, "pp": 2, "highlight": 5})
    assert pictures._widget_call("n = 8\nRankMapWidget(world_size=n)") is None  # needs the notebook's variables
    assert pictures._widget_call("print(1)") is None
    view = pictures.widget_view("RankMapWidget(world_size=8, tp=2, pp=2, highlight=5)", "01-cell9")
    assert list(view.files) == ["assets/widgets/01-cell9-rank-map.svg"]
    assert b"<svg" in view.files["assets/widgets/01-cell9-rank-map.svg"]
    assert '<img src="assets/widgets/01-cell9-rank-map.svg"' in view.html and "<table>" in view.html


def test_the_pipeline_widget_starts_where_its_static_view_is_drawn():
    """The page draws pipeline_widget() with explore()'s defaults: the sliders must start there."""
    import inspect

    from course_lib.classroom.widgets.pipeline import explore, pipeline_widget

    box = pipeline_widget()
    start = [control.value for row in box.children[:2] for control in row.children]
    assert start == [p.default for p in inspect.signature(explore).parameters.values()]


# ---------------------------------------------------------------------------------------
# The command: files it did not write are never replaced
# ---------------------------------------------------------------------------------------

def _tiny_site_args(tmp_path, out):
    solutions = tmp_path / "solutions"
    solutions.mkdir(exist_ok=True)
    (solutions / "00_tiny.ipynb").write_text(json.dumps(_tiny_solution()), encoding="utf-8")
    return ["site", "--out", str(out), "--solutions", str(solutions), "--figures", str(ROOT / "figures"),
            "--readme", str(ROOT / "README.md")]


def test_site_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "site"
    out.mkdir()
    (out / "index.html").write_text("my own page")
    assert main(_tiny_site_args(tmp_path, out)) == 2
    refusal = capsys.readouterr().err
    assert f"error: --out {out}: index.html already there" in refusal and "--force" in refusal
    assert (out / "index.html").read_text() == "my own page" and not (out / "00_tiny.html").exists()
    assert main(_tiny_site_args(tmp_path, out) + ["--force"]) == 0
    page = (out / "00_tiny.html").read_text(encoding="utf-8")
    assert "secret_answer" not in page and "NotImplementedError" in page and "twice x" in page
    assert main(_tiny_site_args(tmp_path, out)) == 0   # its own files: replaced without --force
    assert "0 written, " in capsys.readouterr().err


def test_site_refuses_an_unknown_lab_in_one_line(tmp_path, capsys):
    assert main(_tiny_site_args(tmp_path, tmp_path / "site") + ["--labs", "99"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --labs 99: no such lab in {tmp_path / 'solutions'}"


def test_site_refuses_a_missing_readme_table_in_one_line(tmp_path, capsys):
    (tmp_path / "README.md").write_text("# Course\n\nno tables\n")
    args = _tiny_site_args(tmp_path, tmp_path / "site")
    args[args.index("--readme") + 1] = str(tmp_path / "README.md")
    assert main(args) == 2
    assert capsys.readouterr().err.strip().endswith(
        "no heading 'Course map'; the site's index reads its table from there")


# ---------------------------------------------------------------------------------------
# The built site in a real browser
# ---------------------------------------------------------------------------------------

CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine: `make test` installs Debian's chromium when run as root; "
                             "otherwise run `sudo apt-get install chromium fonts-noto-cjk` (or set CHROMIUM)")

# Evaluated in each page after its load event: what a reader sees. Then a span of Chinese is added
# at the end of <main>, so the browser can report which fonts drew it (Visit.fonts).
PAGE_FACTS = """(() => {
  const main = document.querySelector('main') || document.body;
  const images = [...main.querySelectorAll('img')];
  const facts = {
    h1: (main.querySelector('h1') || {}).innerText || null,
    images: images.map(i => ({src: i.getAttribute('src').slice(0, 80), ok: i.complete && i.naturalWidth > 0,
                              shown: i.getBoundingClientRect().width > 0})),
    links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
    exercises: main.querySelectorAll('.celltag_exercise').length,
    text: main.innerText,
    fontStack: getComputedStyle(main).fontFamily,
  };
  const probe = main.appendChild(Object.assign(document.createElement('span'),
                                               {id: 'cjk-probe', textContent: '张量并行流水线并行'}));
  probe.getBoundingClientRect();  // lay it out now, then let a frame be drawn, so its fonts are known
  return document.fonts.ready.then(() => new Promise(done => requestAnimationFrame(() => done(facts))));
})()"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``.out``: the site built from a snapshot of solutions/, ``.solutions``: that snapshot (pages are compared
    with the notebooks they came from, even while someone edits solutions/)."""
    out = tmp_path_factory.mktemp("site")
    snapshot = tmp_path_factory.mktemp("solutions")
    for path in SOLUTIONS:
        shutil.copyfile(path, snapshot / path.name)
    assert main(["site", "--out", str(out), "--solutions", str(snapshot),
                 "--figures", str(ROOT / "figures"), "--readme", str(ROOT / "README.md")]) == 0
    return SimpleNamespace(out=out, solutions=snapshot)


@pytest.fixture(scope="module")
def browser():
    with Chromium(CHROMIUM) as chromium:
        group = chromium.process.pid  # the browser leads its own process group
        yield chromium
    assert _group_gone(group, within=10.0), "a Chromium process outlived the browser's close()"


def _group_gone(group: int, within: float) -> bool:
    """No process of ``group`` is left (its helpers' zombies are reaped by init shortly after close)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _visit(browser, path: Path):
    visit = browser.visit(path.resolve().as_uri(), PAGE_FACTS, font_probe="#cjk-probe")
    return visit, visit.value


def _families(stack: str) -> set[str]:
    return {name.strip().strip('"\'') for name in stack.split(",")}


def _title(path: Path) -> str:
    """The lab's title as its author wrote it: the first '# ' line of the first markdown cell that has one."""
    for cell in read_notebook(path)["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        found = re.search(r"^# (.+)$", source, re.M) if cell["cell_type"] == "markdown" else None
        if found:
            return found.group(1).strip()
    raise AssertionError(f"{path} has no title")


@pytest.mark.slow
@needs_chromium
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_each_lab_page_reads_well_in_chromium(site, browser, path):
    path = site.solutions / path.name  # the notebook as it was when the page was built
    visit, facts = _visit(browser, site.out / f"{path.stem}.html")
    assert visit.errors == [], f"{path.stem}.html logged errors"
    assert [url for url in visit.requests if not url.startswith(("file:", "data:"))] == [], "must work offline"
    assert facts["h1"] == _title(path)
    assert len([image for image in facts["images"] if image["shown"]]) >= 2, "at least two pictures"
    assert [image["src"] for image in facts["images"] if not image["ok"]] == [], "every image resolves"
    solution = read_notebook(path)
    assert leaked_lines(facts["text"], solution_lines(solution)) == [], "no solution text"
    assert facts["exercises"] == sum("exercise" in c["metadata"].get("tags", []) for c in make_lab(solution)["cells"])
    assert visit.fonts and set(visit.fonts) <= _families(facts["fontStack"]), (
        f"Chinese drawn with {visit.fonts}, not a font of the page's stack: install a CJK font "
        f"(Debian: apt-get install fonts-noto-cjk)")


@pytest.mark.slow
@needs_chromium
def test_the_index_links_every_lab_and_shows_the_map_and_glossary(site, browser):
    visit, facts = _visit(browser, site.out / "index.html")
    assert visit.errors == [] and all(url.startswith(("file:", "data:")) for url in visit.requests)
    assert {f"{path.stem}.html" for path in SOLUTIONS} <= set(facts["links"])
    assert all((site.out / link).is_file() for link in facts["links"] if link.endswith(".html"))
    assert "Course map" in facts["text"] and "Total: " in facts["text"] and "张量并行" in facts["text"]
    assert set(visit.fonts) <= _families(facts["fontStack"])


@pytest.mark.slow
@needs_chromium
def test_the_browser_check_sees_broken_pages(tmp_path, browser):
    """The checks above can fail: a missing image, a console error, an exception and a remote request are seen."""
    page = tmp_path / "broken.html"
    page.write_text('<html><body><main><h1>x</h1><img src="missing.png"><img src="http://127.0.0.1:9/remote.png">'
                    '<script>console.error("boom"); undefined_function();</script></main></body></html>')
    visit, facts = _visit(browser, page)
    joined = "\n".join(visit.errors)
    assert "console.error: boom" in joined and "undefined_function" in joined and "missing.png" in joined
    assert "http://127.0.0.1:9/remote.png" in visit.requests
    assert [image["ok"] for image in facts["images"]] == [False, False]
