"""The rule book (course_lib.rules): each rule gives the same one-line message through every
entry point that accepts its input -- ParallelConfig, the trainer's validation, the ``python -m
course_lib train`` command and the torchrun entry (``course_lib.train.main``), ``megatron-cmd``,
``rankmap``, the planner, the sweep, the data pipeline and the layers used on their own -- and
every bad value is refused before any work starts.

The expected message is the rule function's own (called directly), so a second wording anywhere
fails here. Nothing is launched: the command entry points are refused before torchrun starts (and
``run_torchrun`` is replaced by a tripwire in case one is not).
"""

import argparse
import math
import re

import pytest

from course_lib import rules
from course_lib.__main__ import main as course_main
from course_lib.activation_memory import expected_saved_tensors
from course_lib.data import cp_token_positions, microbatch_sample_indices
from course_lib.data.blend import parse_split, split_indices, split_matrix
from course_lib.data.corpus import BUILTIN_CORPUS, corpus_token_documents
from course_lib.data.source import DEFAULT_SPLIT
from course_lib.megatron import MegatronRun
from course_lib.model import GPTConfig
from course_lib.sizing import ModelSpec, plan, validate_config
from course_lib.sweep.runs import SWEEP_BATCH, SWEEP_MODEL, config_argv
from course_lib.tensor_parallel import TransformerConfig
from course_lib.tensor_parallel.memory import layer_parameter_shapes
from course_lib.topology import ParallelConfig
from course_lib.train import build_parser, main as train_main, parse_args, validate_args

# The sweep's model (8 layers, hidden 64, 8 heads, sequence 32, micro 1, global 16) on 8 ranks.
BASE = dict(world=8, tp=1, pp=1, cp=1, layers=SWEEP_MODEL["num_layers"], hidden=SWEEP_MODEL["hidden_size"],
            heads=SWEEP_MODEL["num_attention_heads"], seq=SWEEP_MODEL["seq_length"],
            micro=SWEEP_BATCH["micro_batch_size"], global_=SWEEP_BATCH["global_batch_size"], sp=False, vpp=None)
MEGATRON_MODEL = ("layers", "hidden", "heads")       # megatron-cmd's model is the seed's, not a flag
SEED = {(1, 1, 1): "A", (2, 1, 1): "B", (4, 1, 1): "C", (2, 2, 1): "D", (1, 4, 1): "E", (2, 2, 2): "F"}


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    def tripwire(*args, **kwargs):
        raise AssertionError("a bad run reached torchrun")
    monkeypatch.setattr("course_lib.train.run_torchrun", tripwire)  # the name train.run calls


def _message(call) -> str:
    """The one-line message ``call()`` refuses with."""
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def _cli(argv, capsys) -> str:
    """The ``error:`` line of ``python -m course_lib ARGV`` (exit code 2, nothing on stdout)."""
    capsys.readouterr()
    assert course_main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err[len("error: "):].rstrip("\n")


# ---------------------------------------------------------------------------- entry points


def _train_argv(s: dict) -> list[str]:
    argv = ["--tensor-model-parallel-size", s["tp"], "--pipeline-model-parallel-size", s["pp"],
            "--context-parallel-size", s["cp"], "--num-layers", s["layers"], "--hidden-size", s["hidden"],
            "--num-attention-heads", s["heads"], "--seq-length", s["seq"], "--micro-batch-size", s["micro"],
            "--global-batch-size", s["global_"]]
    if s["vpp"] is not None:
        argv += ["--virtual-pipeline-model-parallel-size", s["vpp"]]
    return [str(a) for a in argv] + (["--sequence-parallel"] if s["sp"] else [])


def _via_config(s, capsys):
    return _message(lambda: ParallelConfig(
        s["world"], tp=s["tp"], pp=s["pp"], cp=s["cp"], num_layers=s["layers"], num_attention_heads=s["heads"],
        hidden_size=s["hidden"], seq_length=s["seq"], micro_batch_size=s["micro"], global_batch_size=s["global_"],
        sequence_parallel=s["sp"], virtual_pipeline_model_parallel_size=s["vpp"]))


def _via_trainer(s, capsys):
    return _message(lambda: validate_args(parse_args(_train_argv(s)), s["world"]))


def _via_train_command(s, capsys):
    return _cli(["train", "--nproc-per-node", str(s["world"]), *_train_argv(s)], capsys)


def _via_torchrun_entry(s, capsys, monkeypatch=None):
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", str(s["world"]))
        mp.setenv("RANK", "0")
        assert train_main(_train_argv(s)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    return err[len("error: "):].rstrip("\n")


def _via_megatron_cmd(s, capsys):
    if any(s[k] != BASE[k] for k in MEGATRON_MODEL):
        return None
    argv = ["megatron-cmd", "--tp", s["tp"], "--pp", s["pp"], "--cp", s["cp"], "--nproc", s["world"],
            "--seq-length", s["seq"], "--micro-batch-size", s["micro"], "--global-batch-size", s["global_"]]
    argv += ["--vpp", s["vpp"]] if s["vpp"] is not None else []
    return _cli([str(a) for a in argv] + (["--sp"] if s["sp"] else []), capsys)


def _via_rankmap(s, capsys):
    if any(s[k] != BASE[k] for k in ("hidden", "seq", "micro", "global_", "sp", "vpp")):
        return None
    argv = ["rankmap", "--world-size", s["world"], "--tp", s["tp"], "--pp", s["pp"], "--cp", s["cp"],
            "--num-layers", s["layers"], "--num-attention-heads", s["heads"]]
    return _cli([str(a) for a in argv], capsys)


def _via_planner(s, capsys):
    model = ModelSpec("case", s["layers"], s["hidden"], s["heads"], 51200, s["seq"])
    if s["world"] % (s["tp"] * s["pp"] * s["cp"]):
        return None                                   # the planner takes DP: its world always divides
    dp = s["world"] // (s["tp"] * s["pp"] * s["cp"])
    kw = dict(tp=s["tp"], pp=s["pp"], dp=dp, cp=s["cp"], vp=s["vpp"] or 1, sequence_parallel=s["sp"],
              micro_batch_size=s["micro"], global_batch_size=s["global_"])
    msg = _message(lambda: validate_config(model, **kw))
    assert _message(lambda: plan(model, **kw)) == msg
    return msg


def _via_sweep(s, capsys):
    name = SEED.get((s["tp"], s["pp"], s["cp"]))
    if name is None or s["sp"] or s["vpp"] is not None:
        return None
    model = {key: s[k] for key, k in (("num_layers", "layers"), ("hidden_size", "hidden"),
                                      ("num_attention_heads", "heads"), ("seq_length", "seq"),
                                      ("micro_batch_size", "micro"), ("global_batch_size", "global_"))}
    msg = _message(lambda: config_argv(name, world_size=s["world"], **model))
    prefix = f"config {name} (TP {s['tp']}, PP {s['pp']}, CP {s['cp']}) on {s['world']} ranks: "
    assert msg.startswith(prefix)
    return msg[len(prefix):]


LAYOUT_ENTRY_POINTS = {"ParallelConfig": _via_config, "validate_args": _via_trainer,
                       "python -m course_lib train": _via_train_command, "course_lib.train.main": _via_torchrun_entry,
                       "megatron-cmd": _via_megatron_cmd, "rankmap": _via_rankmap, "planner": _via_planner,
                       "sweep": _via_sweep}

# rule case: (changes to BASE, the rule's own call that gives the expected message, entry points that must apply it)
ALL = set(LAYOUT_ENTRY_POINTS)
LAYOUT_CASES = {
    "world % (tp*pp*cp)": (dict(tp=3), lambda: rules.data_parallel_size(8, 3, 1, 1), ALL - {"planner", "sweep"}),
    "heads % tp": (dict(world=16, tp=16), lambda: rules.heads_divisible_by_tp(8, 16), ALL - {"sweep"}),
    "heads % tp (model)": (dict(tp=4, heads=6), lambda: rules.heads_divisible_by_tp(6, 4), ALL - {"megatron-cmd"}),
    "layers % pp": (dict(pp=4, layers=6), lambda: rules.pipeline_split(6, 4), ALL - {"megatron-cmd"}),
    "hidden % heads": (dict(hidden=60), lambda: rules.hidden_divisible_by_heads(60, 8),
                       ALL - {"megatron-cmd", "rankmap"}),
    "seq % 2cp": (dict(tp=2, pp=2, cp=2, seq=30), lambda: rules.sequence_split(30, 2), ALL - {"rankmap"}),
    "SP: (seq / cp) % tp": (dict(tp=4, seq=30, sp=True), lambda: rules.sequence_parallel_split(30, 1, 4),
                            ALL - {"rankmap", "sweep"}),
    "global % (micro*dp)": (dict(global_=12), lambda: rules.num_microbatches(12, 1, 8), ALL - {"rankmap"}),
    "vpp needs pp": (dict(vpp=2), lambda: rules.virtual_pipeline(2, 1, [8]), ALL - {"rankmap", "sweep"}),
    "stage layers % vpp": (dict(pp=2, vpp=3), lambda: rules.virtual_pipeline(3, 2, [4, 4]),
                           ALL - {"rankmap", "sweep"}),
    "interleaved m % pp": (dict(pp=2, vpp=2, global_=12), lambda: rules.interleaved_microbatch_group(2, 3, 2),
                           ALL - {"rankmap", "sweep"}),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_a_layout_rule_reads_the_same_through_every_entry_point(case, capsys):
    changes, rule, expected_entries = LAYOUT_CASES[case]
    expected = _message(rule)
    scenario = {**BASE, **changes}
    got = {}
    for name, via in LAYOUT_ENTRY_POINTS.items():
        msg = via(scenario, capsys)
        if msg is not None:
            got[name] = msg
    assert set(got) == expected_entries, case
    assert got == {name: expected for name in got}


# The layers and the data pipeline, used on their own, guard with the same rules.
def test_layers_and_data_pipeline_apply_the_same_rules():
    heads = _message(lambda: rules.heads_divisible_by_tp(6, 4))
    assert _message(lambda: layer_parameter_shapes(TransformerConfig(hidden_size=24, num_attention_heads=6), 4)) \
        == heads
    assert _message(lambda: expected_saved_tensors(32, 1, 24, 6, tp=4)) == heads
    ffn = _message(lambda: rules.ffn_divisible_by_tp(10, 4))
    assert _message(lambda: layer_parameter_shapes(
        TransformerConfig(hidden_size=16, num_attention_heads=4, ffn_hidden_size=10), 4)) == ffn
    assert _message(lambda: expected_saved_tensors(32, 1, 16, 4, tp=4, ffn_hidden_size=10)) == ffn
    hidden = _message(lambda: rules.hidden_divisible_by_heads(60, 8))
    for make in (lambda: TransformerConfig(hidden_size=60, num_attention_heads=8),
                 lambda: GPTConfig(hidden_size=60, num_attention_heads=8)):
        assert _message(make) == hidden
    cp = _message(lambda: rules.sequence_split(30, 2))
    from course_lib.context_parallel.zigzag import check_sequence_split
    from course_lib.sizing import activation_bytes_per_layer

    assert _message(lambda: cp_token_positions(30, 0, 2)) == cp
    assert _message(lambda: check_sequence_split(30, 2)) == cp
    assert _message(lambda: expected_saved_tensors(30, 1, 64, 8, cp=2)) == cp
    sp = _message(lambda: rules.sequence_parallel_split(30, 1, 4))
    assert _message(lambda: expected_saved_tensors(30, 1, 64, 8, tp=4, sequence_parallel=True)) == sp
    assert _message(lambda: activation_bytes_per_layer(30, 1, 64, 8, tp=4, sequence_parallel=True)) == sp
    batch = _message(lambda: rules.num_microbatches(12, 1, 8))
    assert _message(lambda: microbatch_sample_indices(0, 0, 0, 8, 1, 12)) == batch
    dropout = _message(lambda: rules.cp_attention_dropout(0.1, 2))
    assert _message(lambda: validate_args(parse_args(_train_argv({**BASE, "tp": 2, "pp": 2, "cp": 2}) +
                                                     ["--attention-dropout", "0.1"]), 8)) == dropout
    assert _message(lambda: expected_saved_tensors(32, 1, 64, 8, cp=2, attention_dropout=0.1)) == dropout


def test_cp_pipeline_vocab_and_encoder_rules_are_the_rule_book_s():
    from course_lib.context_parallel.ring import ring_sends_per_layer
    from course_lib.data import vocab_size_with_padding
    from course_lib.pipeline.stages import layer_split

    assert layer_split(8, 4, vp_size=2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert _message(lambda: layer_split(8, 3, vp_size=2)) == _message(lambda: rules.pipeline_ranks(3, 2))
    assert _message(lambda: layer_split(6, 4, vp_size=2)) == _message(lambda: rules.virtual_pipeline(2, 2, [3, 3]))
    assert _message(lambda: ring_sends_per_layer(0)) == _message(lambda: rules.integer(rules.CP, 0))
    assert rules.heads_divisible_by_cp(8, 4, 2) == 4 and rules.heads_divisible_by_groups(8, 2) == 4
    assert _message(lambda: rules.query_groups(3, 8, 1)) == _message(lambda: rules.heads_divisible_by_groups(8, 3))
    # one padding function behind the data package and the model
    assert vocab_size_with_padding is rules.vocab_size_with_padding
    assert GPTConfig(vocab_padding_tp=4).padded_vocab_size == rules.vocab_size_with_padding(257, 4) == 512
    # Megatron-core 0.9-0.13: each replica also holds encoder_tp x encoder_pp ranks
    assert rules.data_parallel_size(12, 2, 2, encoder_tp=1, encoder_pp=2) == 2
    assert _message(lambda: rules.data_parallel_size(8, 2, 2, encoder_tp=1, encoder_pp=2)).startswith(
        "world_size=8 is not divisible by (tensor-model-parallel-size=2 × pipeline-model-parallel-size=2 + "
        "encoder-tensor-model-parallel-size=1 × encoder-pipeline-model-parallel-size=2) = 6; ")


# ---------------------------------------------------------------------------- SP with TP = 1: one policy


def test_sequence_parallel_with_tp_1_is_turned_off_and_said_in_one_line(capsys):
    note = rules.SP_WITHOUT_TP
    cfg = ParallelConfig(8, seq_length=32, sequence_parallel=True)
    assert cfg.sequence_parallel is False and cfg.notes == (note,)
    run = validate_args(parse_args(_train_argv({**BASE, "sp": True})), 8)
    assert run.parallel.sequence_parallel is False and run.parallel.notes == (note,)
    p = plan(ModelSpec("case", 8, 64, 8, 51200, 32), dp=8, sequence_parallel=True)
    assert p.config["sequence_parallel"] is False and note in p.notes
    capsys.readouterr()
    assert course_main(["megatron-cmd", "--sp"]) == 0
    out = capsys.readouterr().out
    assert out.count(note) == 1 and "--sequence-parallel" not in out


# ---------------------------------------------------------------------------- values: refused before work

def _train_split(seq_length: int = 100000) -> tuple[int, int, int]:
    """The default --split's train documents of the built-in corpus, their tokens, and ``seq_length``."""
    docs = corpus_token_documents()
    train = split_indices(len(docs), split_matrix(parse_split(DEFAULT_SPLIT))[0])
    return len(train), sum(len(docs[i]) for i in train), seq_length


TRAINER_VALUES = [
    (["--lr", "nan"], lambda: rules.number("lr", math.nan, 0.0)),
    (["--lr", "inf"], lambda: rules.number("lr", math.inf, 0.0)),
    (["--ffn-hidden-size", "0"], lambda: rules.integer("ffn_hidden_size", 0)),
    (["--ffn-hidden-size", "-4"], lambda: rules.integer("ffn_hidden_size", -4)),
    (["--init-method-std", "-1"], lambda: rules.number("init_method_std", -1.0, 0.0)),
    (["--min-lr", "0.01"], lambda: rules.min_lr(0.01, 1e-3)),
    (["--clip-grad", "nan"], lambda: rules.number("clip_grad", math.nan, 0.0)),
    (["--adam-beta1", "1.0"], lambda: rules.number("adam_beta1", 1.0, 0.0, 1.0, high_open=True)),
    (["--adam-beta2", "-0.1"], lambda: rules.number("adam_beta2", -0.1, 0.0, 1.0, high_open=True)),
    (["--weight-decay", "-0.1"], lambda: rules.number("weight_decay", -0.1, 0.0)),
    (["--distributed-timeout-minutes", "nan"],
     lambda: rules.timeout_seconds("distributed_timeout_minutes", math.nan, unit_s=60)),
    (["--distributed-timeout-minutes", "1e-9"],
     lambda: rules.timeout_seconds("distributed_timeout_minutes", 1e-9, unit_s=60)),
    (["--hidden-dropout", "nan"], lambda: rules.probability("hidden_dropout", math.nan)),
    (["--seq-length", "100000"], lambda: rules.split_holds_a_sample(f"train (of {BUILTIN_CORPUS})", *_train_split())),
    (["--tensor-model-parallel-size", "0"], lambda: rules.integer("tensor-model-parallel-size", 0)),
    (["--model-parallel-size", "2"], lambda: rules.removed_flag("model-parallel-size", 2, "tensor-model-parallel-size")),
]


@pytest.mark.parametrize("extra, rule", TRAINER_VALUES, ids=[" ".join(e) for e, _ in TRAINER_VALUES])
def test_bad_trainer_values_are_refused_the_same_everywhere(extra, rule, capsys):
    expected = _message(rule)
    argv = _train_argv(BASE) + extra
    assert _message(lambda: validate_args(parse_args(argv), 8)) == expected
    assert _cli(["train", "--nproc-per-node", "8", *argv], capsys) == expected
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "8")
        mp.setenv("RANK", "0")
        assert train_main(argv) == 2
    assert capsys.readouterr().err == f"error: {expected}\n"


def test_run_values_read_the_same_in_megatron_cmd(capsys):
    lr = _message(lambda: rules.number("lr", math.nan, 0.0))
    assert _message(lambda: MegatronRun(lr=math.nan)) == lr
    assert _cli(["megatron-cmd", "--lr", "nan"], capsys) == lr
    assert _message(lambda: MegatronRun(lr=1e-3, min_lr=1e-2)) == _message(lambda: rules.min_lr(1e-2, 1e-3))
    assert _message(lambda: MegatronRun(clip_grad=math.inf)) == _message(lambda: rules.number("clip_grad", math.inf, 0))
    assert _message(lambda: MegatronRun(weight_decay=-0.1)) == _message(
        lambda: rules.number("weight_decay", -0.1, 0.0))


def test_layers_refuse_the_values_the_trainer_refuses():
    for kw, rule in ((dict(ffn_hidden_size=0), lambda: rules.integer("ffn_hidden_size", 0)),
                     (dict(init_method_std=-1.0), lambda: rules.number("init_method_std", -1.0, 0.0)),
                     (dict(hidden_dropout=math.nan), lambda: rules.probability("hidden_dropout", math.nan))):
        expected = _message(rule)
        assert _message(lambda: TransformerConfig(hidden_size=64, num_attention_heads=8, **kw)) == expected
        assert _message(lambda: GPTConfig(**kw)) == expected


def _typed_flags(kind):
    return [a for a in build_parser()._actions if a.option_strings and a.type is kind]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_flag_refuses_nan_and_inf(value):
    flags = _typed_flags(float)
    assert len(flags) >= 12
    for action in flags:
        argv = _train_argv(BASE) + [f"{action.option_strings[0]}={value}"]
        msg = _message(lambda: validate_args(parse_args(argv), 8))
        assert msg.startswith(f"{action.dest}={float(value)!r} must be "), msg


def test_every_size_flag_refuses_zero_and_negatives():
    for action in _typed_flags(int):
        if action.dest == "model_parallel_size":  # removed from Megatron: refused whatever its value
            continue
        minimum = 0 if action.dest in ("seed", "lr_warmup_iters") else 1
        for value in (minimum - 1, -7):
            argv = _train_argv(BASE) + [f"{action.option_strings[0]}={value}"]
            msg = _message(lambda: validate_args(parse_args(argv), 8))
            axis = action.dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "context_parallel_size")
            name = action.dest.replace("_", "-") if axis else action.dest
            assert re.match(rf"{name}={value} must be an integer (>= {minimum}|in {minimum}\.\.)", msg), msg


def test_a_run_that_cannot_fit_in_memory_names_the_flag(capsys):
    """Estimated first, refused in one line (the available bytes vary, so they are masked)."""
    def masked(msg):
        return re.sub(r"has [\d.,]+ \w+ available", "has X available", msg)

    for flag, value in (("--hidden-size", "1000000"), ("--seq-length", "60000")):
        argv = _train_argv(BASE) + [flag, value]
        msg = _message(lambda: validate_args(parse_args(argv), 8))
        dest = flag[2:].replace("-", "_")
        assert msg.startswith(f"{dest}={value} needs about ") and msg.endswith(f"; use a smaller {dest}"), msg
        assert masked(_cli(["train", "--nproc-per-node", "8", *argv], capsys)) == masked(msg)
    # a run's own ranks are not counted twice once they run: pretrain validates without the estimate
    validate_args(parse_args(_train_argv(BASE) + ["--hidden-size", "1000000"]), 8, check_memory=False)


def test_nproc_per_node_is_checked_like_every_size(capsys):
    assert _cli(["train", "--nproc-per-node", "0", *_train_argv(BASE)], capsys) == \
        _message(lambda: rules.integer("nproc_per_node", 0))


# ---------------------------------------------------------------------------- the rule book itself


def test_the_rule_book_lists_every_rule_and_needs_no_torch():
    import subprocess
    import sys

    public = [n for n, f in vars(rules).items() if callable(f) and not n.startswith("_")
              and getattr(f, "__module__", None) == rules.__name__]
    for name in set(public) - {"UsageError"}:
        assert f":func:`{name}`" in rules.__doc__, f"{name} is missing from the rule list"
    code = "import sys, course_lib.rules, course_lib.topology; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_a_persons_bad_input_is_a_usage_error_and_a_bug_keeps_its_traceback(capsys, monkeypatch):
    """Every error the library raises on purpose is a :class:`rules.UsageError` (a ``ValueError``), which the
    command line prints in one line; any other exception -- Python's own ``ValueError`` too -- is a bug and
    keeps its traceback. The checkers (``classroom/checks``) raise ``ValueError`` as the students' code does."""
    from pathlib import Path

    from course_lib.topology import cli as rankmap_cli

    package = Path(rules.__file__).parent
    plain = [f"{path.relative_to(package.parent)}:{number}" for path in sorted(package.rglob("*.py"))
             if "classroom/checks" not in path.as_posix()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\b(raise|return) ValueError\(", line)]
    assert not plain, "raise rules.UsageError for a person's bad input (the CLI prints it in one line):\n" + \
        "\n".join(plain)
    assert _cli(["rankmap", "--world-size", "8", "--tp", "3"], capsys).startswith("world_size=8 is not divisible")

    def bug(args):
        return int("not a number")            # a ValueError of Python's own, not a rule's
    monkeypatch.setattr(rankmap_cli, "run", bug)
    with pytest.raises(ValueError, match="invalid literal") as info:
        course_main(["rankmap", "--world-size", "8"])
    assert not isinstance(info.value, rules.UsageError)


def test_uneven_split_with_interleaving_follows_megatron():
    # --num-layers-per-virtual-pipeline-stage cannot describe an uneven split (Megatron's validate_args)
    msg = _message(lambda: rules.virtual_pipeline_size(8, 2, num_layers_per_virtual_pipeline_stage=1, uneven=True))
    assert "--num-virtual-stages-per-pipeline-rank" in msg
    cfg = ParallelConfig(8, pp=2, num_layers=8, decoder_first_pipeline_num_layers=2,
                         virtual_pipeline_model_parallel_size=2, global_batch_size=8)
    flags = cfg.megatron_flags()
    assert flags[flags.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    # first/last stages hold >= 1 layer (Megatron: "must be larger than 0")
    assert _message(lambda: ParallelConfig(8, pp=2, num_layers=8, decoder_first_pipeline_num_layers=0)) == \
        _message(lambda: rules.integer("decoder_first_pipeline_num_layers", 0))
    assert ParallelConfig(8, pp=2, num_layers=8, virtual_pipeline_model_parallel_size=1).vpp == 1   # 1 = none


def test_messages_name_the_flag_the_values_and_a_fix():
    assert _message(lambda: rules.heads_divisible_by_tp(6, 4)) == (
        "num_attention_heads=6 is not divisible by tensor-model-parallel-size=4; "
        "use a tensor-model-parallel-size that divides 6 (1, 2, 3, 6)")
    assert _message(lambda: rules.number("lr", math.nan, 0.0)) == "lr=nan must be a finite number >= 0"
    assert _message(lambda: rules.integer("seed", True, 0)) == "seed=True must be an integer >= 0"
    assert _message(lambda: rules.probability("attention_dropout", 1.0)) == "attention_dropout=1.0 must be in [0, 1)"
    assert rules.divisors(12) == [1, 2, 3, 4, 6, 12] and rules.nearby_multiples(30, 4) == "28 or 32"
    assert isinstance(argparse.Namespace, type)


def test_sharding_strategies_have_one_source_and_read_the_same_in_the_engine():
    import torch

    from course_lib.distributed import STRATEGIES, ShardedDataParallel
    from course_lib.deepspeed import config as ds_config
    assert STRATEGIES is rules.SHARDING_STRATEGIES
    assert [rules.sharding_stage(s) for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")] == [0, 1, 2, 3]
    for stage, name in ((2, "optim_grads"), (3, "optim_grads_params")):   # DeepSpeed's ZeRO stage -> Megatron-FSDP
        t = ds_config.translate(ds_config.parse({"zero_optimization": {"stage": stage}}))
        assert ["--data-parallel-sharding-strategy", name] in t.flags
    assert _message(lambda: rules.sharding_stage("zero3")) == (
        "--data-parallel-sharding-strategy='zero3' is unknown; use one of no_shard, optim, optim_grads, "
        "optim_grads_params")
    # the engine refuses it before it touches a process group
    assert _message(lambda: ShardedDataParallel(torch.nn.Linear(2, 2), None, strategy="zero3")) == \
        _message(lambda: rules.sharding_stage("zero3"))
