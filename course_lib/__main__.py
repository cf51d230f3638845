"""``python -m course_lib <command> ...`` -- the course's command line.

Each command lives in the module that owns its concept; this file only maps
command names to modules (imported lazily, so ``rankmap`` does not pay for
``import torch``). A command module provides ``add_arguments(parser)`` and
``run(args) -> int``.
"""

import argparse
import importlib
import os
import sys

COMMANDS = {
    # name: (module, one-line help)
    "labs": ("course_lib.classroom.notebooks.generator", "generate labs/ from solutions/ (or --check that labs/ is current)"),
    "workspace": ("course_lib.classroom.notebooks.workspace", "copy new labs into your workspace my-labs/ (never over your work); --fresh NN for a fresh copy"),
    "figures": ("course_lib.classroom.figures", "regenerate figures/ from the tested drawing functions"),
    "rankmap": ("course_lib.topology.cli", "print or draw the TP/PP/DP/CP rank grid and its process groups"),
    "megatron-cmd": ("course_lib.megatron.command",
                     "print the real Megatron-LM commands (pretrain_gpt.py, preprocess_data.py, run_tiny_gpt.sh)"),
    "tokenizer": ("course_lib.data.train_tokenizer",
                  "train the course's byte-level BPE on the corpus: GPT-2's vocab.json + merges.txt"),
    "preprocess": ("course_lib.data.preprocess",
                   "Megatron's tools/preprocess_data.py: JSON lines -> PREFIX_text_document.bin/.idx"),
    "report": ("course_lib.megatron.report", "read training logs (Megatron-LM or course) into the Day 22 record table"),
    "train": ("course_lib.train", "train the tiny GPT under a TP/PP/CP/DP layout with Megatron's flags (checks, then runs torchrun)"),
    "sweep": ("course_lib.sweep", "train the tiny GPT under the Day 22 configs A-F on 8 ranks: logs, record table, communication, bubble, plots"),
    "pipeline": ("course_lib.pipeline.cli", "a pipeline schedule's per-rank order, bubble and activation memory (simulated)"),
    "project": ("course_lib.sizing.projection",
                "project a layout's step time, tokens/s, MFU and communication on a named GPU cluster (A100, H100, H200)"),
    "ds-config": ("course_lib.deepspeed.config",
                  "read a DeepSpeed ds_config.json and print the equivalent Megatron-LM and course flags"),
    "checkpoint": ("course_lib.training.checkpoint_inspect",
                   "inspect a --save folder: iteration, format, saved layout, every tensor and which rank holds which slice"),
    "site": ("course_lib.classroom.site", "build the course as a static website (index + one page per lab, works offline)"),
    "grade": ("course_lib.classroom.grading",
              "grade a class: each student's exercise cells in a fresh official lab, fenced and timed; grades.csv, feedback/"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else list(argv)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if argv and argv[0] == name:  # import only the command being run
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    from course_lib.rules import UsageError

    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args) or 0
    except UsageError as exc:  # a person's input broke a rule: one line, no traceback (a bug keeps its traceback)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head` closed our stdout: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
