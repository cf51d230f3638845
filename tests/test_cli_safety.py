"""Student safety at the command line (issue 11): linear time and bounded memory on any input,
never overwriting what a person has, and one-line errors instead of tracebacks.

Every command runs through ``course_lib.__main__.main`` (what ``python -m course_lib`` runs):
a refusal is exit code 2 with one ``error: ...`` line, and the protected file keeps its bytes.
"""

import dataclasses
import os
import resource
import subprocess
import sys
import time
import tracemalloc
import types
from pathlib import Path

import pytest

from course_lib.classroom import figures as figures_mod
from course_lib.__main__ import main
from course_lib.training import logs as logs_mod
from course_lib.training.logs import parse_log

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_logs"
REPO = Path(__file__).resolve().parents[1]
WORLD_LINE = ("using world size: 8, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel "
              "sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 2\n")
ITERATION_LINE = (" [2026-01-01 10:00:00.123456] iteration       10/     100 | consumed samples:          160 | "
                  "elapsed time per iteration (ms): 812.3 | lm loss: 4.123456E+00 |\n")


def refused(capsys, argv, *needles) -> str:
    """Run ``python -m course_lib ARGV``: exit code 2, one ``error:`` line holding every needle."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def ok(capsys, argv) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


# ---- class 4: linear time, bounded memory --------------------------------------------------------

# Lines that made the old patterns backtrack quadratically (the old parser: 3 s for a 40 kB line).
PATHOLOGICAL = {
    "text glued to memory (MB)": "x" * 16_000 + " memory (MB)",
    "open parentheses": "(" * 16_000 + " memory (MB)",
    "repeated rank tags": "[Rank 0] " * 1_800 + " memory (MB)",
    "repeated 'validation'": "validation" * 1_600,
    "spaces after 'loss at'": "validation loss at " + " " * 16_000,
    "repeated parameter counts": "number of parameters on (" * 2_400,
    "a 5000-digit iteration": "iteration " + "9" * 5_000 + "/1 |",
}


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_pathological_line_parses_in_linear_time(name):
    """16 kB lines (under the line cap, so the patterns really run): milliseconds now, seconds before."""
    line = PATHOLOGICAL[name]
    start = time.perf_counter()
    parsed = parse_log(WORLD_LINE + line + "\n" + ITERATION_LINE)
    assert time.perf_counter() - start < 0.5, name
    assert parsed.config["tp"] == 2 and [it["iteration"] for it in parsed.iterations] == [10]
    assert parsed.memory == [] and parsed.validation == [] and parsed.parameters == []


def test_megabytes_of_pathological_text_stay_fast():
    """2 MB of the worst lines, and a 2 MB line without newlines (skipped whole, counted)."""
    start = time.perf_counter()
    parse_log(PATHOLOGICAL["text glued to memory (MB)"])
    assert time.perf_counter() - start < 0.5          # fail fast where the patterns are quadratic
    many = "\n".join(list(PATHOLOGICAL.values()) * 20)   # ~2 MB, every line under the cap
    start = time.perf_counter()
    parse_log(many)
    glued = WORLD_LINE + "x" * 2_000_000 + " memory (MB) | allocated: 1.0\n" + ITERATION_LINE
    parsed = parse_log(glued)
    assert time.perf_counter() - start < 2.0
    assert parsed.long_lines_skipped == 1 and parsed.memory == [] and len(parsed.iterations) == 1


def test_parse_log_file_streams_a_log_without_newlines_in_bounded_memory(tmp_path):
    log = tmp_path / "no_newlines.log"
    with open(log, "w") as f:
        f.write(WORLD_LINE)
        for _ in range(64):
            f.write("memory (MB) | " * 9_000)               # 8 MB on one line
        f.write("\n" + ITERATION_LINE)
    tracemalloc.start()
    try:
        parsed = logs_mod.parse_log_file(log)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB for an 8 MB line"
    assert parsed.config["world_size"] == 8 and len(parsed.iterations) == 1 and parsed.long_lines_skipped == 1


def test_streaming_reads_every_fixture_as_parse_log_does(monkeypatch, tmp_path):
    """Tiny chunks split lines and CRLF pairs anywhere; the result is what parse_log(text) gives."""
    monkeypatch.setattr(logs_mod, "_FILE_CHUNK_CHARS", 7)
    for path in sorted(FIXTURES.glob("*.log")):
        assert logs_mod.parse_log_file(path) == parse_log(path.read_text()), path.name
        crlf = tmp_path / path.name
        crlf.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
        assert dataclasses.asdict(logs_mod.parse_log_file(crlf)) == dataclasses.asdict(parse_log(path.read_text()))


def test_rankmap_refuses_worlds_it_cannot_tabulate_or_draw(capsys, tmp_path):
    refused(capsys, ["rankmap", "--world-size", str(2**20 + 8)], "at most 1048576 ranks")
    refused(capsys, ["rankmap", "--world-size", "2048", "--out", str(tmp_path / "m.svg")], "draws at most 1024 ranks")
    assert not (tmp_path / "m.svg").exists()
    assert "(per-rank coordinates omitted for 1024 ranks)" in ok(capsys, ["rankmap", "--world-size", "1024"])


def test_rankmap_two_billion_ranks_is_refused_without_allocating():
    """The old command grew to 22 GB; under a 1 GiB address-space limit it must still answer in one line."""
    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "course_lib", "rankmap", "--world-size", "2147483648"],
                         capture_output=True, text=True, timeout=60, preexec_fn=limit_memory, env=env, cwd=REPO)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.startswith("error: --world-size 2147483648") and res.stderr.count("\n") == 1


@pytest.mark.parametrize("flags,needle", [
    (["--t-f", "0"], "--t-f 0.0 is not a time"),
    (["--t-f", "nan"], "--t-f nan is not a time"),
    (["--t-b", "inf"], "--t-b inf is not a time"),
    (["--t-b", "-1"], "--t-b -1.0 is not a time"),
    (["--t-w", "nan"], "--t-w nan is not a time"),
    (["--pp", "64", "--microbatches", "1025"], "at most 65536"),
])
def test_pipeline_refuses_impossible_times_and_huge_schedules(capsys, flags, needle):
    refused(capsys, ["pipeline", *flags], needle)


def test_pipeline_bound_is_checked_before_building_anything():
    """pp = m = 2**31 would build 2**62 passes; the check needs no schedule (a call, not the CLI, so
    that code without the check fails here at once instead of building for ever)."""
    from course_lib.pipeline import cli

    args = types.SimpleNamespace(pp=2**31, vp=2, microbatches=2**31, t_f=1.0, t_b=2.0, t_w=0.0)
    with pytest.raises(ValueError, match=r"= 9223372036854775808 \(stage, micro-batch\) passes"):
        cli.check_arguments(args)


def test_pipeline_zero_weight_time_is_fine(capsys):
    assert "bubble fraction" in ok(capsys, ["pipeline", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "4",
                                            "--t-w", "0"])


# ---- class 5: never overwrite what a person has ----------------------------------------------------

@pytest.fixture
def training_log(tmp_path):
    log = tmp_path / "A.log"
    log.write_bytes((FIXTURES / "core_v0.16.0_tp2_pp2_cp2.log").read_bytes())
    return log


@pytest.mark.parametrize("flag", ["--markdown", "--csv"])
def test_report_never_writes_over_a_log_it_reads(capsys, training_log, flag):
    before = training_log.read_bytes()
    for spelling in (str(training_log), str(training_log.parent / "." / "A.log")):
        refused(capsys, ["report", str(training_log), flag, spelling, "--force"], "is also an input")
    link = training_log.parent / "link.md"
    link.symlink_to(training_log)
    refused(capsys, ["report", str(training_log), flag, str(link), "--force"], "is also an input")
    assert training_log.read_bytes() == before


def test_report_replaces_an_existing_table_only_with_force(capsys, training_log, tmp_path):
    table = tmp_path / "table.md"
    table.write_text("my notes\n")
    refused(capsys, ["report", str(training_log), "--markdown", str(table)], "already exists", "--force")
    assert table.read_text() == "my notes\n"
    refused(capsys, ["report", str(training_log), "--markdown", str(tmp_path / "t.x"), "--csv", str(tmp_path / "t.x")],
            "same file")
    assert not (tmp_path / "t.x").exists()
    ok(capsys, ["report", str(training_log), "--markdown", str(table), "--force"])
    assert table.read_text().startswith("| config |") and not list(tmp_path.glob(".*.tmp"))


def test_rankmap_out_and_export_corpus_replace_only_with_force(capsys, tmp_path, monkeypatch):
    from course_lib.data import corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "_documents", lambda: ("first document", "second document"))  # skip ~3 s
    picture, corpus = tmp_path / "map.dot", tmp_path / "corpus.jsonl"
    picture.write_text("mine")
    corpus.write_text("mine")
    refused(capsys, ["rankmap", "--world-size", "8", "--tp", "2", "--out", str(picture)], "already exists")
    refused(capsys, ["megatron-cmd", "--export-corpus", str(corpus)], "already exists", "--force")
    assert picture.read_text() == corpus.read_text() == "mine"
    ok(capsys, ["rankmap", "--world-size", "8", "--tp", "2", "--out", str(picture), "--force"])
    ok(capsys, ["megatron-cmd", "--export-corpus", str(corpus), "--force"])
    assert picture.read_text().startswith("digraph") and corpus.read_text().count("\n") == 2


@pytest.fixture
def fake_figures(monkeypatch):
    """``figures`` with one fast fake writer: ``drawn`` holds what it draws (name -> bytes)."""
    drawn = {"a.png": b"A1", "sub/b.svg": b"B1"}
    calls = []

    def write_figures(folder):
        calls.append(folder)
        paths = []
        for name, data in drawn.items():
            (Path(folder) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(folder) / name).write_bytes(data)
            paths.append(Path(folder) / name)
        return paths

    module = types.ModuleType("fake_figure_writer")
    module.write_figures = write_figures
    monkeypatch.setitem(sys.modules, "fake_figure_writer", module)
    monkeypatch.setattr(figures_mod, "WRITERS", {"fake_figure_writer": "write_figures"})
    return types.SimpleNamespace(drawn=drawn, calls=calls)


def test_figures_replace_only_their_own_files(capsys, tmp_path, fake_figures):
    out = tmp_path / "figs"
    ok(capsys, ["figures", "--out", str(out)])
    assert (out / "a.png").read_bytes() == b"A1" and (out / "sub" / "b.svg").read_bytes() == b"B1"
    (out / "notes.txt").write_text("a person's file")

    fake_figures.drawn["a.png"] = b"A2"          # the code changed: its own, untouched figure is refreshed
    assert "wrote" in ok(capsys, ["figures", "--out", str(out)]) and (out / "a.png").read_bytes() == b"A2"

    (out / "a.png").write_bytes(b"edited by hand")
    fake_figures.drawn.update({"a.png": b"A3", "sub/b.svg": b"B3"})
    refused(capsys, ["figures", "--out", str(out)], "a.png", "nothing was written", "--force")
    assert (out / "a.png").read_bytes() == b"edited by hand"
    assert (out / "sub" / "b.svg").read_bytes() == b"B1"     # all or nothing: b.svg was its own, yet not written

    ok(capsys, ["figures", "--out", str(out), "--force"])
    assert (out / "a.png").read_bytes() == b"A3" and (out / "sub" / "b.svg").read_bytes() == b"B3"
    assert (out / "notes.txt").read_text() == "a person's file"


def test_figures_never_replace_a_persons_file_of_the_same_name(capsys, tmp_path, fake_figures):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "a.png").write_bytes(b"my own picture")
    refused(capsys, ["figures", "--out", str(out)], "a.png", "already there")
    assert (out / "a.png").read_bytes() == b"my own picture" and not (out / "sub").exists()
    (out / "a.png").write_bytes(b"A1")          # the same bytes as drawn: nothing to replace, nothing refused
    ok(capsys, ["figures", "--out", str(out)])


def test_committed_figures_folder_is_its_own():
    """``make figures`` refreshes the committed figures/ without --force: the ledger covers every figure
    it draws, so a figure whose bytes differ on another machine is still recognised as its own."""
    ledger = figures_mod.OutputLedger(REPO / "figures")
    names = {"00_collectives_before_after.png", "pipeline_bubble_vs_m.png", "rankmap_8_tp2_pp2_dp2.svg",
             "tp_pp_boundaries_8layers_tp2_pp2.png"}
    assert names <= set(ledger.hashes)


# ---- class 7: one-line errors ------------------------------------------------------------------

def test_unwritable_or_invalid_outputs_are_one_line_errors_before_any_work(capsys, tmp_path, fake_figures):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    refused(capsys, ["rankmap", "--world-size", "8", "--out", "/proc/course_map.svg"], "--out /proc/course_map.svg")
    refused(capsys, ["rankmap", "--world-size", "8", "--out", str(a_file / "map.svg")], "is a file, not a folder")
    (tmp_path / "maps.svg").mkdir()
    refused(capsys, ["rankmap", "--world-size", "8", "--out", str(tmp_path / "maps.svg")], "is a folder")
    refused(capsys, ["megatron-cmd", "--export-corpus", "/proc/course/corpus.jsonl"], "--export-corpus")
    refused(capsys, ["megatron-cmd", "--export-corpus", str(tmp_path)], "is a folder")
    refused(capsys, ["report", str(FIXTURES / "v2.6_tp2_pp2_dp2.log"), "--csv", "/proc/course.csv"], "--csv")
    refused(capsys, ["figures", "--out", "/proc/course_figures"], "--out /proc/course_figures")
    refused(capsys, ["figures", "--out", str(a_file)], "is a file, not a folder")
    assert fake_figures.calls == []             # refused before anything was drawn


@pytest.mark.parametrize("content,needle", [
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8, "not a training log"),
    ("using world size: 8, caf\xe9\n".encode("latin-1"), "not UTF-8 text"),
    (b"plain text\x00with a NUL\n", "binary file"),
], ids=["executable", "latin-1", "nul-bytes"])
def test_report_on_binary_or_non_utf8_files(capsys, tmp_path, content, needle):
    log = tmp_path / "weird.log"
    log.write_bytes(content)
    refused(capsys, ["report", str(log)], str(log), needle)


@pytest.mark.parametrize("world_line,needles", [
    ("using world size: 8, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 0, "
     "pipeline-model-parallel size: 2", ["tensor-model-parallel size 0", "is 0"]),
    ("using world size: 8, tensor-model-parallel size: 0, pipeline-model-parallel size: 2",
     ["tensor-model-parallel size 0"]),
    ("using world size: 8 and model-parallel size: 0", ["tensor-model-parallel size 0"]),
    # rank 0's and rank 4's lines spliced: TP 2 x PP 1 x CP 1 x DP 2 = 4 ranks in a world of 8
    ("using world size: 8, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 2, "
     "pipeline-model-parallel size: 1", ["= 4 != world size 8", "tensor-model-parallel size 2"]),
    ("using world size: 8, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 2, "
     "encoder-tensor-model-parallel size: 1, pipeline-model-parallel size: 2, encoder-pipeline-model-parallel "
     "size: 2", ["(TP x PP + encoder TP x encoder PP) x CP x DP = 12 != world size 8"]),
    ("using world size: 12, tensor-model-parallel size: 8", ["not divisible by TP x PP x CP = 8"]),
])
def test_report_on_impossible_headers(capsys, tmp_path, world_line, needles):
    log = tmp_path / "garbled.log"
    log.write_text(world_line + "\n" + ITERATION_LINE)
    refused(capsys, ["report", str(log)], str(log), "impossible 'using world size' line", *needles)


def test_megatron_cmd_quotes_the_data_dir_in_every_line(capsys):
    data_dir = "my data/$HOME"
    out = ok(capsys, ["megatron-cmd", "--show", "all", "--data-dir", data_dir])
    starts = [i for i in range(len(out)) if out.startswith(data_dir, i)]
    assert len(starts) >= 10
    assert all(out[i - 1] == "'" for i in starts), "an unquoted --data-dir"
    refused(capsys, ["megatron-cmd", "--data-dir", "data\nrm -rf ~"], "control character")
    refused(capsys, ["megatron-cmd", "--data-dir=-rf"], "starts with '-'")
