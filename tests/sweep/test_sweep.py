"""course_lib.sweep: the Day 22 A-F sweep on real ranks, its logs, tables, communication and bubble.

A reduced sweep (configs A, D and E, 8 real forked ranks, 2 iterations) runs once per module;
every check reads it. Independent references: the single-process dense model (loss parity), the
parameter count and the activation shape (communication bytes), Megatron's rank order
(``RankGrid``, itself checked against Megatron's ``parallel_state`` elsewhere) and the 1F1B
simulator (measured bubble). One config goes through real torchrun (world 2, ~10 s).
"""

import argparse
import io
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from course_lib import sweep as S
from course_lib.__main__ import main as course_main
from course_lib.launch import launch
from course_lib.megatron import COLUMNS
from course_lib.topology.seed import SEED_SWEEP
from course_lib.training.logs import parse_log
from course_lib.megatron import report as report_cli
from course_lib.pipeline import bubble_fraction, build_schedule, simulate
from course_lib.topology import RankGrid

NAMES = ["A", "D", "E"]
ITERS = 2
ACT_BYTES = S.SWEEP_MODEL["seq_length"] * S.SWEEP_BATCH["micro_batch_size"] * S.SWEEP_MODEL["hidden_size"] * 4


@pytest.fixture(scope="module")
def sweep_tmpdir(tmp_path_factory):
    """The module sweep's temporary folder ($TMPDIR and tempfile's, while it runs)."""
    return tmp_path_factory.mktemp("tmp")


@pytest.fixture(scope="module")
def swept(tmp_path_factory, sweep_tmpdir):
    out = tmp_path_factory.mktemp("day22")
    progress = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(sweep_tmpdir))
        patch.setattr(tempfile, "tempdir", str(sweep_tmpdir))
        sweep = S.run_sweep(NAMES, out=out, iters=ITERS, run_name="first", launcher="fork", timeout=120,
                            stream=progress)
    return out, sweep, progress.getvalue()


@pytest.fixture(scope="module")
def runs(swept):
    """The sweep's ConfigRun objects (every rank's returned record), by name."""
    return {r.name: r for r in swept[1]["runs"]}


def test_sweep_writes_every_log_and_table_atomically_under_a_named_run(swept, sweep_tmpdir):
    out, sweep, progress = swept
    run_dir = out / "runs" / "first"
    for folder in (out, run_dir):
        for n in NAMES:
            assert (folder / f"{n}.log").is_file() and (folder / f"{n}.json").is_file()
        for f in ("record_table.md", "record_table.csv", "comm_by_group.md", "comm_by_group.csv", "summary.md",
                  "day22_megatron_3d4d.md", "tokens_per_s.png", "memory_per_rank.png"):
            assert (folder / f).stat().st_size > 0, f
    assert not list(out.rglob("*.tmp*")) and not list(sweep_tmpdir.iterdir())  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "A.log").stat().st_mode & 0o777 == 0o666 & ~umask          # not the temp file's 0600
    run = json.loads((run_dir / "day22_sweep.json").read_text())
    assert run["configs"][0]["name"] == "A" and run["configs"][0]["run"] == "first"
    assert (run["status"], run["planned"], run["done"], run["stopped_by"]) == ("finished", NAMES, NAMES, None)
    assert progress.count("running ") == 3 and "[########################] 3/3 configs" in progress
    csv_lines = (out / "record_table.csv").read_text().splitlines()
    assert csv_lines[0] == ",".join(COLUMNS)
    assert [line.split(",")[0] for line in csv_lines[1:]] == NAMES
    assert all("run first" in line.split(",", 9)[9] for line in csv_lines[1:])       # each row names its run


def test_record_table_is_read_from_the_logs_with_the_megatron_parser(swept, capsys):
    out, sweep, _ = swept
    for s in sweep["configs"]:
        tp, pp, cp = SEED_SWEEP[s["name"]]
        dp = 8 // (tp * pp * cp)
        log = parse_log((out / f"{s['name']}.log").read_text())
        assert {k: log.config[k] for k in ("world_size", "tp", "pp", "cp", "dp")} == dict(
            world_size=8, tp=tp, pp=pp, cp=cp, dp=dp)
        row = s["row"]
        assert (row["TP"], row["PP"], row["CP"], row["DP"], row["micro-batches"]) == (tp, pp, cp, dp, 16 // dp)
        assert [it["iteration"] for it in log.iterations] == [1, 2]
        assert row["tokens/s"] == pytest.approx(16 * 32 / (row["step time (ms)"] / 1000), rel=1e-3)
        # the log's memory lines (DP rank 0 of each position) hold the busiest rank of the returned records
        assert row["max mem/rank (MB)"] == pytest.approx(max(s["memory_mb_per_rank"]), abs=0.01)
        assert log.memory[0]["source"] == "tracked tensor bytes"
        assert log.loss_curve()[-1][1] < log.loss_curve()[0][1]               # loss falls
    # `python -m course_lib report logs/day22/*.log` gives the same table (the sweep adds bubble notes)
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    report_cli.run(parser.parse_args([str(out / f"{n}.log") for n in NAMES] + ["--format", "csv"]))
    reported = [line.split(",")[:9] for line in capsys.readouterr().out.splitlines()]
    assert reported == [line.split(",")[:9] for line in (out / "record_table.csv").read_text().splitlines()]


def test_3d_layout_loss_equals_the_single_process_model(runs):
    ok, worst = S.check_loss_parity(runs["D"])
    assert ok and worst < 1e-4, worst
    assert len(runs["D"].lm_loss) == ITERS


def test_communication_per_group_matches_the_model_shapes(swept, runs):
    _, sweep, _ = swept
    by = {s["name"]: s for s in sweep["configs"]}
    a = by["A"]
    # A: one flat all-reduce of every fp32 gradient + the loss (sum, count) in float64, over 8 ranks
    grads = a["params_per_rank"][0] * 4
    assert a["comm_per_iteration"] == {"dp": {"calls": 2, "bytes": grads + 16, "sent_bytes": 2 * (grads + 16) * 7 / 8}}
    # E: PP 4, 8 micro-batches: a middle stage sends 8 activations forward and 8 gradients back
    e = by["E"]["comm_per_iteration"]["pp"]
    assert e["bytes"] == e["sent_bytes"] == 2 * 8 * ACT_BYTES and e["calls"] == 16
    # D: the nested recorder counts exactly what pretrain's own per-iteration record counts; the
    # one-time copy of the word embeddings (first -> last stage) is set-up, not iteration traffic
    for rec in runs["D"].records:
        assert {k: v["bytes"] for k, v in rec["comm_per_iteration"].items()} == rec["comm"]
    vocab_rows = 384 // 2                                                   # 257 bytes padded to 384, TP 2
    assert by["D"]["comm_setup"] == {"embedding": vocab_rows * S.SWEEP_MODEL["hidden_size"] * 4}
    assert a["comm_setup"] == {}
    assert set(by["D"]["comm_per_iteration"]) == {"tp", "pp", "dp", "embedding", "tp-pp"}
    assert "tp" not in by["E"]["comm_per_iteration"] and "pp" not in a["comm_per_iteration"]
    md = S.comm_markdown(sweep["configs"])
    assert "| config | tp | pp | dp | embedding | tp-pp |" in md


def test_config_d_under_zero3_halves_its_model_states_with_the_same_loss(swept, runs, tmp_path):
    """The Day 22 table's sharded row (Lab 07): D with Megatron-FSDP's ZeRO-3 over its DP 2, through the
    sweep (fork, 2 iterations), against the single process and against the swept D. fp32 Adam holds
    4 + 4 + 8 = 16 bytes per parameter; ZeRO-3 over d = 2 ranks leaves 8 on each (ZeRO's formula)."""
    from course_lib.sizing.memory import model_state_bytes

    sweep = S.run_sweep(["D-zero3"], out=tmp_path, iters=ITERS, run_name="z3", launcher="fork", timeout=120,
                        progress=False)
    z3 = sweep["runs"][0]
    assert "--use-megatron-fsdp" in z3.argv and "optim_grads_params" in z3.argv
    ok, worst = S.check_loss_parity(z3)
    assert ok and worst < 1e-4, worst
    for d_rank, z_rank in zip(runs["D"].records, z3.records):
        psi = z_rank["num_parameters"]
        assert d_rank["memory"]["allocated"] == 16 * psi
        want = model_state_bytes(psi, 2, 3, k=8, param_bytes=4, grad_bytes=4)
        assert z_rank["memory"]["allocated"] == want.weights + want.grads + want.optimizer == 8 * psi
        assert z_rank["state_bytes"]["params"] == want.weights
    memory = parse_log(z3.log).memory                       # the log's memory lines carry the sharded bytes
    assert memory and all(m["params_bytes"] == 2 * z3.records[m["rank"]]["num_parameters"] for m in memory)
    rows = (tmp_path / "record_table.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["D-zero3"]
    assert z3.row()["max mem/rank (MB)"] < runs["D"].row()["max mem/rank (MB)"]
    said = [c for c in S.conclusions([runs["D"].summary(), z3.summary()]) if c.startswith("Sharding: D-zero3")]
    assert len(said) == 1 and "0.50x D's" in said[0]
    # ZeRO-3's DP traffic: 2 all-gathers per unit per micro-batch + 1 reduce-scatter = (2 * 8 + 1) / 2 all-reduces
    price = [c for c in S.conclusions([runs["D"].summary(), z3.summary()]) if c.startswith("Sharding's price")]
    assert len(price) == 1 and "8.5x D's" in price[0]
    # --figures DIR --add: the new row joins a committed table without re-running the others
    fig = tmp_path / "figures"
    S.publish(swept[1], fig, swept[1]["run_dir"])
    S.publish(S.add_to_committed(sweep, fig), fig, sweep["run_dir"])
    table = [r.split(",") for r in (fig / "day22_record_table.csv").read_text().splitlines()[1:]]
    assert [r[0] for r in table] == NAMES + ["D-zero3"]
    assert ["run z3" in r[-1] for r in table] == [False] * len(NAMES) + [True]
    assert all("run first" in r[-1] for r in table[:len(NAMES)])
    assert (fig / "day22_logs" / "A.log").read_text() == (swept[0] / "A.log").read_text()
    assert (fig / "day22_logs" / "D-zero3.log").read_text() == z3.log
    assert [c["name"] for c in S.committed_summary(fig)["configs"]] == NAMES + ["D-zero3"]
    assert S._committed_rows_not_in(fig, NAMES) == ["D-zero3"]    # what a plain --figures run would drop, said


def test_groups_seen_by_the_ranks_are_megatrons(runs):
    grid = RankGrid(8, tp=2, pp=2, cp=1)
    assert runs["D"].groups() == {axis: sorted(grid.groups(axis)) for axis in ("tp", "cp", "dp", "pp")}
    assert runs["D"].groups()["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]            # COURSE.md's fact


def test_measured_bubble_is_computed_like_the_formula():
    """Records whose pipeline events are a 1F1B simulation give exactly (p-1)/m; the sweep's
    measured value is the same computation on real timestamps."""
    p, m = 4, 8
    tl = simulate(build_schedule("1f1b", p, m), t_f=1.0, t_b=2.0)
    records = []
    for dp in range(2):
        for r in range(p):
            events = [(str(e.action), e.stage, e.start + 100.0 * dp, e.end + 100.0 * dp) for e in tl.events[r]]
            records.append({"coords": {"tp": 0, "cp": 0, "dp": dp, "pp": r}, "pipeline_events": events})
    tls = S.measured_timelines(records, p, m)
    assert len(tls) == 2 and all(t.bubble_fraction == pytest.approx(bubble_fraction(p, m)) for t in tls)


def test_measured_bubble_and_timeline_of_real_pipelines(swept):
    _, sweep, _ = swept
    by = {s["name"]: s for s in sweep["configs"]}
    assert by["A"]["bubble"] == {"formula": 0.0, "measured": None} and by["A"]["timeline"] is None
    for name, p in (("D", 2), ("E", 4)):
        b = by[name]["bubble"]
        assert b["formula"] == bubble_fraction(p, 8) and b["measured"] > 0
        tl = S.summary_timeline(by[name])
        assert tl.pp_size == p and all(len(ev) == 16 for ev in tl.events)     # 8 F + 8 B per stage
        assert tl.bubble_fraction > 0
    assert "bubble" in by["E"]["row"]["notes"] and "(p-1)/m" in by["E"]["row"]["notes"]


def test_rerun_keeps_earlier_runs_and_refuses_to_overwrite_a_named_one(swept):
    out, _, _ = swept
    before = (out / "runs" / "first" / "A.log").read_text()
    with pytest.raises(ValueError, match="run 'first' already exists .* choose another --run-name") as err:
        S.run_sweep(["A"], out=out, iters=1, run_name="first", launcher="fork", progress=False)
    assert "\n" not in str(err.value)
    S.run_sweep(["A"], out=out, iters=1, world_size=2, run_name="second", launcher="fork", progress=False,
                timeout=120)
    assert (out / "runs" / "first" / "A.log").read_text() == before                  # the first run is kept
    assert (out / "A.log").read_text() == (out / "runs" / "second" / "A.log").read_text()   # latest = newest
    latest = S.latest_summary(out)
    assert [s["name"] for s in latest["configs"]] == NAMES and latest["configs"][0]["iters"] == 1
    assert (out / "D.log").read_text() == (out / "runs" / "first" / "D.log").read_text()    # untouched configs
    assert [(s["run"], s["status"], s["rows"]) for s in latest["sources"]] == [
        ("second", "finished", ["A"]), ("first", "finished", ["D", "E"])]
    # the latest of each config mixes settings: the tables say so, and each config's groups are its own
    summary = (out / "summary.md").read_text()
    assert "**Settings differ between rows** (compare them with care): A: 8 layers" in summary
    assert "2 ranks (fork), 1 iterations; D: 8 layers" in summary
    assert "on 2 / 8 ranks" in (out / "day22_megatron_3d4d.md").read_text()


@pytest.mark.parametrize("call, message", [
    (lambda: S.parse_configs("A,G"), "unknown config G: the sweep has A, B, C, D, E, F, D-distopt, D-zero3"),
    (lambda: S.parse_configs("A,a"), "names a config twice"),
    (lambda: S.config_argv("F", world_size=4), "config F .* world_size=4 is not divisible by"),
    (lambda: S.config_argv("C", world_size=8, num_attention_heads=6), "num_attention_heads=6 is not divisible"),
    (lambda: S.config_argv("A", hidden=3), "unknown model setting hidden"),
    (lambda: S.run_sweep(["A"], iters=0), "--iters=0 must be an integer >= 1"),
    (lambda: S.run_sweep(["A"], run_name="../x"), "--run-name '../x' may only use"),
    (lambda: S.committed_summary("/nonexistent"), "no committed sweep at"),
    (lambda: S.run(argparse.Namespace(configs="D-zero3", add=True, figures=None)), "--add adds this run's configs"),
])
def test_bad_input_fails_in_one_line_before_anything_runs(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


def test_parse_configs_and_progress_bar():
    assert S.parse_configs(None) == list("ABCDEF") and S.parse_configs("e, a") == ["E", "A"]
    assert S.parse_configs("all,d-zero3") == [*"ABCDEF", "D-zero3"]          # the sharded rows only by name
    assert S.SWEEP_CONFIGS["D-distopt"] == S.SWEEP_CONFIGS["D-zero3"] == SEED_SWEEP["D"]
    assert S._progress(0, 6, 0.0) == "[........................] 0/6 configs, 0 s"
    assert S._progress(3, 6, 30.0) == "[############............] 3/6 configs, 30 s, ~30 s left"


def test_cli_runs_through_real_torchrun_and_publishes(tmp_path, capsys, monkeypatch):
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    parser = argparse.ArgumentParser()
    S.add_arguments(parser)
    args = parser.parse_args(["--configs", "A", "--iters", "1", "--nproc-per-node", "2",
                              "--out", str(tmp_path / "logs"), "--run-name", "t", "--figures", str(tmp_path / "fig")])
    assert S.run(args) == 0
    printed = capsys.readouterr().out
    assert "| A | 1 | 1 | 1 | 2 | 8 |" in printed and "sweep time:" in printed
    log = (tmp_path / "logs" / "A.log").read_text()
    assert "launched with torchrun" in log and parse_log(log).config["dp"] == 2
    fig = tmp_path / "fig"
    for f in ("day22_sweep.json", "day22_record_table.md", "day22_record_table.csv", "day22_comm_by_group.csv",
              "day22_logs/A.log", "day22_megatron_3d4d.md", "day22_tokens_per_s.png", "day22_memory_per_rank.png"):
        assert (fig / f).stat().st_size > 0, f
    committed = S.committed_summary(fig)
    assert committed["launcher"] == "torchrun" and committed["world_size"] == 2
    assert (committed["status"], committed["done"], "process" not in committed) == ("finished", ["A"], True)
    assert not list((tmp_path / "tmp").iterdir())       # torchrun's torchelastic_* and the job folder: gone
    # publishing again replaces the sweep's own files; an edited deliverable needs --force
    S.publish(committed, fig, tmp_path / "logs" / "runs" / "t")
    (fig / "day22_megatron_3d4d.md").write_text("my conclusions")
    with pytest.raises(ValueError, match="day22_megatron_3d4d.md already exists; pass --force"):
        S.publish(committed, fig, tmp_path / "logs" / "runs" / "t")
    assert [p.name for p in S.write_figures(tmp_path / "again", committed)] == ["day22_tokens_per_s.png",
                                                                                 "day22_memory_per_rank.png"]
    deliverable = S.deliverable_markdown(committed)
    assert deliverable.startswith("# Day 22") and "## 5. Conclusions" in deliverable


# ---------------------------------------------------------------- honest bookkeeping (replayed runs, no launch)


def replay(runs, stop_at=None, stop=None, seen=None):
    """A runner that returns the module's real runs again instead of launching; at config ``stop_at``
    it calls ``stop()`` (which raises) instead. ``seen`` collects the temporary folder each call had."""
    def runner(name, **kwargs):
        if seen is not None:
            seen.append((tempfile.gettempdir(), os.environ.get("TMPDIR")))
        if name == stop_at:
            stop()
        return runs[name]
    return runner


def _raise(exc):
    def stop():
        raise exc
    return stop


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)                                       # the handler raises long before this ends


def _csv_notes(path):
    return {line.split(",")[0]: line.split(",", 9)[9] for line in path.read_text().splitlines()[1:]}


def test_rows_from_different_runs_are_labelled_and_an_interrupted_run_says_so_everywhere(runs, tmp_path):
    seen, outside = [], (tempfile.gettempdir(), os.environ.get("TMPDIR"))
    S.run_sweep(["A", "E"], out=tmp_path, run_name="one", runner=replay(runs, seen=seen), progress=False)
    with pytest.raises(KeyboardInterrupt):
        S.run_sweep(["D", "A", "E"], out=tmp_path, run_name="two", progress=False,
                    runner=replay(runs, "E", _raise(KeyboardInterrupt), seen))
    one, two = (json.loads((tmp_path / "runs" / r / "day22_sweep.json").read_text()) for r in ("one", "two"))
    assert (one["status"], one["done"]) == ("finished", ["A", "E"])
    assert (two["status"], two["planned"], two["done"]) == ("interrupted", ["D", "A", "E"], ["D", "A"])
    assert two["stopped_by"].startswith("KeyboardInterrupt") and two["ended"]
    # the top-level tables mix two runs: every row says which, and the interrupted one is named as such
    notes = _csv_notes(tmp_path / "record_table.csv")
    assert [(n, notes[n].rstrip('"').rsplit("; ", 1)[1]) for n in notes] == [
        ("A", "run two (interrupted)"), ("D", "run two (interrupted)"), ("E", "run one")]
    assert [line.rsplit(",", 1)[1] for line in (tmp_path / "comm_by_group.csv").read_text().splitlines()] == [
        "run", "run two (interrupted)", "run two (interrupted)", "run one"]
    assert "| run two (interrupted) |" in (tmp_path / "comm_by_group.md").read_text()
    assert "; run two (interrupted) |" in (tmp_path / "record_table.md").read_text()
    interrupted = "**Run `two` was interrupted after configs D, A**: KeyboardInterrupt (Ctrl-C"
    for name in ("summary.md", "day22_megatron_3d4d.md"):
        text = (tmp_path / name).read_text()
        assert "Rows come from 2 runs" in text and interrupted in text and "; not run: E; rows here: A, D." in text
        assert "- Run `one` finished: A, E; rows here: E." in text
    own = (tmp_path / "runs" / "two" / "day22_megatron_3d4d.md").read_text()
    assert f"> {interrupted}" in own and "Rows come from" not in own
    # the plots were redrawn for the mix, and say which runs they show
    assert S.runs_caption(S.latest_summary(tmp_path)) == "run two (interrupted): A, D; run one: E"
    assert (tmp_path / "tokens_per_s.png").read_bytes() != (tmp_path / "runs" / "one" / "tokens_per_s.png").read_bytes()
    # the sweep leaves the process's temporary folder alone (the launcher leaves no files there)
    assert seen == [outside] * 5
    # a student's conclusions in the deliverable are never replaced without --force
    (tmp_path / "day22_megatron_3d4d.md").write_text("my conclusions")
    with pytest.raises(ValueError, match=r"day22_megatron_3d4d.md already exists; pass --force") as err:
        S.run_sweep(["A"], out=tmp_path, run_name="three", runner=replay(runs, "A", _raise(AssertionError)))
    assert "\n" not in str(err.value) and not (tmp_path / "runs" / "three").exists()
    assert (tmp_path / "day22_megatron_3d4d.md").read_text() == "my conclusions"


@pytest.mark.parametrize("stop, reason, raised", [
    (_raise(KeyboardInterrupt), "KeyboardInterrupt (Ctrl-C or a notebook interrupt)", KeyboardInterrupt),
    (_sigterm, "SIGTERM", SystemExit),
    (_raise(RuntimeError("rank 3 failed: boom\n\n--- traceback ---")), "RuntimeError: rank 3 failed: boom",
     RuntimeError),
])
def test_every_way_a_run_stops_is_recorded_in_its_summary(runs, tmp_path, stop, reason, raised):
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(raised) as err:
        S.run_sweep(["A"], out=tmp_path, run_name="r", runner=replay(runs, "A", stop), progress=False)
    run = json.loads((tmp_path / "runs" / "r" / "day22_sweep.json").read_text())
    assert (run["status"], run["done"], run["stopped_by"]) == ("interrupted", [], reason)
    assert signal.getsignal(signal.SIGTERM) is handler                     # SIGTERM handling given back
    if raised is SystemExit:
        assert err.value.code == 128 + signal.SIGTERM                      # exits as SIGTERM would


def _sleeping_rank(in_flight):
    if os.environ["RANK"] == "0":
        in_flight.with_suffix(".tmp").write_text(str(os.getpid()))
        in_flight.with_suffix(".tmp").replace(in_flight)
    time.sleep(120)


def _sweep_killed_in_config_e(out, done, in_flight, tmp):
    """A forked copy of this process (no fresh interpreter to pay for): its own $TMPDIR, the sweep of ``done``
    (returned as it is) then E, killed while E's ranks run."""
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None

    def runner(name, **kwargs):
        if name == done.name:
            return done
        launch(_sleeping_rank, world_size=2, timeout=300, output="none", in_flight=in_flight)   # killed meanwhile

    S.run_sweep([done.name, "E"], out=out, run_name="killed", runner=runner, progress=False)


def test_a_killed_sweep_keeps_what_finished_leaves_no_temp_files_and_is_marked_by_the_next(runs, tmp_path):
    import multiprocessing

    out, in_flight, tmp = tmp_path / "out", tmp_path / "in_flight", tmp_path / "tmp"
    tmp.mkdir()
    proc = multiprocessing.get_context("fork").Process(target=_sweep_killed_in_config_e,
                                                       args=(out, runs["A"], in_flight, tmp))
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while not in_flight.exists() and proc.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert in_flight.exists(), f"the sweep never reached config E (exit code {proc.exitcode})"
    finally:
        proc.kill()                                     # SIGKILL: the sweep cannot write anything more
        proc.join()
    run_dir = out / "runs" / "killed"
    deadline = time.monotonic() + 10
    while any(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list(tmp.iterdir()) and not list(out.rglob("*.tmp*"))          # no temporary file left behind
    assert (out / "A.log").read_text() == (run_dir / "A.log").read_text() == runs["A"].log   # saved as it finished
    assert json.loads((run_dir / "day22_sweep.json").read_text())["status"] == "running"
    source = S.latest_summary(out)["sources"][0]          # read later, the run is known to be killed
    assert (source["run"], source["status"], source["done"]) == ("killed", "interrupted", ["A"])
    assert source["stopped_by"] == "the process was killed (it ended without marking the run finished)"
    S.run_sweep(["D"], out=out, run_name="next", runner=replay(runs), progress=False)
    settled = json.loads((run_dir / "day22_sweep.json").read_text())
    assert settled["status"] == "interrupted"
    assert "> **Run `killed` was interrupted after configs A**" in (run_dir / "day22_megatron_3d4d.md").read_text()
    deliverable = (out / "day22_megatron_3d4d.md").read_text()
    assert "**Run `killed` was interrupted after configs A**: the process was killed" in deliverable


@pytest.mark.parametrize("flag, path", [("--out", "/proc/nope"), ("--out", "FILE"), ("--figures", "/proc/nope"),
                                        ("--figures", "FILE/sub")])
def test_an_unwritable_output_is_refused_in_one_line_before_any_training(flag, path, tmp_path, capsys):
    (tmp_path / "FILE").write_text("a person's file")
    path = path.replace("FILE", str(tmp_path / "FILE"))
    out = path if flag == "--out" else str(tmp_path / "out")
    start = time.perf_counter()
    rc = course_main(["sweep", "--configs", "A", "--iters", "1", "--nproc-per-node", "2", "--launcher", "fork",
                      "--out", out] + (["--figures", path] if flag == "--figures" else []))
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {flag} ") and err.count("\n") == 1, err
    assert time.perf_counter() - start < 5 and not (tmp_path / "out" / "runs").exists()   # nothing trained
    assert (tmp_path / "FILE").read_text() == "a person's file"


def test_a_persons_file_at_a_sweep_name_needs_force(runs, swept, tmp_path):
    (tmp_path / "record_table.md").write_text("my table")
    with pytest.raises(ValueError, match="record_table.md already exists; pass --force"):
        S.run_sweep(["A"], out=tmp_path, run_name="r", runner=replay(runs, "A", _raise(AssertionError)))
    with pytest.raises(AssertionError):                # with force it gets as far as training
        S.run_sweep(["A"], out=tmp_path, run_name="r", force=True, runner=replay(runs, "A", _raise(AssertionError)),
                    progress=False)
    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "day22_megatron_3d4d.md").write_text("my deliverable")
    with pytest.raises(ValueError, match="--figures .*day22_megatron_3d4d.md already exists; pass --force"):
        S.publish(swept[1], figures, swept[1]["run_dir"])
    assert (figures / "day22_megatron_3d4d.md").read_text() == "my deliverable"


def test_make_sweep_may_replace_the_committed_summary_without_force():
    """figures/ records what `make sweep` published (safe_files.OutputLedger), so the next one replaces it."""
    from course_lib.safe_files import OutputLedger

    figures = Path(S.__file__).resolve().parents[2] / "figures"
    names = S.publish_names([s["name"] for s in S.committed_summary(figures)["configs"]])
    ledger = OutputLedger(figures)
    assert [n for n in names if not ledger.is_own(n)] == []
