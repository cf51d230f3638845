"""Which layers are MoE: Megatron's ``--moe-layer-freq`` (pure Python, no torch).

Used by the model (:mod:`course_lib.moe.transformer`), the trainer's flags and the sizing
calculators (:mod:`course_lib.sizing.moe`).
"""

from __future__ import annotations

from course_lib import rules

__all__ = ["moe_layer_pattern", "parse_moe_layer_freq"]

MAX_PATTERN_CHARS = 1_000    # Megatron's own examples are ~20 characters: "([1]*3+[0]*1)*24"
MAX_PATTERN_LAYERS = 10_000  # the deepest published GPTs have ~100-200 layers


def moe_layer_pattern(num_layers: int, moe_layer_freq=1) -> list[int]:
    """Megatron's ``--moe-layer-freq``: 1 for an MoE layer, 0 for a dense one, per layer (0-based).

    An int ``k``: layer ``i`` is MoE when ``i % k == 0`` (``k = 1``: every layer); a list: the pattern
    itself, one entry per layer (``megatron/core/models/gpt/gpt_layer_specs.py``,
    ``get_gpt_decoder_block_spec``). ``moe_layer_pattern(4, 2) == [1, 0, 1, 0]``."""
    num_layers = rules.integer("num-layers", num_layers)
    if isinstance(moe_layer_freq, bool):
        raise rules.UsageError(f"moe-layer-freq={moe_layer_freq!r} must be an int k or a list of 0/1 per layer")
    if isinstance(moe_layer_freq, int):
        k = rules.integer("moe-layer-freq", moe_layer_freq)
        return [1 if i % k == 0 else 0 for i in range(num_layers)]
    pattern = list(moe_layer_freq) if isinstance(moe_layer_freq, (list, tuple)) else None
    if pattern is None or any(v not in (0, 1) or isinstance(v, bool) for v in pattern):
        raise rules.UsageError(f"moe-layer-freq={moe_layer_freq!r} must be an int k or a list of 0/1 per layer, "
                               f"e.g. [1, 0, 1, 0]")
    if len(pattern) != num_layers:
        raise rules.UsageError(f"moe-layer-freq has {len(pattern)} entries but num-layers={num_layers}: give one 0/1 "
                               f"per layer")
    return pattern


def parse_moe_layer_freq(text):
    """``--moe-layer-freq`` from the command line: ``"2"`` -> 2, ``"([1]*3+[0]*1)*2"`` -> a 0/1 list.

    Megatron's ``moe_freq_type`` evaluates the string as Python; here only list displays of integers,
    ``+`` and ``*`` by an integer are accepted (nothing else is run)."""
    import ast

    if isinstance(text, (int, list, tuple)):
        return text
    source = str(text).strip()
    refusal = (f"moe-layer-freq={source[:40]!r}{'...' if len(source) > 40 else ''} must be an integer or a list "
               f"pattern such as '([1]*3+[0]*1)*2' (lists of 0/1, + and * only)")
    if len(source) > MAX_PATTERN_CHARS:
        raise rules.UsageError(f"{refusal}, at most {MAX_PATTERN_CHARS} characters (this one has {len(source)})")

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.List):
            return checked([value(e) for e in node.elts])
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) == isinstance(right, list):
                return checked(left + right) if isinstance(left, list) else left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                items, times = (left, right) if isinstance(left, list) else (right, left)
                if times >= 0:
                    return checked(items * times if len(items) * times <= MAX_PATTERN_LAYERS else None)
            if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
                return left * right if abs(left * right) <= MAX_PATTERN_LAYERS else checked(None)
        raise rules.UsageError(refusal)

    def checked(pattern):
        """``pattern``, unless it expands past MAX_PATTERN_LAYERS (``None``: it would)."""
        if pattern is None or len(pattern) > MAX_PATTERN_LAYERS:
            raise rules.UsageError(f"{refusal}; this one expands past {MAX_PATTERN_LAYERS} layers")
        return pattern

    try:
        tree = ast.parse(source, mode="eval").body
        return value(tree)
    except (SyntaxError, RecursionError, MemoryError):
        raise rules.UsageError(refusal) from None
