"""The 3D/4D rank grid: which rank sits where, and every process group.

``RankGrid(world_size, tp, pp, cp)`` numbers ranks exactly like Megatron-LM's
``RankGenerator`` (``megatron/core/parallel_state.py``): the parallel sizes are
laid out in ``order`` (default ``"tp-cp-ep-dp-pp"``) with the **first axis
varying fastest**, so

    rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (dp_rank + dp * pp_rank)))

and a group for a set of axes (a ``token`` such as ``"tp"`` or ``"dp-cp"``) is
the set of ranks that differ only along those axes, listed in group-rank order
(the first axis of ``order`` varies fastest inside the group too). Groups are
listed in Megatron's creation order. ``dp`` is derived: ``world_size / (tp*pp*cp)``.

:func:`rank_groups` is the one algorithm that lists a grid's groups (Megatron's
``generate_masked_orthogonal_rank_groups``): ``RankGrid`` (the dense grid) and
:class:`course_lib.moe.grid.MoEGrid` (the dense and the expert grids) both call it.

No torch here: this module is pure Python + numpy, so it is instant to import
and the rank-map CLI works without torch.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from course_lib import rules
from course_lib.rules import AXIS_FLAG

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


def split_axes(name: str, text, example: str, also: str = "") -> list[str]:
    """The axes of ``text`` (``"tp-cp-dp"``), each checked: one-line ValueError naming ``name`` for
    an empty string, an unknown axis or a repeated one (``example`` and ``also`` make the fix)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name}={text!r} must be axes joined by '-', e.g. '{example}'{also}")
    parts = [t.strip() for t in text.lower().split("-")]
    for t in parts:
        if t not in AXES:
            raise ValueError(f"{name}={text!r} has unknown axis {t!r}; use {', '.join(AXES)} joined by '-', "
                             f"e.g. '{example}'{also}")
    dup = sorted({t for t in parts if parts.count(t) > 1})
    if dup:
        raise ValueError(f"{name}={text!r} repeats axis {dup[0]!r}; list each axis once, e.g. '{example}'")
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
                raise ValueError(f"{AXIS_FLAG[name]}={sizes[name]} but {name!r} is missing from "
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
    """Megatron's rank layout for ``world_size`` ranks (``RankGenerator`` semantics).

    Args:
        world_size: number of ranks (GPUs).
        tp, pp, cp: tensor-, pipeline- and context-parallel sizes.
            ``dp = world_size // (tp*pp*cp)`` is derived, never given.
        ep, expert_tp: expert-model-parallel and expert tensor-parallel sizes
            (``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``; default tp).
        order: axes joined by '-', **first varies fastest** (Megatron's default
            ``"tp-cp-ep-dp-pp"``: TP neighbours get consecutive ranks, i.e. the same
            NVLink box; pipeline stages are the slowest axis).

    Like Megatron-core (MoE parallel folding, ``initialize_model_parallel``), the same
    ranks are numbered twice: ``groups``/``coords`` are the **dense** grid (ep = 1, so DP
    is world / (tp·pp·cp) whatever EP is) and ``expert_groups``/``expert_coords`` the
    **expert** grid (expert_tp × ep × expert_dp × pp, cp = 1), see :mod:`course_lib.moe.grid`.

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
        # The dense grid has ep = 1 (Megatron-core since MoE parallel folding): EP never shrinks DP.
        dp = rules.data_parallel_size(world_size, tp, pp, cp)
        self.world_size = int(world_size)
        self.sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
        self.order = parse_order(order, self.sizes)
        self._shape = [self.sizes[a] for a in self.order]  # fastest first
        self._stride = [math.prod(self._shape[:i]) for i in range(len(self._shape))]  # coords / rank_of
        self._cache: dict[tuple, np.ndarray] = {}
        self._ep, self._expert_tp = ep, expert_tp
        self._moe = None
        if ep > 1 or expert_tp is not None:
            self.moe  # validate the expert grid now (Megatron's rules), not at first use

    @property
    def moe(self):
        """The dense + expert grids as :class:`course_lib.moe.grid.MoEGrid` (validated)."""
        if self._moe is None:
            from course_lib.moe.grid import MoEGrid  # moe.grid imports this module

            self._moe = MoEGrid(self.world_size, tp=self.tp, pp=self.pp, cp=self.cp, ep=self._ep,
                                expert_tp=self._expert_tp, order=self.order_str)
        return self._moe

    # ---- sizes -------------------------------------------------------------
    tp = property(lambda self: self.sizes["tp"])
    pp = property(lambda self: self.sizes["pp"])
    cp = property(lambda self: self.sizes["cp"])
    dp = property(lambda self: self.sizes["dp"], doc="data-parallel size, derived: world / (tp*pp*cp), whatever ep is")
    ep = property(lambda self: self._ep, doc="expert-model-parallel size (the expert grid's; the dense grid has ep = 1)")
    expert_tp = property(lambda self: self.moe.expert_tp, doc="expert tensor-parallel size (default: tp)")
    expert_dp = property(lambda self: self.moe.expert_dp, doc="expert data-parallel size: world / (expert_tp*ep*pp)")

    @property
    def order_str(self) -> str:
        return "-".join(self.order)

    @property
    def axes(self) -> tuple[str, ...]:
        """Axes reported by ``coords`` (the dense grid's: tp, cp, dp, pp), in grid order."""
        return tuple(a for a in self.order if a != "ep")

    def __repr__(self) -> str:
        expert = (f", ep={self.ep}, expert_tp={self.expert_tp}, expert_dp={self.expert_dp}"
                  if self._moe is not None else "")
        return (f"RankGrid(world_size={self.world_size}, tp={self.tp}, pp={self.pp}, cp={self.cp}, "
                f"dp={self.dp}{expert}, order='{self.order_str}')")

    # ---- coordinates ---------------------------------------------------------
    def _check_rank(self, rank) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} is outside the grid; use 0 <= rank < world_size={self.world_size}")
        return int(rank)

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
                raise ValueError(f"unknown axis {a!r} in rank_of(); use {', '.join(AXES)}")
        rank = 0
        for a, s, d in zip(self.order, self._shape, self._stride):
            i = coords.get(a, 0)
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < s:
                raise ValueError(f"{a}={i!r} is outside 0..{s - 1} ({a} size is {s})")
            rank += int(i) * d
        return rank

    # ---- groups -------------------------------------------------------------
    def _parse_token(self, token: str) -> tuple[str, ...]:
        parts = split_axes("token", token, "dp-cp", also=f", or one of {', '.join(SPECIAL_TOKENS)}")
        return tuple(sorted(parts, key=self.order.index))

    def group_array(self, token: str) -> np.ndarray:
        """Groups of ``token`` as a read-only int array of shape [num_groups, group_size]."""
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
        masked = self._parse_token(token)
        if masked not in self._cache:
            arr = np.ascontiguousarray(rank_group_array(self.order, self.sizes, "-".join(masked)))
            arr.setflags(write=False)
            self._cache[masked] = arr
        return self._cache[masked]

    def groups(self, token: str) -> list[list[int]]:
        """Every group of ``token``, each a list of global ranks in group-rank order.

        ``token``: axes joined by '-' in any order (``"tp"``, ``"dp"``, ``"dp-cp"``,
        ``"tp-pp"`` = Megatron's model-parallel group, ``"tp-dp-cp"``, ...), or
        ``"embedding"`` (first and last rank of each pipeline group; only the first
        when pp == 1) or ``"position_embedding"`` (first rank of each pipeline group).
        Identical to ``RankGenerator.get_ranks(token)`` / initialize_model_parallel.
        """
        return self.group_array(token).tolist()

    def group_of(self, rank: int, token: str) -> list[int] | None:
        """The ``token`` group that contains ``rank`` (None: rank is in no
        embedding / position-embedding group, e.g. a middle pipeline stage)."""
        rank = self._check_rank(rank)
        arr = self.group_array(token)
        hit = np.nonzero((arr == rank).any(axis=1))[0]
        return arr[hit[0]].tolist() if len(hit) else None

    def groups_of(self, rank: int, tokens: Iterable[str] | None = None) -> dict[str, list[int] | None]:
        """``{token: group containing rank}`` for the main groups (see ``main_tokens``)."""
        return {t: self.group_of(rank, t) for t in (tokens or self.main_tokens())}

    # ---- the expert grid (MoE layers) ------------------------------------------
    def expert_groups(self, token: str) -> list[list[int]]:
        """Groups of the expert grid (Megatron's second ``RankGenerator``: expert_tp × ep ×
        expert_dp × pp, cp = 1): ``"ep"`` (token all-to-all), ``"tp"`` (expert TP), ``"dp"``
        (expert DP: expert-gradient reduction), ``"pp"``, ``"tp-ep"``, ``"tp-ep-pp"``."""
        return self.moe.expert_groups(token)

    def expert_group_of(self, rank: int, token: str) -> list[int]:
        """The expert-grid ``token`` group that contains ``rank``."""
        return self.moe.expert_group_of(self._check_rank(rank), token)

    def expert_coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` in the expert grid: ``{'tp', 'ep', 'dp', 'pp'}`` (each its
        index inside that expert group)."""
        rank = self._check_rank(rank)
        return {a: self.moe.expert_group_of(rank, a).index(rank) for a in ("tp", "ep", "dp", "pp")}

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
        if not 0 <= stage < self.pp:
            raise ValueError(f"stage={stage} is outside 0..{self.pp - 1}")
        return sorted(int(g[stage]) for g in self.group_array("pp"))

    # ---- text ----------------------------------------------------------------
    def table(self, tokens: Iterable[str] | None = None, max_groups: int = 64) -> str:
        """A plain-text table of groups (one line per token) for printing."""
        lines = [f"{self!r}", f"{'group':<20} {'size':>4} {'count':>5}  groups"]
        for t in (tokens or self.main_tokens()):
            arr = self.group_array(t)
            shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in arr[:max_groups].tolist())
            if len(arr) > max_groups:
                shown += f" ... ({len(arr) - max_groups} more)"
            lines.append(f"{t:<20} {arr.shape[1]:>4} {arr.shape[0]:>5}  {shown}")
        if tokens is None and self.ep > 1:
            for t in ("ep", "tp", "dp"):
                groups = self.expert_groups(t)
                shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:max_groups])
                if len(groups) > max_groups:
                    shown += f" ... ({len(groups) - max_groups} more)"
                lines.append(f"{'expert ' + t:<20} {len(groups[0]):>4} {len(groups):>5}  {shown}")
        return "\n".join(lines)

    def coords_table(self) -> str:
        """One line per rank: its coordinates."""
        head = "rank " + " ".join(f"{a:>3}" for a in self.axes)
        rows = [f"{r:>4} " + " ".join(f"{v:>3}" for v in self.coords(r).values()) for r in range(self.world_size)]
        return "\n".join([head] + rows)
