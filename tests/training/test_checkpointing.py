"""course_lib.training.checkpointing: Megatron's checkpoint flow on real ranks and real files.

Few launches, many checks each (a launch costs seconds on this machine): every run trains the tiny GPT
6 iterations (warm-up 2, linear decay), straight or as 3 + save (``--exit-interval 3``) + ``--load`` + 3.
* an exact resume (same layout, torch_dist and legacy torch, plain and distributed optimizer):
  iterations 4-6 bit-identical to the straight run's;
* resharding (torch_dist): TP2 x PP2 x DP2 loaded under TP1 x PP4 x DP2, TP4 x DP2 and one process; the
  distributed optimizer's DP4 state under DP8 and DP2 -- the straight run's losses within 1e-5 (the
  layouts sum in different orders: ~1e-7); the legacy format refuses a layout change in one line;
* faults: a save killed before its rename leaves the tracker and the previous checkpoint; a truncated
  or damaged file, another model, a damaged tracker: one line naming it; an empty folder: Megatron's
  warning, training from scratch; ``--no-load-optim`` and ``--finetune`` load what they say.
"""

import errno
import os
import re
import shutil
import signal

import pytest
import torch.distributed.checkpoint  # noqa: F401 -- imported once here: every forked rank inherits it (~1 s each)

from course_lib.__main__ import main as cli
from course_lib.launch import RankError, launch
from course_lib.train import parse_args, pretrain, validate_args
from course_lib.training.checkpointing import CheckpointError

BASE = ["--uniform-vocab-padding", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "6",
        "--log-interval", "3", "--lr", "3e-3", "--lr-warmup-iters", "2"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer", "--micro-batch-size", "1"]       # micro 1: DP8 fits the batch of 8
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--moe-aux-loss-coeff", "1e-2"]
EP2 = ["--expert-model-parallel-size", "2"]
RESHARD_TOL = 1e-5


def _train(*flags):
    return pretrain(parse_args(BASE + [str(f) for f in flags]), print_args=False)["lm_loss"]


def _save_then_resume(layout, save, fmt, resumed_save=None):
    """3 iterations + save (every 2 and at the exit, 3), then a new run loading it for 3 more."""
    _train(*layout, "--save", save, "--save-interval", 2, "--exit-interval", 3, "--ckpt-format", fmt)
    more = ["--save", resumed_save, "--save-interval", 3] if resumed_save else []
    return _train(*layout, "--load", save, *more)


def _error(*flags):
    try:
        _train(*flags)
    except CheckpointError as exc:
        return str(exc)
    return None


def _eight_ranks(root, dp4):
    out = {"straight": _train(*TP2_PP2)}
    out["dist"] = _save_then_resume(TP2_PP2, f"{root}/dist", "torch_dist", resumed_save=f"{root}/resumed")
    out["legacy"] = _save_then_resume(TP2_PP2, f"{root}/legacy", "torch")
    out["TP1 x PP4 x DP2"] = _train("--pipeline-model-parallel-size", 4, "--load", f"{root}/dist")
    out["TP4 x DP2"] = _train("--tensor-model-parallel-size", 4, "--load", f"{root}/dist")
    out["legacy to PP4"] = _error("--pipeline-model-parallel-size", 4, "--load", f"{root}/legacy")
    out["distopt DP8"] = _train(*DISTOPT, "--load", dp4)
    return out


def _four_ranks(root):
    return {"straight": _train(*DISTOPT), "resumed": _save_then_resume(DISTOPT, f"{root}/dp4", "torch_dist")}


def _killed_in_save(root):
    """Save at 2 (complete), then die at the rename of the save at 4: SIGKILL on rank 0."""
    from course_lib.training import checkpointing

    publish = checkpointing._publish

    def dying(tmp, final):
        if final.name == "iter_0000004":
            os.kill(os.getpid(), signal.SIGKILL)
        publish(tmp, final)

    checkpointing._publish = dying
    _train("--save", root, "--save-interval", 2)


def _two_ranks(root, dp4):
    out = {"distopt DP2": _train(*DISTOPT, "--load", dp4), "after the kill": _train("--load", f"{root}/killed")}
    out["moe straight"] = _train(*MOE, *EP2)
    out["moe resumed"] = _save_then_resume(MOE + EP2, f"{root}/moe", "torch_dist")
    return out


def _one_rank(root):
    out = {"one process": _train("--load", f"{root}/dist"), "moe one process": _train(*MOE, "--load", f"{root}/moe")}
    out["no-load-optim"] = _train("--load", f"{root}/dist", "--no-load-optim")
    out["finetune"] = _train("--load", f"{root}/dist", "--finetune", "--save", f"{root}/resumed", "--save-interval", 6)   # over iter 6
    out["empty"] = _train("--load", f"{root}/empty", "--exit-interval", 1)
    for case in ("truncated", "tracker", "common", "hostile common", "hostile metadata", "hostile legacy",
                 "consumed"):
        out[case] = _error("--load", f"{root}/{case}")
    out["another model"] = _error("--load", f"{root}/dist", "--hidden-size", 128)

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    os.fsync = full_disk                  # every write of the save at iteration 6 fails
    out["full disk"] = _error("--load", f"{root}/full", "--save", f"{root}/full", "--save-interval", 6)
    return out


class _RunsCode:
    """Unpickled, this runs a shell command (``os.system``): what a crafted checkpoint could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant_hostile_pickles(root):
    """Copies of the saved checkpoints whose common.pt, DCP .metadata or legacy file would run code when read."""
    import pickle

    import torch

    for case, src in (("hostile common", "dist"), ("hostile metadata", "dist"), ("hostile legacy", "legacy")):
        shutil.copytree(root / src, root / case)
    evil = _RunsCode(root / "code ran")
    common = root / "hostile common" / "iter_0000003" / "common.pt"
    state = torch.load(common, weights_only=False)      # the test's own file, just written
    torch.save({**state, "args": evil}, common)
    (root / "hostile metadata" / "iter_0000003" / ".metadata").write_bytes(pickle.dumps(evil))
    legacy = root / "hostile legacy" / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"
    torch.save({"model": {}, "rng_state": [evil]}, legacy)


def _plant_a_data_position_off_by_one_batch(root):
    """A copy of the torch_dist checkpoint whose common.pt says one global batch more was consumed."""
    import torch

    shutil.copytree(root / "dist", root / "consumed")
    common = root / "consumed" / "iter_0000003" / "common.pt"
    state = torch.load(common, weights_only=False)      # the test's own file, just written
    torch.save({**state, "consumed_train_samples": state["consumed_train_samples"]
                + state["data_flags"]["global_batch_size"]}, common)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    dp4 = f"{root}/dp4"
    res = {"4": launch(_four_ranks, world_size=4, output="none", timeout=240, root=str(root))}
    with pytest.raises(RankError) as killed:
        launch(_killed_in_save, world_size=2, output="none", timeout=240, root=f"{root}/killed")
    res["killed"] = killed.value
    res["killed files"] = sorted(p.name for p in (root / "killed").iterdir())
    res["killed tracker"] = (root / "killed" / "latest_checkpointed_iteration.txt").read_text()
    res["8"] = launch(_eight_ranks, world_size=8, output="none", timeout=300, root=str(root), dp4=dp4)
    res["2"] = launch(_two_ranks, world_size=2, output="none", timeout=240, root=str(root), dp4=dp4)
    for case in ("truncated", "tracker", "common", "full"):
        shutil.copytree(root / "dist", root / case)
    damaged = root / "truncated" / "iter_0000003" / "__3_0.distcp"
    os.truncate(damaged, damaged.stat().st_size // 2)
    (root / "tracker" / "latest_checkpointed_iteration.txt").write_text("3\x00junk")
    (root / "common" / "iter_0000003" / "common.pt").write_bytes(b"not a checkpoint")
    (root / "empty").mkdir()
    _plant_hostile_pickles(root)
    _plant_a_data_position_off_by_one_batch(root)
    res["1"] = launch(_one_rank, world_size=1, output="none", timeout=240, root=str(root))
    res["root"] = root
    return res


def test_resume_is_exact_in_both_formats_and_with_the_distributed_optimizer(runs):
    eight, four = runs["8"][-1], runs["4"][-1]          # the last rank is on the last stage
    straight = eight["straight"]
    assert len(straight) == 6 and straight[5] < straight[0]
    assert eight["dist"] == straight[3:]                   # bit-identical: same layout, same arithmetic
    assert eight["legacy"] == straight[3:]
    assert four["resumed"] == four["straight"][3:]
    printed = "\n".join(runs["8"].outputs)
    assert "saving checkpoint at iteration       2" in printed and "exiting program at iteration 3" in printed
    assert "successfully loaded checkpoint from" in printed and "[ t 1/2, p 1/2 ] at iteration 3" in printed


def test_checkpoint_files_tracker_and_the_save_at_the_end(runs):
    root = runs["root"]
    dist, legacy = root / "dist", root / "legacy"
    assert (dist / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert sorted(p.name for p in dist.iterdir()) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    files = sorted(p.name for p in (dist / "iter_0000003").iterdir())
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(8)] + ["common.pt", "metadata.json"]
    assert sorted(p.relative_to(legacy / "iter_0000003").as_posix() for p in (legacy / "iter_0000003").rglob("*.pt")) \
        == [f"mp_rank_{t:02d}_{p:03d}/model_optim_rng.pt" for t in range(2) for p in range(2)]
    assert (root / "resumed" / "latest_checkpointed_iteration.txt").read_text() == "6"   # saved at the end
    assert sorted(p.name for p in (root / "dp4").iterdir())[:2] == ["iter_0000002", "iter_0000003"]


def test_torch_dist_reshards_to_other_layouts_and_dp_sizes(runs):
    eight = runs["8"][-1]
    straight = eight["straight"][3:]
    for name, losses in (("TP1 x PP4 x DP2", eight["TP1 x PP4 x DP2"]), ("TP4 x DP2", eight["TP4 x DP2"]),
                         ("one process", runs["1"][0]["one process"])):
        assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, straight)) < RESHARD_TOL, (name, losses)
    dp4 = runs["4"][-1]["straight"][3:]
    for losses in (eight["distopt DP8"], runs["2"][-1]["distopt DP2"]):
        assert max(abs(a - b) for a, b in zip(losses, dp4)) < RESHARD_TOL, losses
    message = eight["legacy to PP4"]
    assert "legacy torch format" in message and "TP2 x PP2 x VPP1" in message and "TP1 x PP4 x VPP1" in message
    assert "--ckpt-format torch_dist" in message and "\n" not in message


def test_moe_experts_are_sharded_over_ep_with_global_offsets_and_reshard(runs):
    """EP2 on 2 ranks (expert DP1): each rank writes its 2 of the 4 experts of each layer as a chunk of
    megatron-core's [L, E, F, H]; the resume is exact, and one process loads all 4 experts and continues
    with the EP2 run's losses."""
    from course_lib.training.checkpoint_inspect import describe_checkpoint, holders

    two, one = runs["2"][-1], runs["1"][0]
    assert two["moe resumed"] == two["moe straight"][3:]
    assert max(abs(a - b) for a, b in zip(one["moe one process"], two["moe straight"][3:])) < RESHARD_TOL
    d = describe_checkpoint(runs["root"] / "moe")
    assert (d["layout"]["ep"], d["layout"]["expert_tp"]) == (2, 1)
    tensors = {t["key"]: t for t in d["tensors"]}
    for name, shape in (("linear_fc1", [4, 4, 96, 64]), ("linear_fc2", [4, 4, 64, 96])):
        for prefix in ("", "optimizer.state.exp_avg."):
            t = tensors[f"{prefix}decoder.layers.mlp.experts.experts.{name}.weight"]
            mine = {r: [(layer, 2 * r, 0, 0) for layer in range(4)] for r in (0, 1)}
            assert t["shape"] == shape and [c[:2] for c in t["chunks"]] == sorted((r, o) for r in mine for o in mine[r])
            assert {r: [h[0] for h in v] for r, v in holders(d["layout"], t).items()} == mine
    assert len(tensors["decoder.layers.mlp.router.weight"]["chunks"]) == 4           # replicated: once a layer


def test_a_save_killed_before_its_rename_leaves_the_previous_checkpoint(runs):
    assert runs["killed"].exc_type == "ProcessDied" and runs["killed"].rank == 0
    assert runs["killed tracker"] == "2"
    assert runs["killed files"] == [".iter_0000004.incomplete", "iter_0000002", "latest_checkpointed_iteration.txt"]
    straight = runs["8"][-1]["straight"]
    assert max(abs(a - b) for a, b in zip(runs["2"][-1]["after the kill"], straight[2:])) < RESHARD_TOL


def test_faults_and_partial_loads_say_what_happened(runs):
    one, printed = runs["1"][0], runs["1"].outputs[0]
    straight = runs["8"][-1]["straight"]
    assert "WARNING: could not find the metadata file" in printed
    assert "will not load any checkpoints and will start from random" in printed
    assert abs(one["empty"][0] - straight[0]) < RESHARD_TOL and len(one["empty"]) == 1
    messages = {k: one[k] for k in ("truncated", "tracker", "common", "another model", "full disk")}
    assert all(m is not None and "\n" not in m for m in messages.values()), messages
    assert "__3_0.distcp is truncated" in messages["truncated"]
    assert "latest_checkpointed_iteration.txt should hold an iteration number" in messages["tracker"]
    assert "common.pt cannot be read" in messages["common"]
    assert "consumed_train_samples=" in one["consumed"] and "but its folder is iteration 3" in one["consumed"]
    assert "hidden_size=64" in messages["another model"] and "hidden_size=128" in messages["another model"]
    assert "saving checkpoint at iteration 6" in messages["full disk"] and "No space left on device" in messages[
        "full disk"] and "the previous checkpoint and latest_checkpointed_iteration.txt are unchanged" in messages[
        "full disk"]
    full = runs["root"] / "full"
    assert (full / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert sorted(p.name for p in full.iterdir()) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    # --no-load-optim: iteration 4's loss is the model's (before any step), then fresh Adam moments differ
    assert abs(one["no-load-optim"][0] - straight[3]) < RESHARD_TOL
    assert abs(one["no-load-optim"][1] - straight[4]) > 1e-4
    # --finetune: the saved model, trained from iteration 0: 6 iterations, and better than from scratch
    assert len(one["finetune"]) == 6 and one["finetune"][0] < straight[0] - 0.1
    assert "the random number generators are per rank: not loaded" in printed   # the layout changed: said so
    assert "iter_0000006 already exists (an earlier run's save of this iteration); replacing it" in printed


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_by_load_inspect_and_the_lab_helpers(runs, capsys):
    from course_lib.classroom.checks.checkpoints import check_read_plan  # noqa: F401 -- the Lab 09 checker's reader
    from course_lib.training.checkpoint_inspect import describe_checkpoint
    from course_lib.training.dcp_io import SafeFileSystemReader
    from course_lib.training.safe_load import UnsafeCheckpointError, torch_load

    root, one = runs["root"], runs["1"][0]
    refused = {"hostile common": "common.pt needs posix.system", "hostile metadata": ".metadata needs posix.system",
               "hostile legacy": "model_optim_rng.pt needs posix.system"}
    for case, needs in refused.items():
        assert needs in one[case] and "reading it could run code, so it was refused" in one[case], one[case]
        assert "\n" not in one[case]
        assert cli(["checkpoint", "inspect", str(root / case)]) == 2
        assert needs in capsys.readouterr().err
        with pytest.raises(CheckpointError, match=re.escape(needs)):
            describe_checkpoint(root / case)                      # Lab 09's inspect helper
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        torch_load(root / "hostile common" / "iter_0000003" / "common.pt")       # what Lab 09 reads common.pt with
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        SafeFileSystemReader(str(root / "hostile metadata" / "iter_0000003")).read_metadata()   # and .metadata
    assert not (root / "code ran").exists()
    # the allow-list is enough for a real save: the untouched checkpoint reads
    assert set(torch_load(root / "dist" / "iter_0000003" / "common.pt")) >= {"args", "iteration", "opt_param_scheduler"}


def test_common_pt_is_read_by_megatron_core_and_as_megatron_lm_reads_it(runs):
    """megatron-core 0.16.1's own OptimizerParamScheduler resumes from the course's common.pt (the LR of sample 24
    equals the course scheduler's); ``args`` is a Namespace with the consumed samples, as Megatron-LM's
    load_checkpoint reads it (getattr)."""
    import argparse

    import torch

    from course_lib.optimizer import LRScheduler
    from course_lib.training.safe_load import torch_load

    scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    common = torch_load(runs["root"] / "dist" / "iter_0000003" / "common.pt")
    args = common["args"]
    assert isinstance(args, argparse.Namespace) and (args.consumed_train_samples, args.hidden_size) == (24, 64)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    mcore = scheduler.OptimizerParamScheduler(sgd, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0,
                                              lr_decay_steps=1, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                              wd_incr_steps=1, wd_incr_style="constant")   # all taken from the file
    mcore.load_state_dict(common["opt_param_scheduler"])
    ours = LRScheduler(3e-3, 0.0, args.lr_decay_style, 2 * 8, 6 * 8)
    ours.step(24)
    assert mcore.num_steps == 24 and sgd.param_groups[0]["lr"] == pytest.approx(ours.get_lr(), rel=1e-12)
    assert (mcore.lr_warmup_steps, mcore.lr_decay_steps, mcore.max_lr) == (16, 48, 3e-3)
    # megatron-core reads the whole checkpoint's sharded metadata (its --dist-ckpt-strictness checks need it):
    # the RNG states are its ShardedObjects, one per (PP, TP) rank of the TP2 x PP2 save, each a list of 2 DP states
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    md = load_sharded_metadata(str(runs["root"] / "dist" / "iter_0000003"))
    rng = sorted(k for k in md if k.startswith("rng_state"))
    assert rng == [f"rng_state/shard_{pp}.{tp}_2.2" for pp in range(2) for tp in range(2)], rng


def test_inspect_names_every_tensor_and_the_ranks_that_hold_its_slices(runs, capsys):
    assert cli(["checkpoint", "inspect", str(runs["root"] / "dist")]) == 0
    out = capsys.readouterr().out
    assert "iteration 3 | format torch_dist | consumed samples 24 | saved under TP2 x PP2 x CP1 x DP2" in out
    # megatron-core's key: the 4 layers stacked, each layer's TP2 halves; layers 0-1 from stage 0's ranks 0-3
    row = next(line for line in out.splitlines() if line.split()[:1] == ["decoder.layers.mlp.linear_fc1.weight"])
    assert "[4, 256, 64]" in row and "262144" in row
    slices = re.findall(r"r(\d) \[(\d):\d, (\d+:\d+), 0:64\]", row)
    assert sorted((layer, rows) for _, layer, rows in slices) == [
        (str(layer), rows) for layer in range(4) for rows in ("0:128", "128:256")]
    assert all((int(rank) < 4) == (int(layer) < 2) for rank, layer, _ in slices)
    assert "__7_0.distcp" in out
    assert cli(["checkpoint", "inspect", str(runs["root"] / "legacy")]) == 0
    assert "mp_rank_01_001" in capsys.readouterr().out
    assert cli(["checkpoint", "inspect", str(runs["root"] / "empty")]) == 2


def test_inspect_draws_the_slice_map_of_what_each_rank_holds_and_writes(runs, tmp_path, capsys, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from PIL import Image

    from course_lib.training import checkpoint_inspect
    from course_lib.training.checkpoint_inspect import describe_checkpoint, holders, slice_map_figure

    d = describe_checkpoint(runs["root"] / "dist")
    tensors = {t["key"]: t for t in d["tensors"]}
    fc1 = tensors["decoder.layers.mlp.linear_fc1.weight"]     # [4 layers, 256, 64]
    held = holders(d["layout"], fc1)                      # TP2 x PP2 x DP2: stage 0 is ranks 0-3, DP pairs (0, 2), (1, 3)
    assert sorted(held) == list(range(8)) and {c[0] for c in fc1["chunks"]} <= set(range(8))
    assert all({o[0] for o, _, _ in held[r]} == ({0, 1} if r < 4 else {2, 3}) for r in range(8))   # a stage's layers
    assert held[0] == [(c[1], c[2], c[0]) for c in fc1["chunks"] if c[1][1:] == (0, 0) and c[1][0] < 2]
    assert held[0] == held[2] and held[0][0][2] in (0, 2)              # DP replicas: one of them wrote it
    assert held[0][0][:2] == ((0, 0, 0), (1, 128, 64))
    norm = holders(d["layout"], tensors["decoder.layers.self_attention.linear_qkv.layer_norm_weight"])
    assert sorted(norm) == list(range(8)) and len({h[0][2] for r, h in norm.items() if r < 4}) == 1  # layer 0: 1 writer
    fig = slice_map_figure(d, r"^decoder\.layers\.mlp\.linear_fc1\.weight$")
    patches = [p for p in fig.axes[0].patches if p.get_fill() and p.get_alpha() is not None]
    solid = [p for p in patches if p.get_alpha() == 1.0]
    assert len(solid) == 8 and len(patches) == 16          # 4 layers x 2 chunks written once, held twice
    out = tmp_path / "map.png"
    argv = ["checkpoint", "inspect", str(runs["root"] / "dist"), "--out", str(out), "--tensors", "linear_fc1"]
    assert cli(argv) == 0 and Image.open(out).size[0] > 500
    assert "wrote" in capsys.readouterr().err
    assert cli(argv) == 2 and "already exists; pass --force" in capsys.readouterr().err
    (tmp_path / "m.svg").write_text("an older map")       # --force replaces it (one render proves both)
    assert cli(argv[:-2] + ["--force", "--out", str(tmp_path / "m.svg")]) == 0
    assert (tmp_path / "m.svg").read_bytes().startswith(b"<?xml")
    capsys.readouterr()
    monkeypatch.setattr(checkpoint_inspect, "MAP_MAX_TENSORS", 40)     # the 48 tensors (16 keys x model, Adam)
    for extra, message in ((["--out", str(tmp_path / "m.jpg")], "the slice map is written as .svg, .png, .pdf"),
                           (["--out", str(tmp_path / "x.png"), "--tensors", "("], "is not a regular expression"),
                           (["--out", str(tmp_path / "x.png"), "--tensors", "nothing"], "matches none of the"),
                           (["--out", str(tmp_path / "x.png"), "--tensors", "."], "matches 48 tensors")):
        assert cli(["checkpoint", "inspect", str(runs["root"] / "dist"), *extra]) == 2
        assert message in capsys.readouterr().err, message
    assert cli(["checkpoint", "inspect", str(runs["root"] / "legacy"), "--out", str(tmp_path / "l.png")]) == 2
    assert "legacy torch checkpoint" in capsys.readouterr().err and not (tmp_path / "l.png").exists()


@pytest.mark.parametrize("extra, message", [
    (["--save-interval", "2"], "save_interval=2 has no folder to save into; add --save DIR"),
    (["--finetune"], "finetune=True says what to load, but there is no --load"),
    (["--save", "/proc/x", "--save-interval", "2"], "--save /proc/x"),
    (["--save", "{tmp}"], "without --save-interval: Megatron's validate_args asserts a save interval"),
    (["--save", "{tmp}", "--save-interval", "2", "--num-experts", "2", "--ckpt-format", "torch"], "num_experts=2 with --ckpt-format torch"),
    (["--save", "{tmp}", "--save-interval", "2", "--exit-interval", "0"], "exit_interval"),
    (["--save", "{tmp}", "--save-interval", "2", "--ckpt-format", "fsdp_dtensor"], "the course writes its checkpoints as torch_dist or torch"),
])
def test_checkpoint_flags_fail_in_one_line(extra, message, tmp_path):
    argv = BASE + [a.replace("{tmp}", str(tmp_path)) for a in extra]
    with pytest.raises(ValueError) as err:
        validate_args(parse_args(argv), 1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_defaults_are_megatrons():
    a = validate_args(parse_args(BASE), 1).namespace()
    assert (a.ckpt_format, a.save, a.load, a.save_interval, a.exit_interval) == ("torch_dist", None, None, None, None)
    assert not (a.no_load_optim or a.no_load_rng or a.finetune)
    for fmt in ("torch_dcp", "fsdp_dtensor"):   # Megatron's other formats: accepted while nothing is saved
        assert validate_args(parse_args(BASE + ["--ckpt-format", fmt]), 1).namespace().ckpt_format == fmt
