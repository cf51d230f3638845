"""RankGrid (course_lib/topology/grid.py) and ParallelConfig (course_lib/topology/config.py).

The groups are checked against a TEST ORACLE written here: Megatron-LM's
algorithm (``megatron/core/parallel_state.py``: ``RankGenerator`` +
``generate_masked_orthogonal_rank_groups``, and the embedding groups built in
``initialize_model_parallel``) transcribed as plain nested loops, with no numpy
and no code shared with ``course_lib.topology``. The oracle is in turn checked
against the numbers printed in Megatron's own docstrings and the seed's 8-GPU
example. ``test_topology_megatron.py`` compares with the real megatron-core.
"""

import functools
import itertools

import pytest

from course_lib.topology import ParallelConfig, RankGrid, divisors

# --------------------------------------------------------------------------
# The oracle: Megatron's algorithm in the simplest loop form.
# --------------------------------------------------------------------------


def megatron_masked_groups(world_size, parallel_size, mask):
    """generate_masked_orthogonal_rank_groups as Megatron writes it: for every combination
    of the unmasked indices (first fastest) one group, whose members enumerate the masked
    indices (first fastest); rank = sum(index[i] * prod(parallel_size[:i])), each index
    decomposed from its position. Too slow for the exhaustive tests (one decomposition per
    member): it checks :func:`oracle_masked_groups` below."""
    stride = [1]
    for s in parallel_size:
        stride.append(stride[-1] * s)
    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    group_size = 1
    for s in masked_shape:
        group_size *= s

    def decompose(index, shape):  # index = sum(idx[i] * prod(shape[:i]))
        idx, step = [], 1
        for s in shape:
            idx.append((index // step) % s)
            step *= s
        return idx

    groups = []
    for group_index in range(world_size // group_size):
        outer = decompose(group_index, unmasked_shape)
        base = sum(i * d for i, d in zip(outer, unmasked_stride))
        group = []
        for rank_in_group in range(group_size):
            inner = decompose(rank_in_group, masked_shape)
            group.append(base + sum(i * d for i, d in zip(inner, masked_stride)))
        groups.append(group)
    return groups


def _first_index_fastest(shape, strides):
    """Every sum(idx[i] * strides[i]) over idx in shape, idx[0] varying fastest."""
    out = [0]
    for s, d in zip(shape, strides):
        out = [o + i * d for i in range(s) for o in out]
    return out


def oracle_masked_groups(world_size, parallel_size, mask):
    """:func:`megatron_masked_groups`, enumerating each index set once instead of decomposing
    every position (the same groups in the same order: test_the_oracle_is_megatrons_loop)."""
    stride = [1]
    for s in parallel_size:
        stride.append(stride[-1] * s)
    masked = [(s, d) for s, d, m in zip(parallel_size, stride, mask) if m]
    unmasked = [(s, d) for s, d, m in zip(parallel_size, stride, mask) if not m]
    offsets = _first_index_fastest(*zip(*masked)) if masked else [0]
    bases = _first_index_fastest(*zip(*unmasked)) if unmasked else [0]
    assert len(offsets) * len(bases) == world_size
    return [[base + offset for offset in offsets] for base in bases]


@functools.lru_cache(maxsize=16)  # embedding groups reuse the pp groups just computed
def oracle_get_ranks(tp, ep, dp, pp, cp, order, token):
    """RankGenerator(tp, ep, dp, pp, cp, order).get_ranks(token), plus the embedding
    groups initialize_model_parallel derives from each pipeline group."""
    name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
    order = order.lower()
    for name in name_to_size:  # Megatron appends missing size-1 axes in this order
        if name not in order.split("-"):
            assert name_to_size[name] == 1
            order = order + "-" + name
    ordered = order.split("-")
    sizes = [name_to_size[t] for t in ordered]
    world = tp * ep * dp * pp * cp
    if token in ("embedding", "position_embedding"):
        out = []
        for pp_ranks in oracle_get_ranks(tp, ep, dp, pp, cp, order, "pp"):
            if token == "position_embedding" or len(pp_ranks) == 1:
                out.append([pp_ranks[0]])
            else:
                out.append([pp_ranks[0], pp_ranks[-1]])
        return out
    mask = [False] * len(ordered)
    for t in token.split("-"):
        mask[ordered.index(t)] = True
    return oracle_masked_groups(world, sizes, mask)


# --- the oracle reproduces Megatron's documented numbers ------------------------------

def test_oracle_matches_megatron_docstrings():
    # generate_masked_orthogonal_rank_groups docstring: sizes [tp, dp, pp] = [2, 3, 4], dp mask
    dp = oracle_masked_groups(24, [2, 3, 4], [False, True, False])
    assert dp[0] == [0, 2, 4] and dp[1] == [1, 3, 5] and dp[7] == [19, 21, 23]
    # same docstring: 8 GPUs, order tp-pp-dp, sizes 2-2-2 -> dp groups
    assert oracle_masked_groups(8, [2, 2, 2], [False, False, True]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4
    assert oracle_get_ranks(2, 1, 2, 4, 1, "tp-cp-ep-dp-pp", "dp") == [
        [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert oracle_get_ranks(2, 1, 2, 4, 1, "tp-cp-ep-dp-pp", "pp") == [
        [0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    # context_parallel_size docstring: 8 GPUs, tp=4, cp=2
    assert oracle_get_ranks(4, 1, 1, 1, 2, "tp-cp-ep-dp-pp", "cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_the_oracle_is_megatrons_loop():
    # every shape of 1-4 axes with sizes 1-3 (worlds up to 81), every mask: the same groups in the same order
    n = 0
    for k in range(1, 5):
        for sizes in itertools.product(range(1, 4), repeat=k):
            world = functools.reduce(lambda a, b: a * b, sizes)
            for mask in itertools.product((False, True), repeat=k):
                assert oracle_masked_groups(world, list(sizes), list(mask)) == \
                    megatron_masked_groups(world, list(sizes), list(mask)), (sizes, mask)
                n += 1
    assert n == 2 * 3 + 4 * 9 + 8 * 27 + 16 * 81
    # and on every 16th grid of the exhaustive tests below (worlds to 128, axis sizes to 128), Megatron's
    # default order, each plain token of theirs (RankGrid's enumeration is the oracle's: this keeps a
    # per-member reference on large axes too)
    order = ["tp", "cp", "ep", "dp", "pp"]
    for world, tp, pp, cp, dp in itertools.islice(all_configs(), 0, None, 16):
        sizes = [tp, cp, 1, dp, pp]
        for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp"):
            mask = [a in token.split("-") for a in order]
            assert oracle_masked_groups(world, sizes, mask) == megatron_masked_groups(world, sizes, mask), \
                (world, tp, pp, cp, token)


# --- RankGrid == the seeds and Megatron's docstrings ------------------------------------

def test_seed_8_gpu_example():
    g = RankGrid(8, tp=2, pp=2)
    assert g.dp == 2
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("embedding") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.groups("position_embedding") == [[0], [1], [2], [3]]
    assert g.groups("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g.groups_of(5) == {"tp": [4, 5], "dp": [5, 7], "pp": [1, 5], "tp-pp": [0, 1, 4, 5],
                              "embedding": [1, 5]}


def test_megatron_docstring_examples():
    g = RankGrid(16, tp=2, pp=4)
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert RankGrid(8, tp=4, cp=2).groups("cp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert RankGrid(8, tp=2, pp=2, order="tp-pp-dp").groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    dp = RankGrid(24, tp=2, pp=4, order="tp-dp-pp").groups("dp")
    assert dp[0] == [0, 2, 4] and dp[7] == [19, 21, 23]


# --- RankGrid == oracle, exhaustively ---------------------------------------------------

def all_configs(max_world=128):
    for world in range(1, max_world + 1):
        for tp in divisors(world):
            for pp in divisors(world // tp):
                for cp in divisors(world // (tp * pp)):
                    yield world, tp, pp, cp, world // (tp * pp * cp)


DEFAULT_TOKENS = ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "embedding", "position_embedding"]


def test_all_configs_default_order_match_oracle():
    n = 0
    for world, tp, pp, cp, dp in all_configs():
        g = RankGrid(world, tp=tp, pp=pp, cp=cp)
        assert g.dp == dp
        for token in DEFAULT_TOKENS:
            if cp == 1 and token in ("cp", "dp-cp"):
                continue  # trivial here (singletons / = dp); covered by the every-order test below
            assert g.groups(token) == oracle_get_ranks(tp, 1, dp, pp, cp, "tp-cp-ep-dp-pp", token), \
                (world, tp, pp, cp, token)
        n += 1
    assert n == 5137  # every (tp, pp, cp) whose product divides a world size 1..128


@pytest.mark.parametrize("order", ["tp-pp-dp-cp", "tp-cp-pp-dp", "pp-dp-cp-tp"])
def test_all_configs_alternative_orders_match_oracle(order):
    # tp-pp-dp: Megatron's docstring's alternative; tp-cp-pp-dp: picotron's
    # view(dp, pp, cp, tp) in Megatron notation; pp-dp-cp-tp: everything reversed.
    for world, tp, pp, cp, dp in all_configs():
        if order == "tp-cp-pp-dp" and cp == 1:
            continue  # identical to tp-pp-dp-cp when cp == 1
        g = RankGrid(world, tp=tp, pp=pp, cp=cp, order=order)
        for token in ("tp", "dp", "pp"):
            assert g.groups(token) == oracle_get_ranks(tp, 1, dp, pp, cp, order, token), (world, tp, pp, cp)


def test_every_order_every_token_match_oracle():
    # all 24 orders of (tp, cp, dp, pp) x all 15 axis sets, on worlds with many factors
    axes = ["tp", "cp", "dp", "pp"]
    tokens = ["-".join(c) for k in range(1, 5) for c in itertools.combinations(axes, k)]
    tokens += ["embedding", "position_embedding"]
    for world in (12, 16):
        for _, tp, pp, cp, dp in (c for c in all_configs(world) if c[0] == world):
            for perm in itertools.permutations(axes):
                order = "-".join(perm)
                g = RankGrid(world, tp=tp, pp=pp, cp=cp, order=order)
                for token in tokens:
                    assert g.groups(token) == oracle_get_ranks(tp, 1, dp, pp, cp, order, token), \
                        (world, tp, pp, cp, order, token)


def test_expert_grid_matches_oracle():
    # Megatron's expert grid: ep > 1 with cp == 1
    for world in (8, 16, 24, 32):
        for tp in divisors(world):
            for ep in divisors(world // tp):
                for pp in divisors(world // (tp * ep)):
                    dp = world // (tp * ep * pp)
                    g = RankGrid(world, tp=tp, pp=pp, ep=ep)
                    for token in ("ep", "tp-ep", "tp-ep-pp", "dp", "pp"):
                        assert g.expert_groups(token) == oracle_get_ranks(tp, ep, dp, pp, 1, "tp-cp-ep-dp-pp",
                                                                          token)
                    # the dense grid ignores ep: its DP is world / (tp·pp), as Megatron's
                    assert g.groups("dp") == RankGrid(world, tp=tp, pp=pp).groups("dp")
                    assert g.dp == world // (tp * pp) and g.expert_dp == dp


def test_groups_partition_the_world_and_token_order_is_irrelevant():
    g = RankGrid(48, tp=2, pp=3, cp=2)
    for token in ["tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp-dp-pp"]:
        flat = sorted(r for grp in g.groups(token) for r in grp)
        assert flat == list(range(48))
    assert g.groups("cp-dp") == g.groups("dp-cp") == g.groups("DP-CP")
    assert g.groups("tp-cp-dp-pp") == [list(range(48))]


# --- coordinates --------------------------------------------------------------------------

def test_coords_formula_and_roundtrip():
    g = RankGrid(48, tp=2, pp=3, cp=2)  # dp = 4
    for r in range(48):
        c = g.coords(r)
        assert set(c) == {"tp", "cp", "dp", "pp"}
        assert r == c["tp"] + 2 * (c["cp"] + 2 * (c["dp"] + 4 * c["pp"]))  # tp fastest, pp slowest
        assert g.rank_of(**c) == r
        for token in ("tp", "cp", "dp", "pp"):  # the axis coordinate is the rank inside that group
            assert g.group_of(r, token).index(r) == c[token]
    assert RankGrid(8, tp=2, pp=2).coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    alt = RankGrid(8, tp=2, pp=2, order="tp-pp-dp")
    assert alt.coords(5) == {"tp": 1, "pp": 0, "dp": 1, "cp": 0}
    ep = RankGrid(16, tp=2, ep=4)
    assert ep.coords(7) == {"tp": 1, "cp": 0, "dp": 3, "pp": 0}          # dense: ep does not exist there
    assert ep.expert_coords(7) == {"tp": 1, "ep": 3, "dp": 0, "pp": 0}   # expert grid: tp-ep-dp-pp
    for r in range(16):
        assert ep.rank_of(**ep.coords(r)) == r


def test_group_of_middle_stage_has_no_embedding_group():
    g = RankGrid(12, tp=1, pp=3, cp=1)  # dp 4, stages: ranks 0-3, 4-7, 8-11
    assert g.group_of(5, "embedding") is None
    assert g.group_of(9, "embedding") == [1, 9]
    assert g.group_of(9, "position_embedding") is None
    assert g.stage_ranks(1) == [4, 5, 6, 7]
    # pp == 1: the embedding group is the rank itself
    assert RankGrid(4, tp=2).groups("embedding") == [[0], [1], [2], [3]]


# --- validation -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tp=3), r"world_size=8 is not divisible by tensor-model-parallel-size=3 × "
                               r"pipeline-model-parallel-size=1 = 3"),
    (dict(world_size=8, tp=2, pp=2, cp=4), r"world_size=8 is not divisible by .* = 16"),
    (dict(world_size=0), r"world_size=0 must be an integer >= 1"),
    (dict(world_size=8, tp=0), r"tensor-model-parallel-size=0 must be an integer >= 1"),
    (dict(world_size=8, tp=2, cp=2, order="tp-dp-pp"),
     r"context-parallel-size=2 but 'cp' is missing from order='tp-dp-pp'; add it, e.g. order='tp-cp-dp-pp'"),
    (dict(world_size=8, order="tp-xp-dp"), r"unknown axis 'xp'"),
    (dict(world_size=8, order="tp-dp-tp-pp"), r"repeats axis 'tp'"),
    (dict(world_size=8, tp=2, ep=8), r"world_size=8 is not divisible by expert-tensor-parallel-size=2 × "
                                     r"expert-model-parallel-size=8"),
])
def test_rank_grid_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        RankGrid(**kwargs)
    assert "\n" not in str(info.value)


def test_rank_grid_lookup_errors():
    g = RankGrid(8, tp=2, pp=2)
    for call, msg in [(lambda: g.coords(8), r"rank=8 must be an integer in 0..7 for world_size=8"),
                      (lambda: g.rank_of(tp=2), r"tp=2 must be an integer in 0..1 for tensor-model-parallel-size=2"),
                      (lambda: g.rank_of(xx=0), r"unknown axis 'xx'"),
                      (lambda: g.groups("tp-mp"), r"unknown axis 'mp'"),
                      (lambda: g.groups("tp-tp"), r"repeats axis 'tp'; list each axis once")]:
        with pytest.raises(ValueError, match=msg):
            call()
    # size-1 axes may be omitted from the order (Megatron appends them)
    assert RankGrid(8, tp=2, pp=2, order="tp-dp-pp").order == ("tp", "dp", "pp", "ep", "cp")


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tp=4, num_attention_heads=6),
     r"^num_attention_heads=6 is not divisible by tensor-model-parallel-size=4; "
     r"use a tensor-model-parallel-size that divides 6 \(1, 2, 3, 6\)$"),
    (dict(world_size=8, tp=3), r"world_size=8 is not divisible by tensor-model-parallel-size=3"),
    (dict(world_size=8, pp=4, num_layers=10),
     r"^num_layers=10 is not divisible by pipeline-model-parallel-size=4; .*decoder_first_pipeline_num_layers"),
    (dict(world_size=8, pp=4, num_layers=10, decoder_first_pipeline_num_layers=3),
     r"leaves 7 layers for 3 middle stage\(s\)"),
    (dict(world_size=8, pp=1, num_layers=10, decoder_first_pipeline_num_layers=3),
     r"decoder_first_pipeline_num_layers=3 needs pipeline-model-parallel-size > 1"),
    (dict(world_size=8, cp=2, seq_length=102),
     r"^seq_length=102 is not divisible by 2 × context-parallel-size=2 = 4 .* e.g. 100 or 104$"),
    (dict(world_size=8, tp=8, seq_length=100, sequence_parallel=True),
     r"^sequence_parallel: seq_length/context-parallel-size = 100 is not divisible by tensor-model-parallel-size=8; "
     r"use a seq_length that is a multiple of 8, e.g. 96 or 104$"),
    (dict(world_size=8, tp=2, pp=2, micro_batch_size=2, global_batch_size=6),
     r"^global_batch_size=6 is not divisible by micro_batch_size=2 × data-parallel-size=2 = 4; "
     r"use a multiple of 4, e.g. 4 or 8$"),
    (dict(world_size=8, tp=2, num_attention_heads=8, hidden_size=500),
     r"hidden_size=500 is not divisible by num_attention_heads=8"),
    (dict(world_size=8, tp=4, num_attention_heads=8, num_query_groups=2),
     r"num_query_groups=2 is not divisible by tensor-model-parallel-size=4"),
    (dict(world_size=8, tp=2, pp=2, cp=2, order="tp-cp-pp-dp"), r"must end with 'pp'"),
    (dict(world_size=8, pp=1, num_layers=8, virtual_pipeline_model_parallel_size=2),
     r"needs pipeline-model-parallel-size > 1"),
    (dict(world_size=8, pp=2, num_layers=8, virtual_pipeline_model_parallel_size=3),
     r"stage 0 has 4 layers, not divisible by virtual_pipeline_model_parallel_size=3"),
    (dict(world_size=8, micro_batch_size=0), r"micro_batch_size=0 must be an integer >= 1"),
])
def test_parallel_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        ParallelConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_parallel_config_derived_values_from_the_seeds():
    # seed 003, Day 22 sweep on 8 ranks with the GPU model (8 layers, hidden 512, 8 heads)
    sweep = {"A": (1, 1, 1, 8), "B": (2, 1, 1, 4), "C": (4, 1, 1, 2), "D": (2, 2, 1, 2),
             "E": (1, 4, 1, 2), "F": (2, 2, 2, 1)}
    for name, (tp, pp, cp, dp) in sweep.items():
        c = ParallelConfig(8, tp=tp, pp=pp, cp=cp, num_layers=8, hidden_size=512, num_attention_heads=8,
                           seq_length=1024, micro_batch_size=1, global_batch_size=16)
        assert c.dp == dp, name
        assert c.num_microbatches == 16 // dp, name
        assert sum(c.layers_per_stage()) == 8
    # seed 001: 128 GPUs, TP4 x PP4 -> DP 8, 72 layers -> 18 per stage, 256 / (8 * 8) = 4 micro-batches
    c = ParallelConfig(128, tp=4, pp=4, num_layers=72, hidden_size=10240, num_attention_heads=80,
                       micro_batch_size=8, global_batch_size=256)
    assert (c.dp, c.layers_per_stage(), c.num_microbatches) == (8, [18] * 4, 4)
    assert c.layer_ranges()[1] == range(18, 36)
    # seed 000: 32 GPUs, TP16 x PP2 -> DP 1, 1024 / (8 * 1) = 128; TP4 x PP8 -> DP 1
    assert ParallelConfig(32, tp=16, pp=2, micro_batch_size=8, global_batch_size=1024).num_microbatches == 128
    assert ParallelConfig(32, tp=4, pp=8).dp == 1
    # Megatron's default global batch: micro * dp
    assert ParallelConfig(8, tp=2, micro_batch_size=3).effective_global_batch_size == 12


def test_uneven_pipeline_split_is_explicit():
    c = ParallelConfig(16, pp=4, num_layers=10, decoder_first_pipeline_num_layers=1,
                       decoder_last_pipeline_num_layers=1)
    assert c.layers_per_stage() == [1, 4, 4, 1]
    assert [list(r) for r in c.layer_ranges()] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert ParallelConfig(8, pp=2, num_layers=7, decoder_first_pipeline_num_layers=3).layers_per_stage() == [3, 4]


def test_megatron_flags_have_no_derived_dp():
    c = ParallelConfig(128, tp=4, pp=4, num_layers=72, hidden_size=10240, num_attention_heads=80,
                       micro_batch_size=8, global_batch_size=256)
    flags = c.megatron_flags()
    assert flags[:4] == ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "4"]
    assert "--data-parallel-size" not in flags and "--model-parallel-size" not in flags
    assert "--num-workers" not in flags
    assert ParallelConfig(8, tp=2, pp=2, cp=2).megatron_flags()[4:6] == ["--context-parallel-size", "2"]


def test_rankmap_prints_the_expert_grid_beside_the_dense_one(capsys):
    from course_lib.__main__ import main

    assert main(["rankmap", "--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "2", "--highlight", "5"]) == 0
    out = capsys.readouterr().out
    assert "dp                      2     4  [0,2] [1,3] [4,6] [5,7]" in out   # dense DP: EP does not shrink it
    assert "expert ep               2     4  [0,2] [1,3] [4,6] [5,7]" in out
    assert "expert dp               1     8" in out and "  expert ep  [5, 7]" in out
    assert main(["rankmap", "--world-size", "8", "--tp", "2", "--pp", "2", "--ep", "4"]) == 2
    assert "expert-model-parallel-size=4" in capsys.readouterr().err
