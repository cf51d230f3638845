"""The 3D/4D rank grid: which rank sits where, and every process group -- dense and expert.

``RankGrid(world_size, tp, pp, cp)`` numbers ranks exactly like Megatron-LM's
``RankGenerator`` (``megatron/core/parallel_state.py``): the parallel sizes are
laid out in ``order`` (default ``"tp-cp-ep-dp-pp"``) with the **first axis
varying fastest**, so

    rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (dp_rank + dp * pp_rank)))

and a group for a set of axes (a ``token`` such as ``"tp"`` or ``"dp-cp"``) is
the set of ranks that differ only along those axes, listed in group-rank order
(the first axis of ``order`` varies fastest inside the group too). Groups are
listed in Megatron's creation order. ``dp`` is derived: ``world_size / (tp*pp*cp)``.

With ``ep`` / ``expert_tp`` the same grid also numbers the ranks of the MoE layers, as
Megatron-core does since *MoE parallel folding* (Liu et al. 2025): ``initialize_model_parallel``
builds two ``RankGenerator`` s over one ``order`` string --

* the **dense** grid (attention, embeddings, dense MLPs) has ``ep = 1``: ``tp × cp × dp × pp``,
  ``dp = world / (tp·pp·cp)``; expert parallelism does not shrink the dense data-parallel size;
* the **expert** grid (the experts) has ``cp = 1``: ``expert_tp × ep × expert_dp × pp``,
  ``expert_tp`` = ``--expert-tensor-parallel-size`` (default ``tp``), ``expert_dp = world /
  (expert_tp·ep·pp)``; the context-parallel (and data-parallel) ranks are *folded* into EP and
  expert DP.

One object holds both, like torchtitan's ``ParallelDims`` holds the dense and the expert sizes.
Megatron's checks, each a one-line ``ValueError`` from :mod:`course_lib.rules`: both products
divide the world, an axis of size > 1 appears in ``order``, ``order`` ends with ``pp`` or
``pp == 1`` or ``expert_dp == dp``, and the two grids have the same pipeline groups (a rank is on
one stage for every layer).

:func:`rank_groups` is the one algorithm that lists a grid's groups (Megatron's
``generate_masked_orthogonal_rank_groups``), for both grids.

No torch here: this module is pure Python + numpy, so it is instant to import
and the rank-map CLI works without torch.

>>> g = RankGrid(8, tp=2, pp=2, ep=2, expert_tp=1)
>>> g.dp, g.expert_dp
(2, 2)
>>> g.groups("dp")[:2], g.expert_groups("ep")[:2]
([[0, 2], [1, 3]], [[0, 1], [2, 3]])
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from course_lib import rules
from course_lib.rules import AXIS_FLAG, UsageError

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# Megatron appends axes missing from `order` in the order of its name_to_size
# dict (RankGenerator.__init__); only axes of size 1 may be missing.
_MEGATRON_APPEND_ORDER = ("tp", "pp", "dp", "ep", "cp")
SPECIAL_TOKENS = ("embedding", "position_embedding")

# The groups Megatron's initialize_model_parallel builds from the non-expert
# grid, with the global variable that holds them and what runs inside.
MEGATRON_GROUPS = {
    "tp": ("_TENSOR_MODEL_PARALLEL_GROUP",
           "all-reduce after each row-parallel GEMM (2 per layer forward, 2 backward); "
           "with sequence parallel: all-gather + reduce-scatter instead"),
    "cp": ("_CONTEXT_PARALLEL_GROUP",
           "ring exchange of K/V chunks (send/recv) inside attention"),
    "dp": ("_DATA_PARALLEL_GROUP",
           "gradient all-reduce (or reduce-scatter + all-gather with the distributed optimizer)"),
    "dp-cp": ("_DATA_PARALLEL_GROUP_WITH_CP",
              "gradient all-reduce when cp > 1 (CP ranks hold the same weights)"),
    "pp": ("_PIPELINE_MODEL_PARALLEL_GROUP",
           "send/recv of activations (forward) and their gradients (backward) between neighbouring stages"),
    "tp-pp": ("_MODEL_PARALLEL_GROUP",
              "all-reduce of scalars over one model replica (grad norm, inf/nan check)"),
    "embedding": ("_EMBEDDING_GROUP",
                  "all-reduce of the tied word-embedding gradient between first and last stage"),
    "position_embedding": ("_POSITION_EMBEDDING_GROUP",
                           "first stage only (learned position embeddings live there)"),
    "tp-cp": ("_TENSOR_AND_CONTEXT_PARALLEL_GROUP", "used by some MoE and attention code paths"),
    "tp-dp": ("_TENSOR_AND_DATA_PARALLEL_GROUP", "fp8 amax reduction, MoE"),
    "tp-dp-cp": ("_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP", "fp8 amax reduction with cp"),
}

# The groups Megatron builds from the expert grid, with the global that holds them and what runs inside.
MEGATRON_EXPERT_GROUPS = {
    "ep": ("_EXPERT_MODEL_PARALLEL_GROUP", "token all-to-all (dispatch and combine)"),
    "tp": ("_EXPERT_TENSOR_PARALLEL_GROUP", "the experts' tensor parallelism"),
    "dp": ("_EXPERT_DATA_PARALLEL_GROUP", "expert gradient reduction"),
    "pp": ("(pipeline groups: must equal the dense grid's)", "send/recv between stages"),
    "tp-ep": ("_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", "the allgather dispatcher with expert TP"),
    "tp-ep-pp": ("_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP", "the experts' share of the grad norm"),
}
EXPERT_TOKENS = tuple(MEGATRON_EXPERT_GROUPS)


def split_axes(name: str, text, example: str, also: str = "") -> list[str]:
    """The axes of ``text`` (``"tp-cp-dp"``), each checked: one-line ValueError naming ``name`` for
    an empty string, an unknown axis or a repeated one (``example`` and ``also`` make the fix)."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"{name}={text!r} must be axes joined by '-', e.g. '{example}'{also}")
    parts = [t.strip() for t in text.lower().split("-")]
    for t in parts:
        if t not in AXES:
            raise UsageError(f"{name}={text!r} has unknown axis {t!r}; use {', '.join(AXES)} joined by '-', "
                             f"e.g. '{example}'{also}")
    dup = sorted({t for t in parts if parts.count(t) > 1})
    if dup:
        raise UsageError(f"{name}={text!r} repeats axis {dup[0]!r}; list each axis once, e.g. '{example}'")
    return parts


def parse_order(order: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """Validate ``order`` like Megatron's RankGenerator and return the full axis order.

    Axes of size 1 may be left out (they are appended, as Megatron does); an axis of
    size > 1 that is missing is an error. Unknown or repeated axes are errors too
    (Megatron fails on them with a KeyError or builds wrong groups).
    """
    tokens = split_axes("order", order, DEFAULT_ORDER)
    given = list(tokens)
    for name in _MEGATRON_APPEND_ORDER:
        if name not in tokens:
            if sizes[name] != 1:
                # suggest: insert it where Megatron's default order has it
                later = [t for t in given if AXES.index(t) > AXES.index(name)]
                at = given.index(later[0]) if later else len(given)
                fixed = "-".join(given[:at] + [name] + given[at:])
                raise UsageError(f"{AXIS_FLAG[name]}={sizes[name]} but {name!r} is missing from "
                                 f"order={order!r}; add it, e.g. order='{fixed}'")
            tokens.append(name)
    return tuple(tokens)


def _group_offsets(order: tuple[str, ...], sizes: dict[str, int], token: str) -> tuple[list[int], list[int]]:
    """``(first rank of each group, offset of each member)`` of ``token``'s groups: group ``g``
    is ``[bases[g] + m for m in members]``. Megatron's ``generate_masked_orthogonal_rank_groups``:
    members vary along the token's axes, groups along the others, first axis fastest in both."""
    inside = set(split_axes("token", token, "dp-cp"))
    stride = {a: math.prod(sizes[b] for b in order[:i]) for i, a in enumerate(order)}

    def offsets(axes: list[str]) -> list[int]:
        out = [0]
        for a in axes:  # later axes vary slower
            out = [o + i * stride[a] for i in range(sizes[a]) for o in out]
        return out

    return offsets([a for a in order if a not in inside]), offsets([a for a in order if a in inside])


def rank_groups(order: tuple[str, ...], sizes: dict[str, int], token: str) -> list[list[int]]:
    """Groups of ``token`` in a grid laid out along ``order`` (first axis fastest), as lists of ranks.

    A group is the set of ranks that differ only along the token's axes (``token``: axes
    joined by '-', in any order); members are listed with the grid's first axis fastest,
    groups with the other axes' first axis fastest -- the semantics of Megatron's
    ``generate_masked_orthogonal_rank_groups`` (``megatron/core/parallel_state.py``).
    ``order``: every axis once (as returned by :func:`parse_order`); ``sizes``: axis -> size.
    """
    bases, members = _group_offsets(order, sizes, token)
    return [[base + m for m in members] for base in bases]


def rank_group_array(order: tuple[str, ...], sizes: dict[str, int], token: str) -> np.ndarray:
    """:func:`rank_groups` as an int64 array [num_groups, group_size] (fast for a million ranks)."""
    bases, members = _group_offsets(order, sizes, token)
    return np.add.outer(np.asarray(bases, dtype=np.int64), np.asarray(members, dtype=np.int64))


class RankGrid:
    """Megatron's rank layout for ``world_size`` ranks (``RankGenerator`` semantics), dense and expert.

    Args:
        world_size: number of ranks (GPUs).
        tp, pp, cp: tensor-, pipeline- and context-parallel sizes.
            ``dp = world_size // (tp*pp*cp)`` is derived, never given.
        ep, expert_tp: expert-model-parallel and expert tensor-parallel sizes
            (``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``; default tp).
            ``expert_dp = world_size // (expert_tp*ep*pp)`` is derived.
        order: axes joined by '-', **first varies fastest** (Megatron's default
            ``"tp-cp-ep-dp-pp"``: TP neighbours get consecutive ranks, i.e. the same
            NVLink box; pipeline stages are the slowest axis).

    ``groups``/``group_of``/``coords`` are the **dense** grid (ep = 1, so DP is world /
    (tp·pp·cp) whatever EP is), ``expert_groups``/``expert_group_of``/``expert_coords`` the
    **expert** grid (expert_tp × ep × expert_dp × pp, cp = 1); see the module. The expert grid is
    validated on creation when ``ep > 1`` or ``expert_tp`` is given, else on first use.

    >>> g = RankGrid(8, tp=2, pp=2)
    >>> g.groups("tp"), g.groups("pp"), g.groups("dp")
    ([[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])
    >>> g.coords(5)
    {'tp': 1, 'cp': 0, 'dp': 0, 'pp': 1}
    >>> g.rank_of(tp=1, dp=0, pp=1)
    5
    """

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                 expert_tp: int | None = None, order: str = DEFAULT_ORDER):
        tp, pp, cp, ep = (rules.integer(AXIS_FLAG[n], v) for n, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)))
        etp = tp if expert_tp is None else rules.integer(rules.EXPERT_TP, expert_tp)
        dp = rules.data_parallel_size(world_size, tp, pp, cp)
        self.world_size = int(world_size)
        self.sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
        self.expert_sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": rules.expert_data_parallel_size(
            self.world_size, etp, ep, pp), "pp": pp}
        self.order = parse_order(order, self.sizes)
        self._order_text = order                           # the expert grid parses it again, with its own sizes
        self._shape = [self.sizes[a] for a in self.order]  # fastest first
        self._stride = [math.prod(self._shape[:i]) for i in range(len(self._shape))]  # coords / rank_of
        self._cache: dict[tuple, np.ndarray] = {}
        self._expert_order: tuple[str, ...] | None = None
        self.has_experts = ep > 1 or expert_tp is not None
        if self.has_experts:
            self.expert_order  # validate the expert grid now (Megatron's rules), not at first use

    @property
    def expert_order(self) -> tuple[str, ...]:
        """The expert grid's full axis order, validated like Megatron's ``initialize_model_parallel``."""
        if self._expert_order is None:
            order = parse_order(self._order_text, self.expert_sizes)
            rules.expert_order(self._order_text, order[-1], self.pp, self.dp, self.expert_dp)
            if not np.array_equal(self.group_array("pp"), rank_group_array(order, self.expert_sizes, "pp")):
                raise UsageError(
                    f"order='{self._order_text}' gives the dense and the expert layers different pipeline groups "
                    f"with {AXIS_FLAG['cp']}={self.cp}, {AXIS_FLAG['ep']}={self.ep}, {rules.EXPERT_TP}="
                    f"{self.expert_tp} (Megatron asserts they are equal); use an order ending in 'pp', "
                    f"e.g. '{DEFAULT_ORDER}'")
            self._expert_order = order
        return self._expert_order

    # ---- sizes -------------------------------------------------------------
    tp = property(lambda self: self.sizes["tp"])
    pp = property(lambda self: self.sizes["pp"])
    cp = property(lambda self: self.sizes["cp"])
    dp = property(lambda self: self.sizes["dp"], doc="data-parallel size, derived: world / (tp*pp*cp), whatever ep is")
    ep = property(lambda self: self.expert_sizes["ep"],
                  doc="expert-model-parallel size (the expert grid's; the dense grid has ep = 1)")
    expert_tp = property(lambda self: self.expert_sizes["tp"], doc="expert tensor-parallel size (default: tp)")
    expert_dp = property(lambda self: self.expert_sizes["dp"],
                         doc="expert data-parallel size, derived: world / (expert_tp*ep*pp)")

    @property
    def order_str(self) -> str:
        return "-".join(self.order)

    @property
    def axes(self) -> tuple[str, ...]:
        """Axes reported by ``coords`` (the dense grid's: tp, cp, dp, pp), in grid order."""
        return tuple(a for a in self.order if a != "ep")

    def __repr__(self) -> str:
        expert = f", ep={self.ep}, expert_tp={self.expert_tp}, expert_dp={self.expert_dp}" if self.has_experts else ""
        return (f"RankGrid(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, "
                f"dp={self.dp}{expert}, order='{self.order_str}')")

    # ---- coordinates ---------------------------------------------------------
    def _check_rank(self, rank) -> int:
        return rules.rank_in("rank", rank, self.world_size, "world_size")

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` in the dense grid: ``{'tp': .., 'cp': .., 'dp': .., 'pp': ..}``
        (its place in the expert grid: :meth:`expert_coords`)."""
        rank = self._check_rank(rank)
        idx = {a: (rank // d) % s for a, s, d in zip(self.order, self._shape, self._stride)}
        return {a: idx[a] for a in self.axes}

    def rank_of(self, **coords: int) -> int:
        """Inverse of ``coords``: ``rank_of(tp=1, dp=0, pp=1)``. Omitted axes count as 0."""
        for a in coords:
            if a not in AXES:
                raise UsageError(f"unknown axis {a!r} in rank_of(); use {', '.join(AXES)}")
        return sum(rules.rank_in(a, coords.get(a, 0), s, AXIS_FLAG[a]) * d
                   for a, s, d in zip(self.order, self._shape, self._stride))

    # ---- groups -------------------------------------------------------------
    def _parse_token(self, token: str, also: str = "") -> tuple[str, ...]:
        parts = split_axes("token", token, "dp-cp", also=also)
        return tuple(sorted(parts, key=self.order.index))

    def _array(self, key: tuple, order: tuple[str, ...], sizes: dict[str, int], masked: tuple[str, ...]) -> np.ndarray:
        if key not in self._cache:
            arr = np.ascontiguousarray(rank_group_array(order, sizes, "-".join(masked)))
            arr.setflags(write=False)
            self._cache[key] = arr
        return self._cache[key]

    def group_array(self, token: str) -> np.ndarray:
        """Dense groups of ``token`` as a read-only int array of shape [num_groups, group_size]."""
        token = token.strip().lower() if isinstance(token, str) else token
        if token in SPECIAL_TOKENS:
            key = (token,)
            if key not in self._cache:
                pp = self.group_array("pp")
                cols = [0] if token == "position_embedding" or self.pp == 1 else [0, -1]
                arr = np.ascontiguousarray(pp[:, cols])
                arr.setflags(write=False)
                self._cache[key] = arr
            return self._cache[key]
        masked = self._parse_token(token, also=f", or one of {', '.join(SPECIAL_TOKENS)}")
        return self._array(masked, self.order, self.sizes, masked)

    def groups(self, token: str) -> list[list[int]]:
        """Every dense group of ``token``, each a list of global ranks in group-rank order.

        ``token``: axes joined by '-' in any order (``"tp"``, ``"dp"``, ``"dp-cp"``,
        ``"tp-pp"`` = Megatron's model-parallel group, ``"tp-dp-cp"``, ...), or
        ``"embedding"`` (first and last rank of each pipeline group; only the first
        when pp == 1) or ``"position_embedding"`` (first rank of each pipeline group).
        Identical to ``RankGenerator.get_ranks(token)`` / initialize_model_parallel.
        """
        return self.group_array(token).tolist()

    def group_of(self, rank: int, token: str) -> list[int] | None:
        """The dense ``token`` group that contains ``rank`` (None: rank is in no
        embedding / position-embedding group, e.g. a middle pipeline stage)."""
        rank = self._check_rank(rank)
        arr = self.group_array(token)
        hit = np.nonzero((arr == rank).any(axis=1))[0]
        return arr[hit[0]].tolist() if len(hit) else None

    def groups_of(self, rank: int, tokens: Iterable[str] | None = None) -> dict[str, list[int] | None]:
        """``{token: group containing rank}`` for the main groups (see ``main_tokens``)."""
        return {t: self.group_of(rank, t) for t in (tokens or self.main_tokens())}

    # ---- the expert grid (MoE layers) ------------------------------------------
    def expert_group_array(self, token: str) -> np.ndarray:
        """Expert groups of ``token`` as a read-only int array of shape [num_groups, group_size]."""
        masked = self._parse_token(token)
        return self._array(("expert",) + masked, self.expert_order, self.expert_sizes, masked)

    def expert_groups(self, token: str) -> list[list[int]]:
        """Groups of the expert grid (Megatron's second ``RankGenerator``: expert_tp × ep ×
        expert_dp × pp, cp = 1): ``"ep"`` (token all-to-all), ``"tp"`` (expert TP), ``"dp"``
        (expert DP: expert-gradient reduction), ``"pp"``, ``"tp-ep"``, ``"tp-ep-pp"`` (any axes)."""
        return self.expert_group_array(token).tolist()

    def expert_group_of(self, rank: int, token: str) -> list[int]:
        """The expert-grid ``token`` group that contains ``rank``."""
        rank = self._check_rank(rank)
        arr = self.expert_group_array(token)
        return arr[np.nonzero((arr == rank).any(axis=1))[0][0]].tolist()

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` in the expert grid: ``{'tp', 'ep', 'dp', 'pp'}`` (each its
        index inside that expert group)."""
        rank = self._check_rank(rank)
        stride = 1
        idx = {}
        for a in self.expert_order:
            idx[a] = (rank // stride) % self.expert_sizes[a]
            stride *= self.expert_sizes[a]
        return {a: idx[a] for a in ("tp", "ep", "dp", "pp")}

    def local_experts(self, rank: int, num_experts: int) -> list[int]:
        """Global indices of the experts ``rank`` holds: ``num_experts / ep`` consecutive ones
        (Megatron's ``local_expert_indices``). ``--num-experts`` must be divisible by ``ep``."""
        per = rules.moe_experts(rules.integer("num-experts", num_experts), self.ep) // self.ep
        first = self.expert_coords(rank)["ep"] * per
        return list(range(first, first + per))

    def main_tokens(self) -> list[str]:
        """The dense groups worth showing for this grid: tp, cp, dp (dp-cp), pp, tp-pp, embedding."""
        toks = ["tp"]
        if self.cp > 1:
            toks.append("cp")
        toks.append("dp")
        if self.cp > 1:
            toks.append("dp-cp")
        toks += ["pp", "tp-pp", "embedding"]
        return toks

    def stage_ranks(self, stage: int) -> list[int]:
        """All ranks on pipeline stage ``stage`` (pp coordinate), ascending."""
        stage = rules.rank_in("stage", stage, self.pp, AXIS_FLAG["pp"])
        return sorted(int(g[stage]) for g in self.group_array("pp"))

    # ---- text ----------------------------------------------------------------
    def table(self, tokens: Iterable[str] | None = None, max_groups: int = 64) -> str:
        """A plain-text table of groups (one line per token) for printing."""
        lines = [f"{self!r}", f"{'group':<20} {'size':>4} {'count':>5}  groups"]
        rows = [(t, self.group_array(t)) for t in (tokens or self.main_tokens())]
        if tokens is None and self.ep > 1:
            rows += [(f"expert {t}", self.expert_group_array(t)) for t in ("ep", "tp", "dp")]
        for label, arr in rows:
            shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in arr[:max_groups].tolist())
            if len(arr) > max_groups:
                shown += f" ... ({len(arr) - max_groups} more)"
            lines.append(f"{label:<20} {arr.shape[1]:>4} {arr.shape[0]:>5}  {shown}")
        return "\n".join(lines)

    def coords_table(self) -> str:
        """One line per rank: its coordinates."""
        head = "rank " + " ".join(f"{a:>3}" for a in self.axes)
        rows = [f"{r:>4} " + " ".join(f"{v:>3}" for v in self.coords(r).values()) for r in range(self.world_size)]
        return "\n".join([head] + rows)
