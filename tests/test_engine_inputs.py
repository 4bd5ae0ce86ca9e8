"""What a caller hands the engine: seeds, prompts, devices, total_tokens=1, and the tau that
comes back. Bad input is one ValueError line naming the value, the rule and the fix.

Runs on the tiny random pair of conftest.py (48-token context, fresh EAGLE-3 head).
"""

from __future__ import annotations

import pytest
import torch
from test_context import CHAIN, FIXED, TREE, prompt_of

from rheo_engine import Engine


def one_line_error(call, match: str) -> str:
    with pytest.raises(ValueError, match=match) as err:
        call()
    message = str(err.value)
    assert "\n" not in message, message
    return message


PROMPT = prompt_of(6)


# --- seeds -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, -1])
def test_a_fresh_seed_is_reported_and_reproduces_the_run(tiny, seed):
    first = tiny.generate(PROMPT, 12, temperature=1.0, seed=seed, **CHAIN, **FIXED)
    second = tiny.generate(PROMPT, 12, temperature=1.0, seed=seed, **CHAIN, **FIXED)
    assert 0 <= first.seed < 2**64 and first.seed != second.seed
    again = tiny.generate(PROMPT, 12, temperature=1.0, seed=first.seed, **CHAIN, **FIXED)
    assert again.seed == first.seed and again.token_ids == first.token_ids
    assert again.accept_lengths == first.accept_lengths


def test_seeds_at_both_ends_of_the_range_run(tiny):
    for seed in (0, 2**64 - 1):
        assert tiny.generate(PROMPT, 4, temperature=1.0, seed=seed, **CHAIN, **FIXED).seed == seed


@pytest.mark.parametrize(
    "seed, shown",
    [
        (2**64, str(2**64)),
        (-2, "-2"),
        (1.5, "1.5"),
        (True, "True"),
        ("3", "'3'"),
        (torch.tensor(3), "tensor(3)"),
    ],
)
def test_bad_seeds_are_one_line_errors(tiny, seed, shown):
    message = one_line_error(lambda: tiny.request(PROMPT, 4, seed=seed), "seed=")
    assert f"seed={shown}" in message and "2**64" in message and "-1" in message


# --- prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, match",
    [
        (["a", "b"], r"prompt\[0\]='a' \(str\) is not an int token id"),
        ([1, 2.0], r"prompt\[1\]=2.0 \(float\)"),
        ([1, 5, True], r"prompt\[2\]=True \(bool\)"),
        ([[1, 2]], r"prompt\[0\]=\[1, 2\] \(list\)"),
        (None, "prompt must be a str or a list of int token ids, got NoneType"),
        (b"abc", "got bytes"),
        (torch.tensor([[1, 2]]), r"1-D of integer token ids, got shape \[1, 2\]"),
        (torch.tensor([1.0, 2.0]), "dtype torch.float32"),
        ([1, 4096], "outside"),
        ([], "empty"),
    ],
)
def test_bad_prompts_are_one_line_errors(tiny, prompt, match):
    one_line_error(lambda: tiny.request(prompt, 4), match)


def test_token_ids_as_list_tuple_or_tensor(tiny):
    runs = [
        tiny.generate(p, 5, method="ar", temperature=0)
        for p in (PROMPT, tuple(PROMPT), torch.tensor(PROMPT), torch.tensor(PROMPT).int())
    ]
    assert all(r.token_ids == runs[0].token_ids for r in runs) and len(runs[0].token_ids) == 5


@pytest.mark.parametrize("value", ["5", 2.0, True, None])
def test_max_new_tokens_must_be_an_int(tiny, value):
    one_line_error(lambda: tiny.request(PROMPT, value), "max_new_tokens=.* must be an int")


# --- total_tokens=1 is a plain run -----------------------------------------------------------


def count_head_calls(monkeypatch, engine: Engine) -> dict[str, int]:
    """Calls of the head's entry points; "layer" counts every form of the decoder layer (the
    CPU's levels and commits run layer_in_pool, or both it and logits in one C++ call,
    level_one_call; elsewhere layer)."""
    calls = {"new_pool": 0, "fuse": 0, "layer": 0, "layer_in_pool": 0, "logits": 0,
             "level_one_call": 0}  # fmt: skip
    for name in calls:
        real = getattr(engine.head, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(engine.head, name, counted)
    return calls


@pytest.mark.parametrize("method", ["topk", "rrsw", "rheo"])
def test_total_tokens_1_never_runs_the_head(tiny, monkeypatch, method):
    ar = {T: tiny.generate(PROMPT, 10, method="ar", temperature=T, seed=4) for T in (0.0, 1.0)}
    calls = count_head_calls(monkeypatch, tiny)
    for T in (0.0, 1.0):
        gen = tiny.generate(PROMPT, 10, method=method, temperature=T, seed=4, total_tokens=1)
        # The same plain steps as ar, on the same coins: the same tokens even when sampling.
        assert gen.token_ids == ar[T].token_ids and gen.accept_lengths == [1] * 10
    assert sum(calls.values()) == 0, calls
    tiny.generate(PROMPT, 3, method=method, temperature=0, seed=4, **TREE, **FIXED)
    one = calls.pop("level_one_call")  # a layer and its logits
    calls["layer"] += calls.pop("layer_in_pool") + one
    calls["logits"] += one
    assert min(calls.values()) > 0, f"the counters miss head calls: {calls}"


# --- honest tau ------------------------------------------------------------------------------


@pytest.mark.parametrize("at", [0, 1], ids=["eos_first", "eos_second"])
def test_tokens_drafted_past_an_eos_do_not_count(tiny, monkeypatch, at):
    """Make the at-th token of a step that produced at least 3 an EOS: the rerun (same seed,
    so the same steps) stops there and counts that step as at + 1 tokens, not 3 or more."""
    for seed in range(20):
        gen = tiny.generate(PROMPT, 30, method="rheo", temperature=1.0, seed=seed, **CHAIN, **FIXED)
        starts = [sum(gen.accept_lengths[:k]) for k in range(gen.steps)]
        ids = gen.token_ids
        found = [
            k for k, start in enumerate(starts)
            if gen.accept_lengths[k] >= 3 and ids[start + at] not in ids[: start + at]
        ]  # fmt: skip
        if found:
            break
    else:
        pytest.fail("no run of the chain trees accepted two drafts in a step")
    k = found[0]
    eos = gen.token_ids[starts[k] + at]
    monkeypatch.setattr(tiny, "eos_ids", (eos,))
    cut = tiny.generate(PROMPT, 30, method="rheo", temperature=1.0, seed=seed, **CHAIN, **FIXED)
    assert cut.stop_reason == "eos" and cut.token_ids == gen.token_ids[: starts[k] + at]
    assert cut.accept_lengths == gen.accept_lengths[:k] + [at + 1]
    assert sum(cut.accept_lengths) == len(cut.token_ids) + 1


def test_no_step_counts_tokens_past_max_new_tokens(tiny):
    for new in (1, 2, 4, 7):
        gen = tiny.generate(PROMPT, new, method="rheo", temperature=1.0, seed=1, **CHAIN, **FIXED)
        if gen.stop_reason != "eos":
            assert len(gen.token_ids) == sum(gen.accept_lengths) == new


# --- devices ---------------------------------------------------------------------------------


def test_unknown_device_is_a_one_line_error():
    message = one_line_error(lambda: Engine.from_pretrained(device="bogus"), "device='bogus'")
    assert "available: cpu" in message
    one_line_error(lambda: Engine.from_pretrained(device="mps"), "cpu or cuda only")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_a_one_line_error():
    message = one_line_error(
        lambda: Engine.from_pretrained(device="cuda"), "device='cuda' is not available"
    )
    assert message.endswith("available: cpu")
    if torch.version.cuda is None:
        assert f"this torch ({torch.__version__}) was built without CUDA" in message
