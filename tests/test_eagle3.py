"""The EAGLE-3 head: official checkpoint round trip, forward, tree levels, commit, bad input.

A scaled-down head with the official key names (docs/eagle3_format.md §3) and a non-identity d2t
sits on a random 6-layer Llama target. Its outputs are checked against ``ref_forward``, an
independent plain-torch transcription of docs/eagle3_format.md §7 run causally over a node's
whole sequence of pairs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rheo_engine.config import ModelConfig, TreeConfig
from rheo_engine.io.convert_eagle3 import convert_eagle3
from rheo_engine.io.weights import load_safetensors, save_safetensors
from rheo_engine.models.eagle3 import Eagle3Head, HeadConfig
from rheo_engine.models.eagle3_drafter import Eagle3Drafter
from rheo_engine.models.llama import LlamaModel
from rheo_engine.spec import kernels
from rheo_engine.spec.draft import draft_tree
from rheo_engine.spec.verify import read_outcome

V, VD, HID, LAYERS = 64, 24, 32, 6  # target vocab, draft vocab, hidden (target = head), layers
FEATURES = (1, 3, 4)  # listed: EAGLE's default (2, 3, 3) repeats a layer for 6 layers
F_IN = len(FEATURES) * HID


def target_config(**over) -> ModelConfig:
    d = dict(vocab_size=V, hidden_size=HID, intermediate_size=48, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    return ModelConfig(**(d | over))


def random_target(cfg: ModelConfig | None = None, seed: int = 0) -> LlamaModel:
    cfg = cfg or target_config()
    g = torch.Generator().manual_seed(seed)
    from rheo_engine.models.llama import expected_shapes

    weights = {k: torch.randn(s, generator=g) * 0.3 for k, s in expected_shapes(cfg).items()}
    return LlamaModel.from_weights(cfg, weights, "cpu", torch.float32)


def head_config_dict(hidden: int = HID, **over) -> dict:
    d = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden,
         "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": VD, "rms_norm_eps": 1e-5,
         "eagle_aux_hidden_state_layer_ids": list(FEATURES), "torch_dtype": "float32"}  # fmt: skip
    return d | over


def official_state_dict(hidden: int = HID, target_hidden: int = HID, seed: int = 1) -> dict:
    """Random tensors under the official names and shapes; d2t offsets to sorted target ids."""
    g = torch.Generator().manual_seed(seed)
    D, Hq, Hkv, inter = hidden // 4, 4, 2, 40

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g) * 0.3

    used = torch.randperm(V, generator=g)[:VD].sort().values  # draft vocab, ascending target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    m = "midlayer."
    return {
        "fc.weight": r(hidden, len(FEATURES) * target_hidden),
        m + "hidden_norm.weight": 1 + r(hidden), m + "input_layernorm.weight": 1 + r(hidden),
        m + "self_attn.q_proj.weight": r(Hq * D, 2 * hidden),
        m + "self_attn.k_proj.weight": r(Hkv * D, 2 * hidden),
        m + "self_attn.v_proj.weight": r(Hkv * D, 2 * hidden),
        m + "self_attn.o_proj.weight": r(hidden, Hq * D),
        m + "post_attention_layernorm.weight": 1 + r(hidden),
        m + "mlp.gate_proj.weight": r(inter, hidden), m + "mlp.up_proj.weight": r(inter, hidden),
        m + "mlp.down_proj.weight": r(hidden, inter),
        "norm.weight": 1 + r(hidden), "lm_head.weight": r(VD, hidden) * 3,
        "d2t": used - torch.arange(VD), "t2d": t2d,
    }  # fmt: skip


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return random_target()


@pytest.fixture(scope="module")
def head(target: LlamaModel) -> Eagle3Head:
    return Eagle3Head.from_weights(
        HeadConfig.from_dict(head_config_dict(), target.cfg), official_state_dict(), target
    )


# --- independent reference (docs/eagle3_format.md §7) ----------------------------------------


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    D = x.shape[-1]
    ang = pos[:, None].double() / theta ** (torch.arange(0, D, 2).double() / D)  # [S, D/2]
    c, s = ang.cos().float()[:, None], ang.sin().float()[:, None]  # [S, 1, D/2]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


def ref_forward(sd: dict, embed: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor):
    """Causal head over S pairs (h [S, H] already fused, target ids [S]) at positions 0..S-1."""
    m, S, D = "midlayer.", h.shape[0], h.shape[1] // 4
    x = torch.cat((_norm(embed[tokens], sd[m + "input_layernorm.weight"]),
                   _norm(h, sd[m + "hidden_norm.weight"])), -1)  # fmt: skip
    pos = torch.arange(S)
    q = _rope((x @ sd[m + "self_attn.q_proj.weight"].T).view(S, 4, D), pos)
    k = _rope((x @ sd[m + "self_attn.k_proj.weight"].T).view(S, 2, D), pos)
    v = (x @ sd[m + "self_attn.v_proj.weight"].T).view(S, 2, D)
    out = torch.empty(S, 4, D)
    for head_i in range(4):  # query head i reads kv head i // 2 (GQA)
        scores = q[:, head_i] @ k[:, head_i // 2].T / D**0.5
        scores = scores.masked_fill(torch.ones(S, S).tril() == 0, float("-inf"))
        out[:, head_i] = scores.softmax(-1) @ v[:, head_i // 2]
    h1 = h + out.view(S, -1) @ sd[m + "self_attn.o_proj.weight"].T
    y = _norm(h1, sd[m + "post_attention_layernorm.weight"])
    gate = torch.nn.functional.silu(y @ sd[m + "mlp.gate_proj.weight"].T)
    h2 = h1 + (gate * (y @ sd[m + "mlp.up_proj.weight"].T)) @ sd[m + "mlp.down_proj.weight"].T
    return h2, _norm(h2, sd["norm.weight"]) @ sd["lm_head.weight"].T


def ref_path_logits(sd, embed, features, next_tokens, path_tokens) -> torch.Tensor:
    """Draft logits after a chain of tree tokens, recomputed from scratch with no tree."""
    h_in, tokens = features @ sd["fc.weight"].T, next_tokens
    h2, logits = ref_forward(sd, embed, h_in, tokens)
    for t in path_tokens:  # each step feeds the previous output h2 back with its own token
        h_in = torch.cat((h_in, h2[-1:]))
        tokens = torch.cat((tokens, torch.tensor([t])))
        h2, logits = ref_forward(sd, embed, h_in, tokens)
    return logits[-1]


def prompt_pairs(B: int, L: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, F_IN, generator=g), torch.randint(0, V, (B, L), generator=g)


# --- checkpoint -----------------------------------------------------------------------------


def test_official_checkpoint_round_trip(tmp_path: Path, target: LlamaModel, head: Eagle3Head):
    sd = official_state_dict()
    src = tmp_path / "official"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(head_config_dict()))
    torch.save(sd, src / "pytorch_model.bin")  # as DeepSpeed save_16bit_model writes it
    out = convert_eagle3(src, tmp_path / "converted")
    saved = load_safetensors(out)
    assert saved.keys() == sd.keys()
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    assert all(torch.equal(saved[k], sd[k]) for k in sd)

    loaded = Eagle3Head.from_pretrained(out, target)
    to_target = loaded.draft_to_target
    assert to_target is not None and not torch.equal(to_target, torch.arange(VD))
    assert torch.equal(to_target, torch.arange(VD) + sd["d2t"])
    assert torch.equal(to_target, sd["t2d"].nonzero().flatten())
    features, next_tokens = prompt_pairs(1, 7)
    logits = []
    for h in (head, loaded):
        drafter = Eagle3Drafter(h, max_len=32)
        drafter.prefill(features, next_tokens)
        logits.append(drafter.root_logits())
    assert logits[0].dtype == torch.float32 and logits[0].shape == (1, VD)
    assert torch.equal(logits[0], logits[1])
    ref = ref_path_logits(sd, target.embed_tokens, features[0], next_tokens[0], [])
    torch.testing.assert_close(logits[0][0], ref, atol=1e-5, rtol=1e-5)


def test_converter_accepts_safetensors_and_refuses_bad_dirs(tmp_path: Path):
    src = tmp_path / "st"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(head_config_dict()))
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin or model.safetensors"):
        convert_eagle3(src, tmp_path / "a")
    sd = official_state_dict()
    save_safetensors(sd, src / "model.safetensors")
    out = convert_eagle3(src, tmp_path / "b")
    assert torch.equal(load_safetensors(out)["d2t"], sd["d2t"])
    with pytest.raises(ValueError, match="exists and is not empty"):
        convert_eagle3(src, out)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2)}, bad / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"not an EAGLE-3 head.*fc.weight"):
        convert_eagle3(bad, tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="not found"):
        convert_eagle3(tmp_path / "missing", tmp_path / "d")


def test_from_pretrained_points_a_bin_only_dir_to_the_converter(tmp_path: Path, target):
    (tmp_path / "config.json").write_text(json.dumps(head_config_dict()))
    torch.save(official_state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="rheo_engine.io.convert eagle3"):
        Eagle3Head.from_pretrained(tmp_path, target)


def test_head_with_own_embedding_and_target_hidden_size(target: LlamaModel):
    """A head narrower than its target (70B-style): fc fuses 3 * target_hidden_size."""
    sd = official_state_dict(hidden=16, target_hidden=HID)
    cfg = HeadConfig.from_dict(head_config_dict(hidden=16, target_hidden_size=HID), target.cfg)
    with pytest.raises(ValueError, match=r"hidden_size=16 .* embed_tokens is \[64, 32\]"):
        Eagle3Head.from_weights(cfg, sd, target)
    embed = torch.randn(V, 16)
    head = Eagle3Head.from_weights(cfg, sd | {"embed_tokens.weight": embed}, target)
    features, next_tokens = prompt_pairs(1, 5)
    drafter = Eagle3Drafter(head, max_len=8)
    drafter.prefill(features, next_tokens)
    ref = ref_path_logits(sd, embed, features[0], next_tokens[0], [])
    torch.testing.assert_close(drafter.root_logits()[0], ref, atol=1e-4, rtol=1e-4)


# --- drafting -------------------------------------------------------------------------------


def test_expand_equals_recomputing_each_path(target: LlamaModel, head: Eagle3Head):
    """Masks and positions: every node of a 3-level expansion equals its chain run causally."""
    sd, K, B = official_state_dict(), 3, 2
    features, next_tokens = prompt_pairs(B, 6)
    drafter = Eagle3Drafter(head, max_len=16, slots=B)
    drafter.prefill(features[:, :4], next_tokens[:, :4])  # two prefills = one longer prefill
    drafter.prefill(features[:, 4:], next_tokens[:, 4:])
    root = drafter.root_logits()
    g = torch.Generator().manual_seed(3)
    to_target = head.draft_to_target
    paths = [[[]] for _ in range(B)]  # per batch entry: token chains of the last expanded nodes
    for level in (1, 2, 3):
        n_parents = len(paths[0])
        parent_rank = torch.randint(0, n_parents, (B, K), generator=g)
        parent_rank[:, 0] = n_parents - 1  # the last-ranked parent is used too
        tokens = to_target[torch.randint(0, VD, (B, K), generator=g)]  # target ids
        logits = drafter.expand(level, parent_rank, tokens)
        assert logits.shape == (B, K, VD)
        paths = [[paths[b][int(parent_rank[b, j])] + [int(tokens[b, j])] for j in range(K)]
                 for b in range(B)]  # fmt: skip
        for b in range(B):
            for j in range(K):
                ref = ref_path_logits(sd, target.embed_tokens, features[b], next_tokens[b],
                                      paths[b][j])  # fmt: skip
                torch.testing.assert_close(
                    logits[b, j], ref, atol=1e-4, rtol=1e-4
                )  # fp32 summation-order noise
    for b in range(B):
        ref = ref_path_logits(sd, target.embed_tokens, features[b], next_tokens[b], [])
        torch.testing.assert_close(root[b], ref, atol=1e-4, rtol=1e-4)


def _expand_three_levels(drafter: Eagle3Drafter, B: int, K: int = 3) -> list[torch.Tensor]:
    """root_logits and three levels with fixed random parents and tokens: every level's logits."""
    g = torch.Generator().manual_seed(7)
    outs, n_parents = [drafter.root_logits()], 1
    for level in (1, 2, 3):
        parent_rank = torch.randint(0, n_parents, (B, K), generator=g)
        tokens = torch.randint(0, V, (B, K), generator=g)
        outs.append(drafter.expand(level, parent_rank, tokens))
        n_parents = K
    return outs


@pytest.mark.parametrize("tree_rows", [128, 0])
def test_levels_in_the_pool_equal_the_gathered_levels(head: Eagle3Head, monkeypatch, tree_rows):
    """The CPU's in-pool levels (their K/V in the slots after each m, read in place by the tree
    attention kernel) against the gathered path (the committed rows and the levels' K/V copied
    beside them), a ragged batch of three in scattered slots; the prompts' pairs run in one
    padded commit first (in place too). With no scratch rows the slot of the longest sequence
    runs out at level 3 and the tree continues on the gathered path."""
    assert head.attends_in_pool()
    monkeypatch.setattr(Eagle3Drafter, "TREE_ROWS", tree_rows)
    outs = {}
    for in_pool in (True, False):
        monkeypatch.setattr(Eagle3Head, "attends_in_pool", lambda self, v=in_pool: v)
        drafter = Eagle3Drafter(head, max_len=16, slots=4)
        for slot, n in ((3, 10), (0, 4), (2, 7)):
            features, next_tokens = prompt_pairs(1, n, seed=slot)
            drafter.prefill(features, next_tokens, slots=[slot])
        drafter.begin([3, 0, 2])
        outs[in_pool] = _expand_three_levels(drafter, B=3)
        assert drafter._in_pool == (in_pool and tree_rows > 0)
    for got, want in zip(outs[True], outs[False], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fp32 summation order


def _accept_longest_path(tree: kernels.Tree, bonus: int) -> kernels.Verdict:
    """A verdict accepting the first longest root-to-leaf path of the tree (batch entry 0)."""
    rows = tree.retrieve_indices[0]
    lens = (rows >= 0).sum(1)
    best = rows[int(lens.argmax())]
    n = int(lens.max())
    return kernels.Verdict(
        accept_path=best.view(1, -1).clone(),
        accept_len=torch.tensor([n], dtype=torch.int32),
        bonus_token=torch.tensor([bonus], dtype=torch.int32),
    )


def test_commit_equals_prefill_of_the_accepted_sequence(head: Eagle3Head):
    """Through the real tree builder: after each commit the head is a fresh prefill's equal."""
    features, next_tokens = prompt_pairs(1, 5)
    drafter = Eagle3Drafter(head, max_len=64)
    drafter.prefill(features, next_tokens)
    all_features, all_tokens = features, next_tokens
    cfg = TreeConfig(method="topk", topk=3, depth=3, total_tokens=9)
    g = torch.Generator().manual_seed(4)
    for step, bonus in enumerate((5, 17)):
        root, prefix = next_tokens[:, -1:].flatten().int(), torch.tensor([all_tokens.shape[1]])
        dt = draft_tree(drafter, root, prefix, cfg, 0.0, 0, step, head.draft_to_target)
        verdict = _accept_longest_path(dt.tree, bonus)
        n = int(verdict.accept_len[0])
        assert n >= 2  # the test commits drafted nodes, not just the root
        tree_features = torch.randn(1, dt.tree.tokens.shape[1], F_IN, generator=g)
        drafter.commit(dt.tree, verdict, read_outcome(dt.tree, verdict), tree_features)
        path = verdict.accept_path[0, :n].long()
        all_features = torch.cat((all_features, tree_features[:, path]), 1)
        new_tokens = torch.cat((dt.tree.tokens[0, path[1:]].long(), torch.tensor([bonus])))
        all_tokens = torch.cat((all_tokens, new_tokens.view(1, -1)), 1)
        assert drafter.length(0) == all_tokens.shape[1]
        fresh = Eagle3Drafter(head, max_len=64)
        fresh.prefill(all_features, all_tokens)
        torch.testing.assert_close(drafter.root_logits(), fresh.root_logits(), atol=1e-4, rtol=0)
        next_tokens = new_tokens.view(1, -1)


def test_target_features_feed_the_drafter(target: LlamaModel, head: Eagle3Head):
    """The target's features for head.feature_layers have the width fc expects."""
    tokens = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(5))
    cache = target.new_cache(8)
    _, features = target.forward(tokens, torch.arange(6).view(1, 6), cache,
                                 feature_layers=head.feature_layers)  # fmt: skip
    drafter = Eagle3Drafter(head, max_len=8)
    drafter.prefill(features[:, :-1], tokens[:, 1:])
    assert torch.isfinite(drafter.root_logits()).all()


def test_low_precision_head_returns_float32(target: LlamaModel):
    cfg = HeadConfig.from_dict(head_config_dict(), target.cfg)
    head = Eagle3Head.from_weights(cfg, official_state_dict(), target, dtype=torch.bfloat16)
    drafter = Eagle3Drafter(head, max_len=8)
    drafter.prefill(*prompt_pairs(1, 4))
    root = drafter.root_logits()
    assert root.dtype == torch.float32 and head.w["fc.weight"].dtype == torch.bfloat16
    level1 = drafter.expand(1, torch.zeros(1, 2, dtype=torch.long), torch.tensor([[3, 9]]))
    assert level1.dtype == torch.float32 and torch.isfinite(level1).all()


# --- configuration --------------------------------------------------------------------------


def test_head_config_feature_layers_and_defaults():
    big = target_config(num_hidden_layers=32)
    d = head_config_dict()
    del d["eagle_aux_hidden_state_layer_ids"]
    cfg = HeadConfig.from_dict(d, big)
    assert cfg.feature_layers == (2, 16, 29)  # EAGLE's (2, N//2, N-3)
    assert cfg.rope_theta == 10000.0 and cfg.target_hidden_size == HID and cfg.head_dim == 8
    # SpecForge/SGLang's eagle_config names layer outputs: k is the residual entering layer k+1.
    eagle_config = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    nested = HeadConfig.from_dict(d | eagle_config, big)
    assert nested.feature_layers == (2, 16, 29)
    top = HeadConfig.from_dict(head_config_dict(rope_theta=5e5), big)
    assert top.feature_layers == FEATURES and top.rope_theta == 5e5
    no_draft_vocab = {k: v for k, v in d.items() if k != "draft_vocab_size"}
    assert HeadConfig.from_dict(no_draft_vocab, big).draft_vocab_size == V
    with pytest.raises(ValueError, match=r"repeats a layer.*eagle_aux_hidden_state_layer_ids"):
        HeadConfig.from_dict(d, target_config())  # N=6: (2, 3, 3)
    with pytest.raises(ValueError, match="lacks.*intermediate_size"):
        HeadConfig.from_dict({k: v for k, v in d.items() if k != "intermediate_size"}, big)
    with pytest.raises(ValueError, match="rope_scaling type='linear' is not supported"):
        HeadConfig.from_dict(d | {"rope_scaling": {"type": "linear", "factor": 2.0}}, big)


def test_identity_d2t_gives_no_mapping(target: LlamaModel):
    sd = official_state_dict()
    sd["lm_head.weight"] = torch.randn(V, HID)
    sd["d2t"] = torch.zeros(V, dtype=torch.int64)
    sd["t2d"] = torch.ones(V, dtype=torch.bool)  # every target id is in the draft vocabulary
    cfg = HeadConfig.from_dict(head_config_dict(draft_vocab_size=V), target.cfg)
    assert Eagle3Head.from_weights(cfg, sd, target).draft_to_target is None
    del sd["d2t"], sd["t2d"]
    assert Eagle3Head.from_weights(cfg, sd, target).draft_to_target is None


@pytest.mark.parametrize(
    "cfg_over, sd_change, match",
    [
        ({"vocab_size": 65}, None, r"head vocab_size=65 != target vocab_size=64"),
        ({"target_hidden_size": 16}, None, r"target_hidden_size=16 != target hidden_size=32"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}, None, r"\[6\] outside \[0, 6\).*=6"),
        ({}, "drop_fc", r"lacks \['fc.weight'\]"),
        ({}, "drop_d2t", r"lacks \['d2t'\]"),
        ({}, "d2t_range", r"draft id 23 to target id 64 .* \[0, 64\)"),
        ({}, "extra_key", r"unexpected keys \['model.layers.0.mlp.up_proj.weight'\]"),
        ({"intermediate_size": 41}, None, r"midlayer.mlp.gate_proj.weight has shape \[40, 32\]"),
    ],
)
def test_bad_heads_are_refused(target: LlamaModel, cfg_over: dict, sd_change, match: str):
    sd = official_state_dict()
    if sd_change == "drop_fc":
        del sd["fc.weight"]
    elif sd_change == "drop_d2t":
        del sd["d2t"]
    elif sd_change == "d2t_range":
        sd["d2t"] = sd["d2t"].clone()
        sd["d2t"][-1] = V - (VD - 1)
    elif sd_change == "extra_key":
        sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=match):
        cfg = HeadConfig.from_dict(head_config_dict(**cfg_over), target.cfg)
        Eagle3Head.from_weights(cfg, sd, target)


def test_drafter_refuses_bad_calls(head: Eagle3Head):
    drafter = Eagle3Drafter(head, max_len=6)
    with pytest.raises(ValueError, match="before any pair"):
        drafter.root_logits()
    features, next_tokens = prompt_pairs(1, 4)
    with pytest.raises(ValueError, match=r"features must be \[B=1, L, F=96\]"):
        drafter.prefill(features[..., :HID], next_tokens)
    with pytest.raises(ValueError, match="needs 8 rows .* max_len=6"):
        drafter.prefill(*prompt_pairs(1, 8))
    drafter.prefill(features, next_tokens)
    one = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="call root_logits"):
        drafter.expand(1, one, one)
    drafter.root_logits()
    with pytest.raises(ValueError, match="levels 1, 2"):
        drafter.expand(2, one, one)
    # A rank past the nodes expanded is not looked at on the host (no device read per level):
    # the gather fails.
    with pytest.raises(RuntimeError, match="out of (DATA )?bounds"):  # gather / index_select
        drafter.expand(1, one + 1, one)
