"""Benchmark tree attention: rheo's kernel against torch-native SDPA with a boolean mask.

Checks both against reference.tree_attention_ref first, then times each case (warm-up, median
of reps) and prints one CSV row per case: µs per call, the torch time, the ratio, and the GB/s
of K/V actually read (2 * B * (prefix_len + N) * Hkv * D * element size per call).

    python bench/bench_tree_attention.py [--quick] [--device cpu|cuda]
    python bench/bench_tree_attention.py --shapes 1,64,32,32/16,64,32,32 --prefixes 300 \
        --dtypes bfloat16     # widened 1B's layer (N,H,Hkv,D) at 1 and 16 nodes
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Timer, conditions, conditions_line, max_abs_diff
from inputs import ArgumentParser

from rheo_engine.spec import kernels, reference

B, N, H, HKV, D = 1, 60, 32, 8, 128


def chain_of_paths_mask(n: int, device: torch.device) -> torch.Tensor:
    """[1, n, n] uint8 ancestor mask of a tree like EAGLE's: each node's parent is (i - 1) // 3."""
    mask = torch.zeros(1, n, n, dtype=torch.uint8)
    for i in range(n):
        mask[0, i, i] = 1
        if i > 0:
            mask[0, i] |= mask[0, (i - 1) // 3]
    return mask.to(device)


def torch_native(q, k, v, tree_mask, prefix_len):
    """SDPA over prefix + tree with a boolean [N, prefix + N] mask; GQA by repeat_interleave."""
    rows, group = prefix_len + q.shape[1], q.shape[2] // k.shape[2]
    kr = k[:, :rows].repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, L, D]
    vr = v[:, :rows].repeat_interleave(group, dim=2).transpose(1, 2)
    visible = torch.ones(q.shape[0], 1, q.shape[1], rows, dtype=torch.bool, device=q.device)
    visible[:, 0, :, prefix_len:] = tree_mask.bool()
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kr, vr, attn_mask=visible)
    return out.transpose(1, 2)


def run_case(prefix_len: int, dtype: torch.dtype, device: torch.device, reps: int,
             shape: tuple[int, int, int, int] = (N, H, HKV, D)) -> str:  # fmt: skip
    N, H, HKV, D = shape  # noqa: N806 (the module's names, per case)
    gen = torch.Generator().manual_seed(prefix_len)
    rows = prefix_len + N
    q = torch.randn(B, N, H, D, generator=gen).to(device, dtype)
    k = torch.randn(B, rows, HKV, D, generator=gen).to(device, dtype)
    v = torch.randn(B, rows, HKV, D, generator=gen).to(device, dtype)
    mask = chain_of_paths_mask(N, device)
    exact = reference.tree_attention_ref(q.float(), k.float(), v.float(), mask, prefix_len)
    limit = 1e-4 if dtype == torch.float32 else 3e-2
    rheo = lambda: kernels.tree_attention(q, k, v, mask, prefix_len)
    native = lambda: torch_native(q, k, v, mask, prefix_len)
    max_abs_diff(rheo(), exact, limit, "the rheo kernel and reference.tree_attention_ref")
    max_abs_diff(native(), exact, limit, "torch SDPA and reference.tree_attention_ref")
    timer = Timer(device)
    rheo_us, torch_us = timer.median_us(rheo, reps), timer.median_us(native, reps)
    bytes_moved = 2 * B * rows * HKV * D * q.element_size()
    gb_per_s = bytes_moved / (rheo_us * 1e-6) / 1e9
    dtype_name = str(dtype).removeprefix("torch.")
    return (
        f"{device.type},{dtype_name},{B},{N},{H},{HKV},{D},{prefix_len},{rheo_us:.1f},"
        f"{torch_us:.1f},{torch_us / rheo_us:.2f},{gb_per_s:.2f}"
    )


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cases and repetitions")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default=f"{N},{H},{HKV},{D}",
                        help="N,H,Hkv,D of each case, cases split by /")  # fmt: skip
    parser.add_argument("--prefixes", help="cached rows, comma-separated (default 128,1024,4096)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="float32 and/or bfloat16")
    args = parser.parse_args()
    try:
        shapes = [tuple(int(v) for v in case.split(",")) for case in args.shapes.split("/")]
        given = None if args.prefixes is None else [int(v) for v in args.prefixes.split(",")]
    except ValueError:
        parser.error(f"--shapes takes N,H,Hkv,D/... and --prefixes integers, got "
                     f"{args.shapes!r}, {args.prefixes!r}")  # fmt: skip
    if any(len(c) != 4 or min(c) < 1 or c[1] % c[2] for c in shapes):
        parser.error(f"--shapes: each case is N,H,Hkv,D >= 1 with H a multiple of Hkv, got "
                     f"{args.shapes!r}")  # fmt: skip
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if not set(args.dtypes.split(",")) <= set(dtypes):
        parser.error(f"--dtypes takes float32 and/or bfloat16, got {args.dtypes!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and kernels.has_cuda()):
        parser.error("--device cuda needs a CUDA GPU and a CUDA build of rheo_engine._C; use cpu")
    prefixes = given or ([128, 1024] if args.quick else [128, 1024, 4096])
    reps = 5 if args.quick else (50 if device.type == "cpu" else 200)
    print(conditions_line(conditions("tree_attention", args.device, reps=reps)))
    print("# tree mask: parent of node i is (i - 1) // 3; GB/s = K/V read")
    print("device,dtype,B,N,H,Hkv,D,prefix_len,rheo_us,torch_us,speedup,rheo_kv_GB_per_s")
    for dtype in (dtypes[name] for name in args.dtypes.split(",")):
        for shape in shapes:
            for prefix_len in prefixes:
                print(run_case(prefix_len, dtype, device, reps, shape), flush=True)


if __name__ == "__main__":
    main()
