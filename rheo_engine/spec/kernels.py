"""Typed wrappers over the compiled kernels (the only module that imports ``_C``).

Each function allocates its outputs, calls the kernel on the inputs' device and returns the
outputs. Shapes use the letters of docs/algorithm.md §1: B batch, N tree nodes, V vocabulary,
K pool slots, Se = min(S, V) sparse support, H/Hkv heads, D head dim. Bad input raises
``ValueError`` from the C++ checks, naming the value, the rule and the fix.

The status word (csrc/include/rheo/common.h StatusBit). A CUDA kernel cannot raise without a
host sync, so the kernels of a step take ``status``, a [1] int32 word on their device
(``status_word``): on bad input a CUDA kernel ORs a bit into it, writes outputs that keep the
later kernels in bounds and goes on; the step reads the word once, with its verdict, and
``raise_status`` raises the error the CPU kernel would have raised. The CPU kernels raise at
once and leave the word alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

try:
    from rheo_engine import _C
except ImportError as err:  # not built, or built against another torch: say how to rebuild
    raise ImportError(
        f"rheo_engine._C does not load with torch {torch.__version__} ({err}); build it against "
        "the installed torch: `bash rheo.sh setup` in a clone, or `pip install "
        "--no-build-isolation .` (docs/building.md)"
    ) from err

PoolKind = Literal["topk", "rheo"]
VerifyMethod = Literal["topk", "rrsw", "rheo"]
_POOL_KINDS = {"topk": 0, "rheo": 1}
_VERIFY_METHODS = {"topk": 0, "rrsw": 1, "rheo": 2}


def has_cuda() -> bool:
    """True when the extension was compiled with the CUDA kernels."""
    return bool(_C.has_cuda())


def build_info() -> str:
    """What the extension holds, e.g. ``'cpu'`` or ``'cpu + cuda sm_90'``."""
    return str(_C.build_info())


def cuda_build_note() -> str:
    """Why the build did or did not compile the CUDA kernels (setup.py's reason, e.g. "torch
    has no CUDA", "nvcc not found", "GPU found"); "" for a build that did not record it."""
    return str(_C.cuda_build_note())


def built_with_torch() -> str:
    """The torch version the extension was compiled against ("" when not recorded)."""
    return str(_C.built_with_torch())


CpuIsa = Literal["default", "avx2", "avx512"]


def cpu_isa() -> CpuIsa:
    """The level the CPU kernels dispatch to: the CPU's best, or ``RHEO_CPU_ISA`` (read once at
    import) lowered to it. Every level gives the same bits; only the speed differs."""
    return _C.cpu_isa()


def set_cpu_isa(level: CpuIsa) -> CpuIsa:
    """Dispatch the CPU kernels to ``level``, lowered to what the CPU runs (for tests); returns
    the level now active. ``ValueError`` for an unknown level."""
    return _C.set_cpu_isa(level)


def _acc_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _lookup(table: dict[str, int], value: str, what: str) -> int:
    if value not in table:
        raise ValueError(f"{what}={value!r} is not one of {sorted(table)}; pick one of those")
    return table[value]


# --- the status word ---------------------------------------------------------------------

# The bits of common.h StatusBit (exported by _C), in step order.
NON_FINITE_DRAFT = int(_C.STATUS_NON_FINITE_DRAFT)  # pool sampler: a NaN/inf draft logit
BAD_FORCED = int(_C.STATUS_BAD_FORCED)  # pool sampler: a forced token that cannot be Y
NAN_SCORE = int(_C.STATUS_NAN_SCORE)  # select_expand / build_tree: a NaN path score
BAD_TREE = int(_C.STATUS_BAD_TREE)  # build_tree: parents, ancestor closure, depth or prefix_len
NON_FINITE_TARGET = int(_C.STATUS_NON_FINITE_TARGET)  # verification: NaN/inf at a visited node
BAD_VERIFY_INPUT = int(_C.STATUS_BAD_VERIFY_INPUT)  # verification: the tree or q~ breaks rules
BAD_CONTROLS = int(_C.STATUS_BAD_CONTROLS)  # logit controls: the tree or the history breaks rules
# Bit -> the rule and fix of the error the CPU kernel raises for that input (the word has no
# room for the offending value: the CPU kernels on the same input name it).
STATUS_ERRORS = {
    NON_FINITE_DRAFT: (
        "the draft logits must be finite (a NaN/inf draft logit); drop masked tokens from the "
        "vocabulary instead of setting them to -inf"
    ),
    BAD_FORCED: (
        "forced_sample holds a token that cannot be the sampled token of its row (not a "
        "non-lead support token with q~ > 0); pass -1 to draw, or a non-lead support token "
        "with q~ > 0"
    ),
    NAN_SCORE: (
        "draft scores hold NaN; scores must be sums of log proxies (finite or -inf); check the "
        "draft's log_proxy (the draft head produced NaN logits: check its weights and dtype)"
    ),
    BAD_TREE: (
        "the draft candidates do not form a tree (a parent after its child, a child outscoring "
        "its parent, a node deeper than depth= or a negative prefix_len); scores must be sums "
        "of log proxies <= 0: concatenate the levels root-side first and pass the levels drafted"
    ),
    NON_FINITE_TARGET: (
        "target logits must be finite at every visited node; check the target model output "
        "(masked tokens must be large negative numbers, not -inf; fp16 overflow: try bfloat16)"
    ),
    BAD_VERIFY_INPUT: (
        "the tree or the q~ table breaks verification's rules (parents precede their nodes, "
        "tokens and q~ ids in [0, V), at most one sampled child per parent, a sampled token in "
        "its support with q~ > 0, path_capacity >= depth + 1); lay the tree out with build_tree"
    ),
    BAD_CONTROLS: (
        "the tree or the history breaks logit controls' rules (parents precede their nodes, "
        "tokens in [0, V), history ids in [0, V) strictly ascending with counts >= 0, "
        "0 <= history_len <= H, suppress ids in [0, V)); build the history with NodeHistory"
    ),
}


def status_word(device: torch.device | str) -> torch.Tensor:
    """A zeroed status word [1] int32 on ``device``, for the kernels of one step."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def coin_key(seed: int, step: int, device: torch.device | str) -> torch.Tensor:
    """The coins' key [2] int64 (seed, step) on ``device`` for pool_sampler / verification's
    ``key``: the kernels read seed and step from it, so a captured step replays with the step
    its buffer holds (a seed >= 2**63 is kept as its int64 bit pattern)."""
    return torch.tensor(_key_values(seed, step), dtype=torch.int64, device=device)


def _key_values(seed: int, step: int) -> list[int]:
    for name, v in (("seed", seed), ("step", step)):
        if not 0 <= v < 2**64:
            raise ValueError(f"{name}={v} must be in [0, 2**64) (the Philox key and counter)")
    return [v - 2**64 if v >= 2**63 else v for v in (seed, step)]


def raise_status(bits: int) -> None:
    """Raise the ValueError a CPU kernel raises for the first bit set in ``bits`` (the status
    word read on the host); nothing for 0. Other bits set are named after it."""
    if bits == 0:
        return
    known = [bit for bit in STATUS_ERRORS if bits & bit]
    unknown = bits & ~sum(STATUS_ERRORS)
    if not known:
        raise RuntimeError(
            f"status={bits:#x} holds no known bit (common.h StatusBit); rebuild rheo_engine._C "
            "together with rheo_engine"
        )
    more = [f"{bit:#x}" for bit in known[1:]] + ([f"{unknown:#x}"] if unknown else [])
    also = f" (status={bits:#x}: bits {', '.join(more)} are set too)" if more else ""
    raise ValueError(STATUS_ERRORS[known[0]] + also)


# --- pool sampler -------------------------------------------------------------------------


@dataclass
class Pool:
    """Per row of draft logits: the K children of an expanded node (docs/algorithm.md §4)."""

    tokens: torch.Tensor  # [n, K] int32, slot order
    log_proxy: torch.Tensor  # [n, K] float32 (float64 for float64 logits)
    sampled_slot: torch.Tensor  # [n] int32, slot of Y or -1
    q_tilde_ids: torch.Tensor  # [n, Se] int32, support in descending logit order
    q_tilde: torch.Tensor  # [n, Se] q~ on the support (0 on leads)
    q_sampled: torch.Tensor  # [n] q~(Y), 0 when there is no Y


def pool_sampler(
    logits: torch.Tensor,
    K: int,
    m: int,
    S: int,
    T: float,
    kind: PoolKind = "rheo",
    seed: int = 0,
    step: int = 0,
    level: int = 0,
    forced_sample: torch.Tensor | None = None,
    status: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
) -> Pool:
    """Build the pool of every row of ``logits`` [n, V] (fp32/bf16/fp16/fp64).

    ``forced_sample`` [n] int32 (-1 = draw) pins the sampled token, for exact enumeration.
    ``status`` [1] int32 (CUDA): a NaN/inf row or an impossible forced token sets a bit there.
    ``key`` [2] int64 (coin_key) on the logits' device: seed and step read from it, in place of
    ``seed`` and ``step`` (a captured step's coins).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got shape {list(logits.shape)}")
    n, V = logits.shape
    Se = max(0, min(S, V))
    acc = _acc_dtype(logits)
    dev = logits.device
    out = Pool(
        tokens=torch.empty(n, max(K, 0), dtype=torch.int32, device=dev),
        log_proxy=torch.empty(n, max(K, 0), dtype=acc, device=dev),
        sampled_slot=torch.empty(n, dtype=torch.int32, device=dev),
        q_tilde_ids=torch.empty(n, Se, dtype=torch.int32, device=dev),
        q_tilde=torch.empty(n, Se, dtype=acc, device=dev),
        q_sampled=torch.empty(n, dtype=acc, device=dev),
    )
    _C.pool_sampler(
        logits, K, m, S, float(T), _lookup(_POOL_KINDS, kind, "kind"), seed, step, level,
        forced_sample, out.tokens, out.log_proxy, out.sampled_slot, out.q_tilde_ids,
        out.q_tilde, out.q_sampled, status, key,
    )  # fmt: skip
    return out


# --- proxy rerank -------------------------------------------------------------------------


def select_expand(
    scores: torch.Tensor, topk: int, status: torch.Tensor | None = None
) -> torch.Tensor:
    """Indices [B, topk] int32 of the best ``topk`` of ``scores`` [B, M] (tie rule), best first.

    ``status`` [1] int32 (CUDA): a NaN score sets a bit there (that row gets 0..topk-1)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, M], got shape {list(scores.shape)}")
    if not 1 <= topk <= scores.shape[1]:
        raise ValueError(
            f"topk={topk} must be in [1, M={scores.shape[1]}] (candidates at this level); "
            "lower topk"
        )
    expand = torch.empty(scores.shape[0], topk, dtype=torch.int32, device=scores.device)
    _C.select_expand(scores, expand, status)
    return expand


@dataclass
class Tree:
    """A pruned draft tree in the layout verification and tree attention take (B trees)."""

    tokens: torch.Tensor  # [B, N] int32, root at node 0
    parents: torch.Tensor  # [B, N] int32, -1 for the root
    depth: torch.Tensor  # [B, N] int32
    positions: torch.Tensor  # [B, N] int32, prefix_len + depth
    sampled_row: torch.Tensor  # [B, N] int32, row of the node's q~ or -1
    cand_index: torch.Tensor  # [B, N] int32, flat candidate index, -1 for the root
    tree_mask: torch.Tensor  # [B, N, N] uint8, ancestor-or-self
    retrieve_indices: torch.Tensor  # [B, N, depth + 1] int32, root-to-leaf paths, -1 padded
    n_leaves: torch.Tensor  # [B] int32


def build_tree(
    cand_scores: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_parents: torch.Tensor,
    cand_sampled: torch.Tensor,
    root_tokens: torch.Tensor,
    prefix_len: torch.Tensor,
    total_tokens: int,
    depth: int,
    status: torch.Tensor | None = None,
) -> Tree:
    """Keep the global top-(total_tokens - 1) candidates [B, L] and lay out the tree.

    ``status`` [1] int32 (CUDA): an entry whose candidates hold NaN or form no tree sets a bit
    there (and gets n_leaves -1)."""
    if cand_scores.dim() != 2:
        raise ValueError(f"cand_scores must be [B, L], got shape {list(cand_scores.shape)}")
    B, L = cand_scores.shape
    N = total_tokens
    if not 1 <= N <= L + 1:
        raise ValueError(
            f"total_tokens={N} must be in [1, L + 1 = {L + 1}] (candidates drafted plus the "
            "root); lower total_tokens or draft more"
        )
    if depth < 0:
        raise ValueError(f"depth={depth} must be >= 0")
    dev = cand_scores.device

    def i32(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.int32, device=dev)

    tree = Tree(
        tokens=i32(B, N), parents=i32(B, N), depth=i32(B, N), positions=i32(B, N),
        sampled_row=i32(B, N), cand_index=i32(B, N),
        tree_mask=torch.empty(B, N, N, dtype=torch.uint8, device=dev),
        retrieve_indices=i32(B, N, depth + 1), n_leaves=i32(B),
    )  # fmt: skip
    _C.build_tree(
        cand_scores, cand_tokens, cand_parents, cand_sampled, root_tokens, prefix_len,
        tree.tokens, tree.parents, tree.depth, tree.positions, tree.sampled_row,
        tree.cand_index, tree.tree_mask, tree.retrieve_indices, tree.n_leaves, status,
    )  # fmt: skip
    return tree


# --- fused layer operators ----------------------------------------------------------------


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm of the residual r = x + delta (or of x when ``delta`` is None): returns
    (r, normed), both [..., hidden] in x's dtype (bf16 or fp32; r is ``x`` itself without delta).
    x, delta [..., hidden] with dense rows; weight [hidden]. r rounds as a torch add; the norm
    sums r^2 in double in a fixed order, then as HF: fp32 normalise, round, times the weight
    (csrc/include/rheo/fused_ops.h). A row's bits depend on that row only."""
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if delta is None:
        _C.add_rms_norm(x, None, weight, eps, None, normed)
        return x, normed
    residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _C.add_rms_norm(x, delta, weight, eps, residual, normed)
    return residual, normed


def rope_qk(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, H: int, Hkv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the q and k heads of a fused qkv [..., (H + 2 Hkv) D] (dense rows): returns
    q [..., H, D] and k [..., Hkv, D], contiguous, rotated with cos, sin [..., D / 2] (qkv's
    dtype, contiguous) as HF's q * cos + rotate_half(q) * sin, bit for bit. The v heads are
    untouched: take them as a view of qkv."""
    D = 2 * cos.shape[-1]
    lead = qkv.shape[:-1]
    q = torch.empty((*lead, H, D), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((*lead, Hkv, D), dtype=qkv.dtype, device=qkv.device)
    _C.rope_qk(qkv, cos, sin, H, Hkv, q, k)
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up of a fused gate_up [..., 2 I] (gate first; dense rows) -> [..., I],
    bf16 or fp32, bit for bit torch's vectorised silu and product."""
    out = torch.empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2), dtype=gate_up.dtype,
                      device=gate_up.device)  # fmt: skip
    _C.silu_mul(gate_up, out)
    return out


def decoder_layers(norms: list[torch.Tensor], weights: list[torch.Tensor], types: list[int],
                   outs: list[int], final_norm: torch.Tensor, eps: float, H: int, Hkv: int,
                   D: int):  # fmt: skip
    """A Llama target's decoder layers on the CPU in one call (bindings/decoder_layers.cpp):
    ``norms`` attn_norm, mlp_norm per layer; ``weights`` qkv, o, gate_up, down per layer, each
    packed GGUF blocks (``types`` its QUANT_TYPES value, ``outs`` its rows) or a dense matrix
    run by skinny_linear (type -1). Its ``run(x [1, n, hidden], cos, sin [1, n, D/2], k_pool,
    v_pool [layers, slots, rows, Hkv, D], slot, lo, tree_mask [1, n, T] uint8,
    feature_layers)`` is LlamaModel's fused layer loop for one sequence in a KV slot, the same
    kernels in the same order: [normed [1, n, hidden]] plus the features when asked."""
    return _C.DecoderLayers(norms, weights, types, outs, final_norm, eps, H, Hkv, D)


def draft_level(norms: list[torch.Tensor], weights: list[torch.Tensor], types: list[int],
                outs: list[int], eps: float, H: int, Hkv: int, D: int):  # fmt: skip
    """An EAGLE-3 head's draft level on the CPU in one call (bindings/decoder_layers.cpp):
    ``norms`` input_layernorm, hidden_norm, post_attention_layernorm, norm; ``weights`` qkv
    (stacked), o, gate_up (stacked), down, lm_head, each packed or dense as decoder_layers takes
    them. Its ``run(h, e [1, n, hidden], cos, sin [1, n, D/2], k_pool, v_pool [1, slots, rows,
    Hkv, D], slot, row0, prefix, tree_mask [1, n, T] uint8)`` is Eagle3Head.layer_in_pool then
    logits for one sequence, the same kernels in the same order: [h2, logits float32]."""
    return _C.DraftLevel(norms, weights, types, outs, eps, H, Hkv, D)


# --- quantized linear ---------------------------------------------------------------------

QUANT_TYPES = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # csrc/include/rheo/quant_linear.h QuantType


def quantize_rows_q8(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [n, in] bf16/fp32 (in % 32 == 0) as the quantized linear layer reads it: Q8 blocks of 32
    columns, (xq [n, in] int8, xd [n, in/32] fp32 scale, xs [n, in/32] int32 sum of codes,
    xm [n, in/32] fp32 = xd * xs) (quant_linear.h states the rounding)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [n, in], got shape {list(x.shape)}")
    n, nb = x.shape[0], x.shape[1] // 32
    xq = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    xd = torch.empty(n, nb, dtype=torch.float32, device=x.device)
    xs = torch.empty(n, nb, dtype=torch.int32, device=x.device)
    xm = torch.empty(n, nb, dtype=torch.float32, device=x.device)
    _C.quantize_rows_q8(x, xq, xd, xs, xm)
    return xq, xd, xs, xm


def quant_linear(x: torch.Tensor, w: torch.Tensor, qtype: str, out: int) -> torch.Tensor:
    """y [..., out] = x [..., in] @ W^T with W packed (rheo_engine.models.quant.pack):
    w [ceil(out/16), in/32, record] uint8 of type ``qtype`` (q8_0, q4_0, q4_1). x (bf16 or fp32,
    contiguous) is quantized once to Q8 blocks; exact int32 block dot products, float32 scale
    sums in block order, one rounding to x's dtype. A row's bits do not depend on the other rows,
    the thread count or the CPU path."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"qtype={qtype!r} is not one of {list(QUANT_TYPES)}")
    if not x.is_contiguous():
        x = x.contiguous()
    # No reshape or view here: each costs microseconds, as much as a small matmul's work.
    y = x.new_empty((*x.shape[:-1], out))
    _C.quant_linear(x, w, QUANT_TYPES[qtype], out, y)
    return y


def quant_gather_rows(w: torch.Tensor, qtype: str, rows: int, ids: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """W[ids] dequantized: ids [...] int64 (contiguous, on w's device) -> [..., in] in ``dtype``
    (bf16 or fp32), W [rows, in] packed as quant_linear's. Each value as gguf.quants gives it in
    float32 (d * q, d * (q - 8), d * q + m), rounded once to the dtype. On the CPU an id outside
    [0, rows) is a ValueError; on CUDA it is clamped (checking would read the device)."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"qtype={qtype!r} is not one of {list(QUANT_TYPES)}")
    nb = w.shape[1] if w.dim() == 3 else 0
    out = torch.empty((*ids.shape, nb * 32), dtype=dtype, device=w.device)
    _C.quant_gather_rows(w, QUANT_TYPES[qtype], rows, ids.view(-1), out.view(-1, nb * 32))
    return out


# --- skinny linear ------------------------------------------------------------------------


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [..., out] = x [..., in] @ w [out, in]^T, for the few rows of a decode step or tree.

    bf16 or fp32 (x, w and y alike); products and sums in fp32 in one fixed order whatever the
    row count, threads or ISA path (skinny_linear.h; bf16 flushes denormals as vdpbf16ps does),
    one rounding to the dtype (bf16: nearest even, as torch rounds a bf16 linear). Any number of
    rows: the models run every CPU bf16/fp32 linear on it. ``w`` must be contiguous (nn.Linear
    layout); ``x`` is read in place as rows one stride apart (any contiguous tensor, or a row
    slice).
    """
    if x.dim() < 1 or w.dim() != 2:
        raise ValueError(
            f"x must be [..., in] and w [out, in], got shapes {list(x.shape)}, {list(w.shape)}"
        )
    # No reshape or view here: each costs microseconds, as much as a small matmul's work.
    y = x.new_empty((*x.shape[:-1], w.shape[0]))
    _C.skinny_linear(x, w, y)
    return y


def quant_linear_amx() -> str:
    """What quant_linear's AMX-INT8 path (8+ rows, the same bits as every path) runs on here:
    "hardware" (the CPU lists AMX-INT8, the OS grants its tiles, a probe and a self-check passed),
    "emulated" (the instructions' semantics in C++: tests) or "off" (the VNNI / AVX2 paths)."""
    return _C.quant_linear_amx()


def set_quant_linear_amx(mode: str) -> str:
    """Set the AMX path's mode: "auto" (hardware where it is granted and checks out; the default,
    or "off" where RHEO_AMX=off), "off", or "emulate" (its logic on emulated tiles, where the CPU
    has AVX-512 VNNI: tests); returns quant_linear_amx() after the change."""
    if mode not in ("auto", "off", "emulate"):
        raise ValueError(f"mode={mode!r} is not one of 'auto', 'off', 'emulate'")
    return _C.set_quant_linear_amx(mode)


def quant_linear_amx_self_check() -> bool:
    """The self-check the AMX path passes before it runs (random panels of each type, against the
    portable path bit for bit), on emulated tiles: False without AVX-512 VNNI."""
    return _C.quant_linear_amx_self_check()


def skinny_linear_bf16_dot() -> bool:
    """Whether bf16 skinny_linear runs on AVX-512-BF16's vdpbf16ps (at the avx512 level): the
    CPU has it, it is allowed, and its bits passed the one-time self-check against the reference
    order (csrc/include/rheo/skinny_linear.h). Either way the bits are the same."""
    return _C.skinny_linear_bf16_dot()


def set_skinny_linear_bf16_dot(on: bool) -> bool:
    """Allow vdpbf16ps or not (tests, benches: the AVX-512F FMA path otherwise); returns
    skinny_linear_bf16_dot() after the change."""
    return _C.set_skinny_linear_bf16_dot(on)


# --- tree attention -----------------------------------------------------------------------


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tree_mask: torch.Tensor,
    prefix_len: int,
    scale: float | None = None,
    prefix_lens: torch.Tensor | None = None,
    kv_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, N, H, D] over k, v [B, Lc, Hkv, D] (prefix + tree) -> [B, N, H, D].

    ``tree_mask`` [B, N, N] uint8 marks each node's ancestors and itself; every node sees the
    whole prefix (rows 0..prefix_len-1 of the cache); tree rows start at ``prefix_len``. A mask
    [B, N, T] with T tree rows for N queries: node i sees tree row j where it is 1 (a draft
    head's level: its nodes over the rows of earlier levels and their own, models/eagle3_drafter).

    A ragged batch from a KV pool: ``prefix_lens`` [B] int32 gives each sequence's prefix
    length P_b (it sees rows 0..P_b-1, its tree rows are P_b..P_b+T-1) and ``kv_slots`` [B] int32
    the slot of k, v [S, Lc, Hkv, D] that holds it (any S; without it S = B, slot b). Both live
    on q's device: the caller uploads them once per forward and reuses them for every layer.
    ``prefix_len`` must then be max(prefix_lens) (or any bound of them), known on the host: the
    CUDA split plan is sized from it, so nothing is read back. On the CPU every value is
    checked (ValueError); on CUDA bad values are not detected (they are clamped into range).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, N, H, D], got shape {list(q.shape)}")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _C.tree_attention(
        q, k, v, tree_mask, prefix_len, prefix_lens, kv_slots,
        q.shape[-1] ** -0.5 if scale is None else scale, out,
    )  # fmt: skip
    return out


def tree_attention_exp_mismatches(first: int = 0, last: int = 2**32 - 1, stride: int = 1) -> int:
    """The CPU tree attention's softmax exponentials at the active dispatch level (8 at a time,
    csrc/cpu/tree_attention.cpp) against the C library's expf, over the float bit patterns
    ``first, first + stride, ... <= last``: how many differ, or -1 where the level computes them
    with expf itself. For tests."""
    return _C.tree_attention_exp_check(first, last, stride)


# --- verification -------------------------------------------------------------------------


@dataclass
class Verdict:
    """Outcome of verifying B trees: the accepted node path and the emitted token."""

    accept_path: torch.Tensor  # [B, P] int32 node indices, root first, -1 padded
    accept_len: torch.Tensor  # [B] int32 nodes accepted including the root
    bonus_token: torch.Tensor  # [B] int32


def _check_tree_inputs(logits: torch.Tensor) -> tuple[int, int, int]:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, N, V], got shape {list(logits.shape)}")
    B, N, V = logits.shape
    return B, N, V


def logit_controls(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    history_ids: torch.Tensor,
    history_counts: torch.Tensor,
    history_len: torch.Tensor,
    suppress_ids: torch.Tensor,
    suppress_below: torch.Tensor,
    repetition_penalty: float = 1.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    status: torch.Tensor | None = None,
) -> None:
    """Penalise and ban each node's row of ``logits`` [B, N, V] (float32/64) in place, with
    that node's own history (csrc/include/rheo/logit_controls.h).

    tokens, parents [B, N] int32 (the tree); history_ids, history_counts [B, H] int32: the
    sequence's distinct tokens ascending and how often each was generated, history_len [B]
    entries in use; suppress_ids [E] int32 banned at nodes of depth < suppress_below [B]."""
    _check_tree_inputs(logits)
    _C.logit_controls(
        logits, tokens, parents, history_ids, history_counts, history_len, suppress_ids,
        suppress_below, float(repetition_penalty), float(presence_penalty),
        float(frequency_penalty), status,
    )  # fmt: skip


def verification(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sampled_row: torch.Tensor,
    q_tilde_ids: torch.Tensor,
    q_tilde: torch.Tensor,
    method: VerifyMethod,
    T: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int = 0,
    step: int = 0,
    path_capacity: int | None = None,
    status: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
    depth: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> Verdict:
    """Walk B trees with target ``logits`` [B, N, V]; q~ table [R, Se] for the sampled nodes.

    ``status`` [1] int32 (CUDA): a tree or q~ table that breaks the rules, or a non-finite
    target logit at a visited node, sets a bit there (and that tree gets accept_len 1).
    ``key`` [2] int64 (coin_key): seed and step read from it, in place of ``seed`` and ``step``.
    ``packed`` [B, 3 + 2P + N] int32 (CPU): filled with verify.read_outcome's row of each tree
    (the tree's ``depth`` [B, N] int32 gives its last N columns), so the step's read is one copy
    with no operator to gather it."""
    B, N, _ = _check_tree_inputs(logits)
    P = N if path_capacity is None else path_capacity
    dev = logits.device
    out = Verdict(
        accept_path=torch.empty(B, P, dtype=torch.int32, device=dev),
        accept_len=torch.empty(B, dtype=torch.int32, device=dev),
        bonus_token=torch.empty(B, dtype=torch.int32, device=dev),
    )
    _C.verification(
        logits, tokens, parents, sampled_row, q_tilde_ids, q_tilde,
        _lookup(_VERIFY_METHODS, method, "method"), float(T), float(top_p), top_k, float(min_p),
        seed, step, out.accept_path, out.accept_len, out.bonus_token, status, key, depth, packed,
    )  # fmt: skip
    return out


def verification_law(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    sampled_row: torch.Tensor,
    q_tilde_ids: torch.Tensor,
    q_tilde: torch.Tensor,
    method: VerifyMethod,
    T: float,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact law of the walk (CPU): accept_prob [B, N] and emit_prob [B, N, V].

    accept_prob[b, i] = P(move into node i | parent visited); emit_prob[b, i, v] = P(stop at i and
    emit v | i visited). Use float64 logits for exact checks.
    """
    B, N, V = _check_tree_inputs(logits)
    acc = _acc_dtype(logits)
    accept_prob = torch.empty(B, N, dtype=acc)
    emit_prob = torch.empty(B, N, V, dtype=acc)
    _C.verification_law(
        logits, tokens, parents, sampled_row, q_tilde_ids, q_tilde,
        _lookup(_VERIFY_METHODS, method, "method"), float(T), float(top_p), top_k, float(min_p),
        accept_prob, emit_prob,
    )  # fmt: skip
    return accept_prob, emit_prob
