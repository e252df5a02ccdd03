"""`ckptconv plan`: what a run would do, from a checkpoint or a shapes-only description, without data."""
import json
import math

import pytest

from ckptconv.jobs.plan import CPU_GBPS, PER_PIECE_RSS, PER_TENSOR_RSS, PER_TENSOR_SECONDS
from ckptconv.run.share import assign
from tests.helpers import DATA, run, split_all_rules

GROK = DATA / "grok1_tensors.json"


@pytest.mark.parametrize("hosts", [1, 2, 8])
def test_grok1_real_shapes_at_tp8(hosts):
    r = run("plan", GROK, "--tp", 8, "--hosts", hosts, "--disk-gbps", 2, "--json")
    assert r.exit_code == 0, r.stderr
    plan = json.loads(r.stdout)
    table = json.loads(GROK.read_text())["tensors"]
    tensor_bytes = sum(math.prod(t[k]["shape"]) * (1 if t[k]["dtype"] == "int8" else 2) for t in table if t["quantized"]
                       for k in ("weight", "scales")) + sum(math.prod(t["shape"]) * 4 for t in table if not t["quantized"])
    assert plan["source_bytes"] == tensor_bytes and plan["rules"] == "grok-1"
    assert round(tensor_bytes / 1e9, 2) == 318.24  # the release's 318 GB, without pickle framing
    assert [u["name"] for u in plan["units"]] == [f"rank-{i:05d}" for i in range(8)]
    per_process = [p["bytes_written"] for p in plan["processes"]]
    assert len(per_process) == hosts and max(per_process) - min(per_process) <= max(u["bytes"] for u in plan["units"])
    assert sum(per_process) == sum(u["bytes"] for u in plan["units"])
    busiest = max(plan["processes"], key=lambda p: p["seconds"])
    assert busiest["tensors_written"] == len(busiest["units"]) * plan["tensor_count"]   # every tensor per rank dir
    bytes_ = max(per_process)   # the slower of disk (read + write at 2 GB/s) and CPU, plus the per-tensor work
    assert plan["seconds"] == pytest.approx(max(2 * bytes_ / 2e9, bytes_ / (CPU_GBPS["reshard"] * 1e9))
                                            + PER_TENSOR_SECONDS["reshard"] * busiest["tensors_written"])


def test_estimates_grow_with_the_tensor_count_not_the_bytes(tmp_path):
    """Two shapes-only checkpoints of the same bytes, 10 and 10,000 tensors: memory and time grow
    with the count (per-tensor bookkeeping), memory does not with the bytes."""
    def plan(n, rows):
        path = tmp_path / f"{n}.json"
        path.write_text(json.dumps({"tensors": [{"name": f"t{i}", "shape": [rows, 1024], "dtype": "bfloat16"}
                                                for i in range(n)]}))
        return json.loads(run("plan", path, "--json").stdout)["processes"][0]
    few, many = plan(10, 10000), plan(10000, 10)
    assert few["bytes_written"] == pytest.approx(many["bytes_written"], rel=0.01)   # (headers differ)
    assert many["peak_rss_bytes"] - few["peak_rss_bytes"] == pytest.approx(PER_TENSOR_RSS["convert"] * 9990, rel=0.01)
    assert many["seconds"] - few["seconds"] == pytest.approx(PER_TENSOR_SECONDS["convert"] * 9990, rel=0.01)


def test_a_reshards_memory_is_per_tensor_and_per_rank_piece(tmp_path):
    """A reshard holds every tensor's record and plan in each process, and per rank piece it writes
    only its digest (pieces are made as they are written): more ranks cost pieces, not tensors."""
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"tensors": [{"name": f"t{i}", "shape": [8, 16], "dtype": "float32"}
                                            for i in range(10000)]}))
    rules = split_all_rules(tmp_path)

    def peak(tp, hosts=1):
        r = run("plan", path, "--tp", tp, "--rules", rules, "--hosts", hosts, "--json")
        assert r.exit_code == 0, r.stderr
        # (less the bytes written: a small write touches only that much of the staging buffers)
        return [p["peak_rss_bytes"] - p["bytes_written"] for p in json.loads(r.stdout)["processes"]]
    (two,), (eight,) = peak(2), peak(8)
    assert eight - two == pytest.approx(PER_PIECE_RSS * 10000 * 6, rel=0.01)
    four_hosts = peak(8, hosts=4)   # two rank directories each, every tensor planned in each
    assert four_hosts == [two] * 4
    assert two - PER_PIECE_RSS * 20000 > PER_TENSOR_RSS["reshard"] * 10000


def test_plan_of_a_checkpoint_matches_what_convert_writes(hf_llama, tmp_path):
    r = run("plan", hf_llama["dir"], "--max-shard-size", "60KB", "--hosts", 2, "--json")
    plan = json.loads(r.stdout)
    out = tmp_path / "out"
    assert run("convert", hf_llama["dir"], out, "--max-shard-size", "60KB", "--quiet").exit_code == 0
    assert {u["name"]: u["bytes"] for u in plan["units"]} == \
        {p.name: p.stat().st_size for p in out.glob("model-*.safetensors")}


def test_assign_balances_largest_first():
    assert assign([5, 1, 4, 2, 3], 2) == [0, 0, 1, 0, 1]  # 5 -> p0, 4 -> p1, 3 -> p1, 2 -> p0, 1 -> p0 (tie)
    assert assign([], 3) == [] and assign([7], 4) == [0]


def test_shapes_only_description_cannot_be_converted(tmp_path):
    r = run("convert", GROK, tmp_path / "out")
    assert r.exit_code == 2 and "holds no tensor data" in r.stderr and not (tmp_path / "out").exists()
