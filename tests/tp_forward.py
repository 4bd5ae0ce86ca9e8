"""One rank of a tensor-parallel target forward, for tests/test_tensor_parallel.py.

Started as N processes with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): every rank loads its part of each target directory given (fp32, read through
io.weights.open_safetensors), runs a prefill and a tree forward, and writes what it saw to
OUT/rank{R}.json: rank 0 also the logits and features (OUT/<i>.safetensors), every rank its
resident weight bytes, the bytes it read and the files it opened, in order.

    python tests/tp_forward.py OUT TARGET_DIR [TARGET_DIR ...]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rheo_engine.config import ModelConfig
from rheo_engine.io.weights import open_safetensors, save_safetensors
from rheo_engine.models.llama import LlamaModel, resident_weight_bytes
from rheo_engine.parallel import TPGroup

# The inputs both sides run (the test rebuilds them for one device): a prefill of B = 2 prompts
# of 7 tokens, then a tree of 5 nodes per entry (root, two children, a grandchild under each).
B, PROMPT = 2, 7
TREE_PARENTS = [-1, 0, 0, 1, 2]
FEATURE_LAYERS = (0, 2, 5)


def inputs(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt tokens [B, PROMPT], tree tokens [B, N], tree positions [B, N], tree mask
    [B, N, N]) drawn from a fixed generator."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab_size, (B, PROMPT), generator=g)
    n = len(TREE_PARENTS)
    tokens = torch.randint(0, vocab_size, (B, n), generator=g)
    depth = [0] * n
    mask = torch.zeros(n, n, dtype=torch.uint8)
    for i, parent in enumerate(TREE_PARENTS):
        mask[i] = mask[parent] if parent >= 0 else 0
        mask[i, i] = 1
        depth[i] = depth[parent] + 1 if parent >= 0 else 0
    positions = (PROMPT + torch.tensor(depth)).expand(B, n)
    return prompt, tokens, positions.contiguous(), mask.expand(B, n, n).contiguous()


def run(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The prefill's logits and features and the tree's logits and features."""
    prompt, tokens, positions, mask = inputs(model.cfg.vocab_size)
    cache = model.new_cache(PROMPT + len(TREE_PARENTS), batch=B)
    with torch.no_grad():
        logits, features = model.forward(
            prompt, torch.arange(PROMPT).expand(B, PROMPT), cache, None, FEATURE_LAYERS
        )
        cache.advance(PROMPT)
        tree_logits, tree_features = model.forward(tokens, positions, cache, mask, FEATURE_LAYERS)
    return {"prefill_logits": logits, "prefill_features": features,
            "tree_logits": tree_logits, "tree_features": tree_features}  # fmt: skip


def main() -> None:
    out, targets = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    group = TPGroup(rank, size, torch.device("cpu"))
    report = []
    for i, target in enumerate(targets):
        weights = open_safetensors(target)
        model = LlamaModel.from_weights(ModelConfig.from_hf_dir(target), weights,
                                        dtype=torch.float32, tp=group)  # fmt: skip
        report.append({"resident_bytes": resident_weight_bytes(model),
                       "bytes_read": weights.bytes_read, "files_opened": weights.files_opened,
                       "kv_heads": model.kv_heads, "heads": model.heads})  # fmt: skip
        group.stats.reset()
        result = run(model)
        report[-1] |= {"all_reduce_calls": group.stats.all_reduce_calls,
                       "gather_calls": group.stats.gather_calls}  # fmt: skip
        if rank == 0:
            save_safetensors(result, out / f"{i}.safetensors")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
