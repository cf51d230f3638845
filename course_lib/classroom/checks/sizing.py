"""Checkers for sizing a real run from the papers (Lab 06): the parameter count of Eq. 2, and the model
states per GPU with and without Megatron's distributed optimizer.

Each checker calls the student's function on the ten rows of Narayanan et al. 2021's Table 1 and on
small shapes where every term shows, compares with :mod:`course_lib.sizing` (the references, tested
against the papers), prints one verdict line and, when wrong, the hint that names the mistake: the
checker subtracts the answer from the reference and recognises the missing (or extra) term, or
matches the answer against the usual wrong accountings. Numbers of any real type are accepted
within a relative tolerance (``Fraction``, numpy, a 0-d tensor, ``int``); NaN and infinities are
not. A stub that still raises ``NotImplementedError`` gets "not attempted yet"; a checker never
raises; a monkeypatch is undone; an answer that is the course's own function is told so.
"""

from __future__ import annotations

from course_lib import sizing
from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import drawn_rng, same_number

__all__ = ["check_gpt_parameters", "check_model_state_bytes"]

# (layers, hidden, vocabulary, sequence): Narayanan Table 1 (V = 51,200, s = 2048), then small shapes.
TABLE1_SHAPES = [(24, 2304), (30, 3072), (36, 4096), (40, 6144), (48, 8192), (60, 10240), (80, 12288),
                 (96, 16384), (105, 20480), (128, 25600)]
PARAMETER_CASES = [(2, 8, 100, 16), (3, 16, 50, 20)] + [(l, h, 51200, 2048) for l, h in TABLE1_SHAPES]
REL = 1e-9


def drawn_parameter_cases(rng, count: int = 2) -> list:
    """``count`` GPT shapes ``(layers, hidden, vocabulary, sequence)`` drawn for this run."""
    return [(rng.randint(2, 120), 64 * rng.randint(2, 400), rng.randint(1000, 260000), rng.choice((512, 1024, 2048,
                                                                                                   4096, 8192)))
            for _ in range(count)]


def drawn_state_cases(rng, count: int = 2) -> list:
    """``count`` cases ``(params on the GPU, tp, dp, cp, distributed optimizer)`` drawn for this run, CP > 1 and
    the distributed optimizer on in each (where the DP x CP sharding shows)."""
    return [(rng.randint(10_000, 5_000_000), rng.choice((1, 2, 4, 8)), rng.randint(2, 16), rng.choice((2, 4)), True)
            for _ in range(count)]


def _parameter_terms(layers, h, vocab, seq) -> list:
    """(what the answer is missing, hint) for each term of Eq. 2 a count can leave out or add."""
    return [
        (layers * 13 * h, "the biases and LayerNorms: 13h per layer -- a bias per linear layer (3h + h + 4h + h) "
                          "and a gain and a bias per LayerNorm (2 x 2h)"),
        (layers * 9 * h, "the biases: every linear layer has one, the size of its output -- 3h + h + 4h + h = 9h "
                         "per layer"),
        (layers * 4 * h, "the two LayerNorms: each has a gain and a bias of h numbers, 4h per layer"),
        (layers * 2 * h, "half of the LayerNorm parameters: each of the 2 LayerNorms has a gain *and* a bias"),
        ((vocab + seq) * h, "the embeddings: the word embedding V·h and the position embedding s·h"),
        (vocab * h, "the word embedding, V·h (counted once: the output layer shares it)"),
        (seq * h, "the learned position embedding, s·h"),
        (-vocab * h, "the output layer is tied to the word embedding: Megatron (and Eq. 2) count V·h once"),
        (-2 * h, "Eq. 2 leaves out the final LayerNorm (2h): count the paper's way to compare with Table 1"),
        (layers * 4 * h * h, "the MLP goes h -> 4h -> h: its two weight matrices hold 4h² each, 8h² together"),
        (layers * 2 * h * h, "the QKV projection maps h -> 3h: 3h² weights, 3h biases"),
    ]


def _parameter_hint(value: float, layers, h, vocab, seq) -> str:
    want = sizing.num_parameters(layers, h, vocab, seq)
    if abs(value * 1e9 - want) <= REL * want or abs(value * 1e6 - want) <= REL * want:
        return "return the count itself, not billions or millions"
    if abs(value - 12 * layers * h * h) <= REL * want:
        return "12lh² is only the weight matrices: add the biases, the LayerNorms and the embeddings"
    missing = want - value
    for term, hint in _parameter_terms(layers, h, vocab, seq):
        if abs(missing - term) <= REL * want:
            return ("the count misses " if term > 0 else "the count has an extra term -- ") + hint
    return ("per layer: four weight matrices (3h², h², 4h², 4h²), their biases (3h + h + 4h + h) and two "
            "LayerNorms (2h each); then V·h + s·h once")


@exercise("gpt_parameters")
def check_gpt_parameters(fn) -> bool:
    """``fn(num_layers, hidden_size, vocab_size, seq_length) -> parameters``: Narayanan et al. 2021's Eq. 2,
    ``12lh² + 13lh + (V + s)h`` -- checked on Table 1's ten models and on small shapes."""
    if is_course_answer(fn):
        return False
    for layers, h, vocab, seq in PARAMETER_CASES + drawn_parameter_cases(drawn_rng()):
        args = f"gpt_parameters({layers}, {h}, {vocab}, {seq})"
        got, err = checked_call(fn, layers, h, vocab, seq, references=references_for("gpt_parameters"))
        if err == "todo":
            return not_attempted("gpt_parameters")
        if err:
            print(f"✗ {args}: {err}")
            return False
        want = sizing.num_parameters(layers, h, vocab, seq)
        verdict = same_number(got, want, rel=REL)
        if verdict:
            continue
        print(f"✗ {args}: " + (f"returned {verdict.value:,.0f}, not Eq. 2's count" if verdict.value is not None
                               else verdict.reason))
        if verdict.value is not None:
            print(f"  hint: {_parameter_hint(verdict.value, layers, h, vocab, seq)}")
        return False
    layers, h = TABLE1_SHAPES[-1]
    print(f"✓ gpt_parameters: Eq. 2 on all ten rows of Table 1, two small shapes and two drawn for this run; the "
          f"1T row has "
          f"{sizing.num_parameters(layers, h, 51200, 2048) / 1e9:.1f}B parameters (the table prints 1008.0)")
    return True


# ------------------------------------------------------------------ Exercise 2: model states per GPU

# (params on the GPU, tp, dp, cp, distributed optimizer): the 1T row's first stage, then shapes where
# DP and CP differ, and a DP of 5 (12/5 is not a whole number of bytes).
STATE_CASES = [(1_000_000, 8, 6, 1, False), (1_000_000, 8, 6, 1, True), (3_000_000, 4, 4, 2, True),
               (2_000_000, 2, 1, 4, True), (700_001, 1, 5, 1, True), (123_456, 4, 8, 2, False)]


def _state_bytes(params, dp, cp, distributed) -> float:
    """The reference: Megatron's bf16 parameters with fp32 gradients, ``sizing.megatron_optimizer_bytes_per_param``."""
    return params * sizing.megatron_optimizer_bytes_per_param(dp * cp, distributed, "bf16", "fp32").total


def _state_mistakes(params, tp, dp, cp, distributed) -> list:
    """(what that mistake returns, hint), for the usual wrong accountings of one case."""
    d = dp * cp
    shard = (lambda by: 12 / by) if distributed else (lambda by: 12)
    return [
        (params * 16, "16 bytes is ZeRO's count with 16-bit gradients; Megatron's bf16 training keeps fp32 "
                      "gradients: 2 (bf16 weight) + 4 (fp32 gradient) + 12 (fp32 master weight and two Adam "
                      "moments) = 18"),
        (params * (16 / d if distributed else 16), "16 bytes is ZeRO's count with 16-bit gradients; Megatron's "
                                                   "bf16 training keeps fp32 gradients: 2 + 4 + 12"),
        (params * (2 + 4 + shard(dp)), "Megatron shards the optimizer over the data-parallel *and* context-"
                                       "parallel ranks (the DP × CP group): divide the 12 bytes by dp·cp"),
        (params * (2 + 4 + shard(tp * d)), "TP already split the weights (params_on_gpu counts this GPU's share): "
                                           "the optimizer is sharded over the replicas that hold the *same* "
                                           "weights, DP × CP, not TP"),
        (params * (2 + 4 + shard(tp)), "the optimizer state is not sharded by TP -- TP already split the weights; "
                                       "the distributed optimizer shards over DP × CP"),
        (params * 18 / d, "the distributed optimizer (ZeRO-1) shards only the optimizer's 12 bytes; the bf16 weight "
                          "and the fp32 gradient stay whole on every GPU: 6 + 12/d"),
        (params * (2 + 12 / d + 4 / d), "the distributed optimizer (ZeRO-1) shards only the optimizer's 12 bytes; "
                                        "the gradient buffer stays whole (a reduce-scatter in place): 6 + 12/d"),
        (params * 18, "with the distributed optimizer the optimizer's 12 bytes are divided by d = dp·cp: 6 + 12/d"),
        (params * (4 + 16 / d if distributed else 20), "that is the fp16-parameters-with-fp16-gradients row (an "
                                                       "fp32 gradient copy in the optimizer); bf16 keeps fp32 "
                                                       "gradients: 18, or 6 + 12/d"),
        (params * (8 + 8 / d if distributed else 16), "that is the fp32 row; bf16 weights and fp32 gradients give "
                                                      "18, or 6 + 12/d"),
        (params / tp * (6 + shard(d)), "params_on_gpu is already this GPU's share after TP and PP: do not "
                                       "divide it by TP again"),
        (_state_bytes(params, dp, cp, distributed) / 1e9, "return bytes, not GB"),
    ]


@exercise("model_state_bytes_per_gpu")
def check_model_state_bytes(fn) -> bool:
    """``fn(params_on_gpu, tp, dp, cp, distributed_optimizer) -> bytes`` of weights, gradients and optimizer
    state on one GPU for Megatron's bf16 training with Adam (18 bytes per parameter, 6 + 12/(dp·cp) with
    ``--use-distributed-optimizer``)."""
    if is_course_answer(fn):
        return False
    for params, tp, dp, cp, distributed in STATE_CASES + drawn_state_cases(drawn_rng()):
        args = f"model_state_bytes_per_gpu({params:,}, tp={tp}, dp={dp}, cp={cp}, distributed_optimizer={distributed})"
        got, err = checked_call(fn, params, tp, dp, cp, distributed,
                                references=references_for("model_state_bytes_per_gpu"))
        if err == "todo":
            return not_attempted("model_state_bytes_per_gpu")
        if err:
            print(f"✗ {args}: {err}")
            return False
        want = _state_bytes(params, dp, cp, distributed)
        verdict = same_number(got, want, rel=REL, abs_tol=1.0)  # rounded to whole bytes is right too
        if verdict:
            continue
        shown = (f"returned {verdict.value:,.1f} ({verdict.value / params:g} bytes per parameter)"
                 if verdict.value is not None else verdict.reason)
        print(f"✗ {args}: {shown}")
        if verdict.value is not None:
            for wrong, hint in _state_mistakes(params, tp, dp, cp, distributed):
                if abs(verdict.value - wrong) <= REL * max(abs(wrong), 1.0):
                    print(f"  hint: {hint}")
                    break
            else:
                print("  hint: per parameter: 2 (bf16 weight) + 4 (fp32 gradient) + 12 (fp32 master weight, two Adam "
                      "moments), the 12 divided by dp·cp with the distributed optimizer")
        return False
    print(f"✓ model_state_bytes_per_gpu: 18 bytes per parameter, 6 + 12/(dp·cp) with the distributed optimizer, on "
          f"{len(STATE_CASES) + 2} cases (2 drawn for this run) -- the 1T row's first stage at DP 6: "
          f"{sizing.megatron_optimizer_bytes_per_param(6, True, 'bf16', 'fp32').total:.0f} bytes per parameter")
    return True
