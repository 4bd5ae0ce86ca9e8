"""The draft vocabulary's size, by measurement (issue 26): what share of the target it covers
against what a draft level costs.

    python bench/head_vocab.py --work /tmp/hw   # after head_shards --features-only --work /tmp/hw

For each size Vd (the Vd most frequent reply tokens of the training shards, as head_shards picks
them), on the held-out windows' kept final states:
* argmax coverage: the share of positions whose target argmax is a draft token (the others are
  masked in training and can never be drafted at T = 0);
* mass coverage: the mean target probability (T = 1) that falls on draft tokens (what the
  drafts can at best carry at T = 1);
and, on this CPU, one thread, the time of a draft level of 16 nodes (the head's layer over a
300-pair context + its lm_head over Vd rows, bf16) against one plain target step at the same
context (the target as the engine runs it: Q4_1 kept quantized).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rheo_engine.io.gguf import read_gguf  # noqa: E402
from rheo_engine.models.eagle3 import Eagle3Head, init_head_weights  # noqa: E402
from rheo_engine.models.llama import LlamaModel  # noqa: E402
from rheo_engine.models.eagle3_drafter import Eagle3Drafter  # noqa: E402
from rheo_engine.train.head import head_config  # noqa: E402
from rheo_engine.train.head_config import HeadTrainConfig  # noqa: E402
from rheo_engine.train.head_features import load_packed, settings_of  # noqa: E402
from rheo_engine.train.head_shards import (available_shards, draft_vocabulary_of,  # noqa: E402
                                           load_target, read_sequences)  # fmt: skip
from bench.common import isa_line  # noqa: E402

SIZES = (4096, 8192, 16384, 32768, 49152)


def fastest(fn, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="head_shards --work (features kept)")
    p.add_argument("--data", type=Path, default=Path("weights/smollm2/data"))
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--nodes", type=int, default=16)
    a = p.parse_args()
    torch.set_num_threads(1)
    from rheo_engine.runtime.pairs import smollm2_gguf

    gguf = smollm2_gguf()
    target = load_target(gguf, "cpu", torch.bfloat16)
    t = target.cfg
    layers = (2, t.num_hidden_layers // 2, t.num_hidden_layers - 3)
    val = load_packed(a.work / "features" / "val128.safetensors",
                      settings_of(gguf, layers, torch.bfloat16))  # fmt: skip
    if val is None:
        raise SystemExit(f"no held-out features in {a.work}/features: run head_shards "
                         "--features-only first")  # fmt: skip
    train = read_sequences(a.data, [i for i in available_shards(a.data) if i > 1])
    lm = target.lm_head.float()
    probs = torch.cat([torch.softmax(torch.nn.functional.linear(h.float(), lm), -1)
                       for h in val.hidden.split(2048)])  # fmt: skip  # [P, V]
    # A plain step at the same context, on the target as the engine runs it (the GGUF file's
    # Q4_1 matrices kept quantized): one token after a prefill of `context`.
    runs = LlamaModel.from_gguf(read_gguf(gguf), dtype=torch.bfloat16)
    ids = torch.randint(3, t.vocab_size, (1, a.context + 1))
    cache = runs.new_cache(a.context + 1, 1)
    with torch.no_grad():
        runs.forward(ids[:, :-1], torch.arange(a.context).unsqueeze(0), cache)
    cache.length = a.context  # committed; each timed step writes the next row, uncommitted

    def plain() -> None:
        runs.forward(ids[:, -1:], torch.tensor([[a.context]]), cache)

    with torch.no_grad():
        t_plain = fastest(plain)
    rows = []
    for Vd in SIZES:
        used = draft_vocabulary_of(train, t.vocab_size, Vd)
        inside = torch.zeros(t.vocab_size, dtype=torch.bool)
        inside[used] = True
        cfg = HeadTrainConfig(feature_layers=layers, draft_vocab=0 if Vd == t.vocab_size else Vd)
        w = init_head_weights(head_config(t, cfg), 0)
        if Vd < t.vocab_size:
            w["d2t"] = used - torch.arange(Vd)
            w["t2d"] = inside
        head = Eagle3Head.from_weights(head_config(t, cfg), w, target, dtype=torch.bfloat16)
        drafter = Eagle3Drafter(head, a.context + 8)
        F_in = len(layers) * t.hidden_size
        drafter.prefill(torch.randn(1, a.context, F_in).bfloat16(), ids[:, 1 : a.context + 1])
        drafter.root_logits()
        tokens = torch.randint(3, 1000, (1, a.nodes))
        rank = torch.zeros(1, a.nodes, dtype=torch.long)

        def level() -> None:
            drafter.root_logits()
            drafter.expand(1, rank, tokens)

        with torch.no_grad():
            t_level = fastest(level) - fastest(drafter.root_logits)
        rows.append({"Vd": Vd, "argmax_coverage": round(float(inside[val.argmax].float().mean()), 4),
                     "mass_coverage": round(float(probs[:, inside].sum(-1).mean()), 4),
                     "level_ms": round(t_level * 1e3, 2),
                     "level_over_plain": round(t_level / t_plain, 3)})  # fmt: skip
        print(rows[-1], flush=True)
    out = {"cpu": isa_line(), "threads": 1, "plain_step_ms": round(t_plain * 1e3, 2),
           "context": a.context, "nodes": a.nodes, "positions": int(val.offsets[-1]), "rows": rows}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
