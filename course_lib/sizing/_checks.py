"""Input checks of the sizing calculators: :mod:`course_lib.rules`' value rules under the names the
formulas use, plus the two checks that are the calculators' own (the recompute mode, a GPT shape).

Every layout rule (heads % tp, layers % pp, seq % 2·cp, micro-batches, ...) is called from
:mod:`course_lib.rules` directly, so an error reads the same as the one a real launch, the
trainer or ``megatron-cmd`` gives.
"""

from __future__ import annotations

from course_lib import rules

RECOMPUTE_CHOICES = ("none", "selective", "full")


def positive_int(name: str, value) -> int:
    """``value`` as an int, or ValueError unless it is an integer >= 1."""
    return rules.integer(name, value)


def non_negative_int(name: str, value) -> int:
    """``value`` as an int, or ValueError unless it is an integer >= 0."""
    return rules.integer(name, value, 0)


def positive_number(name: str, value) -> float:
    """``value``, or ValueError unless it is a finite real number > 0."""
    return rules.number(name, value, 0.0, low_open=True)


def recompute_mode(recompute) -> str:
    """Normalise ``recompute``: True -> "full", False/None -> "none", or one of RECOMPUTE_CHOICES."""
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in RECOMPUTE_CHOICES:
        raise rules.UsageError(
            f"recompute={recompute!r} is not one of {', '.join(RECOMPUTE_CHOICES)} "
            "(Megatron: --recompute-granularity selective|full, or no flag for none)"
        )
    return recompute


def model_shape(num_layers, hidden_size, num_heads=None, vocab_size=None, seq_length=None) -> None:
    """Check a GPT shape: positive sizes, and hidden_size divisible by the number of heads."""
    rules.integer("num_layers", num_layers)
    rules.integer("hidden_size", hidden_size)
    if num_heads is not None:
        rules.integer("num_attention_heads", num_heads)
        rules.hidden_divisible_by_heads(hidden_size, num_heads)
    if vocab_size is not None:
        rules.integer("vocab_size", vocab_size)
    if seq_length is not None:
        rules.integer("seq_length", seq_length)
