"""Validation loss of a default-style target (trained by rheo_engine.train.target) on windows of
a given length of the stdlib validation split: how well it uses a longer context.

    python bench/val_loss.py --target weights/default/target --seq 256 1024

Prints one line per window length: mean next-token cross-entropy (nats/token, the weights as
stored, computed in fp32) over consecutive non-overlapping windows, as train.target reports it.
A window longer than the target's context is allowed (it measures extrapolation) and marked.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from inputs import ArgumentParser, BadInput, at_least, checking, cli

from rheo_engine.io.weights import load_safetensors
from rheo_engine.train.corpus import load_corpus
from rheo_engine.train.data import build_streams
from rheo_engine.train.model import TinyLlama
from rheo_engine.train.target import evaluate


def load(target: Path, max_len: int) -> tuple[TinyLlama, int]:
    c = json.loads((target / "config.json").read_text())
    model = TinyLlama(c["vocab_size"], c["hidden_size"], c["num_hidden_layers"],
                      c["num_attention_heads"], c["num_key_value_heads"],
                      c["intermediate_size"], max_len)  # fmt: skip
    w = load_safetensors(target / "model.safetensors")
    model.load_state_dict({k: v.float() for k, v in w.items()})
    return model, int(c["max_position_embeddings"])


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python bench/val_loss.py", description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, required=True, help="an HF directory from train.target")
    p.add_argument("--seq", type=at_least(1), nargs="+", required=True, help="window lengths")
    p.add_argument("--threads", type=at_least(1), default=1)
    args = p.parse_args(argv)
    with checking():
        if not (args.target / "tokenizer.model").is_file():
            raise BadInput(
                f"--target {args.target} has no tokenizer.model; pass a train.target dir"
            )
        model, context = load(args.target, max(args.seq))
        corpus = load_corpus()
    torch.set_num_threads(args.threads)
    for seq in args.seq:
        windows = build_streams(corpus, args.target / "tokenizer.model", seq).val_windows
        loss = evaluate(model, windows)
        note = "" if seq <= context else f"  (beyond its {context}-token context)"
        print(f"{args.target}  seq {seq:5d}  {len(windows):3d} windows  val loss {loss:.4f}  "
              f"ppl {math.exp(loss):.2f}{note}", flush=True)  # fmt: skip


if __name__ == "__main__":
    cli(main, sys.argv[1:])
