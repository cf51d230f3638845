"""Read Megatron-LM training logs -- every format era -- and the course's own logs.

``parse_log(text) -> ParsedLog`` with

* ``.config`` -- ``world_size``, ``dp``, ``cp``, ``tp``, ``pp`` from the
  ``using world size: ...`` line (plus model/batch sizes from the arguments
  block when it is printed, and ``num_microbatches`` derived from them);
* ``.iterations`` -- one dict per iteration line: ``iteration``, ``train_iters``,
  ``timestamp`` (str or None), ``consumed_samples``, ``elapsed_ms``,
  ``throughput`` (TFLOP/s/GPU, only with ``--log-throughput``), ``learning_rate``,
  ``global_batch_size``, ``lm_loss``, ``loss_scale``, ``grad_norm``,
  ``skipped_iterations``, ``nan_iterations``, and any other ``name: value`` field
  (name lower-cased, non-alphanumerics -> ``_``);
* ``.memory`` -- one dict per ``report_memory`` line: ``rank``, ``iteration``,
  ``allocated_mb``, ``max_allocated_mb``, ``reserved_mb``, ``max_reserved_mb``
  (and any extra field, e.g. ``total_device_memory_used_mb`` or the course's
  ``source``);
* ``.args`` (the ``---- arguments ----`` block), ``.parameters`` (the
  ``number of parameters on (tensor, pipeline) model parallel rank`` lines),
  ``.theoretical_memory``, ``.validation`` and ``.era``.

Format eras (format strings read in NVIDIA/Megatron-LM; fixtures for each in
``tests/fixtures/megatron_logs/``):

==========  ===================================================================
era         what changes
==========  ===================================================================
pre-0.6     ``training_log`` in ``megatron/training.py``: the line starts
            `` iteration {:8d}/{:8d} |``; ``report_memory`` (``megatron/utils.py``)
            prints raw floats (``'{}'.format(mb)``).
0.6-0.15    ``megatron/training/training.py`` (commit f427c6f, 2024-03-09, first
            in core_v0.6.0) prefixes `` [%Y-%m-%d %H:%M:%S]``; memory still raw
            floats (``megatron/training/utils.py``).
0.16+       commit 6cf285b (2026-01-27) adds microseconds ``[... %H:%M:%S.%f]``;
            c40b6ea (2026-01-16) logs iteration 1 as well (initialisation
            overhead) and reports memory after it and after the next logged
            iteration; 82ea022 (2026-01-21) prints memory with ``:.2f``. All
            first released in core_v0.16.0; unchanged on main (d98e8a6).
==========  ===================================================================

The ``using world size`` line (``validate_args``, ``megatron/training/arguments.py``)
changed wording too: ``data-parallel-size`` (v2.x) vs ``data-parallel size``; no CP
field before core 0.4; a missing comma after the CP size (core 0.4-0.8); extra
``encoder-tensor-/encoder-pipeline-model-parallel size`` fields (core 0.9-0.13,
which must not be read as TP/PP) and ``hierarchical context-parallel sizes`` (from
core 0.10; without its comma until core 0.13: ``sizes: Nonetensor-model-parallel size: 2``).
The oldest form, ``using world size: 8 and model-parallel size: 2`` (v1.0), is read
as TP = model-parallel size, PP = 1. Lines may carry a launcher prefix
(``[default0]:`` from ``torchrun --tee``, ``3: `` from ``srun -l``).

The contract for the course's own logs (``course_lib.train``): this module also writes
them -- :func:`world_size_line`, :func:`arguments_lines`, :func:`parameters_line`,
:func:`iteration_line`, :func:`memory_line`, each printed with :func:`print_line` -- exactly
in Megatron's current (0.16+) form, so the format lives here once and the parser reads back
what the writers wrote (``tests/training/test_megatron_log_writers.py``)::

    using world size: 8, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 2
    ------------------------ arguments ------------------------
      global_batch_size ............................... 16
      micro_batch_size ................................ 2
      seq_length ...................................... 64
      ...
    -------------------- end of arguments ---------------------
     [2026-08-22 15:22:22.123456] iteration       10/     100 | consumed samples:          160 | elapsed time per iteration (ms): 812.3 | learning rate: 3.000000E-04 | global batch size:    16 | lm loss: 4.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |
    [Rank 0] (after 10 iterations) memory (MB) | allocated: 12.34 | max allocated: 56.78 | reserved: 0.00 | max reserved: 0.00 | source: tracked tensor bytes

(the arguments block: ``'  {} {} {}'.format(name, '.' * (48 - len(name)), value)``,
sorted by name, as ``_print_args``). On CPU there is no CUDA allocator: the course
reports what it measured and names it in a trailing ``| source: ...`` field
(e.g. ``tracked tensor bytes`` or ``peak RSS``), which lands in ``memory[i]['source']``.

Any input is read in linear time and bounded memory: every pattern is anchored on a
fixed substring and has no nested or overlapping repeats, and a line longer than
``MAX_LINE_CHARS`` (Megatron's lines are under 2 kB; a longer one is a log that lost
its newlines) is skipped without being held whole and counted in
``ParsedLog.long_lines_skipped``. ``parse_log_file(path)`` streams a file the same way
and refuses, in one line naming the file, one that is not UTF-8 text. A ``using world
size`` line whose sizes cannot multiply to the world size (a size of 0, or TP x PP x CP
x DP != world, e.g. two ranks' lines spliced together) is a ``ValueError`` naming the
values, never a row of made-up numbers.
"""

from __future__ import annotations

import datetime
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from course_lib import rules

# field name in the log -> key in the parsed dict (everything else: _slug(name))
ITERATION_KEYS = {
    "consumed samples": "consumed_samples",
    "skipped samples": "skipped_samples",
    "elapsed time per iteration (ms)": "elapsed_ms",
    "throughput per GPU (TFLOP/s/GPU)": "throughput",
    "energy per GPU (J/iter/GPU)": "energy_j_per_gpu",
    "power per GPU (W/GPU)": "power_w_per_gpu",
    "learning rate": "learning_rate",
    "decoupled learning rate": "decoupled_learning_rate",
    "global batch size": "global_batch_size",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "num zeros": "num_zeros",
    "params norm": "params_norm",
    "number of skipped iterations": "skipped_iterations",
    "number of nan iterations": "nan_iterations",
}
MEMORY_KEYS = {
    "allocated": "allocated_mb",
    "max allocated": "max_allocated_mb",
    "reserved": "reserved_mb",
    "max reserved": "max_reserved_mb",
    "cached": "reserved_mb",          # v1.0 called the reserved pool "cached"
    "max cached": "max_reserved_mb",
    "total device memory used": "total_device_memory_used_mb",
}

# Every pattern starts at a fixed substring and bounds what it repeats, so matching a line costs
# time linear in its length (no quadratic backtracking, whatever the line holds). Numbers are at
# most _DIGITS digits: a longer run is not a Megatron number (and int() refuses > 4300 digits).
_DIGITS = r"\d{1,18}(?!\d)"
_PREFIX = re.compile(r"^(?:\[[A-Za-z_]+\d+\]:|\d+: )")
_TIMESTAMP = r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]"
_ITERATION = re.compile(rf"(?:{_TIMESTAMP}\s*)?iteration\s+(?P<it>{_DIGITS})/\s*(?P<total>{_DIGITS})\s*\|")
_MEMORY_MARK = " memory (MB)"
_MEMORY_TAIL = re.compile(r"\s*\|")                      # after " memory (MB)"
_RANK_TAG = re.compile(rf"\[Rank (?P<rank>{_DIGITS})\]\s*")
_MEMORY_ITERATION = re.compile(rf"after ({_DIGITS}) iterations|iteration ({_DIGITS})")
_VALIDATION_ITERATION = re.compile(rf"iteration ({_DIGITS})")
_VALIDATION_MARK, _LOSS_AT = "validation", " loss at "
_WORLD = re.compile(rf"using world size:\s*(?P<world>{_DIGITS})")
_WORLD_V1 = re.compile(rf"using world size:\s*(?P<world>{_DIGITS}) and model-parallel size:\s*(?P<mp>{_DIGITS})")
_WORLD_FIELDS = {
    "dp": re.compile(rf"data-parallel[- ]size:\s*({_DIGITS})"),
    "cp": re.compile(rf"(?<!hierarchical )context-parallel size:\s*({_DIGITS})"),
    "tp": re.compile(rf"(?<!encoder-)tensor-model-parallel size:\s*({_DIGITS})"),
    "pp": re.compile(rf"(?<!encoder-)pipeline-model-parallel size:\s*({_DIGITS})"),
    "encoder_tp": re.compile(rf"encoder-tensor-model-parallel size:\s*({_DIGITS})"),
    "encoder_pp": re.compile(rf"encoder-pipeline-model-parallel size:\s*({_DIGITS})"),
}
_HIER_CP = re.compile(r"hierarchical context-parallel sizes:\s*(None|\[[^\]]{0,200}\])")
_ARGS_START = re.compile(r"^-{3,} arguments -{3,}\s*$")
_ARGS_END = re.compile(r"^-{3,} end of arguments -{3,}\s*$")
_ARG_LINE = re.compile(r"^\s+([A-Za-z_]\w*) \.* (.*)$")
_PARAMS = re.compile(r"number of parameters on \((?P<names>[^)]{0,200})\) model parallel rank "
                     rf"\((?P<ranks>[^)]{{0,200}})\):\s*(?P<n>{_DIGITS})")
_THEORY = re.compile(r"Theoretical memory footprints: weight and optimizer=(?P<w>[\d.]{1,40}) MB, "
                     r"activation=(?P<a>[\d.]{1,40}) MB, total=(?P<t>[\d.]{1,40}) MB")
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER_CHARS = 64  # a field value longer than this is text, not a number

# Megatron's lines are < 2 kB (an arguments-block line with a long --data-path blend may be more);
# a longer line is a log that lost its newlines, skipped without ever being held whole.
MAX_LINE_CHARS = 64 * 1024
# what str.splitlines() splits on, so parse_log(text) sees the lines text.splitlines() gives
_LINE_BREAK = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
_FILE_CHUNK_CHARS = 256 * 1024  # characters read at a time by parse_log_file

# arguments copied into .config when the arguments block is printed
_CONFIG_FROM_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                     "global_batch_size", "sequence_parallel", "virtual_pipeline_model_parallel_size",
                     "train_iters", "params_dtype")
_ARGS_PARALLEL = {"world_size": "world_size", "tp": "tensor_model_parallel_size",
                  "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size", "dp": "data_parallel_size"}


def _slug(name: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", name.strip().lower()).strip("_")


def _number(text: str):
    """int, float (incl. nan/inf) or None for non-numbers (and for anything over _NUMBER_CHARS)."""
    t = text.strip()
    if len(t) > _NUMBER_CHARS:
        return None
    if _INTEGER.fullmatch(t):
        return int(t)
    try:
        return float(t)
    except ValueError:
        return None


def _value(text: str):
    """A printed Python value: int/float/bool/None, else the string."""
    t = text.strip()
    n = _number(t)
    if n is not None:
        return n
    return {"True": True, "False": False, "None": None}.get(t, t)


def _fields(rest: str, key_map: dict[str, str]) -> dict:
    out = {}
    for seg in rest.split("|"):
        name, sep, raw = seg.rpartition(":")
        if not sep or not name.strip():
            continue
        key = key_map.get(name.strip(), _slug(name))
        num = _number(raw)
        out[key] = num if num is not None else raw.strip()
    return out


def _strip_prefix(line: str) -> str:
    return _PREFIX.sub("", line, count=1)


@dataclass
class ParsedLog:
    """What ``parse_log`` found. See the module docstring for every key."""

    config: dict = field(default_factory=dict)
    iterations: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    args: dict = field(default_factory=dict)
    parameters: list[dict] = field(default_factory=list)
    theoretical_memory: dict | None = None
    validation: list[dict] = field(default_factory=list)
    era: str = "unknown"
    long_lines_skipped: int = 0  # lines over MAX_LINE_CHARS (not Megatron's: a log that lost its newlines)

    def loss_curve(self, key: str = "lm_loss") -> list[tuple[int, float]]:
        """``(iteration, loss)`` for every iteration line that printed ``key``."""
        return [(it["iteration"], it[key]) for it in self.iterations if key in it]

    def max_memory_by_rank(self, key: str = "max_allocated_mb") -> dict:
        """Peak of ``key`` per reporting rank over all memory lines (rank ``None``: no ``[Rank r]``)."""
        out: dict = {}
        for m in self.memory:
            if key in m and isinstance(m[key], (int, float)):
                out[m.get("rank")] = max(out.get(m.get("rank"), -math.inf), m[key])
        return out

    def step_time_ms(self) -> float | None:
        """Median ``elapsed_ms`` over the logged iterations after the first (warm-up excluded);
        the first one's value when only one was logged; ``None`` when none was."""
        times = [it["elapsed_ms"] for it in self.iterations if isinstance(it.get("elapsed_ms"), (int, float))]
        if not times:
            return None
        return float(statistics.median(times[1:] if len(times) > 1 else times))


def _parse_world_line(line: str) -> dict | None:
    m = _WORLD_V1.search(line)
    if m:
        world, mp = int(m["world"]), int(m["mp"])
        cfg = {"world_size": world, "tp": mp, "pp": 1, "cp": 1}
        cfg["dp"] = _check_world_sizes(cfg)
        return cfg
    m = _WORLD.search(line)
    if not m:
        return None
    cfg = {"world_size": int(m["world"])}
    for key, rx in _WORLD_FIELDS.items():
        mm = rx.search(line)
        if mm:
            cfg[key] = int(mm.group(1))
    h = _HIER_CP.search(line)
    if h:
        cfg["hierarchical_cp_sizes"] = _value(h.group(1))
    cfg.setdefault("cp", 1)  # printed since core 0.4; no context parallelism before
    cfg.setdefault("tp", 1)
    cfg.setdefault("pp", 1)
    cfg["dp"] = _check_world_sizes(cfg)
    return cfg


def _check_world_sizes(cfg: dict) -> int:
    """The ``using world size`` line's sizes must multiply to the world size (``validate_args``
    asserts it); anything else is a garbled line, refused with the values rather than turned
    into a row of made-up numbers (or a ZeroDivisionError). Returns the data-parallel size: the
    line's own, else derived (:func:`course_lib.rules.data_parallel_size`)."""
    names = {"world_size": "world size", "dp": "data-parallel size", "cp": "context-parallel size",
             "tp": "tensor-model-parallel size", "pp": "pipeline-model-parallel size"}
    printed = ", ".join(f"{names[k]} {cfg[k]}" for k in names if k in cfg)
    zero = [names[k] for k in names if cfg.get(k) == 0]
    if zero:
        raise rules.UsageError(f"impossible 'using world size' line ({printed}): {', '.join(zero)} is 0; "
                               f"the line is garbled or not Megatron-LM's")
    # core 0.9-0.13: encoder ranks come on top of the decoder's (encoder sizes 0 when unused)
    model = cfg["tp"] * cfg["pp"] + cfg.get("encoder_tp", 0) * cfg.get("encoder_pp", 0)
    formula = "TP x PP" if not cfg.get("encoder_pp") else "(TP x PP + encoder TP x encoder PP)"
    world, cp = cfg["world_size"], cfg["cp"]
    if "dp" in cfg and model * cp * cfg["dp"] != world:
        raise rules.UsageError(f"impossible 'using world size' line ({printed}): {formula} x CP x DP = "
                               f"{model * cp * cfg['dp']} != world size {world}; the line is garbled (e.g. two ranks' "
                               f"output spliced together) or not Megatron-LM's")
    if "dp" in cfg:
        return cfg["dp"]
    try:
        return rules.data_parallel_size(world, cfg["tp"], cfg["pp"], cp, encoder_tp=cfg.get("encoder_tp", 0),
                                        encoder_pp=cfg.get("encoder_pp", 0))
    except ValueError:
        raise rules.UsageError(f"impossible 'using world size' line ({printed}): world size {world} is not divisible by "
                               f"{formula} x CP = {model * cp}; the line is garbled or not Megatron-LM's") from None


def _era(iterations: list[dict]) -> str:
    if not iterations:
        return "unknown"
    ts = iterations[0].get("timestamp")
    if ts is None:
        return "pre-0.6"
    return "0.16+" if "." in ts else "0.6-0.15"


def _iter_lines(chunks: Iterable[str]) -> Iterator[str | None]:
    """The lines of the text that ``chunks`` make when joined, split as ``str.splitlines`` does.

    A line longer than ``MAX_LINE_CHARS`` comes out as ``None`` and is never held whole: memory
    stays bounded by one chunk plus one line, however long the input's lines are."""
    head: list[str] = []   # the current line's pieces so far (at most MAX_LINE_CHARS in all)
    size, too_long, after_cr = 0, False, False
    for chunk in chunks:
        start = 1 if after_cr and chunk.startswith("\n") else 0  # a "\r\n" split between two chunks
        for brk in _LINE_BREAK.finditer(chunk, start):
            end = brk.start()
            if too_long or size + end - start > MAX_LINE_CHARS:
                yield None
            else:
                head.append(chunk[start:end])
                yield "".join(head)
            head, size, too_long = [], 0, False
            start = brk.end()
        after_cr = start == len(chunk) and chunk.endswith("\r")
        if too_long or size + len(chunk) - start > MAX_LINE_CHARS:
            head, size, too_long = [], 0, True
        elif start < len(chunk):
            head.append(chunk[start:])
            size += len(chunk) - start
    if too_long:
        yield None
    elif head:
        yield "".join(head)


def _match_memory(line: str) -> tuple[int | None, str, str] | None:
    """``(rank, label, rest)`` of a ``report_memory`` line, e.g. ``[Rank 3] (after 10 iterations)
    memory (MB) | allocated: ...``, else None.

    The label runs from the first non-blank character (after an optional ``[Rank N]`` tag) to
    the first `` memory (MB)`` that is followed by ``|``; found with ``str.find``, in linear time."""
    first = len(line) - len(line.lstrip())
    tag = _RANK_TAG.match(line, first)
    if tag:
        found = _memory_label(line, tag.end())
        if found:
            return int(tag["rank"]), *found
    found = _memory_label(line, first)
    return (None, *found) if found else None


def _memory_label(line: str, start: int) -> tuple[str, str] | None:
    """``(label, rest)`` for a label starting at ``start``: a parenthesised ``(...)`` right before
    `` memory (MB)``, or any text up to the first `` memory (MB) |``."""
    if start >= len(line) or line[start].isspace():
        return None
    if line[start] == "(":
        close = line.find(")", start)
        if close >= 0 and line.startswith(_MEMORY_MARK, close + 1):
            tail = _MEMORY_TAIL.match(line, close + 1 + len(_MEMORY_MARK))
            if tail:
                return line[start:close + 1], line[tail.end():]
    at = line.find(_MEMORY_MARK, start + 1)
    while at >= 0:
        tail = _MEMORY_TAIL.match(line, at + len(_MEMORY_MARK))
        if tail:
            return line[start:at], line[tail.end():]
        at = line.find(_MEMORY_MARK, at + 1)
    return None


def _match_validation(line: str) -> tuple[str, str] | None:
    """``(label, rest)`` of ``validation loss at iteration 40 | lm loss value: ...`` (Megatron may
    put words between ``validation`` and ``loss at``, never a ``|``), else None. Linear time."""
    at = line.find(_VALIDATION_MARK)
    while at >= 0:
        loss_at = line.find(_LOSS_AT, at + len(_VALIDATION_MARK))
        if loss_at < 0:
            return None
        bar = line.find("|", at + len(_VALIDATION_MARK), loss_at)
        if bar < 0:
            label_start = loss_at + len(_LOSS_AT)
            end = line.find("|", label_start)
            if end < 0:
                return None
            return line[label_start:end].rstrip(), line[end + 1:]
        at = line.find(_VALIDATION_MARK, bar)
    return None


def _floats(*texts: str) -> list[float] | None:
    try:
        return [float(t) for t in texts]
    except ValueError:
        return None


def parse_log(text: str) -> ParsedLog:
    """Parse a Megatron-LM (any era) or course training log. Unrecognised lines are ignored.

    Linear in the length of ``text`` (see the module docstring); a ``using world size`` line
    whose sizes are impossible raises ``ValueError`` naming them."""
    if not isinstance(text, str):
        raise rules.UsageError(f"parse_log takes the log text (str), got {type(text).__name__}; "
                               f"read the file first, e.g. parse_log(Path(p).read_text()), or use parse_log_file(p)")
    return _parse_lines(_iter_lines([text]))


def parse_log_file(path) -> ParsedLog:
    """Parse the log at ``path``, streamed: memory stays bounded whatever its size or line lengths.

    A file that is not UTF-8 text (binary, NUL bytes, another encoding) or whose header is
    impossible raises ``ValueError`` in one line naming the file."""
    path = Path(path)
    try:
        return _parse_lines(_iter_lines(_text_chunks(path)))
    except UnicodeDecodeError as exc:
        raise rules.UsageError(f"{path}: not UTF-8 text ({exc.reason}: byte 0x{exc.object[exc.start]:02x}), so not a "
                               f"training log; give the log as written by Megatron-LM or course_lib.train") from None
    except OSError as exc:
        raise rules.UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise rules.UsageError(f"{path}: {exc}") from None


def _text_chunks(path: Path) -> Iterator[str]:
    # newline="": no newline translation; _iter_lines splits every kind of line break itself
    with open(path, encoding="utf-8", newline="") as f:
        while chunk := f.read(_FILE_CHUNK_CHARS):
            if "\0" in chunk:
                raise rules.UsageError("binary file (it holds NUL bytes), not a training log; give the log as written "
                                       "by Megatron-LM or course_lib.train")
            yield chunk


def _parse_lines(lines: Iterable[str | None]) -> ParsedLog:
    out = ParsedLog()
    in_args = False
    for raw in lines:
        if raw is None:
            out.long_lines_skipped += 1
            continue
        line = _strip_prefix(raw)
        if in_args:
            if _ARGS_END.match(line.strip()):
                in_args = False
            else:
                m = _ARG_LINE.match(line)
                if m:
                    out.args[m.group(1)] = _value(m.group(2))
            continue
        if _ARGS_START.match(line.strip()):
            in_args = True
            continue
        if "using world size" in line and not out.config:
            cfg = _parse_world_line(line)
            if cfg:
                out.config = cfg
            continue
        m = _ITERATION.search(line)
        if m and _LOSS_AT not in line:
            rec = {"iteration": int(m["it"]), "train_iters": int(m["total"]), "timestamp": m["ts"]}
            rec.update(_fields(line[m.end():], ITERATION_KEYS))
            out.iterations.append(rec)
            continue
        if "memory (MB)" in line:
            found = _match_memory(line)
            if found:
                rank, label, rest = found
                label = label.strip()
                it = _MEMORY_ITERATION.search(label)
                rec = {"rank": rank, "iteration": int(it.group(1) or it.group(2)) if it else None,
                       "label": label.strip("()")}
                rec.update(_fields(rest, MEMORY_KEYS))
                out.memory.append(rec)
            continue
        m = _PARAMS.search(line)
        if m and all(_INTEGER.fullmatch(r.strip()) for r in m["ranks"].split(",")):
            names = [_slug(n) for n in m["names"].split(",")]
            ranks = [int(r) for r in m["ranks"].split(",")]
            rec = dict(zip(names, ranks))
            rec["num_parameters"] = int(m["n"])
            out.parameters.append(rec)
            continue
        m = _THEORY.search(line)
        sizes = _floats(m["w"], m["a"], m["t"]) if m else None
        if sizes:
            out.theoretical_memory = dict(zip(("weight_and_optimizer_mb", "activation_mb", "total_mb"), sizes))
            continue
        found = _match_validation(line)
        if found:
            label, rest = found
            it = _VALIDATION_ITERATION.search(label)
            rec = {"iteration": int(it.group(1)) if it else None, "label": label}
            rec.update(_fields(rest, {}))
            out.validation.append(rec)
    _fill_config(out)
    out.era = _era(out.iterations)
    return out


def _fill_config(out: ParsedLog) -> None:
    cfg, args = out.config, out.args
    for key, arg in _ARGS_PARALLEL.items():
        if key not in cfg and isinstance(args.get(arg), int):
            cfg[key] = args[arg]
    for arg in _CONFIG_FROM_ARGS:
        if arg in args and arg not in cfg:
            cfg[arg] = args[arg]
    if "global_batch_size" not in cfg and out.iterations and "global_batch_size" in out.iterations[-1]:
        cfg["global_batch_size"] = out.iterations[-1]["global_batch_size"]
    gbs, mbs, dp = cfg.get("global_batch_size"), cfg.get("micro_batch_size"), cfg.get("dp")
    if all(isinstance(v, int) and v > 0 for v in (gbs, mbs, dp)):
        try:
            cfg["num_microbatches"] = rules.num_microbatches(gbs, mbs, dp)
        except ValueError:
            pass                                   # a log whose sizes disagree: no count to report


# ============================================================================ writers
# The lines the course's trainer prints (course_lib.train), in Megatron 0.16's form (see the module
# docstring). Each returns the line, without a newline; print_line writes it.

_MB = 1024.0 * 1024.0


def print_line(line: str, stream=None) -> None:
    """Write one log line with a single ``write`` (default ``sys.stdout``): several ranks share
    torchrun's stdout, and ``print`` writes the text and its newline separately when output is
    unbuffered, so another rank's line could land between them."""
    stream = sys.stdout if stream is None else stream
    stream.write(line + "\n")
    stream.flush()


def world_size_line(world_size: int, dp: int, cp: int, tp: int, pp: int) -> str:
    """``validate_args``'s first line (``megatron/training/arguments.py``, core 0.13+ wording)."""
    return (f"using world size: {world_size}, data-parallel size: {dp}, context-parallel size: {cp}, "
            f"hierarchical context-parallel sizes: None, tensor-model-parallel size: {tp}, "
            f"pipeline-model-parallel size: {pp}")


def arguments_lines(args: dict, title: str = "arguments") -> list[str]:
    """Megatron's ``_print_args`` block: ``'  {} {} {}'.format(name, '.' * (48 - len(name)), value)``
    for each of ``args`` (a dict, e.g. ``vars(namespace)``), sorted case-insensitively, between its
    two rulers."""
    lines = ["  {} {} {}".format(k, "." * (48 - len(k)), v) for k, v in args.items()]
    return ([f"------------------------ {title} ------------------------"]
            + sorted(lines, key=lambda x: x.lower())
            + [f"-------------------- end of {title} ---------------------"])


def parameters_line(tp_rank: int, pp_rank: int, count: int) -> str:
    """``get_model``'s line (``megatron/training/training.py``): this rank's parameter count."""
    return f" > number of parameters on (tensor, pipeline) model parallel rank ({tp_rank}, {pp_rank}): {count}"


def iteration_line(iteration: int, train_iters: int, *, consumed_samples: int, elapsed_ms: float,
                   learning_rate: float, global_batch_size: int, lm_loss: float, grad_norm: float,
                   loss_scale: float = 1.0, skipped_iterations: int = 0, nan_iterations: int = 0,
                   timestamp: str | None = None, extra_losses: dict | None = None) -> str:
    """``training_log``'s iteration line (``megatron/training/training.py``, core 0.16+: the
    timestamp has microseconds). ``timestamp``: ``'%Y-%m-%d %H:%M:%S.%f'``, default now.
    ``extra_losses``: ``{name: value}`` printed right after ``lm loss`` in the same ``:.6E`` form --
    the MoE losses (``load_balancing_loss``, ``z_loss``) that Megatron main's ``track_moe_metrics``
    adds to ``total_loss_dict`` (``megatron/core/transformer/moe/moe_logging.py``); the parser reads
    each back under its name."""
    extra = "".join(f" {name}: {value:.6E} |" for name, value in (extra_losses or {}).items())
    if timestamp is None:
        timestamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
    return (f" [{timestamp}] iteration {iteration:8d}/{train_iters:8d} |"
            f" consumed samples: {consumed_samples:12d} |"
            f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
            f" learning rate: {learning_rate:.6E} |"
            f" global batch size: {global_batch_size:5d} |"
            f" lm loss: {lm_loss:.6E} |{extra}"
            f" loss scale: {loss_scale:.1f} |"
            f" grad norm: {grad_norm:.3f} |"
            f" number of skipped iterations: {skipped_iterations:3d} |"
            f" number of nan iterations: {nan_iterations:3d} |")


def memory_line(rank: int, iteration: int, *, allocated: float, max_allocated: float, reserved: float = 0.0,
                max_reserved: float = 0.0, source: str | None = None) -> str:
    """``report_memory``'s line (``megatron/training/utils.py``, core 0.16+: ``:.2f``), from bytes.
    ``source``: what was measured when it is not CUDA's allocator (the course's trailing field,
    e.g. ``tracked tensor bytes``); None for CUDA's numbers, as Megatron prints them."""
    line = (f"[Rank {rank}] (after {iteration} iterations) memory (MB)"
            f" | allocated: {allocated / _MB:.2f} | max allocated: {max_allocated / _MB:.2f}"
            f" | reserved: {reserved / _MB:.2f} | max reserved: {max_reserved / _MB:.2f}")
    return line if source is None else f"{line} | source: {source}"
