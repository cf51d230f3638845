"""course_lib.training.logs' writers: every line the trainer prints, read back by the parser.

One format lives in one module (writer next to reader); this round trip holds them to each
other: write each line with its writer, parse it with ``parse_log`` / ``parse_log_file``, get
the same numbers back (to the digits the format prints).
"""

import io

import pytest

from course_lib.training.logs import (arguments_lines, iteration_line, memory_line, parameters_line, parse_log,
                                      parse_log_file, print_line, world_size_line)

MB = 1024 * 1024
ARGS = {"seq_length": 32, "sequence_parallel": True, "lr": 0.003, "global_batch_size": 8,
        "virtual_pipeline_model_parallel_size": None, "lr_decay_style": "constant", "Zeta_mixed_case": 1}
ITERATIONS = [   # iteration, elapsed ms, learning rate, lm loss, grad norm, MoE losses (after lm loss)
    (1, 812.34, 3e-3, 5.654321234, 1.23456, {}),
    (2, 95.06, 2.9999e-3, 5.1234567, 0.98765, {"load_balancing_loss": 1.0123456789}),
    (4, 101.96, 1.5e-4, 4.987654321, 12.3456, {"load_balancing_loss": 1.25e-3, "z_loss": 3.456789e-2}),
]
MEMORY = [   # rank, iteration, allocated, max allocated, reserved, max reserved (bytes), source
    (0, 1, 1.234 * MB, 4.567 * MB, 0, 0, "tracked tensor bytes"),
    (3, 2, 10.5 * MB, 20.25 * MB, 32 * MB, 64 * MB, None),       # CUDA's numbers: no source field
]


def _log_text() -> str:
    lines = [world_size_line(8, dp=2, cp=1, tp=2, pp=2), *arguments_lines(ARGS),
             parameters_line(1, 0, 104000), parameters_line(0, 1, 98765)]
    for it, ms, lr, loss, norm, extra in ITERATIONS:
        lines.append(iteration_line(it, 20, consumed_samples=8 * it, elapsed_ms=ms, learning_rate=lr,
                                    global_batch_size=8, lm_loss=loss, grad_norm=norm,
                                    timestamp="2026-12-01 06:00:00.123456", extra_losses=extra))
    for rank, it, a, ma, r, mr, source in MEMORY:
        lines.append(memory_line(rank, it, allocated=a, max_allocated=ma, reserved=r, max_reserved=mr,
                                 source=source))
    return "\n".join(lines) + "\n"


def _check(log) -> None:
    assert {k: log.config[k] for k in ("world_size", "dp", "cp", "tp", "pp")} == dict(world_size=8, dp=2, cp=1,
                                                                                     tp=2, pp=2)
    assert log.args == ARGS
    assert log.parameters == [dict(tensor=1, pipeline=0, num_parameters=104000),
                              dict(tensor=0, pipeline=1, num_parameters=98765)]
    assert log.era == "0.16+"                             # microsecond timestamps: Megatron core 0.16's form
    assert len(log.iterations) == len(ITERATIONS)
    for got, (it, ms, lr, loss, norm, extra) in zip(log.iterations, ITERATIONS):
        assert (got["iteration"], got["train_iters"], got["consumed_samples"], got["global_batch_size"]) == \
            (it, 20, 8 * it, 8)
        assert got["timestamp"] == "2026-12-01 06:00:00.123456"
        assert got["elapsed_ms"] == pytest.approx(ms, abs=0.05)              # :.1f
        assert got["learning_rate"] == pytest.approx(lr, rel=1e-6)           # :.6E
        assert got["lm_loss"] == pytest.approx(loss, rel=1e-6)               # :.6E
        assert got["grad_norm"] == pytest.approx(norm, abs=5e-4)             # :.3f
        assert (got["loss_scale"], got["skipped_iterations"], got["nan_iterations"]) == (1.0, 0, 0)
        for name in ("load_balancing_loss", "z_loss"):                        # :.6E, absent when not written
            assert got.get(name) == (pytest.approx(extra[name], rel=1e-6) if name in extra else None), name
    assert len(log.memory) == len(MEMORY)
    for got, (rank, it, a, ma, r, mr, source) in zip(log.memory, MEMORY):
        assert (got["rank"], got["iteration"], got.get("source")) == (rank, it, source)
        for key, value in (("allocated_mb", a), ("max_allocated_mb", ma), ("reserved_mb", r),
                           ("max_reserved_mb", mr)):
            assert got[key] == pytest.approx(value / MB, abs=0.005), key   # :.2f


def test_every_written_line_parses_back_to_its_numbers(tmp_path):
    text = _log_text()
    _check(parse_log(text))
    path = tmp_path / "train.log"
    path.write_text(text, encoding="utf-8")
    _check(parse_log_file(path))


def test_moe_losses_follow_lm_loss_as_megatron_prints_them():
    line = iteration_line(3, 10, consumed_samples=24, elapsed_ms=1.0, learning_rate=1e-3, global_batch_size=8,
                          lm_loss=4.5, grad_norm=1.0, extra_losses={"load_balancing_loss": 1.03125},
                          timestamp="2026-12-01 06:00:00.000000")
    assert " | lm loss: 4.500000E+00 | load_balancing_loss: 1.031250E+00 | loss scale: 1.0 |" in line


def test_arguments_block_is_megatrons_print_args():
    lines = arguments_lines({"a": 1, "B": 2})        # sorted ignoring case: a before B
    assert lines == ["------------------------ arguments ------------------------",
                     "  a " + "." * 47 + " 1", "  B " + "." * 47 + " 2",
                     "-------------------- end of arguments ---------------------"]


def test_print_line_writes_the_line_and_its_newline_at_once():
    class Writes(io.StringIO):
        calls = 0

        def write(self, s):
            Writes.calls += 1
            return super().write(s)

    out = Writes()
    print_line("[Rank 0] x", out)
    assert out.getvalue() == "[Rank 0] x\n" and Writes.calls == 1
