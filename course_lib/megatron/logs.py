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

The contract for the course's own logs (``course_lib.train``): print these lines,
exactly in Megatron's current (0.16+) form, and this parser reads them::

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
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field

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

_PREFIX = re.compile(r"^(?:\[[A-Za-z_]+\d+\]:|\d+: )")
_TIMESTAMP = r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\]"
_ITERATION = re.compile(rf"(?:{_TIMESTAMP}\s*)?iteration\s+(?P<it>\d+)/\s*(?P<total>\d+)\s*\|(?P<rest>.*)$")
_MEMORY = re.compile(r"(?:\[Rank (?P<rank>\d+)\]\s*)?(?P<label>\([^)]*\)|\S.*?) memory \(MB\)\s*\|(?P<rest>.*)$")
_WORLD = re.compile(r"using world size:\s*(?P<world>\d+)")
_WORLD_V1 = re.compile(r"using world size:\s*(?P<world>\d+) and model-parallel size:\s*(?P<mp>\d+)")
_WORLD_FIELDS = {
    "dp": re.compile(r"data-parallel[- ]size:\s*(\d+)"),
    "cp": re.compile(r"(?<!hierarchical )context-parallel size:\s*(\d+)"),
    "tp": re.compile(r"(?<!encoder-)tensor-model-parallel size:\s*(\d+)"),
    "pp": re.compile(r"(?<!encoder-)pipeline-model-parallel size:\s*(\d+)"),
    "encoder_tp": re.compile(r"encoder-tensor-model-parallel size:\s*(\d+)"),
    "encoder_pp": re.compile(r"encoder-pipeline-model-parallel size:\s*(\d+)"),
}
_HIER_CP = re.compile(r"hierarchical context-parallel sizes:\s*(None|\[[^\]]*\])")
_ARGS_START = re.compile(r"^-{3,} arguments -{3,}\s*$")
_ARGS_END = re.compile(r"^-{3,} end of arguments -{3,}\s*$")
_ARG_LINE = re.compile(r"^\s+([A-Za-z_]\w*) \.* (.*)$")
_PARAMS = re.compile(r"number of parameters on \((?P<names>[^)]*)\) model parallel rank \((?P<ranks>[^)]*)\):\s*(?P<n>\d+)")
_THEORY = re.compile(r"Theoretical memory footprints: weight and optimizer=(?P<w>[\d.]+) MB, "
                     r"activation=(?P<a>[\d.]+) MB, total=(?P<t>[\d.]+) MB")
_VALIDATION = re.compile(r"validation(?P<suffix>[^|]*?) loss at (?P<label>.*?)\s*\|(?P<rest>.*)$")

# arguments copied into .config when the arguments block is printed
_CONFIG_FROM_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                     "global_batch_size", "sequence_parallel", "virtual_pipeline_model_parallel_size",
                     "train_iters", "params_dtype")
_ARGS_PARALLEL = {"world_size": "world_size", "tp": "tensor_model_parallel_size",
                  "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size", "dp": "data_parallel_size"}


def _slug(name: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", name.strip().lower()).strip("_")


def _number(text: str):
    """int, float (incl. nan/inf) or None for non-numbers."""
    t = text.strip()
    if re.fullmatch(r"[+-]?\d+", t):
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
        return {"world_size": world, "tp": mp, "pp": 1, "cp": 1, "dp": world // mp if mp else None}
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
    if "dp" not in cfg:
        cfg["dp"] = cfg["world_size"] // (cfg["tp"] * cfg["pp"] * cfg["cp"])
    return cfg


def _era(iterations: list[dict]) -> str:
    if not iterations:
        return "unknown"
    ts = iterations[0].get("timestamp")
    if ts is None:
        return "pre-0.6"
    return "0.16+" if "." in ts else "0.6-0.15"


def parse_log(text: str) -> ParsedLog:
    """Parse a Megatron-LM (any era) or course training log. Unrecognised lines are ignored."""
    if not isinstance(text, str):
        raise ValueError(f"parse_log takes the log text (str), got {type(text).__name__}; "
                         f"read the file first, e.g. parse_log(Path(p).read_text())")
    out = ParsedLog()
    in_args = False
    for raw in text.splitlines():
        line = _strip_prefix(raw.rstrip("\n"))
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
        if m and " loss at " not in line:
            rec = {"iteration": int(m["it"]), "train_iters": int(m["total"]), "timestamp": m["ts"]}
            rec.update(_fields(m["rest"], ITERATION_KEYS))
            out.iterations.append(rec)
            continue
        if "memory (MB)" in line:
            m = _MEMORY.search(line)
            if m:
                label = m["label"].strip()
                it = re.search(r"(?:after (\d+) iterations|iteration (\d+))", label)
                rec = {"rank": int(m["rank"]) if m["rank"] is not None else None,
                       "iteration": int(it.group(1) or it.group(2)) if it else None,
                       "label": label.strip("()")}
                rec.update(_fields(m["rest"], MEMORY_KEYS))
                out.memory.append(rec)
            continue
        m = _PARAMS.search(line)
        if m:
            names = [_slug(n) for n in m["names"].split(",")]
            ranks = [int(r) for r in m["ranks"].split(",")]
            rec = dict(zip(names, ranks))
            rec["num_parameters"] = int(m["n"])
            out.parameters.append(rec)
            continue
        m = _THEORY.search(line)
        if m:
            out.theoretical_memory = {"weight_and_optimizer_mb": float(m["w"]), "activation_mb": float(m["a"]),
                                      "total_mb": float(m["t"])}
            continue
        m = _VALIDATION.search(line)
        if m:
            label = m["label"]
            it = re.search(r"iteration (\d+)", label)
            rec = {"iteration": int(it.group(1)) if it else None, "label": label}
            rec.update(_fields(m["rest"], {}))
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
    if all(isinstance(v, int) and v > 0 for v in (gbs, mbs, dp)) and gbs % (mbs * dp) == 0:
        cfg["num_microbatches"] = gbs // (mbs * dp)
