"""Input checks shared by the sizing calculators: one-line ValueErrors that name the rule and a fix.

Names in messages follow Megatron-LM's flags (``--tensor-model-parallel-size`` ...), so an error
reads the same as the one a real launch would give.
"""

from __future__ import annotations

from numbers import Real

RECOMPUTE_CHOICES = ("none", "selective", "full")


def positive_int(name: str, value) -> int:
    """``value`` as an int, or ValueError unless it is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (>= 1)")
    return value


def non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer (>= 0)")
    return value


def positive_number(name: str, value) -> float:
    """``value`` as a number, or ValueError unless it is a real number > 0."""
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a positive number (> 0)")
    return value


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def divisible(name: str, value: int, by_name: str, by: int, change_value: bool = False) -> None:
    """ValueError ``"<name>=<value> is not divisible by <by_name>=<by>; <fix>"`` unless by | value.

    The fix lists the divisors of ``value`` to choose ``by_name`` from, or, with
    ``change_value=True`` (e.g. a batch size), the nearest multiples of ``by``.
    """
    if value % by:
        if change_value:
            below, above = value - value % by, value - value % by + by
            fix = f"use a multiple of {by} for {name}, e.g. {below or above} or {above}"
        else:
            fix = f"choose {by_name} among the divisors of {value}: {_divisors(value)}"
        raise ValueError(f"{name}={value} is not divisible by {by_name}={by}; {fix}")


def recompute_mode(recompute) -> str:
    """Normalise ``recompute``: True -> "full", False/None -> "none", or one of RECOMPUTE_CHOICES."""
    if recompute is True:
        return "full"
    if recompute is False or recompute is None:
        return "none"
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(
            f"recompute={recompute!r} is not one of {', '.join(RECOMPUTE_CHOICES)} "
            "(Megatron: --recompute-granularity selective|full, or no flag for none)"
        )
    return recompute


def model_shape(num_layers, hidden_size, num_heads=None, vocab_size=None, seq_length=None) -> None:
    """Check a GPT shape: positive sizes, and hidden_size divisible by the number of heads."""
    positive_int("num_layers", num_layers)
    positive_int("hidden_size", hidden_size)
    if num_heads is not None:
        positive_int("num_attention_heads", num_heads)
        divisible("hidden_size", hidden_size, "num_attention_heads", num_heads)
    if vocab_size is not None:
        positive_int("vocab_size", vocab_size)
    if seq_length is not None:
        positive_int("seq_length", seq_length)
