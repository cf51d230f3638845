"""Parameters, FLOPs, training time and FLOPs utilisation of a GPT, from the papers' closed forms.

Sources (symbols as in the papers: l or L layers, h hidden size, a heads, s sequence length,
V or v vocabulary size, B global batch size in sequences, n GPUs, T training tokens,
X achieved FLOP/s per GPU):

* Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (arXiv:2104.04473), §5.1 and Appendix: Eq. 2 (parameters), Eq. 3 (FLOPs per
  iteration with full activation recomputation), Eq. 4 (training time ~ 8TP/(nX)).
* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198), Appendix A: Eq. 7 (model FLOPs, no recomputation), Eq. 8 (hardware FLOPs
  with selective recomputation), and §6.3 for the MFU/HFU definitions (after Chowdhery et al.).

The model is the GPT of both papers: 4h GeLU MLP, full multi-head attention, biases, two
LayerNorms per layer, learned position embeddings, output layer tied to the word embedding.
Only GEMMs are counted as FLOPs (1 multiply-add = 2 FLOPs), as in the papers. Everything is
exact integer arithmetic; no torch.
"""

from __future__ import annotations

from course_lib import rules
from course_lib.sizing import _checks


def parameter_breakdown(num_layers: int, hidden_size: int, vocab_size: int, seq_length: int,
                        ffn_hidden_size: int | None = None) -> dict:
    """The terms of Narayanan Eq. 2, one weight matrix at a time (counts of parameters).

    Per transformer layer (h = hidden_size): QKV projection ``3h^2 + 3h`` (weight + bias), attention
    output projection ``h^2 + h``, MLP h->4h ``4h^2 + 4h``, MLP 4h->h ``4h^2 + h``, two LayerNorms
    ``4h`` (gain + bias each): ``12h^2 + 13h`` in all. Embeddings: word ``V*h`` (shared with the
    output layer), position ``s*h``. Eq. 2 leaves out the final LayerNorm (``2h``), and so do we;
    it is listed as ``final_layernorm_not_in_eq2`` for exact counts of a real model.
    ``ffn_hidden_size`` (Megatron's ``--ffn-hidden-size``, default the paper's ``4h``) widens the
    MLP: h->f ``hf + f``, f->h ``fh + h``.

    Returns a dict with ``per_layer`` (a dict of the five terms above), ``layers``
    (``num_layers * sum(per_layer)``), ``word_embedding``, ``position_embedding``, ``total``
    (equal to :func:`num_parameters`) and ``final_layernorm_not_in_eq2``.
    """
    _checks.model_shape(num_layers, hidden_size, vocab_size=vocab_size, seq_length=seq_length)
    h = hidden_size
    f = _ffn(ffn_hidden_size, h)
    per_layer = {
        "qkv": 3 * h * h + 3 * h,
        "attention_proj": h * h + h,
        "mlp_fc1": h * f + f,
        "mlp_fc2": f * h + h,
        "layernorms": 4 * h,
    }
    layers = num_layers * sum(per_layer.values())
    word, position = vocab_size * h, seq_length * h
    return {
        "per_layer": per_layer,
        "layers": layers,
        "word_embedding": word,
        "position_embedding": position,
        "total": layers + word + position,
        "final_layernorm_not_in_eq2": 2 * h,
    }


def _ffn(ffn_hidden_size: int | None, hidden_size: int) -> int:
    return 4 * hidden_size if ffn_hidden_size is None else _checks.positive_int("ffn_hidden_size", ffn_hidden_size)


def num_parameters(num_layers: int, hidden_size: int, vocab_size: int, seq_length: int,
                   ffn_hidden_size: int | None = None) -> int:
    """Number of parameters P of a GPT, Narayanan et al. 2021 Eq. 2.

    ``P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 12 l h^2 + 13 l h + (V + s) h``.
    Table 1 of the paper lists this value for its ten models (1.7B ... 1008.0B), with V = 51200 and
    s = 2048. See :func:`parameter_breakdown` for where each term comes from.
    """
    return parameter_breakdown(num_layers, hidden_size, vocab_size, seq_length, ffn_hidden_size)["total"]


def parameters_per_stage(
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    seq_length: int,
    num_heads: int,
    tp: int = 1,
    pp: int = 1,
    ffn_hidden_size: int | None = None,
) -> list[int]:
    """Parameters held by one TP rank of each pipeline stage (a list of ``pp`` counts).

    Follows Megatron's layout: column/row-parallel linear weights, the QKV and MLP-h->4h biases
    and the vocab-parallel word embedding are split over ``tp``; the row-parallel biases (``2h``
    per layer), the LayerNorms (``4h`` per layer) and the position embedding are replicated on
    every TP rank. So one TP rank holds ``(12h^2 + 7h)/tp + 6h`` per layer. Each stage has
    ``num_layers/pp`` layers; the first adds the embeddings ``V*h/tp + s*h``, and with ``pp > 1``
    the last keeps its own copy of the word embedding, ``V*h/tp``, for the tied output layer
    (Megatron's ``shared_embedding_or_output_weight``). Like Eq. 2, the final LayerNorm (2h) is
    not counted. With ``tp = pp = 1`` the single entry equals :func:`num_parameters`.
    ``ffn_hidden_size`` (default ``4h``): the MLP's split weights and fc1 bias, ``(2hf + f)/tp``.
    """
    _checks.model_shape(num_layers, hidden_size, num_heads, vocab_size, seq_length)
    _checks.positive_int("tensor-model-parallel-size", tp)
    _checks.positive_int("pipeline-model-parallel-size", pp)
    rules.heads_divisible_by_tp(num_heads, tp)
    layers = rules.pipeline_split(num_layers, pp)
    rules.vocab_divisible_by_tp(vocab_size, tp)
    h, f = hidden_size, _ffn(ffn_hidden_size, hidden_size)
    rules.ffn_divisible_by_tp(f, tp)
    per_layer = (4 * h * h + 3 * h + 2 * h * f + f) // tp + 6 * h  # exact: tp | heads | h and tp | f
    stages = [n * per_layer for n in layers]
    word = vocab_size // tp * h
    stages[0] += word + seq_length * h
    if pp > 1:
        stages[-1] += word
    return stages


def parameters_per_rank(
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    seq_length: int,
    num_heads: int,
    tp: int = 1,
    pp: int = 1,
    ffn_hidden_size: int | None = None,
) -> int:
    """Parameters on the busiest rank: ``max(parameters_per_stage(...))`` (the first stage)."""
    return max(parameters_per_stage(num_layers, hidden_size, vocab_size, seq_length, num_heads, tp, pp,
                                    ffn_hidden_size))


def flops_per_iteration(
    global_batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    recompute="full",
) -> int:
    """FLOPs of one training iteration (forward + backward of ``global_batch_size`` sequences).

    Per layer the forward pass costs ``24 B s h^2 + 4 B s^2 h`` (QKV 6Bsh^2, scores 2Bs^2h,
    attention over values 2Bs^2h, projection 2Bsh^2, MLP 16Bsh^2), the backward twice that; the
    logit layer costs ``2BshV`` forward and ``4BshV`` backward.

    * ``recompute="full"`` (or True): Narayanan Eq. 3, which includes the extra forward pass:
      ``96 B s l h^2 (1 + s/(6h) + V/(16 l h)) = 96Bslh^2 + 16Bs^2lh + 6BshV``.
    * ``recompute="none"`` (or False): model FLOPs, Korthikanti Eq. 7:
      ``72 B L s h^2 (1 + s/(6h) + v/(12 h L)) = 72Bslh^2 + 12Bs^2lh + 6BshV``.
    * ``recompute="selective"``: hardware FLOPs, Korthikanti Eq. 8, as printed:
      ``72 B L s h^2 (1 + s/(3h) + v/(12 h L)) = 72Bslh^2 + 24Bs^2lh + 6BshV``.
      (Eq. 8 as printed doubles the s/(6h) term. Re-running only QK^T and attention-over-V
      (4Bs^2h per layer) would give s/(4.5h); the paper's own Table 5 HFU/MFU ratios and its
      "2.7% and 1.6% overhead" for GPT-3 and MT-NLG match s/(3h), so we keep the printed form.)
    """
    for name, value in (("global_batch_size", global_batch_size), ("seq_length", seq_length),
                        ("vocab_size", vocab_size)):
        _checks.positive_int(name, value)
    _checks.model_shape(num_layers, hidden_size)
    mode = _checks.recompute_mode(recompute)
    B, s, l, h, V = global_batch_size, seq_length, num_layers, hidden_size, vocab_size
    logits = 6 * B * s * h * V
    if mode == "full":
        return 96 * B * s * l * h * h + 16 * B * s * s * l * h + logits
    if mode == "selective":
        return 72 * B * s * l * h * h + 24 * B * s * s * l * h + logits
    return 72 * B * s * l * h * h + 12 * B * s * s * l * h + logits


def model_flops_per_iteration(global_batch_size, seq_length, num_layers, hidden_size, vocab_size) -> int:
    """Model FLOPs (Korthikanti Eq. 7): what the model needs, whatever is recomputed."""
    return flops_per_iteration(global_batch_size, seq_length, num_layers, hidden_size, vocab_size, "none")


def achieved_flops_per_gpu(flops: float, iteration_time: float, num_gpus: int) -> float:
    """FLOP/s per GPU, Narayanan's X (Table 1 "achieved teraFLOP/s per GPU"): ``F / (t n)``."""
    _checks.positive_number("flops", flops)
    _checks.positive_number("iteration_time", iteration_time)
    _checks.positive_int("num_gpus", num_gpus)
    return flops / (iteration_time * num_gpus)


def flops_utilization(flops: float, iteration_time: float, num_gpus: int, peak_flops_per_gpu: float) -> float:
    """Fraction of peak: ``flops / iteration_time / num_gpus / peak`` (Korthikanti §6.3).

    Pass model FLOPs (:func:`model_flops_per_iteration`) for MFU, and the FLOPs actually run
    (:func:`flops_per_iteration` with the recompute mode used) for HFU. A100 bf16 peak is 312e12
    (Narayanan §5).
    """
    _checks.positive_number("peak_flops_per_gpu", peak_flops_per_gpu)
    return achieved_flops_per_gpu(flops, iteration_time, num_gpus) / peak_flops_per_gpu


def mfu_hfu(
    global_batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    iteration_time: float,
    num_gpus: int,
    peak_flops_per_gpu: float = 312e12,
    recompute="selective",
) -> tuple[float, float]:
    """(MFU, HFU) of an iteration that took ``iteration_time`` seconds (Korthikanti Eq. 7, 8, §6.3)."""
    shape = (global_batch_size, seq_length, num_layers, hidden_size, vocab_size)
    model = flops_per_iteration(*shape, recompute="none")
    hardware = flops_per_iteration(*shape, recompute=recompute)
    return (
        flops_utilization(model, iteration_time, num_gpus, peak_flops_per_gpu),
        flops_utilization(hardware, iteration_time, num_gpus, peak_flops_per_gpu),
    )


def iteration_time(flops: float, num_gpus: int, flops_per_gpu: float) -> float:
    """Seconds per iteration at an achieved ``flops_per_gpu``: ``F / (n X)`` (Narayanan §5.1)."""
    _checks.positive_number("flops", flops)
    _checks.positive_int("num_gpus", num_gpus)
    _checks.positive_number("flops_per_gpu", flops_per_gpu)
    return flops / (num_gpus * flops_per_gpu)


def training_time_approx(num_tokens: float, num_parameters: float, num_gpus: int, flops_per_gpu: float) -> float:
    """End-to-end training time in seconds, Narayanan Eq. 4: ``8 T P / (n X)``.

    Eq. 4 is Eq. 3 with ``6h >> s``, ``16lh >> V+s`` and ``12lh >> V`` (§5.1), so it is a few
    percent low; :func:`training_time` keeps every term. The paper's worked examples: GPT-3
    (P=175B, T=300B, n=1024, X=140 TFLOP/s) takes 34 days; the 1T model (T=450B, n=3072,
    X=163 TFLOP/s) 84 days.
    """
    _checks.positive_number("num_tokens", num_tokens)
    _checks.positive_number("num_parameters", num_parameters)
    _checks.positive_int("num_gpus", num_gpus)
    _checks.positive_number("flops_per_gpu", flops_per_gpu)
    return 8 * num_tokens * num_parameters / (num_gpus * flops_per_gpu)


def training_time(
    num_tokens: float,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    vocab_size: int,
    num_gpus: int,
    flops_per_gpu: float,
    recompute="full",
) -> float:
    """Training time in seconds from Eq. 3 without Eq. 4's approximations.

    ``I = T / (B s)`` iterations of ``F(B)`` FLOPs each; F is linear in B, so the time is
    ``T * F(B=1) / s / (n X)`` and does not depend on the batch size. (Narayanan Table 2's
    "training time for 300B tokens" column follows this form, not Eq. 4.)
    """
    _checks.positive_number("num_tokens", num_tokens)
    per_sequence = flops_per_iteration(1, seq_length, num_layers, hidden_size, vocab_size, recompute)
    return iteration_time(num_tokens * per_sequence / seq_length, num_gpus, flops_per_gpu)
