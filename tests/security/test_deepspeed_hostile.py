"""Hostile and inconsistent DeepSpeed ZeRO checkpoints: the real DeepSpeed files committed under
tests/fixtures/data/deepspeed/, with a rank missing or twice, files of another run, a lying shape, a
truncated file, a `latest` leading elsewhere, pipeline layer files missing, twice, of a huge index,
of other shapes or of tensor-parallel ranks, expert files, or a pickle that would run
code. Each must be refused with exit 2 and one line naming the file and what is wrong, nothing
written. Attacks (code, links leading out, a truncated file, classes off the allowlist) run the real
CLI in a fresh process under a memory cap and a timeout, with every file it opens recorded;
inconsistent files run it in this process (`refused_here`: the same line, a second each saved)."""
import os
import shutil

import pytest
import torch

from tests.fixtures.attacks import Reduce
from tests.helpers import DATA, assert_clean, assert_refused, cli, patch_pickle, run

FIXTURES = DATA / "deepspeed"


def copy(name, tmp_path):
    shutil.copytree(FIXTURES / name, tmp_path / name)
    return tmp_path / name, tmp_path / name / "global_step2"


def convert(src, tmp_path):
    out = tmp_path / "out"
    return cli("convert", src, out), out


def refused(src, tmp_path, *fragments):
    r, out = convert(src, tmp_path)
    assert_refused(r, out, *fragments, src=src)
    assert not out.exists()


def refused_here(src, tmp_path, *fragments):
    """The CLI in this process: exit 2, one line holding every fragment, nothing at or beside OUT."""
    out = tmp_path / "out"
    r = run("convert", src, out)
    lines = r.stderr.splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("ckptconv: error: "), r.stderr
    assert_clean(r.stderr)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))) == []


def test_a_missing_rank_is_refused(tmp_path):
    src, tag = copy("z2-fp32-mlp", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused_here(src, tmp_path, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "partition_count says 2 ranks", "rank 1's", "is missing")
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").rename(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    refused_here(src, tmp_path, "the optimizer state of rank 0 is missing")


def test_a_rank_twice_is_refused(tmp_path):
    src, tag = copy("z2-fp32-mlp", tmp_path)
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    refused_here(src, tmp_path, "holds rank 1's optimizer state", "two runs' files")


def test_a_missing_stage3_model_state_is_refused(tmp_path):
    src, tag = copy("z3-bf16-frozen-tied", tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    refused_here(src, tmp_path, "the model state of rank 1 is missing")


def _stage_1(b):
    """ZeroStageEnum(2) -> ZeroStageEnum(1): the BININT1 right after the global (and its memo)."""
    at = b.index(b"ZeroStageEnum\n") + len(b"ZeroStageEnum\n")
    k = b.index(b"K\x02", at)
    return b[:k] + b"K\x01" + b[k + 2:]


@pytest.mark.parametrize("edit, fragment", [(lambda b: b.replace(b"0.19.8", b"0.19.7"), "ds_version '0.19.7'"),
                                            (_stage_1, "ZeRO stage 1")])
def test_files_of_another_run_are_refused(tmp_path, edit, fragment):
    src, tag = copy("z2-fp32-mlp", tmp_path)
    target = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    patch_pickle(target, edit)
    refused_here(src, tmp_path, "zero_pp_rank_1_mp_rank_00_optim_states.pt", fragment, "different runs")


def mixed(name, tmp_path, pattern):
    """Variant `name`, which the real DeepSpeed saved after step 1 and after step 2, with the files
    of global_step2/ that match `pattern` taken from global_step1/."""
    src, tag = copy(name, tmp_path)
    taken = sorted((src / "global_step1").glob(pattern))
    assert taken
    for f in taken:
        shutil.copy(f, tag / f.name)
    return src, tag


@pytest.mark.parametrize("name, pattern, fragment", [
    # ZeRO-3: rank 1's files, or only its optimizer state, of step 1 beside rank 0's of step 2 ...
    ("z3-fp32-saves", "zero_pp_rank_1_*", "zero_pp_rank_1_mp_rank_00_model_states.pt: rank 1: global_steps 1, "
                                          "rank 0's 2"),
    ("z3-fp32-saves", "zero_pp_rank_1_*_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1: "
                                                          "optimizer step 1, rank 0's 2"),
    # ... or rank 0's of step 1 (the first file is the one the others are held to)
    ("z3-fp32-saves", "zero_pp_rank_0_*", "zero_pp_rank_1_mp_rank_00_model_states.pt: rank 1: global_steps 2, "
                                          "rank 0's 1"),
    # ZeRO-2: one model-state file; each rank's optimizer state records the optimizer's step
    ("z2-bf16-saves", "bf16_zero_pp_rank_1_*", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1: optimizer "
                                               "step 1, rank 0's 2"),
])
def test_ranks_of_two_saves_are_refused_naming_the_ranks_and_their_steps(tmp_path, name, pattern, fragment):
    """Issue 7: such a directory converted into tensors half of one step and half of the other, and
    verify --against passed."""
    src, tag = mixed(name, tmp_path, pattern)
    for s in (src, tag):
        refused_here(s, tmp_path, fragment, "files of different saves")


def test_verify_against_ranks_of_two_saves_is_refused(tmp_path):
    out = tmp_path / "converted"
    assert run("convert", FIXTURES / "z3-fp32-saves", out, "--quiet").exit_code == 0
    src, _ = mixed("z3-fp32-saves", tmp_path, "zero_pp_rank_1_*")
    r = run("verify", out, "--against", src)
    assert r.exit_code == 2 and "rank 1: global_steps 1, rank 0's 2: files of different saves" in r.stderr, r.stderr


def test_a_rank_number_in_a_name_costs_nothing_beyond_the_files(tmp_path):
    """Issue 8: rank 999,999,999 in a name made a list of a billion ranks (1.8 GB, MemoryError after
    21 s); the missing rank is found in as many steps as there are files, in a capped process."""
    src, tag = copy("z2-fp32-mlp", tmp_path)
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_999999999_mp_rank_00_optim_states.pt")
    refused(src, tmp_path, "the optimizer state of rank 2 is missing", "ranks 0-999999999")


def test_shapes_the_partitions_do_not_hold_are_refused(tmp_path):
    src, tag = copy("z2-fp32-mlp", tmp_path)

    def edit(b):   # param_shapes: fc1.weight [13, 7] -> [13, 9]
        at = b.index(b"fc1.weight", b.index(b"param_shapes"))
        k = b.index(b"K\rK\x07", at)
        return b[:k] + b"K\rK\x09" + b[k + 4:]
    patch_pickle(tag / "mp_rank_00_model_states.pt", edit)
    refused_here(src, tmp_path, "zero_pp_rank_0_mp_rank_00_optim_states.pt", "parameter group 0", "need 336 elements", "hold 310 (156, 154)")


def test_stage3_shapes_the_partitions_do_not_hold_are_refused(tmp_path):
    src, tag = copy("z3-bf16-frozen-tied", tmp_path)
    for r in (0, 1):
        def edit(b):   # embed.weight [11, 7] -> [11, 8]
            at = b.index(b"embed.weight", b.index(b"param_shapes"))
            k = b.index(b"K\x0bK\x07", at)
            return b[:k] + b"K\x0bK\x08" + b[k + 4:]
        patch_pickle(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", edit)
    refused_here(src, tmp_path, "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "ceil(numel / 2)")


def test_a_truncated_rank_file_is_refused(tmp_path):
    src, tag = copy("z3-bf16-frozen-tied", tmp_path)
    f = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:3000])
    refused(src, tmp_path, "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")


@pytest.mark.parametrize("tag", ["../elsewhere", "/etc", "global_step2\nglobal_step3", ".."])
def test_latest_naming_anything_but_a_tag_is_refused(tmp_path, tag):
    src, _ = copy("z1-fp32-mlp", tmp_path)
    (src / "latest").write_text(tag)
    refused_here(src, tmp_path, "latest", "not a plain directory name")


def test_latest_leading_outside_is_refused_unread(tmp_path):
    src, _ = copy("z1-fp32-mlp", tmp_path)
    (tmp_path / "secret").write_text("global_step2")
    (src / "latest").unlink()
    os.symlink(tmp_path / "secret", src / "latest")
    refused(src, tmp_path, "latest: leads outside the checkpoint")


def test_a_tag_directory_leading_outside_is_refused(tmp_path):
    src, tag = copy("z1-fp32-mlp", tmp_path)
    shutil.move(tag, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tag)
    refused(src, tmp_path, "leads outside the checkpoint")


PIPE = "z1-bf16-pipe-tied"   # DeepSpeed's PipelineModule, two stages: layer_NN-model_states.pt, mp_rank_00/01


def test_a_pipeline_layer_file_missing_is_refused(tmp_path):
    src, tag = copy(PIPE, tmp_path)
    (tag / "layer_01-model_states.pt").unlink()
    refused_here(src, tmp_path, "layer file of layer 1", "layer_01-model_states.pt", "pipeline stage 0", "is missing")


def test_two_files_claiming_one_layer_are_refused(tmp_path):
    src, tag = copy(PIPE, tmp_path)
    shutil.copy(tag / "layer_01-model_states.pt", tag / "layer_01-model_00-model_states.pt")
    refused_here(src, tmp_path, "holds layer 1, as", "two files claim one layer")


def test_a_huge_layer_index_is_refused(tmp_path):
    src, tag = copy(PIPE, tmp_path)
    shutil.copy(tag / "layer_01-model_states.pt", tag / "layer_999999999-model_states.pt")
    refused(src, tmp_path, "layer_999999999-model_states.pt", "layer index 999999999 is past the last layer")
    (tag / "layer_999999999-model_states.pt").rename(tag / "layer_07-model_states.pt")   # (within the bound)
    refused_here(src, tmp_path, "layer_07-model_states.pt", "of layer 7, which no pipeline stage", "names")
    (tag / "layer_07-model_states.pt").unlink()
    shutil.copy(tag / "layer_01-model_states.pt", tag / "layer_0000000001-model_states.pt")   # 10 digits
    refused_here(src, tmp_path, "layer_0000000001-model_states.pt", "does not spell its layer")


def test_a_tensor_parallel_pipeline_is_refused(tmp_path):
    """Megatron-DeepSpeed's layer_NN-model_XX files of tensor-parallel rank XX: refused, pointing at its tools."""
    src, tag = copy(PIPE, tmp_path)
    for f in list(tag.glob("layer_*")):
        f.rename(tag / f.name.replace("-model_states", "-model_00-model_states"))
    r = run("convert", src, tmp_path / "plain")   # (rank 00 alone, named the Megatron-DeepSpeed way: read)
    assert r.exit_code == 0, r.stderr
    shutil.copy(tag / "layer_01-model_00-model_states.pt", tag / "layer_01-model_01-model_states.pt")
    refused_here(src, tmp_path, "layer_01-model_01-model_states.pt", "tensor-parallel rank 1", "not supported",
                 "ds_to_universal")
    (tag / "layer_01-model_01-model_states.pt").unlink()
    state = torch.load(tag / "mp_rank_01_model_states.pt", weights_only=False)   # (plain data: no DeepSpeed class)
    state["checkpoint_parallel_dimensions"]["tp_degree"] = 2
    torch.save(state, tag / "mp_rank_01_model_states.pt")
    refused_here(src, tmp_path, "mp_rank_01_model_states.pt", "tp_degree is 2", "no tensor parallelism")


def test_a_layer_file_of_other_shapes_is_refused(tmp_path):
    src, tag = copy(PIPE, tmp_path)
    shutil.copy(tag / "layer_01-model_states.pt", tag / "layer_03-model_states.pt")   # 1.weight [7, 6] as layer 3
    refused_here(src, tmp_path, "layer_03-model_states.pt", "'weight' is [7, 6]", "param_shapes says [6, 7]")


def test_a_data_parallel_rank_of_one_stage_missing_is_refused(tmp_path):
    src, tag = copy("z1-bf16-pipe-dp2", tmp_path)   # two stages of two data-parallel ranks
    (tag / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    refused_here(src, tmp_path, "optimizer state of rank 0 of pipeline stage 1 is missing")
    shutil.copy(FIXTURES / "z1-bf16-pipe-dp2" / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt", tag)
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    refused_here(src, tmp_path, "rank 1 of pipeline stage 0 is missing", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")


def test_a_pipeline_stage_missing_or_of_another_run_is_refused(tmp_path):
    src, tag = copy(PIPE, tmp_path)
    (tag / "mp_rank_01_model_states.pt").unlink()
    refused_here(src, tmp_path, "mp_rank_01_model_states.pt", "is missing")
    shutil.copy(FIXTURES / PIPE / "global_step2" / "mp_rank_01_model_states.pt", tag)
    bf16 = "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"
    (tag / bf16).rename(tag / "bf16_zero_pp_rank_0_mp_rank_02_optim_states.pt")
    refused_here(src, tmp_path, "pipeline stage 1", "no optimizer-state file")
    (tag / "bf16_zero_pp_rank_0_mp_rank_02_optim_states.pt").rename(tag / bf16)
    other = FIXTURES / "z1-fp32-pipeline" / "global_step2"   # stage 1 of another run: its own names
    shutil.copy(other / "mp_rank_01_model_states.pt", tag / "mp_rank_01_model_states.pt")
    refused_here(src, tmp_path, "mp_rank_01_model_states.pt", "files of different")


@pytest.mark.parametrize("extra, fragment", [
    ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "2 model-parallel ranks"),
    ("mp_rank_01_model_states.pt", "2 model-parallel ranks"),
    ("layer_01-model_00-model_states.pt", "a module state beside the pipeline's layer files"),
    ("expp_rank_0_mp_rank_00_optim_states.pt", "mixture-of-experts"),
])
def test_pipeline_tensor_and_expert_parallel_files_are_refused(tmp_path, extra, fragment):
    src, tag = copy("z2-fp32-mlp", tmp_path)
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / extra)
    refused_here(src, tmp_path, fragment)


def test_a_pickle_that_runs_code_is_refused_and_nothing_runs(tmp_path):
    src, tag = copy("z2-fp32-mlp", tmp_path)
    canary = tmp_path / "canary"
    torch.save({"optimizer_state_dict": Reduce(os.system, (f"touch {canary}",))},
               tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    refused(src, tmp_path, "zero_pp_rank_1_mp_rank_00_optim_states.pt", "'posix.system'")
    assert not canary.exists()


def test_partitions_that_repeat_one_storage_are_refused(tmp_path):
    """2,000 "partitions" that are the same 1 MiB storage would be 2 GiB of masters from a 3 MB file."""
    from tests.fixtures import zero_layout
    src = tmp_path / "zero"
    zero_layout.write(src, [("w", (1024, 512))], stage=3)
    f = src / "global_step1" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    part = torch.zeros(1 << 18)
    with zero_layout.deepspeed_names():
        state = zero_layout.optim_states(3, 2, part, moments=False)
        state["optimizer_state_dict"]["fp32_flat_groups"] = [part] * 2000
        torch.save(state, f)
    refused(src, tmp_path, f.name, "describe", "over 16x")


def test_a_deepspeed_class_off_the_allowlist_is_refused(tmp_path):
    src, tag = copy("z2-fp32-mlp", tmp_path)
    # LossScaler -> LossScalerX: same length is not possible; a class name of the same length instead
    patch_pickle(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 lambda b: b.replace(b"loss_scaler\nLossScaler", b"loss_scaler\nLossScalar"))
    refused(src, tmp_path, "deepspeed.runtime.fp16.loss_scaler.LossScalar", "not on the allowlist")


@pytest.mark.parametrize("old, new, fragment", [
    (b"2.seen", b"1.bias", "buffer '1.bias' is also a parameter of pipeline stage 0"),   # it said "stage 0 and stage 0"
    (b"2.scale", b"02.scal", "is not a PipelineModule name"),                           # a layer index spelled with a zero
])
def test_a_buffer_named_like_a_parameter_or_spelled_otherwise_is_refused(tmp_path, old, new, fragment):
    """Outside attack on issue 40: the message named one stage twice, and `02.scale` was read as
    layer 2's; the same length keeps the pickle's framing (patch_pickle)."""
    src, tag = copy(PIPE, tmp_path)
    at = tag / "mp_rank_00_model_states.pt"
    patch_pickle(at, lambda b: b.replace(old, new, 1) if b.count(old) else b)
    refused_here(src, tmp_path, fragment)
