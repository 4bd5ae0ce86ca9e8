"""kernels.decoder_layers: a Llama target's layers in one C++ call (one sequence in a KV slot)
against LlamaModel's fused loop in Python, bit for bit: logits, features and the KV rows both
leave, for a prefill, a tree and a decode step, in Q4_1 (SmolLM2, kept quantized), bf16 and fp32;
and when the one call is not taken. kernels.draft_level likewise against Eagle3Head's level in
Python (layer_in_pool, then logits), the head in Q8_0 and in bf16."""

from __future__ import annotations

import pytest
import torch

from rheo_engine.models.kv_cache import SlotPool
from rheo_engine.models.llama import LlamaModel
from rheo_engine.runtime.engine import DEFAULT_PAIR


def default_target(dtype: torch.dtype) -> LlamaModel:
    return LlamaModel.from_pretrained(DEFAULT_PAIR / "target", dtype=dtype)


def smollm2_q4_1() -> LlamaModel:
    from rheo_engine.io.gguf import read_gguf
    from rheo_engine.runtime.pairs import smollm2_gguf

    return LlamaModel.from_gguf(read_gguf(smollm2_gguf()), dtype=torch.bfloat16, quantized=True)


def run(model: LlamaModel, one_call: bool, features: tuple[int, ...]):
    """A 40-token prefill, a 5-node tree (two branches) and a decode step in slot 1 of a
    pool of 3, by the one call or by the Python loop: their outputs and the slot's K/V rows."""
    if one_call:
        model.__dict__.pop("_decoder_layers", None)
    else:
        model._decoder_layers = False  # the loop in Python
    pool = SlotPool(model.cfg.num_hidden_layers, 3, 64, model.kv_heads, model.cfg.head_dim,
                    model.dtype)  # fmt: skip
    view = pool.batch([1])
    outs = []
    with torch.no_grad():
        prompt = (torch.arange(40) * 37 % 500).view(1, -1)
        outs += model.forward(prompt, torch.arange(40).view(1, -1), view, None, features)
        view.advance(40)
        mask = torch.ones(1, 5, 5, dtype=torch.uint8).tril()
        mask[0, 2, 1] = mask[0, 4, 3] = mask[0, 4, 1] = 0  # 0 -> {1, 2}, 1 -> 3, 2 -> 4
        mask[0, 3, 2] = 0
        tokens, positions = torch.tensor([[5, 9, 13, 17, 21]]), torch.tensor([[40, 41, 41, 42, 42]])
        outs += model.forward(tokens, positions, view, mask, features)
        view.commit_paths(torch.tensor([[0, 2, 4]]), [3])
        one = torch.ones(1, 1, 1, dtype=torch.uint8)
        outs += model.forward(torch.tensor([[7]]), torch.tensor([[43]]), view, one, features)
    taken = bool(model.__dict__.get("_decoder_layers"))
    return outs, pool.k[:, 1, :44].clone(), pool.v[:, 1, :44].clone(), taken


@pytest.mark.parametrize("which", ["default fp32", "default bf16", "smollm2 q4_1"])
def test_one_call_equals_the_python_loop_bit_for_bit(which):
    model = {"default fp32": lambda: default_target(torch.float32),
             "default bf16": lambda: default_target(torch.bfloat16),
             "smollm2 q4_1": smollm2_q4_1}[which]()  # fmt: skip
    features = (1, model.cfg.num_hidden_layers - 1)
    loop, k_loop, v_loop, loop_taken = run(model, False, features)
    fast, k_fast, v_fast, fast_taken = run(model, True, features)
    assert fast_taken and not loop_taken, "the one call was not (or always) taken: a weak test"
    assert len(loop) == len(fast) == 6
    for a, b in zip(loop, fast, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(k_loop, k_fast) and torch.equal(v_loop, v_fast)


def test_the_python_loop_runs_where_the_one_call_does_not_apply(monkeypatch):
    """A batch of two sequences, RHEO_LINEAR=torch and autograd take the loop."""
    model = default_target(torch.float32)
    pool = SlotPool(model.cfg.num_hidden_layers, 2, 16, model.kv_heads, model.cfg.head_dim,
                    model.dtype)  # fmt: skip
    x = torch.zeros(1, 1, model.cfg.hidden_size)
    with torch.no_grad():
        assert model._one_call(pool.batch([0]), x) is not None
        assert model._one_call(pool.batch([0, 1]), x.expand(2, 1, -1)) is None
        monkeypatch.setenv("RHEO_LINEAR", "torch")
        assert model._one_call(pool.batch([0]), x) is None
    monkeypatch.delenv("RHEO_LINEAR")
    assert model._one_call(pool.batch([0]), x) is None  # autograd on


def levels(head, one_call: bool):
    """root_logits and two levels of 4 nodes after 60 pairs (Eagle3Drafter, in its pool): the
    draft logits, the frontier's h2 and the pool's K/V, by the one call or the Python path."""
    from rheo_engine.models.eagle3 import Eagle3Head
    from rheo_engine.models.eagle3_drafter import Eagle3Drafter

    before = Eagle3Head.one_call
    Eagle3Head.one_call = one_call
    try:
        g = torch.Generator().manual_seed(3)
        drafter = Eagle3Drafter(head, max_len=80)
        c = head.cfg
        features = torch.randn(1, 60, len(head.feature_layers) * c.target_hidden_size, generator=g)
        next_tokens = torch.randint(0, c.vocab_size, (1, 60), generator=g)
        drafter.prefill(features.to(head.dtype), next_tokens)
        tokens = torch.randint(0, c.vocab_size, (1, 4), generator=g)
        # the one call's flush gives root_logits its logits (only the last pair's lm_head row):
        # head.logits then never runs
        calls = []
        head.logits = lambda h2: calls.append(1) or Eagle3Head.logits(head, h2)
        with torch.no_grad():
            out = [drafter.root_logits()]
            out.append(drafter.expand(1, torch.zeros(1, 4, dtype=torch.long), tokens))
            out.append(drafter.expand(2, torch.tensor([[3, 0, 2, 1]]), tokens + 1))
            # three more pairs, as a step's commit queues them, then the next root
            drafter.prefill(features[:, :3], next_tokens[:, :3] + 1)
            out.append(drafter.root_logits())
        assert drafter._in_pool, "the levels ran on the gathered path: a weak test"
        assert (len(calls) == 0) == one_call, f"head.logits ran {len(calls)} times"
        return out + [drafter._frontier_h.clone(), drafter.pool.k.clone(), drafter.pool.v.clone()]
    finally:
        Eagle3Head.one_call = before
        head.__dict__.pop("logits", None)


@pytest.mark.parametrize("q8", [True, False])
def test_level_one_call_equals_the_python_level_bit_for_bit(q8):
    from rheo_engine.models.eagle3 import Eagle3Head
    from rheo_engine.runtime.engine import DEFAULT_PAIR as PAIR

    target = smollm2_q4_1()
    head = Eagle3Head.from_pretrained(PAIR.parent / "smollm2" / "head", target)
    if q8:
        head.quantize("q8_0")
    python = levels(head, False)
    fast = levels(head, True)
    assert head.__dict__.get("_level", (None, None))[1] is not None, "the one call never ran"
    for a, b in zip(python, fast, strict=True):
        assert torch.equal(a, b)


def test_level_logit_rows_out_of_range_fails_in_one_line():
    from rheo_engine.models.eagle3 import Eagle3Head
    from rheo_engine.models.eagle3_drafter import Eagle3Drafter
    from rheo_engine.runtime.engine import DEFAULT_PAIR as PAIR

    target = LlamaModel.from_pretrained(PAIR / "target")
    head = Eagle3Head.from_pretrained(PAIR / "draft", target)
    drafter = Eagle3Drafter(head, max_len=16)
    h = torch.zeros(1, 2, head.cfg.hidden_size, dtype=head.dtype)
    tokens, positions = torch.zeros(1, 2, dtype=torch.long), torch.arange(2).view(1, 2)
    mask = torch.ones(1, 2, 2, dtype=torch.uint8).tril()
    with torch.no_grad():
        for bad in (0, 3, -2):
            with pytest.raises((ValueError, RuntimeError), match=f"logit_rows={bad} must be in"):
                head.level_one_call(h, tokens, positions, drafter.pool, 0, 0, 0, mask, bad)
        h2, logits = head.level_one_call(h, tokens, positions, drafter.pool, 0, 0, 0, mask, 1)
    assert h2.shape[1] == 2 and logits.shape[:2] == (1, 1)
