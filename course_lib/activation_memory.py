"""Activation memory of one transformer layer, measured on real ranks and explained item by item.

What a layer "stores for backward" is exactly the set of tensors autograd saves
while the forward pass runs: :mod:`course_lib.saved_tensors` records every one of
them with the module that was running and the storage behind it (q, k and v are
three views of one fused QKV output: one storage, not three);
:func:`activation_storages` keeps the distinct storages that are not parameters
and :func:`activation_bytes` adds up their bytes (both re-exported here).

Three accounts of the same layer, kept apart on purpose:

* **measured** -- :func:`measure` runs :class:`~course_lib.tensor_parallel.ParallelTransformerLayer`
  on ``tp * cp`` real ranks and records what one rank saves;
* **expected** -- :func:`expected_saved_tensors` lists, from reading the layer's
  code and torch's kernels, every storage one rank keeps (name, shape, bytes).
  The test asserts measured == expected *exactly*, storage by storage;
* **paper** -- Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models" (https://arxiv.org/abs/2205.05198), section 4:
  ``sbh(10 + 24/t + 5as/(ht))`` bytes per layer with tensor parallelism (Eq. 2) and
  ``sbh/t (34 + 5as/h)`` with sequence parallelism (Eq. 4), from
  :func:`course_lib.sizing.activation_bytes_per_layer`. :func:`compare_with_paper`
  puts the paper's items next to ours, one row per term with the reason for any
  difference (16-bit vs float32, no dropout masks at dropout 0, the flash kernel's
  log-sum-exp instead of the s x s scores, LayerNorm statistics the paper
  neglects, ...). Its columns add up to the paper's formula and to our expected
  total.

Attention backends (Megatron's ``--attention-backend`` names):

* ``"flash"`` -- what ``F.scaled_dot_product_attention`` picks on CPU: a flash
  kernel that saves q, k, v, its output and one log-sum-exp per head and query;
  no ``s x s`` matrix (backward recomputes the scores).
* ``"unfused"`` -- the math kernel, which stores the softmax output like the
  paper's layer (and Megatron's own unfused ``DotProductAttention``).
* with ``cp > 1`` the core attention is :func:`~course_lib.context_parallel.ring_attention`
  over the context-parallel group
  (:class:`~course_lib.context_parallel.ContextParallelSelfAttention`); it computes each
  block flash-style, so ``attention_backend`` must be ``"flash"``.

The exact list is written for the CPU kernels of torch 2.13 (the course's
machines, float32); another torch may save different tensors, and the test says
which storage differs. Shapes: activations are ``[s, b, h]`` as in Megatron.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from course_lib import comm, rules
from course_lib.context_parallel.attention import build_layer
from course_lib.context_parallel.zigzag import shard_sequence
from course_lib.process_groups import new_groups
from course_lib.saved_tensors import SavedTensor, activation_bytes, activation_storages, record_saved_tensors
from course_lib.sizing import activation_breakdown_per_layer, activation_bytes_per_layer
from course_lib.tensor_parallel import TransformerConfig
from course_lib.topology import RankGrid

__all__ = ["ATTENTION_BACKENDS", "SavedTensor", "ExpectedTensor", "record_saved_tensors", "activation_storages",
           "activation_bytes", "build_layer", "local_tokens", "measure_layer", "measure",
           "expected_saved_tensors", "expected_activation_bytes", "compare_with_paper", "format_comparison",
           "format_saved_tensors", "memory_vs_seq_length", "plot_memory_vs_seq_length", "PLOT_SETUPS"]

ATTENTION_BACKENDS = ("flash", "unfused")
FLOAT32 = 4  # bytes per element: the course's layers run in float32 on CPU
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Layer dtypes :func:`measure_layer` and :func:`expected_saved_tensors` take (``dtype=``): float32 (the
default), or a 16-bit dtype as under Megatron's ``--bf16`` / ``--fp16`` (params and activations
16-bit; see :mod:`course_lib.mixed_precision`)."""


def _check_dtype(dtype, cp: int, attention_backend: str) -> int:
    """Bytes per activation element for ``dtype``; 16-bit layers only with the flash kernel and cp = 1.

    torch's CPU math kernel computes a 16-bit attention in float32 (it saves float32 copies of q,
    k, v and the scores), which is neither the paper's layer nor Megatron's; the ring's 16-bit
    bookkeeping is not written out here."""
    if dtype not in DTYPES:
        raise rules.UsageError(f"dtype={dtype} is not one of float32, bfloat16, float16")
    if dtype != torch.float32 and (attention_backend != "flash" or cp > 1):
        raise rules.UsageError(f"dtype={dtype} with attention_backend={attention_backend!r}, cp={cp}: 16-bit layers are "
                               f"measured with attention_backend='flash' and cp=1 (torch's CPU math kernel upcasts "
                               f"16-bit attention to float32)")
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- measuring


def local_tokens(x: torch.Tensor, tp_group, cp_group=None, sequence_parallel: bool = False) -> torch.Tensor:
    """This rank's part of a full ``[s, b, ...]`` tensor: its zigzag chunks over CP (``[s/cp, ...]``),
    then, under sequence parallelism, its contiguous ``1/t`` of those (``[s/(cp t), ...]``). A copy:
    a slice would keep the whole tensor's storage alive and be counted as such."""
    if cp_group is not None and comm.group_size(cp_group) > 1:
        x = shard_sequence(x, comm.group_rank(cp_group), comm.group_size(cp_group), seq_dim=0, layout="zigzag")
    t = comm.group_size(tp_group)
    if sequence_parallel and t > 1:
        if x.shape[0] % t:
            raise rules.UsageError(f"{x.shape[0]} local tokens are not divisible by tensor-model-parallel-size={t} "
                                   f"(sequence parallelism splits them evenly)")
        x = x.chunk(t, dim=0)[comm.group_rank(tp_group)]
    return x.clone(memory_format=torch.contiguous_format)  # its own storage, like a real layer input


def _sdpa_backend(attention_backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION if attention_backend == "flash" else SDPBackend.MATH)


def measure_layer(seq_length: int, micro_batch_size: int, hidden_size: int, num_heads: int, *, tp_group,
                  cp_group=None, sequence_parallel: bool = False, attention_backend: str = "flash",
                  hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                  ffn_hidden_size: Optional[int] = None, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> list[SavedTensor]:
    """Inside a rank: build the layer, run one forward on this rank's tokens, return what it saved.

    Same arguments as :func:`expected_saved_tensors` (the groups give ``tp`` and ``cp``); with a
    16-bit ``dtype`` the layer's params and its input ``[s, b, h]`` are cast to it."""
    tp = comm.group_size(tp_group)
    cp = comm.group_size(cp_group) if cp_group is not None else 1
    _check(seq_length, micro_batch_size, hidden_size, num_heads, tp, sequence_parallel, cp, attention_backend,
           hidden_dropout, attention_dropout, ffn_hidden_size)
    torch.manual_seed(seed)
    config = TransformerConfig(hidden_size=hidden_size, num_attention_heads=num_heads,
                               ffn_hidden_size=ffn_hidden_size, sequence_parallel=sequence_parallel,
                               hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)
    _check_dtype(dtype, cp, attention_backend)
    layer = build_layer(config, tp_group, cp_group).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(seq_length, micro_batch_size, hidden_size, generator=g)
    x = local_tokens(x, tp_group, cp_group, sequence_parallel).to(dtype).requires_grad_()
    with _sdpa_backend(attention_backend) if cp == 1 else nullcontext():
        _, records = record_saved_tensors(layer, x)
    return records


def _measure_rank(cases: list[dict], tp: int, cp: int, group_timeout: float) -> list[list[SavedTensor]]:
    groups = new_groups(RankGrid(tp * cp, tp=tp, cp=cp), ["tp", "cp"], timeout=group_timeout)
    return [measure_layer(tp_group=groups["tp"], cp_group=groups["cp"], **case) for case in cases]


def measure(cases: list[dict], tp: int = 1, cp: int = 1, timeout: float = 120) -> list[list[list[SavedTensor]]]:
    """Measure several layer settings on ``tp * cp`` real ranks (Megatron's rank order, TP fastest).

    ``cases``: dicts of :func:`measure_layer` keyword arguments (``seq_length``,
    ``micro_batch_size``, ``hidden_size``, ``num_heads``, optionally
    ``sequence_parallel``, ``attention_backend``, ``hidden_dropout``,
    ``attention_dropout``, ``ffn_hidden_size``, ``dtype``). Returns ``result[case][rank]``: the
    records of that rank (use :func:`activation_bytes` on them)."""
    from course_lib.launch import launch

    for case in cases:   # fail in the parent with a one-line error, not in every rank
        _check(case["seq_length"], case["micro_batch_size"], case["hidden_size"], case["num_heads"], tp,
               case.get("sequence_parallel", False), cp, case.get("attention_backend", "flash"),
               case.get("hidden_dropout", 0.0), case.get("attention_dropout", 0.0), case.get("ffn_hidden_size"))
        _check_dtype(case.get("dtype", torch.float32), cp, case.get("attention_backend", "flash"))
    per_rank = launch(_measure_rank, world_size=tp * cp, output="none", timeout=timeout, cases=cases, tp=tp, cp=cp,
                      group_timeout=timeout)
    return [[per_rank[r][i] for r in range(tp * cp)] for i in range(len(cases))]


# --------------------------------------------------------------------------- expected


@dataclass(frozen=True)
class ExpectedTensor:
    """One storage our layer keeps for backward: ``name``, storage ``shape``, ``bytes``, and ``term``
    (the row of :func:`compare_with_paper` it belongs to)."""

    name: str
    shape: tuple
    bytes: int
    term: str


def _check(seq_length, micro_batch_size, hidden_size, num_heads, tp, sequence_parallel, cp, attention_backend,
           hidden_dropout, attention_dropout, ffn_hidden_size):
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size),
                        ("hidden_size", hidden_size), ("num_attention_heads", num_heads),
                        (rules.TP, tp), (rules.CP, cp)):
        rules.integer(name, value)
    rules.hidden_divisible_by_heads(hidden_size, num_heads)
    rules.heads_divisible_by_tp(num_heads, tp)
    ffn = 4 * hidden_size if ffn_hidden_size is None else rules.integer("ffn_hidden_size", ffn_hidden_size)
    rules.ffn_divisible_by_tp(ffn, tp)
    if attention_backend not in ATTENTION_BACKENDS:
        raise rules.UsageError(f"attention_backend={attention_backend!r} is unknown: use 'flash' or 'unfused'")
    for name, p in (("hidden_dropout", hidden_dropout), ("attention_dropout", attention_dropout)):
        rules.probability(name, p)
    if cp > 1:
        rules.sequence_split(seq_length, cp)
        if attention_backend != "flash":
            raise rules.UsageError("context-parallel-size>1 runs ring attention, which computes every block "
                                   "flash-style (no s x s matrix is stored); use attention_backend='flash'")
        rules.cp_attention_dropout(attention_dropout, cp)
    if attention_backend == "flash" and attention_dropout:
        raise rules.UsageError(f"attention_dropout={attention_dropout}: the CPU flash kernel has no dropout (torch "
                               f"falls back to the math kernel); use attention_backend='unfused'")
    if sequence_parallel:
        rules.sequence_parallel_split(seq_length, cp, tp)
    return ffn


def expected_saved_tensors(seq_length: int, micro_batch_size: int, hidden_size: int, num_heads: int,
                           tp: int = 1, sequence_parallel: bool = False, cp: int = 1,
                           attention_backend: str = "flash", hidden_dropout: float = 0.0,
                           attention_dropout: float = 0.0,
                           ffn_hidden_size: Optional[int] = None,
                           dtype: torch.dtype = torch.float32) -> list[ExpectedTensor]:
    """Every storage one rank keeps for the backward of one layer, in the order torch saves them.

    Read off the code of :class:`~course_lib.tensor_parallel.ParallelTransformerLayer`
    (``LayerNorm -> QKV GEMM -> attention -> proj GEMM -> residual -> LayerNorm ->
    fc1 -> GeLU -> fc2 -> residual``) and of the ops it calls (torch 2.13, CPU,
    float32: 4 bytes per element, dropout masks included). Symbols: ``s_l = s/cp``
    tokens on this rank, ``s_t = s_l/t`` under sequence parallelism (else ``s_l``)
    for the per-token parts, ``h/t`` and ``a/t`` the rank's share of the hidden size
    and heads, ``hn = h/a``.

    ``dtype`` 16-bit (flash kernel, cp = 1): every activation, the LayerNorm statistics and the
    dropout masks take 2 bytes per element; the flash kernel's log-sum-exp stays float32 (4)."""
    ffn = _check(seq_length, micro_batch_size, hidden_size, num_heads, tp, sequence_parallel, cp,
                 attention_backend, hidden_dropout, attention_dropout, ffn_hidden_size)
    elem = _check_dtype(dtype, cp, attention_backend)
    b, h, t = micro_batch_size, hidden_size, tp
    s_l = seq_length // cp
    s_t = s_l // t if sequence_parallel else s_l
    heads, hn, hp = num_heads // t, hidden_size // num_heads, hidden_size // t
    sp_note = " (SP: this rank's s/t tokens)" if sequence_parallel and t > 1 else ""
    items: list[ExpectedTensor] = []

    def add(name, shape, term):
        n = 1
        for d in shape:
            n *= d
        items.append(ExpectedTensor(name, tuple(shape), n * (FLOAT32 if term == "lse" else elem), term))

    def layernorm(i, what):
        add(f"LayerNorm {i} input ({what}){sp_note}", (s_t, b, h), "layernorm_inputs")
        add(f"LayerNorm {i} mean", (s_t, b, 1), "layernorm_stats")
        add(f"LayerNorm {i} 1/std", (s_t, b, 1), "layernorm_stats")

    def dropout_mask(where, term):
        if hidden_dropout:
            add(f"dropout mask after {where} (float32){sp_note}", (s_t, b, h), term)

    layernorm(1, "the layer input")
    add(f"LayerNorm 1 output = QKV GEMM input{sp_note}", (s_t, b, h), "qkv_input")
    if cp > 1:                                                    # RingAttention.save_for_backward(q, k, v, out, lse)
        add("fused QKV output (q is a view of it)", (s_l, b, 3 * hp), "qkv")
        add("K received from rank r+1, kept for the reverse ring", (b, heads, s_l, hn), "ring_kv")
        add("V received from rank r+1, kept for the reverse ring", (b, heads, s_l, hn), "ring_kv")
        add("ring output (for D = rowsum(dO * O))", (b, heads, s_l, hn), "ring_output")
        add("log-sum-exp per head and query", (b, heads, s_l), "lse")
        add("context, contiguous copy = linear_proj input", (s_l, b, hp), "projection_input")
    elif attention_backend == "flash":                           # SDPA flash (CPU): q, k, v, out, lse
        add("fused QKV output (q, k, v are views of it)", (s_l, b, 3 * hp), "qkv")
        add("log-sum-exp per head and query", (b, heads, s_l), "lse")
        add("attention output = linear_proj input (one storage)", (s_l, b, hp), "projection_input")
    else:                                                        # SDPA math: scaled q, k; softmax; (dropout); v
        add("k * sqrt(1/sqrt(hn)), transposed for QK^T", (b * heads, hn, s_l), "scaled_qk")
        add("q * sqrt(1/sqrt(hn)) for QK^T", (b * heads, s_l, hn), "scaled_qk")
        add("softmax output", (b, heads, s_l, s_l), "softmax_output")
        if attention_dropout:
            add("softmax dropout mask (float32)", (b, heads, s_l, s_l), "softmax_dropout_mask")
        add("fused QKV output (kept alive by the V view)", (s_l, b, 3 * hp), "qkv")
        if attention_dropout:
            add("softmax-dropout output = (.V) GEMM input", (b, heads, s_l, s_l), "dropout_output")
        add("context, contiguous copy = linear_proj input", (s_l, b, hp), "projection_input")
    dropout_mask("attention", "attention_dropout_mask")
    layernorm(2, "the residual sum")
    add(f"LayerNorm 2 output = h->4h GEMM input{sp_note}", (s_t, b, h), "mlp_fc1_input")
    add("h->4h output = GeLU input", (s_l, b, ffn // t), "gelu_input")
    add("GeLU output = 4h->h GEMM input", (s_l, b, ffn // t), "mlp_fc2_input")
    dropout_mask("the MLP", "mlp_dropout_mask")
    return items


def expected_activation_bytes(*args, **kwargs) -> int:
    """Sum of :func:`expected_saved_tensors` (same arguments)."""
    return sum(item.bytes for item in expected_saved_tensors(*args, **kwargs))


# --------------------------------------------------------------------------- versus the paper

# (term, label) in the order of the comparison table
_TERMS = [
    ("layernorm_inputs", "LayerNorm inputs (2 LayerNorms)"),
    ("layernorm_stats", "LayerNorm mean and 1/std"),
    ("qkv_input", "QKV GEMM input"),
    ("qkv", "Q, K and V"),
    ("scaled_qk", "scaled copies of q and k"),
    ("softmax_output", "softmax output (s x s per head)"),
    ("softmax_dropout_mask", "softmax dropout mask"),
    ("dropout_output", "softmax-dropout output"),
    ("lse", "log-sum-exp (per head and query)"),
    ("ring_kv", "ring: K, V received from rank r+1"),
    ("ring_output", "ring: its own output"),
    ("projection_input", "attention projection input"),
    ("attention_dropout_mask", "dropout mask after attention"),
    ("mlp_fc1_input", "h->4h GEMM input"),
    ("gelu_input", "GeLU input"),
    ("mlp_fc2_input", "4h->h GEMM input"),
    ("mlp_dropout_mask", "dropout mask after the MLP"),
]
_REPLICATED = ("layernorm_inputs", "qkv_input", "attention_dropout_mask", "mlp_fc1_input", "mlp_dropout_mask")


def _paper_terms(seq_length, micro_batch_size, hidden_size, num_heads, tp, sequence_parallel, cp) -> dict:
    """Korthikanti's items (§4.1, 16-bit activations, 1-byte masks) on one rank, keyed like our terms.

    The paper lumps "dropout output and V"; we split it. Tokens ``s/cp`` per rank; the score
    items see all ``s`` keys (``a (s/cp) s b``), as in :func:`course_lib.sizing.activation_bytes_per_layer`."""
    p = activation_breakdown_per_layer(seq_length // cp, micro_batch_size, hidden_size, num_heads)
    v = 2 * (seq_length // cp) * micro_batch_size * hidden_size
    terms = {
        "layernorm_inputs": p["layernorm_inputs"], "qkv_input": p["qkv_input"], "qkv": p["q_and_k"] + v,
        "softmax_output": p["softmax_output"] * cp, "softmax_dropout_mask": p["softmax_dropout_mask"] * cp,
        "dropout_output": (p["attention_over_v"] - v) * cp, "projection_input": p["projection_input"],
        "attention_dropout_mask": p["attention_dropout_mask"], "mlp_fc1_input": p["mlp_fc1_input"],
        "gelu_input": p["gelu_input"], "mlp_fc2_input": p["mlp_fc2_input"], "mlp_dropout_mask": p["mlp_dropout_mask"],
    }
    return {k: (val if k in _REPLICATED and not sequence_parallel else val // tp) for k, val in terms.items()}


def _why(term: str, *, tp, sp, cp, backend, hidden_dropout, attention_dropout) -> str:
    """One line: why our bytes for ``term`` differ from the paper's (or that they are the same tensor)."""
    fp32 = "same tensor, float32 (paper: 16-bit)"
    regather = "; SP: keeps s/t tokens, re-gathers them in backward" if sp and tp > 1 else ""
    no_scores = ("none: the ring computes its blocks flash-style" if cp > 1 else
                 "none: flash recomputes the scores from q, k, lse")
    unfused = backend == "unfused" and cp == 1

    def mask(p, name):
        return f"{name}={p}: float32 mask on CPU (Megatron: 1 byte)" if p else f"{name}=0: no dropout, no mask"

    whys = {
        "layernorm_inputs": "same tensors, float32 (paper: 16-bit)",
        "layernorm_stats": "neglected by the paper: a mean and 1/std per token",
        "qkv_input": fp32 + regather,
        "mlp_fc1_input": fp32 + regather,
        "qkv": "one fused QKV output, q/k/v are views; float32" + ("; alive through v" if unfused else ""),
        "scaled_qk": "torch's math kernel scales q, k into new tensors (Megatron: no)",
        "softmax_output": fp32 if unfused else no_scores,
        "softmax_dropout_mask": mask(attention_dropout, "attention_dropout") if unfused else no_scores,
        "dropout_output": (fp32 if attention_dropout else "no dropout: (.V) reads the softmax output")
        if unfused else no_scores,
        "lse": "1 float per head and query instead of s x s",
        "ring_kv": "last K/V received, kept for the reverse ring",
        "ring_output": "the ring's own output, kept for its backward",
        "projection_input": fp32 + (" (= the flash kernel's saved output)" if backend == "flash" and cp == 1
                                    else ""),
        "attention_dropout_mask": mask(hidden_dropout, "hidden_dropout"),
        "mlp_dropout_mask": mask(hidden_dropout, "hidden_dropout"),
        "gelu_input": fp32,
        "mlp_fc2_input": fp32,
    }
    if term not in whys:
        raise rules.UsageError(f"unknown term {term!r}")
    return whys[term]


def compare_with_paper(seq_length: int, micro_batch_size: int, hidden_size: int, num_heads: int, tp: int = 1,
                       sequence_parallel: bool = False, cp: int = 1, attention_backend: str = "flash",
                       hidden_dropout: float = 0.0, attention_dropout: float = 0.0) -> list[dict]:
    """Korthikanti's per-layer items next to ours: rows ``{term, label, paper, ours, why}`` (bytes, one rank)
    and a final ``total`` row.

    ``paper`` adds up to :func:`course_lib.sizing.activation_bytes_per_layer` (Eq. 2 without
    SP, Eq. 4 with; the course's extension for ``cp > 1``); ``ours`` to
    :func:`expected_activation_bytes`. Rows where both are 0 are left out. The paper
    assumes ``ffn = 4h``, so ours does too here."""
    items = expected_saved_tensors(seq_length, micro_batch_size, hidden_size, num_heads, tp, sequence_parallel,
                                   cp, attention_backend, hidden_dropout, attention_dropout)
    paper = _paper_terms(seq_length, micro_batch_size, hidden_size, num_heads, tp, sequence_parallel, cp)
    rows = []
    for term, label in _TERMS:
        ours = sum(i.bytes for i in items if i.term == term)
        if ours == 0 and paper.get(term, 0) == 0:
            continue
        rows.append(dict(term=term, label=label, paper=paper.get(term, 0), ours=ours,
                         why=_why(term, tp=tp, sp=sequence_parallel, cp=cp, backend=attention_backend,
                                  hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)))
    total_paper = activation_bytes_per_layer(seq_length, micro_batch_size, hidden_size, num_heads, tp,
                                             sequence_parallel, "none", cp)
    if sum(r["paper"] for r in rows) != total_paper:   # the item split must reproduce the paper's equation
        raise AssertionError("the paper's items do not add up to activation_bytes_per_layer")
    rows.append(dict(term="total", label="total per layer", paper=total_paper, ours=sum(r["ours"] for r in rows),
                     why="paper: Korthikanti Eq. " + ("4" if sequence_parallel else ("1" if tp == 1 else "2"))
                         + ("" if cp == 1 else " on s/cp tokens (course extension)")))
    return rows


def format_comparison(rows: list[dict], why: bool = True) -> str:
    """Plain-text table of :func:`compare_with_paper` (bytes; deterministic)."""
    head = ["term", "paper (B)", "ours (B)"] + (["why they differ"] if why else [])
    body = [[r["label"], f"{r['paper']:,}", f"{r['ours']:,}"] + ([r["why"]] if why else []) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i in (1, 2) else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body[:-1]]
    return "\n".join(lines + [fmt(["-" * w for w in widths]), fmt(body[-1])])


def format_saved_tensors(records: list[SavedTensor], expected: list[ExpectedTensor]) -> str:
    """Measured storages (first-seen order) next to the expected list: module, producer, bytes, name."""
    measured = activation_storages(records)
    head = ["#", "saved in module", "made by", "measured (B)", "expected (B)", "expected item"]
    body = []
    for i in range(max(len(measured), len(expected))):
        m = measured[i] if i < len(measured) else None
        e = expected[i] if i < len(expected) else None
        body.append([str(i), m["module"] if m else "", m["producer"] if m else "",
                     f"{m['bytes']:,}" if m else "-", f"{e.bytes:,}" if e else "-", e.name if e else ""])
    total_m, total_e = sum(m["bytes"] for m in measured), sum(e.bytes for e in expected)
    body.append(["", "total", "", f"{total_m:,}", f"{total_e:,}", "equal" if total_m == total_e else "DIFFERENT"])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i in (0, 3, 4) else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


# --------------------------------------------------------------------------- memory vs sequence length

PLOT_SETUPS = (
    ("TP", dict(sequence_parallel=False, cp=1, attention_backend="unfused")),
    ("TP+SP", dict(sequence_parallel=True, cp=1, attention_backend="unfused")),
    ("TP+SP, flash attention", dict(sequence_parallel=True, cp=1, attention_backend="flash")),
    ("TP+SP+CP (ring attention)", dict(sequence_parallel=True, cp=None, attention_backend="flash")),
)
"""The setups of :func:`plot_memory_vs_seq_length`: label -> settings (``cp=None``: the plot's ``cp``)."""


def memory_vs_seq_length(seq_lengths, hidden_size: int, num_heads: int, micro_batch_size: int = 1, tp: int = 2,
                         cp: int = 2, source: str = "ours") -> dict[str, list[int]]:
    """Activation bytes per rank per layer for each of :data:`PLOT_SETUPS` at each sequence length.

    ``source="ours"``: :func:`expected_activation_bytes` (float32, our layer, exact);
    ``"paper"``: :func:`course_lib.sizing.activation_bytes_per_layer` (16-bit; its score
    term for every setup, as the paper's layer stores it)."""
    if source not in ("ours", "paper"):
        raise rules.UsageError(f"source={source!r} must be 'ours' or 'paper'")
    out = {}
    for label, setup in PLOT_SETUPS:
        c = cp if setup["cp"] is None else setup["cp"]
        if source == "ours":
            out[label] = [expected_activation_bytes(s, micro_batch_size, hidden_size, num_heads, tp,
                                                    setup["sequence_parallel"], c, setup["attention_backend"])
                          for s in seq_lengths]
        elif setup["attention_backend"] == "unfused" or c > 1:
            out[label] = [activation_bytes_per_layer(s, micro_batch_size, hidden_size, num_heads, tp,
                                                     setup["sequence_parallel"], "none", c) for s in seq_lengths]
    return out


def plot_memory_vs_seq_length(seq_lengths, hidden_size: int, num_heads: int, micro_batch_size: int = 1,
                              tp: int = 2, cp: int = 2, measured: Optional[dict] = None, paper: bool = True):
    """Activation bytes per rank for one layer vs sequence length (log-log).

    Lines: our layer's exact saved-tensor list (:func:`expected_activation_bytes`, float32)
    for every setup of :data:`PLOT_SETUPS`; markers: ``measured`` (``{label: {s: bytes}}``,
    from :func:`measure` on real ranks); dashed (``paper=True``): Korthikanti's formula
    (16-bit, scores stored). Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    seq_lengths = list(seq_lengths)
    ours = memory_vs_seq_length(seq_lengths, hidden_size, num_heads, micro_batch_size, tp, cp, "ours")
    colors = dict(zip([label for label, _ in PLOT_SETUPS], ["tab:red", "tab:blue", "tab:cyan", "tab:green"]))
    fig, ax = plt.subplots(figsize=(9, 5.2))
    for label, values in ours.items():
        ax.plot(seq_lengths, values, color=colors[label], lw=2, label=f"{label}: our layer's formula (float32)")
        if measured and label in measured:
            xs = sorted(measured[label])
            ax.plot(xs, [measured[label][s] for s in xs], "o", color=colors[label], mec="black", ms=7,
                    label=f"{label}: measured on {tp * (cp if 'CP' in label else 1)} ranks")
    if measured:
        edge = max(max(points) for points in measured.values())
        ax.axvline(edge, color="0.4", ls=":", lw=1)
        ax.annotate("measured  |  formula only", (edge, 0.02), xycoords=("data", "axes fraction"), ha="center",
                    fontsize=8, color="0.3", bbox=dict(facecolor="white", edgecolor="none", pad=1))
    if paper:
        for label, values in memory_vs_seq_length(seq_lengths, hidden_size, num_heads, micro_batch_size, tp, cp,
                                                  "paper").items():
            what = "Eq. 4 on s/cp tokens, scores stored" if "CP" in label else ("Eq. 4" if "SP" in label
                                                                                else "Eq. 2")
            ax.plot(seq_lengths, values, "--", color=colors[label], lw=1,
                    label=f"{label}: Korthikanti {what} (16-bit)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("activation bytes per rank, one layer")
    ax.set_title(f"h={hidden_size}, a={num_heads}, b={micro_batch_size}, t={tp}, cp={cp}: "
                 f"markers measured, lines formulas", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
