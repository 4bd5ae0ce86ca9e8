"""Analytic roofline of the engine's CUDA kernels on an NVIDIA H200: reasoned, not
measured.

    python bench/roofline.py

Prints markdown: the limits and model constants, one table per kernel of csrc/cuda/, and what
the kernels of one decode step cost against that step's floor. Pure Python (no torch, no GPU),
deterministic. Sizes are the paper's: Llama-3.1-8B target (H = 32, Hkv = 8, D = 128, hidden
4096, V = 128256, 32 layers), EAGLE-3 head (draft vocabulary 32000), tree N = 60, depth 8,
topk 10, support S = 128, K = 10 slots, m = 1, method rheo at T = 1; bf16 logits and
activations. BENCHMARKS.md pastes this output; tests/test_roofline.py checks it.

The model, per kernel and size:
* compulsory bytes: inputs read once and outputs written once (HBM). Must-do ops: arithmetic
  any design needs (a multiply-add is 2 FLOPs; exps apart, at the special-function unit rate).
* floor = max(bytes / HBM bandwidth, FLOPs / peak, exps / SFU rate); launch excluded. Peak is
  the bf16 tensor-core rate for matmul-shaped work (attention, linear), fp32 cores otherwise.
* current: the code as written, phase by phase. A phase costs the larger of its traffic over
  the bandwidth it can reach and its instructions over the issue rate of the SMs it runs on;
  serial work (one thread, barrier-separated tiles) costs its latency; phases add; one launch
  per kernel. A lone block streams at one SM's share of HBM bandwidth: by Little's law 256-512
  threads with one 2-8 byte load each in flight over a ~150 ns L2 hit reach about the same.
* Uncertain constants take the generous side for the current design (a high L2 bandwidth,
  overlapped exps, no cost for the tests and barriers not named), so gap = current / floor is a
  lower bound, not a forecast. "gap w/ launch" = current / (floor + launch): what a redesign
  that still launches once can win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# H200 SXM limits.
CLOCK_HZ = 1.98e9  # boost clock
SMS = 132
HBM_BW = 4.8e12  # B/s, HBM3e
L2_BW = 10e12  # B/s, generous: microbenchmarks of H100 report ~5.5-7 TB/s
L2_BYTES = 50e6
L1_BW = 128 * SMS * CLOCK_HZ  # 128 B/clock/SM, L1 and shared memory
TENSOR_FLOPS = 990e12  # dense bf16, tensor cores
FP32_FLOPS = 67e12  # CUDA cores, non-tensor
FP64_FLOPS = 33.5e12  # non-tensor (64 FP64 lanes/SM); the ~67 TF/s figure is FP64 tensor
SFU_EXPS = 16 * SMS * CLOCK_HZ  # ex2 per second: 16 a clock per SM
ISSUE = 4 * SMS * CLOCK_HZ  # warp instructions per second: 4 schedulers per SM
LAUNCH_S = 4e-6  # kernel launch overhead (3-5 us)

# Model constants, reasoned from the code.
SM_BW = HBM_BW / SMS  # what a lone block streams at
HOT_BIN_PER_CLK = 4  # shared atomics when a radix digit falls in ~4 bins (a warp replays ~8x)
TILE_CYCLES_L1 = 100  # one barrier-ordered 256-element tile: a load + 3 barriers, row in L1
TILE_CYCLES_L2 = 300  # the same with the row in L2 (a ~270-cycle hit)
L1_ROW_BYTES = 200e3  # a row up to this size stays in an SM's L1 (256 KB, shared with smem)
DEXP_THREAD_CYCLES = 40  # one double exp on a lone thread, consecutive exps overlapped
DEXP_FP64_OPS = 20  # FP64 instructions of one double exp (polynomial and scaling)
WARP_OP_CYCLES = 30  # one dependent warp shuffle / ballot
ATTN_INSTR = (10, 30)  # tree attention warp instructions per (row, key): 10 per D/32, + 30
RANK_CMP_INSTR = 6  # instructions per ranks_before compare in rank_of (load, 2 compares, add)
CHILD_SCAN_CYCLES = 40  # verification_order: thread 0 reads parents[j] (an L1 hit) per node j

# The paper's sizes.
N, DEPTH, TOPK, S_SUPPORT, K_SLOTS, LEADS = 60, 8, 10, 128, 10, 1
H, HKV, D, HIDDEN, INTER, LAYERS = 32, 8, 128, 4096, 14336, 32
V_TARGET, V_DRAFT = 128256, 32000
VISIBLE_TREE = 5.0  # mean ancestors-or-self per node of a 60-node depth-8 tree (assumed)
VISITED = 5  # nodes a verification walk visits = accept length (paper: tau 5.0-5.3)
CANDIDATES = TOPK + (DEPTH - 1) * TOPK * TOPK  # L = 710 for build_tree


@dataclass(frozen=True)
class Estimate:
    """One table row: a size, its floor and the current design's estimate (launch included)."""

    size: str
    compulsory_bytes: float
    ops: str  # the must-do arithmetic, as printed
    floor_s: float
    traffic: str  # what the current design moves or does, as printed
    current_s: float
    bound: str  # the phase or limit that dominates current_s

    @property
    def gap(self) -> float:
        return self.current_s / self.floor_s

    @property
    def gap_with_launch(self) -> float:
        return self.current_s / (self.floor_s + LAUNCH_S)


def si(x: float, unit: str) -> str:
    """3 significant digits and a decimal prefix: si(8.1e9, 'FLOP') = '8.1 GFLOP'; a unit that
    starts with a space is a count: si(2e6, ' exp') = '2 M exp'."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit.strip()}"


def us(t: float) -> str:
    v = t * 1e6
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}" if v >= 0.001 else "<0.001"


def times(x: float) -> str:
    return ">1000x" if x > 1000 else f"{x:.0f}x" if x >= 10 else f"{x:.1f}x"


def sms(count: int) -> str:
    busy = min(count, SMS)
    return f"{busy} SM{'s' if busy > 1 else ''}"


def dominant(phases: dict[str, float]) -> str:
    return max(phases, key=lambda name: phases[name])


# Tree attention: csrc/cuda/tree_attention.cu.
@dataclass(frozen=True)
class TreeAttentionSize:
    B: int
    prefix: int


def kv_bytes(s: TreeAttentionSize) -> float:
    """K and V of one layer, prefix and tree rows, bf16: each read once is compulsory."""
    return s.B * (s.prefix + N) * HKV * D * 2 * 2


def attention_pairs(s: TreeAttentionSize) -> float:
    """(query row, visible key row) pairs: every prefix row plus the node's ancestors-or-self."""
    return s.B * N * H * (s.prefix + VISIBLE_TREE)


def tree_attention_l2_bytes(s: TreeAttentionSize) -> float:
    """One block per (node, head, batch): every pair reads its key's K and V rows again."""
    return attention_pairs(s) * D * 2 * 2


def tree_attention(s: TreeAttentionSize) -> Estimate:
    pairs = attention_pairs(s)
    compulsory = kv_bytes(s) + 2 * s.B * N * H * D * 2 + s.B * N * N  # + q, out, mask
    flops = 4 * D * pairs  # q.k and p.v
    floor = max(compulsory / HBM_BW, flops / TENSOR_FLOPS, pairs / SFU_EXPS)
    per_pair, fixed = ATTN_INSTR
    l2 = tree_attention_l2_bytes(s)
    phases = {
        "HBM (K/V once)": compulsory / HBM_BW,
        "L2 re-reads": l2 / L2_BW,
        "issue (CUDA cores)": pairs * (per_pair * D / 32 + fixed) / ISSUE,
    }
    return Estimate(
        size=f"B={s.B}, prefix {s.prefix}",
        compulsory_bytes=compulsory,
        ops=f"{si(flops, 'FLOP')}, {si(pairs, ' exp')}",
        floor_s=floor,
        traffic=f"{si(l2, 'B')} L2 ({us(l2 / L2_BW)} µs)",
        current_s=max(phases.values()) + LAUNCH_S,
        bound=dominant(phases),
    )


# As built (after the review): 64 query rows of one KV head per block, K/V tiles of 32 keys through
# shared memory once per row tile, fp32 FMAs; prefix split ~256 keys a block, log-sum-exp merge.
ATTN_ROWS_PER_BLOCK, ATTN_KEYS_PER_SPLIT, ATTN_MAX_BLOCKS = 64, 256, 2 * SMS
# Warp instructions per (row, key): D FMAs for q.k with 3 shared loads per 8, D for p.v with 3
# per 32 (the kernel's PTX), over 32 lanes.
ATTN_BUILT_INSTR = (1 + 3 / 8) + (1 + 3 / 32)


def tree_attention_built(s: TreeAttentionSize) -> Estimate:
    g = H // HKV
    row_tiles = math.ceil(N * g / ATTN_ROWS_PER_BLOCK)
    keys = s.prefix + N
    splits = max(1, min(math.ceil(keys / ATTN_KEYS_PER_SPLIT),
                        ATTN_MAX_BLOCKS // (s.B * HKV * row_tiles)))  # fmt: skip
    blocks = s.B * HKV * row_tiles * splits
    pairs = s.B * N * H * keys  # every key of the tile is scored (masked ones too)
    l2 = kv_bytes(s) * row_tiles
    partials = 2 * 4 * s.B * N * H * (D + 2) * splits if splits > 1 else 0.0
    busy = min(blocks, SMS) / SMS
    phases = {
        "HBM (K/V once)": (kv_bytes(s) + partials) / HBM_BW,
        "L2 (K/V per row tile)": l2 / L2_BW,
        "issue (fp32 FMAs)": pairs * ATTN_BUILT_INSTR * D / 32 / (ISSUE * busy),
    }
    return replace(  # the reviewed row's size, floor and must-do work
        tree_attention(s),
        traffic=f"{si(l2, 'B')} L2, {blocks} blocks",
        current_s=max(phases.values()) + (2 if splits > 1 else 1) * LAUNCH_S,
        bound=dominant(phases),
    )


# Pool sampler: csrc/cuda/pool_sampler.cu.
@dataclass(frozen=True)
class PoolSamplerSize:
    rows: int
    V: int


def pool_sampler(s: PoolSamplerSize, built: bool = False) -> Estimate:
    """One 256-thread block per row (rows <= 132: one SM each): 6 passes over V, then thread 0.
    built: as built after the review, the gather scans a contiguous id range per warp with two block
    barriers (a streaming pass; the ties' second pass reads a few tiles), not ordered tiles."""
    se = min(S_SUPPORT, s.V)
    row = s.V * 2
    outputs = K_SLOTS * 8 + se * 8 + 8  # tokens + log proxies, q~ ids + q~, slot + q~(Y)
    compulsory = s.rows * (row + outputs)
    floor = max(compulsory / HBM_BW, s.rows * s.V / SFU_EXPS)
    stream = row / SM_BW
    tile = TILE_CYCLES_L1 if row <= L1_ROW_BYTES else TILE_CYCLES_L2
    phases = {
        "radix digit 1 (hot-bin atomics)": max(stream, s.V / HOT_BIN_PER_CLK / CLOCK_HZ),
        "radix digits 2-4": 3 * stream,
        "ordered gather (tile latency)": max(stream, math.ceil(s.V / 256) * tile / CLOCK_HZ),
        "warp-range gather": stream,
        "outside mass": stream,
        "thread-0 plan_row": (4 * se - 2 * LEADS) * DEXP_THREAD_CYCLES / CLOCK_HZ,
        # built: warp 0, the exps 32 at a time, 4 warp sums and an inverse-CDF scan per 32 entries
        "warp plan_row": (
            math.ceil((4 * se - 2 * LEADS) / 32) * DEXP_THREAD_CYCLES
            + (4 * 5 + math.ceil(se / 32) * (5 + 3)) * WARP_OP_CYCLES
        )
        / CLOCK_HZ,
    }
    for name in ("ordered gather (tile latency)", "thread-0 plan_row") if built else (
        "warp-range gather", "warp plan_row"):  # fmt: skip
        del phases[name]
    waves = math.ceil(s.rows / SMS)
    return Estimate(
        size=f"V={s.V}, {s.rows} row{'s' if s.rows > 1 else ''}",
        compulsory_bytes=compulsory,
        ops=si(s.rows * s.V, " exp"),
        floor_s=floor,
        traffic=f"{si(6 * s.rows * row, 'B')} on {sms(s.rows)}",
        current_s=waves * sum(phases.values()) + LAUNCH_S,
        bound=dominant(phases),
    )


# Verification: csrc/cuda/verification.cu.
@dataclass(frozen=True)
class VerificationSize:
    B: int
    top_k: int = 0
    top_p: float = 1.0


def verification_node_phases(s: VerificationSize) -> dict[str, tuple[float, float]]:
    """Per visited node: phase -> (bytes streamed by the tree's one SM, seconds)."""
    V, logits = V_TARGET, V_TARGET * 2
    fp64_instr_per_sm = FP64_FLOPS / 2 / SMS
    hot = V / HOT_BIN_PER_CLK / CLOCK_HZ
    phases = {
        "max pass": (logits, logits / SM_BW),
        "exp pass (double exp)": (
            logits + 8 * V,
            max((logits + 8 * V) / SM_BW, V * DEXP_FP64_OPS / fp64_instr_per_sm),
        ),
        "normalise + nnz passes": (24 * V, 24 * V / SM_BW),
        "children scan (thread 0)": (0.0, N * CHILD_SCAN_CYCLES / CLOCK_HZ),
    }
    if s.top_k:  # 8 digits of 64-bit keys over the logits, the first into ~4 hot bins
        phases["top-k radix, 8 passes"] = (
            8 * logits,
            max(logits / SM_BW, hot) + 7 * logits / SM_BW,
        )
    if s.top_p < 1.0:  # 8 digits over w (doubles), then ties, keep and renormalise
        phases["top-p radix + 3 passes"] = (
            104 * V,
            max(8 * V / SM_BW, hot) + (7 * 8 + 8 + 16 + 16) * V / SM_BW,
        )
    return phases


def verification(s: VerificationSize) -> Estimate:
    """One 512-thread block per tree (B SMs busy), a walk of VISITED dependent nodes."""
    V = V_TARGET
    compulsory = s.B * (VISITED * (V * 2 + S_SUPPORT * 8) + N * 12 + 12)
    exps = s.B * VISITED * V
    floor = max(compulsory / HBM_BW, exps / SFU_EXPS)
    node = verification_node_phases(s)
    phases = {name: VISITED * t for name, (_, t) in node.items()}
    phases["final draw (2 passes)"] = 16 * V / SM_BW
    per_tree = VISITED * sum(b for b, _ in node.values()) + 16 * V
    sampling = [f"top-k {s.top_k}"] * bool(s.top_k) + [f"top-p {s.top_p}"] * (s.top_p < 1)
    return Estimate(
        size=f"B={s.B}, {', '.join(sampling) or 'plain'}",
        compulsory_bytes=compulsory,
        ops=si(exps, " exp"),
        floor_s=floor,
        traffic=f"{si(per_tree, 'B')}/tree on {sms(s.B)}",
        current_s=math.ceil(s.B / SMS) * sum(phases.values()) + LAUNCH_S,
        bound=dominant(phases),
    )


# As built (after the review): a prepass (grid B*N) reduces every node row to a stats record (max,
# softmax sum, #p > 0, top-k / top-p thresholds) in parallel; the walk (grid B) then costs
# O(K + S) a node and one pass over V for the final draw. A visited node's walk work is a chain
# of dependent block reductions and barriers (assumed ~0.5 µs each, ~6 of them).
WALK_NODE_S = 3e-6


def verification_built(s: VerificationSize) -> Estimate:
    V, logits, rows = V_TARGET, V_TARGET * 2, s.B * N
    key_bytes = 2  # bf16 logits: top-k / top-p radix digits over 16-bit keys
    passes = 1.0 + (key_bytes if s.top_k else 0) + (key_bytes + 1 if s.top_p < 1.0 else 0)
    waves = math.ceil(rows / SMS)
    hot = V / HOT_BIN_PER_CLK / CLOCK_HZ if (s.top_k or s.top_p < 1.0) else 0.0
    phases = {
        "prepass (rows in parallel)": waves * (passes * logits / SM_BW + hot),
        "walk (dependent reductions)": VISITED * WALK_NODE_S,
        "final draw (1 pass)": (1 + 1 / 16) * logits / SM_BW,
    }
    return replace(  # the reviewed row's size, floor and must-do work
        verification(s),
        traffic=f"{si(rows * passes * logits, 'B')} on {sms(rows)}, then {sms(s.B)}",
        current_s=math.ceil(s.B / SMS) * sum(phases.values()) + 2 * LAUNCH_S,
        bound=dominant(phases),
    )


# Proxy rerank: csrc/cuda/proxy_rerank.cu.
@dataclass(frozen=True)
class RerankSize:
    kernel: str  # "select_expand" (M = L scores) or "build_tree" (L candidates)
    B: int
    L: int


def rank_cycles(cands: int, L: int) -> float:
    """256 threads take candidates t, t + 256, ...; each rank_of scans all L scores."""
    warps = min(8, math.ceil(cands / 32))
    return math.ceil(cands / 256) * L * RANK_CMP_INSTR * math.ceil(warps / 4)


def proxy_rerank(s: RerankSize) -> Estimate:
    """One 256-thread block per batch entry; a rank is an O(L) count, so O(L^2) per block."""
    if s.kernel == "select_expand":
        compulsory = s.B * (s.L * 4 + TOPK * 4)
        cycles = rank_cycles(s.L, s.L)
    else:  # scores, tokens, parents, sampled in; 6 int32 per node, mask, paths out
        compulsory = s.B * (s.L * 16 + 8 + N * (6 * 4 + N + (DEPTH + 1) * 4) + 4)
        cycles = rank_cycles(s.L, s.L) + rank_cycles(N - 1, s.L)  # + the parents' ranks
    compares = s.B * s.L * math.log2(s.L)
    phases = {"launch": LAUNCH_S, "O(L^2) rank counts": cycles / CLOCK_HZ}
    return Estimate(
        size=f"{s.kernel}, B={s.B}, {'M' if s.kernel == 'select_expand' else 'L'}={s.L}",
        compulsory_bytes=compulsory,
        ops=si(compares, " cmp"),
        floor_s=max(compulsory / HBM_BW, compares / FP32_FLOPS),
        traffic=f"{si(s.B * s.L * s.L, ' cmp')} on {sms(s.B)}",
        current_s=sum(phases.values()),
        bound=dominant(phases),
    )


# Skinny linear: csrc/cuda/skinny_linear.cu (not on the engine's CUDA path: F.linear runs there).
@dataclass(frozen=True)
class SkinnySize:
    label: str
    n: int
    out: int
    inp: int


def skinny_linear(s: SkinnySize) -> Estimate:
    """One warp per output row, 16-byte chunks, 8 rows of x per pass over the W row."""
    compulsory = (s.out * s.inp + s.n * s.inp + s.n * s.out) * 2
    flops = 2 * s.n * s.inp * s.out
    groups = [min(8, s.n - i) for i in range(0, s.n, 8)]
    # Per 16-byte W chunk: load + 8 converts; per x row: load + 8 converts + 8 FFMA.
    instr = s.out * s.inp / (32 * 8) * sum(9 + 17 * rows for rows in groups)
    phases = {
        "HBM (W once)": compulsory / HBM_BW,
        "L1 (x per output row)": s.out * s.n * s.inp * 2 / L1_BW,
        "issue (CUDA-core FMAs)": instr / ISSUE,
    }
    return Estimate(
        size=f"{s.label} {s.out}x{s.inp}, n={s.n}",
        compulsory_bytes=compulsory,
        ops=si(flops, "FLOP"),
        floor_s=max(compulsory / HBM_BW, flops / TENSOR_FLOPS),
        traffic=f"W {si(s.out * s.inp * 2, 'B')} HBM, x {si(s.out * s.n * s.inp * 2, 'B')} L1",
        current_s=max(phases.values()) + LAUNCH_S,
        bound=dominant(phases),
    )


@dataclass(frozen=True)
class KernelTable:
    title: str
    design: str  # the work mapping the kernel review read in the .cu file (commit abcb590)
    rows: list[Estimate]
    redesign: list[str]
    built: list[Estimate] | None = None  # the same sizes, as built after review (None: unchanged)
    built_design: str = ""


def kernel_tables() -> list[KernelTable]:
    attn = [TreeAttentionSize(b, p) for b in (1, 8) for p in (1024, 8192)]
    pools = [PoolSamplerSize(r, v) for v in (V_DRAFT, V_TARGET) for r in (1, 10, 80)]
    verify = [VerificationSize(1), VerificationSize(1, top_k=50)]
    verify += [VerificationSize(1, top_p=0.9), VerificationSize(8)]
    rerank = [RerankSize("select_expand", b, m) for b, m in ((1, 10), (1, 100), (8, 100))]
    rerank += [RerankSize("build_tree", b, CANDIDATES) for b in (1, 8)]
    skinny = [SkinnySize("head lm_head", n, V_DRAFT, HIDDEN) for n in (1, 10, 80)]
    skinny += [SkinnySize("target gate_up", n, 2 * INTER, HIDDEN) for n in (1, 60)]
    kv = kv_bytes(TreeAttentionSize(1, 8192))
    return [
        KernelTable(
            "Tree attention (per layer; 32 per target forward)",
            f"grid (N, H, B) of 128-thread blocks, one query row each, fp32 CUDA-core math: "
            f"each K/V row is read N*G = {N * H // HKV} times, from L2 (a batch entry's K/V, "
            f"{si(kv, 'B')} at prefix 8192, about fits the {L2_BYTES / 1e6:.0f} MB L2 while its "
            "blocks run: HBM taken as reading it once); no tensor cores.",
            [tree_attention(s) for s in attn],
            [
                "One block per (KV head, prefix split, batch) holding the [N*G, D] = "
                f"[{N * H // HKV}, {D}] query tile; K/V tiles loaded once (TMA, double "
                f"buffered) for all rows, QK^T and PV on tensor cores, the tree mask applied in "
                f"the last tile: K/V traffic {si(kv, 'B')} instead of "
                f"{si(tree_attention_l2_bytes(TreeAttentionSize(1, 8192)), 'B')} at prefix 8192.",
                f"Split the prefix (flash-decoding) so B * Hkv * splits >= {SMS} blocks, "
                "then a log-sum-exp merge of the splits' partial outputs.",
            ],
            [tree_attention_built(s) for s in attn],
            f"one 256-thread block per (KV head, {ATTN_ROWS_PER_BLOCK} query rows, key split, "
            f"batch): K/V tiles of 32 keys go through shared memory once per row tile "
            f"({math.ceil(N * H // HKV / ATTN_ROWS_PER_BLOCK)} reads of K/V instead of "
            f"{N * H // HKV}), the mask applied in the tile; ~{ATTN_KEYS_PER_SPLIT} keys a "
            f"split, at most {ATTN_MAX_BLOCKS} blocks, a log-sum-exp merge kernel; fp32 FMAs "
            "(no tensor cores: the emulator that checks it runs plain CUDA C++). Issue-bound "
            "now; tensor cores are the next step.",
        ),
        KernelTable(
            "Pool sampler (one launch per draft level)",
            "one 256-thread block per row (only `rows` of 132 SMs busy), 4 radix passes + "
            "ordered gather + outside-mass pass = 6 passes over V, shared atomics on a hot "
            f"bin, then thread 0 alone runs plan_row ({4 * S_SUPPORT - 2 * LEADS} double exps "
            "+ the inverse-CDF scan, not counted); 64-entry local arrays per thread.",
            [pool_sampler(s) for s in pools],
            [
                f"Several blocks per row (about {SMS} / rows, or a thread-block cluster): one "
                "pass over V each computing max, sum-exp (online) and a local top-S; a merge "
                "takes the union of candidates, the support, and the outside mass as total "
                "minus support (the outside pass goes away).",
                "plan_row over a warp: the masses and the inverse CDF as warp reductions and "
                "scans over the S entries (4 per lane), not one thread.",
                "Per-warp histograms or warp-aggregated atomics (__match_any_sync) for the hot "
                "first digit; the rank sort as a warp bitonic sort of S keys.",
            ],
            [pool_sampler(s, built=True) for s in pools],
            "the gather scans a contiguous id range per warp (coalesced, two block barriers "
            "instead of three per 256 ids), plan_row runs on warp 0 (lane-strided exps, warp "
            "sums in a fixed order, the inverse CDF as a warp scan 32 entries a round), and the "
            "rank sort keeps at most 8 entries a thread (128-byte stack frame instead of 1 KB); "
            "still one block per row and 6 passes over V.",
        ),
        KernelTable(
            "Verification (one launch per step)",
            f"one 512-thread block per tree (at most B SMs busy) walking {VISITED} dependent "
            "nodes; per node ~4 passes over V (max, double exp, normalise, nnz; +8 radix passes "
            "for top-k, +11 for top-p) on a [V] double workspace, then a 2-pass final draw.",
            [verification(s) for s in verify],
            [
                "Before the walk, one fully parallel pass over all B*N rows (split V, all SMs): "
                "max and sum-exp by online softmax; the walk then needs p at the children's "
                "tokens and the sparse q~ correction only, O(K + S) per node.",
                "Materialise the residual over V once, for the final draw, split over blocks "
                "with a scan; top-k / top-p by radix over the 16 bits of bf16 (2 passes) or "
                "over float32 p, not 8 passes of 64-bit keys.",
            ],
            [verification_built(s) for s in verify],
            "node_stats_kernel, one block per node row (grid B*N), reduces every row in "
            "parallel to a 48-byte record (non-finite flag, max, softmax sum, #p > 0, top-k "
            "threshold, top-p cut) with one online pass (+ key-digit passes over 16-bit keys "
            "for top-k / top-p, masses in 64-bit fixed point so every sum is order-free); "
            "walk_kernel, one block per tree, evaluates p only at the children's tokens and on "
            "the q~ support, keeps the changed entries in a shared-memory hash, and makes one "
            "pass over V for the final draw.",
        ),
        KernelTable(
            "Proxy rerank (select_expand 7 per step, build_tree 1)",
            "one 256-thread block per batch entry; each candidate's rank is an O(L) count over "
            "all scores, O(L^2) per block.",
            [proxy_rerank(s) for s in rerank],
            [
                "Launch-bound: fold select_expand into the pool sampler's merge (or capture the "
                "draft loop in a CUDA graph); build_tree by a shared-memory bitonic sort of "
                "1024 (score, flat index) keys instead of O(L^2) counts.",
            ],
        ),
        KernelTable(
            "Skinny linear (not on the CUDA path today: F.linear runs there)",
            "one warp per output row streaming W once with 16-byte loads, 8 rows of x per "
            "pass; x re-read from L1 per output row; fp32 CUDA-core FMAs, no tensor cores.",
            [skinny_linear(s) for s in skinny],
            [
                "At n <= 10 W streaming bounds it and it is near the floor. For n > 8, tensor "
                "cores (mma with W as the M side, x staged once per block in shared memory) "
                "or cuBLAS; the current design is issue- and L1-bound there.",
            ],
        ),
    ]


def kernel_markdown(t: KernelTable) -> list[str]:
    lines = [f"### {t.title}", "", f"Reviewed design: {t.design}", ""]
    lines.append(
        "| size | compulsory bytes | must-do ops | floor µs | reviewed traffic | reviewed µs "
        "| bound by | gap | gap w/ launch |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in t.rows:
        lines.append(
            f"| {r.size} | {si(r.compulsory_bytes, 'B')} | {r.ops} | {us(r.floor_s)} "
            f"| {r.traffic} | {us(r.current_s)} | {r.bound} | {times(r.gap)} "
            f"| {times(r.gap_with_launch)} |"
        )
    lines += ["", "Redesign:"] + [f"- {note}" for note in t.redesign] + [""]
    if t.built is None:
        return lines + ["Built: unchanged.", ""]
    lines += [f"Built: {t.built_design}", ""]
    lines.append("| size | built traffic | built µs | bound by | gap w/ launch | vs reviewed |")
    lines.append("|---|---:|---:|---|---:|---:|")
    for r, b in zip(t.rows, t.built, strict=True):
        lines.append(
            f"| {b.size} | {b.traffic} | {us(b.current_s)} | {b.bound} "
            f"| {times(b.gap_with_launch)} | {times(r.current_s / b.current_s)} faster |"
        )
    return lines + [""]


# One decode step (B trees, prefix P): the parts, each with its floor and its current estimate.
HEAD_LAYER = HIDDEN * 2 * HIDDEN + 2 * HKV * D * 2 * HIDDEN + HIDDEN * H * D + 3 * INTER * HIDDEN
TARGET_LAYER = (H + 2 * HKV) * D * HIDDEN + H * D * HIDDEN + 3 * INTER * HIDDEN
TARGET_STREAMED = LAYERS * TARGET_LAYER + V_TARGET * HIDDEN  # the embedding is only gathered
HEAD_FC = HIDDEN * 3 * HIDDEN


@dataclass(frozen=True)
class StepPart:
    name: str
    calls: int
    floor_s: float
    current_s: float | None  # None: torch/cuBLAS work, taken at its floor
    built_s: float | None = None  # as built after the review


def matmul_floor(params: float, rows: int) -> float:
    return max(params * 2 / HBM_BW, 2 * params * rows / TENSOR_FLOPS)


def head_floor(B: int, prefix: int) -> float:
    """8 levels of the EAGLE-3 head (B rows, then B * topk), its KV cache, and the fc once."""
    kv = B * prefix * HKV * D * 2 * 2 / HBM_BW
    levels = [B] + [B * TOPK] * (DEPTH - 1)
    per_level = [matmul_floor(HEAD_LAYER + V_DRAFT * HIDDEN, rows) + kv for rows in levels]
    return sum(per_level) + matmul_floor(HEAD_FC, B * VISITED)


def kernel_part(name: str, calls: list[Estimate], built: list[Estimate] | None = None) -> StepPart:
    floor = sum(e.floor_s for e in calls)
    current = sum(e.current_s for e in calls)
    after = current if built is None else sum(e.current_s for e in built)
    return StepPart(name, len(calls), floor, current, after)


def step_parts(B: int, prefix: int) -> list[StepPart]:
    rows = [B] + [B * TOPK] * (DEPTH - 1)  # pool rows per draft level
    scores = [TOPK] + [TOPK * TOPK] * (DEPTH - 2)  # select_expand's M per expansion
    return [
        StepPart("target linears (cuBLAS)", 1, matmul_floor(TARGET_STREAMED, B * N), None),
        StepPart("draft head, 8 levels + fc (torch)", DEPTH, head_floor(B, prefix), None),
        kernel_part(
            "tree_attention",
            [tree_attention(TreeAttentionSize(B, prefix))] * LAYERS,
            [tree_attention_built(TreeAttentionSize(B, prefix))] * LAYERS,
        ),
        kernel_part(
            "pool_sampler",
            [pool_sampler(PoolSamplerSize(r, V_DRAFT)) for r in rows],
            [pool_sampler(PoolSamplerSize(r, V_DRAFT), built=True) for r in rows],
        ),
        kernel_part(
            "select_expand", [proxy_rerank(RerankSize("select_expand", B, m)) for m in scores]
        ),
        kernel_part("build_tree", [proxy_rerank(RerankSize("build_tree", B, CANDIDATES))]),
        kernel_part(
            "verification",
            [verification(VerificationSize(B))],
            [verification_built(VerificationSize(B))],
        ),
    ]


def step_markdown(B: int, prefixes: tuple[int, ...] = (1024, 8192)) -> list[str]:
    per_prefix = [step_parts(B, p) for p in prefixes]
    head = "| part | calls |" + "".join(
        f" P={p} floor µs | reviewed µs | built µs | built % of floor |" for p in prefixes
    )
    lines = [f"#### B = {B}", "", head, "|---|---:|" + "---:|---:|---:|---:|" * len(prefixes)]
    floors = [sum(part.floor_s for part in parts) for parts in per_prefix]
    for i, part in enumerate(per_prefix[0]):
        cells = f"| {part.name} | {part.calls} |"
        for parts, floor in zip(per_prefix, floors, strict=True):
            p = parts[i]
            cur = "(at floor)" if p.current_s is None else us(p.current_s)
            built = "" if p.built_s is None else us(p.built_s)
            share = "" if p.built_s is None else f"{100 * p.built_s / floor:.1f}%"
            cells += f" {us(p.floor_s)} | {cur} | {built} | {share} |"
        lines.append(cells)
    totals = "| **step** | |"
    for parts, floor in zip(per_prefix, floors, strict=True):
        current = sum(p.floor_s if p.current_s is None else p.current_s for p in parts)
        built = sum(p.floor_s if p.built_s is None else p.built_s for p in parts)
        totals += (
            f" **{us(floor)}** | **{us(current)}** ({times(current / floor)}) "
            f"| **{us(built)}** | {times(built / floor)} the floor |"
        )
    return lines + [totals, ""]


def constants_markdown() -> list[str]:
    return [
        "Analytic, not measured: H200 SXM limits and the model's constants (bench/roofline.py):",
        "",
        f"- {SMS} SMs at {CLOCK_HZ / 1e9:.2f} GHz; HBM3e {HBM_BW / 1e12:.1f} TB/s; L2 "
        f"{L2_BW / 1e12:.0f} TB/s (generous) and {L2_BYTES / 1e6:.0f} MB; L1/shared "
        f"{L1_BW / 1e12:.1f} TB/s (128 B/clock/SM); 228 KB shared memory, 2048 threads and "
        "64K registers per SM.",
        f"- bf16 tensor cores {TENSOR_FLOPS / 1e12:.0f} TFLOP/s; fp32 CUDA cores "
        f"{FP32_FLOPS / 1e12:.0f} TFLOP/s; FP64 non-tensor {FP64_FLOPS / 1e12:.1f} TFLOP/s; "
        f"exp (SFU) {SFU_EXPS / 1e12:.2f} T/s; issue {ISSUE / 1e12:.2f} T warp instructions/s; "
        f"launch {LAUNCH_S * 1e6:.0f} µs per kernel.",
        f"- a lone block streams at one SM's share of HBM, {SM_BW / 1e9:.1f} GB/s; hot-bin "
        f"shared atomics {HOT_BIN_PER_CLK} a clock; an ordered 256-element tile "
        f"{TILE_CYCLES_L1} cycles (row in L1) or {TILE_CYCLES_L2} (in L2); a double exp on one "
        f"thread {DEXP_THREAD_CYCLES} cycles, {DEXP_FP64_OPS} FP64 instructions; a dependent warp "
        f"shuffle {WARP_OP_CYCLES} cycles; tree attention "
        f"{ATTN_INSTR[0]} warp instructions per D/32 + {ATTN_INSTR[1]} per (row, key) (reviewed), "
        f"{ATTN_BUILT_INSTR:.2f} per D/32 (built); a verification walk node "
        f"{WALK_NODE_S * 1e6:.0f} µs of dependent reductions (built).",
        f"- sizes: N = {N}, depth {DEPTH}, topk {TOPK}, S = {S_SUPPORT}, K = {K_SLOTS}, "
        f"m = {LEADS}; H = {H}, Hkv = {HKV}, D = {D}; bf16; a node sees {VISIBLE_TREE:g} tree "
        f"rows on average; a walk visits {VISITED} nodes; build_tree ranks L = {CANDIDATES}.",
        "",
    ]


def render() -> str:
    lines = constants_markdown()
    for table in kernel_tables():
        lines += kernel_markdown(table)
    lines += [
        "### One decode step against its floor",
        "",
        f"Target forward over B*N tree tokens: {TARGET_STREAMED / 1e9:.2f} G streamed "
        f"parameters (the embedding is gathered); the head: one decoder layer + a "
        f"{V_DRAFT}x{HIDDEN} lm_head per level, the fc once. Torch parts at their floor, their "
        "launches not counted.",
        "",
    ]
    for B in (1, 8):
        lines += step_markdown(B)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
