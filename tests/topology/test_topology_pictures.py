"""The topology pictures (rank map, boundary sketch), the rankmap CLI and Lab 01's checkers (the rank-map widget: tests/classroom/test_widgets.py).

Pictures are checked by what they contain (every rank, every link, the right
labels), computed independently from the seed's group lists -- not by pixels.
"""

import argparse
import re
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_lib.topology import boundaries, rankmap  # noqa: E402
from course_lib.topology import ParallelConfig, RankGrid  # noqa: E402

SEED = RankGrid(8, tp=2, pp=2)  # TP [0,1][2,3][4,5][6,7]; PP [0,4][1,5][2,6][3,7]; DP [0,2][1,3][4,6][5,7]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


# ---- pure layout helpers ------------------------------------------------------------------

def test_highlight_roles_and_layout_for_the_seed():
    assert rankmap.highlight_roles(SEED, 5) == {5: "self", 4: "tp", 7: "dp", 1: "pp"}
    assert rankmap.highlight_roles(SEED, None) == {}
    assert rankmap.stage_layout(SEED) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


@pytest.mark.parametrize("grid", [RankGrid(128, tp=4, pp=4), RankGrid(8, tp=2, pp=2, cp=2),
                                  RankGrid(24, tp=2, pp=3, cp=2, order="tp-pp-dp-cp"),
                                  RankGrid(32, tp=16, pp=2), RankGrid(32, tp=4, pp=8)])
def test_stage_layout_lines_up_pp_partners(grid):
    layout = rankmap.stage_layout(grid)
    where = {r: (s, b, k) for s, boxes in enumerate(layout) for b, g in enumerate(boxes) for k, r in enumerate(g)}
    assert sorted(where) == list(range(grid.world_size))
    for group in grid.groups("pp"):  # the same box and cell in every stage, stage = pp rank
        assert [where[r][0] for r in group] == list(range(grid.pp))
        assert len({where[r][1:] for r in group}) == 1
    for group in grid.groups("tp"):
        s, b, _ = where[group[0]]
        assert layout[s][b] == group


def test_links_for_the_seed():
    links = rankmap.links(SEED, "ranks", highlight=5)
    pp = {(a, b) for axis, a, b, _ in links if axis == "pp"}
    dp = {(a, b) for axis, a, b, _ in links if axis == "dp"}
    assert pp == {(0, 4), (1, 5), (2, 6), (3, 7)}
    assert dp == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert {(axis, a, b) for axis, a, b, bold in links if bold} == {("pp", 1, 5), ("dp", 5, 7)}
    merged = rankmap.links(SEED, "groups", highlight=5)  # one link per pair of TP boxes
    assert sorted((axis, bold) for axis, _, _, bold in merged) == [
        ("dp", False), ("dp", True), ("pp", False), ("pp", True)]


# ---- graphviz ------------------------------------------------------------------------------

def _cells(source):
    return sorted(int(x) for x in re.findall(r'<TD PORT="p\d+"[^>]*>(?:<B><FONT COLOR="white">)?(\d+)<', source))


def test_graphviz_rank_map_of_the_seed(tmp_path):
    dot = rankmap.rank_map(SEED, highlight=5, num_layers=8)
    src = dot.source
    assert _cells(src) == list(range(8))
    assert src.count("subgraph cluster_stage") == 2
    assert "pipeline stage 0 · layers 0–3" in src and "pipeline stage 1 · layers 4–7" in src
    pp_edges = re.findall(r"(s\d+b\d+):p(\d+):s -> (s\d+b\d+):p(\d+):n", src)
    assert len(pp_edges) == 4  # rank-to-rank PP arrows
    assert src.count("style=dashed") == 2  # DP: one link per pair of boxes, in each stage
    assert rankmap.COLORS["self"] in src and "rank 5: tp [4, 5]  dp [5, 7]  pp [1, 5]" in src
    svg = rankmap.save(dot, tmp_path / "seed.svg").read_text()
    texts = re.findall(r">(\d+)</text>", svg)
    assert sorted(set(map(int, texts)) & set(range(8))) == list(range(8))
    assert rankmap.save(dot, tmp_path / "seed.dot").read_text() == src


def test_graphviz_rank_map_128_ranks_and_cp():
    src = rankmap.rank_map(RankGrid(128, tp=4, pp=4), highlight=37, num_layers=72).source
    assert _cells(src) == list(range(128))
    assert src.count("subgraph cluster_stage") == 4 and src.count("TP group · dp") == 32
    assert "layers 54–71" in src
    cp = rankmap.rank_map(RankGrid(8, tp=2, pp=2, cp=2)).source
    assert cp.count("style=dotted") == 2 and "style=dashed" not in cp  # dp = 1: no DP links


def test_save_rejects_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"cannot write a Graphviz map as '.gif'"):
        rankmap.save(rankmap.rank_map(SEED), tmp_path / "x.gif")
    with pytest.raises(ValueError, match=r"cannot write a matplotlib figure as '.dot'"):
        rankmap.save(rankmap.rank_map_figure(SEED), tmp_path / "x.dot")
    with pytest.raises(ValueError, match="detail="):
        rankmap.rank_map(SEED, detail="everything")


# ---- matplotlib ----------------------------------------------------------------------------

def _numbers(fig):
    return sorted(int(t.get_text()) for t in fig.axes[0].texts if t.get_text().isdigit())


@pytest.mark.parametrize("grid", [SEED, RankGrid(128, tp=4, pp=4), RankGrid(8, tp=2, pp=2, cp=2)])
def test_matplotlib_rank_map_shows_every_rank_once(grid):
    fig = rankmap.rank_map_figure(grid, highlight=grid.world_size - 3)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert _numbers(fig) == list(range(grid.world_size))


def test_matplotlib_rank_map_draws_seed_links():
    fig = rankmap.rank_map_figure(SEED, highlight=5)
    arrows = [p for p in fig.axes[0].patches if isinstance(p, matplotlib.patches.FancyArrowPatch)]
    colors = [matplotlib.colors.to_hex(p.get_edgecolor()) for p in arrows]
    assert colors.count(rankmap.COLORS["pp"]) == 4 and colors.count(rankmap.COLORS["dp"]) == 4


# ---- the hand-drawn boundary picture ---------------------------------------------------------

def _texts(fig):
    return [t.get_text() for t in fig.axes[0].texts]


def _tp_cuts(fig):
    return [ln for ln in fig.axes[0].lines if matplotlib.colors.to_hex(ln.get_color()) == rankmap.COLORS["tp"]]


def test_boundary_sketch_seed_000():
    fig = boundaries.boundary_sketch(8, tp=2, pp=2)
    texts = _texts(fig)
    assert "PP cut: stage 0 (layers 0–3) | stage 1 (layers 4–7)" in texts
    assert sum("⊕ all-reduce (g) over TP" in t for t in texts) == 2 * 4  # 2 per layer, 4 layers drawn
    assert {"QKV·0", "QKV·1", "FC1·0", "FC2·1", "proj·1"} <= set(texts)
    assert any(t.startswith("column split") for t in texts) and any(t.startswith("row split") for t in texts)
    assert len(_tp_cuts(fig)) == 4 * 2 * (2 - 1)  # layers drawn x halves x (tp - 1)
    assert "stage 1\nlayers 4–7" in texts


def test_boundary_sketch_seed_001_and_uneven_split():
    fig = boundaries.boundary_sketch(72, tp=4, pp=4, xkcd=False)
    texts = _texts(fig)
    assert [t for t in texts if t.startswith("PP cut")] == [
        "PP cut: stage 0 (layers 0–17) | stage 1 (layers 18–35)",
        "PP cut: stage 1 (layers 18–35) | stage 2 (layers 36–53)",
        "PP cut: stage 2 (layers 36–53) | stage 3 (layers 54–71)"]
    assert len(_tp_cuts(fig)) == 4 * 2 * 3
    uneven = ParallelConfig(4, pp=4, num_layers=10, decoder_first_pipeline_num_layers=1,
                            decoder_last_pipeline_num_layers=1)
    texts = _texts(boundaries.boundary_sketch(config=uneven, xkcd=False))
    assert "PP cut: stage 0 (layers 0–0) | stage 1 (layers 1–4)" in texts
    assert not any("all-reduce (g)" in t for t in texts)  # tp = 1: nothing to all-reduce
    with pytest.raises(ValueError, match="num_layers=10 is not divisible by pipeline-model-parallel-size=4"):
        boundaries.boundary_sketch(10, tp=1, pp=4)


# ---- CLI -------------------------------------------------------------------------------------

def _cli_args(*argv):
    from course_lib.topology import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli, parser.parse_args(argv)


def test_cli_text_table(capsys):
    cli, args = _cli_args("--world-size", "8", "--tp", "2", "--pp", "2", "--highlight", "5")
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    assert "tp                      2     4  [0,1] [2,3] [4,5] [6,7]" in out
    assert "pp                      2     4  [0,4] [1,5] [2,6] [3,7]" in out
    assert "dp                      2     4  [0,2] [1,3] [4,6] [5,7]" in out
    assert "rank 5: coords {'tp': 1, 'cp': 0, 'dp': 0, 'pp': 1}" in out


def test_cli_writes_svg_with_every_rank(tmp_path):
    out = tmp_path / "rankmap.svg"
    cli, args = _cli_args("--world-size", "8", "--tp", "2", "--pp", "2", "--out", str(out))
    assert cli.run(args) == 0
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert {int(x) for x in re.findall(r">(\d+)</text>", svg)} >= set(range(8))
    cli, args = _cli_args("--world-size", "8", "--tp", "2", "--pp", "2", "--engine", "matplotlib",
                          "--out", str(tmp_path / "m.png"))
    assert cli.run(args) == 0 and (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_bad_config_is_one_line_and_nonzero(capsys, monkeypatch):
    import course_lib.__main__ as main_mod

    monkeypatch.setitem(main_mod.COMMANDS, "rankmap", ("course_lib.topology.cli", "rank map"))
    for argv, msg in [(["--tp", "3"], "world_size=8 is not divisible by tensor-model-parallel-size=3"),
                      (["--tp", "2", "--cp", "2", "--order", "tp-dp-pp"], "'cp' is missing from order"),
                      (["--highlight", "8"], "rank=8 must be an integer in 0..7 for world_size=8"),
                      (["--out", "map.gif"], "use a .svg, .png, .pdf or .dot file name")]:
        code = main_mod.main(["rankmap", "--world-size", "8", *argv])
        err = capsys.readouterr().err
        assert code == 2
        assert err.count("\n") == 1 and msg in err and "Traceback" not in err


# ---- the package -----------------------------------------------------------------------------

def test_package_names_and_a_light_import():
    """``course_lib.topology`` re-exports the grid, the config and (loaded on first use) the pictures;
    importing it loads no torch, matplotlib or Graphviz, so the rank-map CLI's text path stays instant."""
    import course_lib.topology as topology

    assert topology.rank_map is rankmap.rank_map and topology.rank_map_figure is rankmap.rank_map_figure
    assert topology.boundary_sketch is boundaries.boundary_sketch
    assert repr(RankGrid).endswith("'course_lib.topology.RankGrid'>")  # as a reader imports it
    with pytest.raises(AttributeError, match="no attribute 'diagrams'"):
        topology.diagrams  # noqa: B018
    code = ("import sys, course_lib.topology, course_lib.topology.cli; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'graphviz') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---- widget ----------------------------------------------------------------------------------

# ---- Lab 01 checkers ---------------------------------------------------------------------------

def test_lab01_checkers(capsys):
    from course_lib.classroom.checks import rank_grid

    def good_dp(world, tp, pp, cp):
        if world % (tp * pp * cp):
            raise ValueError(f"world_size={world} is not divisible by tp·pp·cp={tp * pp * cp}")
        return world // (tp * pp * cp)

    def todo(*args):
        raise NotImplementedError

    assert rank_grid.check_derive_dp(good_dp)
    assert not rank_grid.check_derive_dp(lambda w, tp, pp, cp: w // (tp * pp))
    assert "context parallelism is a factor" in capsys.readouterr().out
    assert not rank_grid.check_derive_dp(lambda w, tp, pp, cp: w // (tp * pp * cp))  # never raises
    assert "raise ValueError" in capsys.readouterr().out
    assert not rank_grid.check_derive_dp(todo)
    assert capsys.readouterr().out.startswith("not attempted yet")

    assert rank_grid.check_rank_of(lambda t, k, d, p, T, K, D, P: t + T * (k + K * (d + D * p)))
    capsys.readouterr()
    assert not rank_grid.check_rank_of(lambda t, k, d, p, T, K, D, P: t + T * (k + K * (p + P * d)))
    assert "pp before dp" in capsys.readouterr().out
    assert not rank_grid.check_rank_of(lambda t, k, d, p, T, K, D, P: p + P * (d + D * (k + K * t)))
    assert "pp fastest" in capsys.readouterr().out
    assert not rank_grid.check_rank_of(todo)
    assert capsys.readouterr().out.startswith("not attempted yet")
