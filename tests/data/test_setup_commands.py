"""``megatron-cmd --show setup`` prints exactly the commands that make the files: its course lines run
here (the Megatron-LM clone aside; ``tools/preprocess_data.py`` through the course's ``preprocess``,
the same flags), and the files they make are the ones ``pretrain_gpt.py``'s flags name."""

from __future__ import annotations

import shlex

from course_lib.data.bpe import BPETokenizer
from course_lib.data.indexed import IndexedDataset
from course_lib.megatron.command import MegatronRun, gpu_config, pretrain_args, setup_commands


def _commands(text: str) -> list[list[str]]:
    joined = text.replace(" \\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line and not line.startswith("#")]


def test_setup_lines_make_the_files_the_train_command_reads(tmp_path, monkeypatch, capsys):
    from course_lib.__main__ import main

    monkeypatch.chdir(tmp_path)                                 # the printed paths are relative
    ran = []
    for argv in _commands(setup_commands()):
        if argv[:1] == ["git"] or argv[:1] == ["cd"] or "pip" in argv:
            continue                                            # Megatron-LM itself: not here
        if argv[0] == "mkdir":
            (tmp_path / argv[-1]).mkdir(parents=True)
            ran.append("mkdir")
            continue
        if argv[:2] == ["python", "tools/preprocess_data.py"]:
            argv = ["python", "-m", "course_lib", "preprocess", *argv[2:]]
        assert argv[:3] == ["python", "-m", "course_lib"], argv
        assert main(argv[3:]) == 0, capsys.readouterr().err
        ran.append(argv[3])
    assert ran == ["mkdir", "megatron-cmd", "tokenizer", "preprocess"]
    flags = dict(pretrain_args(gpu_config(2, 2), MegatronRun()))
    tok = BPETokenizer.from_files(tmp_path / flags["--vocab-file"], tmp_path / flags["--merge-file"])
    data = IndexedDataset(tmp_path / flags["--data-path"])
    assert tok.vocab_size == 1024 and len(data) == 129
    assert data.document_indices[-1] == 129 and int(data[0][-1]) == tok.eod
