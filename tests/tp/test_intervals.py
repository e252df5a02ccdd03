"""The tensor-parallel planners on plain data, no files: how one rule splits one shape (`split`),
how scales follow their quantized weight, expert groups, and how rules are chosen (`choose_rules`)
from a preset, a config, a marker name or the rules a reshard output recorded."""
from types import SimpleNamespace

import pytest

from ckptconv import dtypes
from ckptconv.errors import BadInput, UsageError
from ckptconv.formats.mesh import recorded_cut
from ckptconv.tp.intervals import plan, split
from ckptconv.tp.presets import PRESETS, MeshSpec, choose_rules
from ckptconv.tp.rules import Rule, RuleSet

F32 = dtypes.BY_CODE["F32"]


def tensor(name, *shape):
    return SimpleNamespace(name=name, shape=tuple(shape), dtype=F32)


@pytest.mark.parametrize("kind, layout, shape, axis", [
    ("column", "torch", (8, 4), 0), ("row", "torch", (8, 4), 1),     # torch Linear: [out, in]
    ("column", "jax", (4, 8), 1), ("row", "jax", (4, 8), 0),         # jax: [in, out]
    ("column", "torch", (8,), 0), ("row", "torch", (8,), None),      # biases: split with columns only
    ("vocab", "torch", (8, 4), 0), ("replicate", "torch", (8, 4), None),
])
def test_rule_kinds_choose_the_axis(kind, layout, shape, axis):
    got_axis, ranges = split("w", shape, Rule("w", kind), layout, 2)
    assert got_axis == axis
    if axis is not None:
        half = shape[axis] // 2
        assert ranges == [[(0, half)], [(half, shape[axis])]]


def test_whole_heads_per_rank():
    assert split("q", (8, 16), Rule("q", "column", heads=4, head_dim=2), "torch", 2) == (0, [[(0, 4)], [(4, 8)]])


def test_fewer_kv_heads_than_ranks_are_shared():
    _, ranges = split("k", (4, 16), Rule("k", "column", kv_heads=2, head_dim=2), "torch", 4)
    assert ranges == [[(0, 2)], [(0, 2)], [(2, 4)], [(2, 4)]]


def test_fused_qkv_takes_each_part_per_rank():
    # 2 query heads and 1 kv head of 2: rows [q0 q1 | k | v]
    _, ranges = split("qkv", (8, 4), Rule("qkv", "qkv", heads=2, kv_heads=1, head_dim=2), "torch", 2)
    assert ranges == [[(0, 2), (4, 6), (6, 8)], [(2, 4), (4, 6), (6, 8)]]


def test_fused_gate_up_halves_split_alike():
    _, ranges = split("gu", (8, 4), Rule("gu", "gate_up"), "torch", 2)
    assert ranges == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]


@pytest.mark.parametrize("shape, rule", [
    ((6, 4), Rule("w", "column")),                                   # 6 rows over 4 ranks
    ((8, 4), Rule("w", "column", heads=3, head_dim=2)),              # 3 heads x 2 is not 8
    ((6, 4), Rule("w", "column", heads=3, head_dim=2)),              # 3 heads over 4 ranks
    ((7, 4), Rule("w", "gate_up")),
])
def test_what_cannot_be_split_evenly_is_refused(shape, rule):
    with pytest.raises(BadInput):
        split("w", shape, rule, "torch", 4)


def test_grouped_scales_follow_their_weight_along_k():
    rules = RuleSet("t", "jax", [Rule(r"w\.weight", "row")])      # jax row: axis 0 = K
    w, s = tensor("w.weight", 16, 8), tensor("w.scales", 4, 8)    # 4 groups of 4 rows
    plans = {p.name: p for p in plan([w, s], rules, 2)}
    assert plans["w.weight"].ranges == [[(0, 8)], [(8, 16)]]
    assert plans["w.scales"].axis == 0 and plans["w.scales"].ranges == [[(0, 2)], [(2, 4)]]


def test_a_group_straddling_two_ranks_is_refused():
    rules = RuleSet("t", "jax", [Rule(r"w\.weight", "row")])
    with pytest.raises(BadInput, match="straddle"):
        plan([tensor("w.weight", 16, 8), tensor("w.scales", 2, 8)], rules, 4)   # groups of 8 rows, pieces of 4


def test_one_group_of_scales_is_replicated():
    rules = RuleSet("t", "jax", [Rule(r"w\.weight", "row")])
    plans = {p.name: p for p in plan([tensor("w.weight", 16, 8), tensor("w.scales", 1, 8)], rules, 2)}
    assert plans["w.scales"].axis is None


def test_expert_groups_split_each_expert_by_tp():
    """--ep cuts the expert axis, tp each expert's own axis: a piece cut on two axes (boxes)."""
    rules = RuleSet("t", "jax", [Rule("moe", "column", experts=True)])
    (p,) = plan([tensor("moe", 4, 8, 8)], rules, tp=2, ep=2)
    assert p.axis == 2 and p.ranges == [[(0, 4)], [(4, 8)], [(0, 4)], [(4, 8)]]
    assert p.outer == (0, [(0, 2), (0, 2), (2, 4), (2, 4)])
    assert [p.piece_shape(r) for r in range(4)] == [(2, 8, 4)] * 4
    assert recorded_cut(p)["boxes"][3] == [{"0": [2, 4], "2": [4, 8]}]


def test_expert_groups_of_a_fused_gate_up_keep_gate_then_up_per_rank():
    rules = RuleSet("t", "torch", [Rule("gu", "gate_up", experts=True)])
    (p,) = plan([tensor("gu", 4, 8, 3)], rules, tp=2, ep=2)   # [E, 2I, H]
    assert p.axis == 1 and p.ranges[1] == [(2, 4), (6, 8)] and p.outer[1][1] == (0, 2)
    assert recorded_cut(p)["boxes"][2] == [{"0": [2, 4], "1": [0, 2]}, {"0": [2, 4], "1": [4, 6]}]


def test_expert_groups_at_tp_1_are_whole_experts():
    rules = RuleSet("t", "torch", [Rule("gu", "gate_up", experts=True)])
    (p,) = plan([tensor("gu", 4, 8, 3)], rules, tp=1, ep=2)
    assert p.axis == 0 and p.outer is None and recorded_cut(p) == {"ranges": [[[0, 2]], [[2, 4]]]}


def test_a_tensor_with_no_elements_is_replicated():
    rules = RuleSet("t", "torch", [Rule("gu", "gate_up", experts=True), Rule("w", "column")])
    plans = plan([tensor("gu", 4, 0, 3), tensor("w", 0, 8)], rules, tp=2, ep=2)
    assert [p.axis for p in plans] == [None, None] and plans[0].rule == "empty: replicate"


def test_per_expert_tensors_need_as_many_experts_in_every_group():
    rules = RuleSet("t", "torch", [Rule(r".*\.experts\.\d+\.w", "column")])
    with pytest.raises(BadInput, match="6 experts cannot be split over ep=4"):
        plan([tensor(f"m.experts.{e}.w", 8, 4) for e in range(6)], rules, tp=1, ep=4)


def test_experts_split_on_their_own_axis_stay_whole_per_group():
    rules = RuleSet("t", "jax", [Rule("moe", "expert", experts=True)])
    (p,) = plan([tensor("moe", 4, 8)], rules, tp=2, ep=2)
    assert p.axis == 0 and p.outer is None and p.ranges == [[(0, 2)], [(0, 2)], [(2, 4)], [(2, 4)]]


def test_scales_follow_their_weights_expert_groups():
    rules = RuleSet("t", "jax", [Rule(r"w\.weight", "row", experts=True)])
    plans = {p.name: p for p in plan([tensor("w.weight", 4, 16, 8), tensor("w.scales", 4, 2, 8),
                                      tensor("v.weight", 4, 16, 8), tensor("v.scales", 4, 1, 8)],
                                     RuleSet("t", "jax", rules.rules + [Rule(r"v\.weight", "row", experts=True)]),
                                     tp=2, ep=2)}
    s = plans["w.scales"]
    assert s.axis == 1 and s.ranges[1] == [(1, 2)] and s.outer == plans["w.weight"].outer
    one = plans["v.scales"]   # one group of K: cut by expert groups only
    assert one.axis == 0 and one.outer is None and one.ranges == [[(0, 2)], [(0, 2)], [(2, 4)], [(2, 4)]]


def test_unmatched_tensors_are_replicated_and_said_so():
    (p,) = plan([tensor("norm", 8)], RuleSet("t", "torch", [Rule("w", "column")]), 2)
    assert p.axis is None and p.rule == "replicate (no rule matched)"


# --- choosing rules


def ckpt(names, config=None, recorded=None):
    return SimpleNamespace(tensors=[tensor(n, 4) for n in names], model_files=[], config=config,
                           recorded_rules=recorded)


def test_config_model_type_picks_the_preset_and_its_head_counts():
    rules = choose_rules(ckpt(["x"], {"model_type": "mistral", "num_attention_heads": 8, "num_key_value_heads": 2,
                                      "hidden_size": 64}), MeshSpec(2))
    assert rules.name == "llama" and rules.params == {"heads": 8, "kv_heads": 2, "head_dim": 8}


def test_a_marker_name_picks_the_preset_without_config():
    rules = choose_rules(ckpt(["transformer.decoder_layer_0.moe.linear.w"]), MeshSpec(8))
    assert rules.name == "grok-1" and rules.params == PRESETS["grok-1"].defaults


def test_overrides_beat_the_config():
    rules = choose_rules(ckpt(["model.layers.0.self_attn.q_proj.weight"], {"num_attention_heads": 8,
                                                                            "hidden_size": 64}),
                         MeshSpec(2, heads={"heads": 4, "kv_heads": None, "head_dim": 16}))
    assert rules.name == "llama" and rules.params["heads"] == 4 and rules.params["head_dim"] == 16


def test_recorded_rules_are_rebuilt_from_the_preset_not_run():
    recorded = {"name": "llama", "layout": "torch", "params": {"heads": 4, "kv_heads": 4, "head_dim": 2},
                "rules": [{"pattern": "(a+)+$", "kind": "column"}]}   # never matched: the preset is rebuilt
    rules = choose_rules(ckpt(["x"], recorded=recorded), MeshSpec(2))
    assert rules.name == "llama" and all(r.pattern != "(a+)+$" for r in rules.rules)
    assert choose_rules(ckpt(["x"], recorded=recorded), MeshSpec(2, preset="gpt2", heads={"heads": 2,
                                                                                             "head_dim": 2})).name == "gpt2"


def test_recorded_rules_of_a_file_must_be_given_again():
    with pytest.raises(UsageError, match="--rules"):
        choose_rules(ckpt(["x"], recorded={"name": "rules file r.toml", "params": {}}), MeshSpec(2))


def test_nothing_fits_is_refused_naming_the_presets():
    with pytest.raises(UsageError, match="no partition preset fits"):
        choose_rules(ckpt(["encoder.weight"]), MeshSpec(2))


def test_a_preset_without_head_counts_says_which():
    with pytest.raises(UsageError, match="no 'heads'"):
        choose_rules(ckpt(["x"], {"model_type": "llama"}), MeshSpec(2))
