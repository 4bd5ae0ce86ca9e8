"""Weights kept in llama.cpp's block formats (Q8_0, Q4_0, Q4_1): ``QuantWeight``.

A GGUF file's Q8_0 / Q4_0 / Q4_1 tensors load as they are stored, repacked once into the panels
the quantized linear kernel reads (csrc/include/rheo/quant_linear.h: 16 W rows x 32 columns per
record, the same bytes as their 16 GGUF blocks), so the Q4_1 SmolLM2 file holds ~1.0x its size in
memory instead of 2.7x as bf16. ``linear(x, w)`` (models/linear.py) runs ``kernels.quant_linear``
on a QuantWeight; a token embedding kept quantized is dequantized only at the looked-up rows
(``embedding``), exactly as gguf's own dequantizer would give them (float32, then the model
dtype). ``quantize_q8_0`` makes a Q8_0 weight of a float one (``--quantize q8_0`` for a
safetensors target), with llama.cpp's quantize_row_q8_0 rule.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from rheo_engine.spec import kernels

KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # GGUF types the kernels run as stored
QUANTIZE_CHOICES = ("q8_0",)  # what a float target can be quantized to at load
_BLOCK = 32  # columns of one block
_PANEL = 16  # W rows of one packed panel
_GGUF_BYTES = {"q8_0": 2 + 32, "q4_0": 2 + 16, "q4_1": 4 + 16}  # one GGUF block
_SCALES = {"q8_0": 1, "q4_0": 1, "q4_1": 2}  # fp16 values heading a GGUF block (d; d, m)


def record_bytes(qtype: str) -> int:
    """Bytes of one packed (panel, block) record: 16 GGUF blocks' bytes."""
    return _PANEL * _GGUF_BYTES[qtype]


class QuantWeight:
    """W [out, in] in a block format, packed for ``kernels.quant_linear``.

    ``packed`` [ceil(out/16), in/32, record_bytes] uint8; ``dtype`` is the float dtype of what
    it gives back (dequantized rows, the linear's output follows x). Quacks like the weight
    tensor where the models need it: ``shape``, ``device``, ``dtype``, ``table[ids]`` (rows,
    dequantized: the EAGLE-3 head embeds its drafts with the target's table so)."""

    def __init__(self, qtype: str, shape: tuple[int, int], packed: torch.Tensor,
                 dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
        out, in_ = shape
        want = ((out + _PANEL - 1) // _PANEL, in_ // _BLOCK, record_bytes(qtype))
        if tuple(packed.shape) != want or packed.dtype != torch.uint8:
            raise ValueError(f"packed {qtype} W {list(shape)} must be uint8 {list(want)}, got "
                             f"{packed.dtype} {list(packed.shape)}")  # fmt: skip
        self.qtype, self.shape, self.packed, self.dtype = qtype, torch.Size(shape), packed, dtype

    def __repr__(self) -> str:
        return f"QuantWeight({self.qtype}, {list(self.shape)}, {self.packed.device})"

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def untyped_storage(self):
        """The packed bytes' storage (llama.resident_weight_bytes counts storages)."""
        return self.packed.untyped_storage()

    def dim(self) -> int:
        return 2

    def is_floating_point(self) -> bool:
        return True  # it stands for a float matrix (llama.check_weights)

    # --- GGUF blocks <-> packed panels -------------------------------------------------------

    @classmethod
    def from_blocks(cls, qtype: str, blocks, shape: tuple[int, int], what: str = "tensor",
                    dtype: torch.dtype = torch.bfloat16) -> QuantWeight:  # fmt: skip
        """Pack GGUF blocks: ``blocks`` holds out * in/32 blocks of ``qtype`` in row order (a
        uint8 array or tensor of any shape); a wrong byte count is one ValueError line."""
        out, in_ = shape
        bb = _GGUF_BYTES[qtype]
        if in_ % _BLOCK:
            raise ValueError(f"{what}: {qtype} needs rows of whole 32-column blocks, got in={in_}")
        raw = blocks if torch.is_tensor(blocks) else torch.from_numpy(np.array(blocks))  # a copy
        need = out * (in_ // _BLOCK) * bb
        if raw.dtype != torch.uint8 or raw.numel() != need:
            raise ValueError(
                f"{what}: a {qtype} tensor of shape {[out, in_]} has {need} bytes "
                f"({out} x {in_ // _BLOCK} blocks of {bb}), got {raw.numel()} "
                f"({raw.dtype}); the file is truncated or corrupt: re-download it"
            )
        raw = raw.reshape(out, in_ // _BLOCK, bb)
        return cls(qtype, (out, in_), _pack(qtype, raw), dtype)

    def blocks(self) -> torch.Tensor:
        """The GGUF blocks [out, in/32, block bytes] uint8 (the inverse of ``from_blocks``)."""
        P, nb, _ = self.packed.shape
        s = 2 * _SCALES[self.qtype] * _PANEL
        head = self.packed[..., :s].reshape(P, nb, _SCALES[self.qtype], _PANEL, 2)
        head = head.permute(0, 3, 1, 2, 4).reshape(P * _PANEL, nb, -1)
        if self.qtype == "q8_0":
            codes = self.packed[..., s:].reshape(P, nb, 8, _PANEL, 4).permute(0, 3, 1, 2, 4)
        else:
            codes = self.packed[..., s:].reshape(P, nb, 4, _PANEL, 4).permute(0, 3, 1, 2, 4)
        codes = codes.reshape(P * _PANEL, nb, -1)
        return torch.cat([head, codes], -1)[: self.shape[0]].contiguous()

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """W rows of ``parts`` (one type, one width) stacked, as torch.cat of their floats."""
        qtype, in_ = parts[0].qtype, parts[0].shape[1]
        if any(p.qtype != qtype or p.shape[1] != in_ for p in parts):
            raise ValueError("QuantWeight.cat needs parts of one type and width")
        out = sum(p.shape[0] for p in parts)
        if all(p.shape[0] % _PANEL == 0 for p in parts):  # whole panels: they just stack
            packed = torch.cat([p.packed for p in parts])
        else:
            packed = _pack(qtype, torch.cat([p.blocks() for p in parts]))
        return QuantWeight(qtype, (out, in_), packed, parts[0].dtype)

    # --- what the models call ------------------------------------------------------------------

    def to(self, device=None, dtype: torch.dtype | None = None):
        """Moved to ``device`` (still packed); with a float ``dtype``, the dequantized tensor."""
        if dtype is not None:
            return self.dequantize(dtype).to(device or self.device)
        if device is None or torch.device(device) == self.device:
            return self
        return QuantWeight(self.qtype, tuple(self.shape), self.packed.to(device), self.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W[ids] dequantized: ids [...] int -> [..., in] in ``dtype`` (default self.dtype),
        each value as gguf.quants gives it (float32 d * q, d * (q - 8) or d * q + m), rounded
        once to the dtype: one kernel call (kernels.quant_gather_rows). An id outside the table
        is a ValueError on the CPU (on CUDA it is clamped: checking would read the device)."""
        flat = ids.to(self.device, torch.long).contiguous()
        out_dtype = dtype or self.dtype
        if out_dtype not in (torch.bfloat16, torch.float32):  # the kernel writes these two
            return self.rows(ids, torch.float32).to(out_dtype)
        return kernels.quant_gather_rows(self.packed, self.qtype, self.shape[0], flat, out_dtype)

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole W [out, in] in ``dtype`` (in slices of rows: no float32 copy of it all)."""
        out = torch.empty(tuple(self.shape), dtype=dtype, device=self.device)
        for r0 in range(0, self.shape[0], 4096):
            ids = torch.arange(r0, min(r0 + 4096, self.shape[0]), device=self.device)
            out[r0 : r0 + len(ids)] = self.rows(ids, dtype)
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ W^T -> [..., out] in x's dtype (``kernels.quant_linear``)."""
        if x.dtype in (torch.bfloat16, torch.float32):
            return kernels.quant_linear(x, self.packed, self.qtype, self.shape[0])
        return kernels.quant_linear(x.float(), self.packed, self.qtype, self.shape[0]).to(x.dtype)


def _pack(qtype: str, raw: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [out, nb, block bytes] -> panels [ceil(out/16), nb, record] (quant_linear.h):
    the rows padded to whole panels with zero blocks, each record the 16 rows' scales, then their
    codes 4 columns x 16 rows at a time. A Q4 byte qs[j] holds columns j and j + 16, so the 4-
    column chunk c of the low nibbles is bytes 4c..4c+3, kept whole (high nibbles: chunk c + 4)."""
    out, nb, bb = raw.shape
    P = (out + _PANEL - 1) // _PANEL
    if P * _PANEL != out:
        raw = torch.cat([raw, raw.new_zeros(P * _PANEL - out, nb, bb)])
    S = _SCALES[qtype]
    r = raw.reshape(P, _PANEL, nb, bb).permute(0, 2, 1, 3)  # [P, nb, 16, bb]
    head = r[..., : 2 * S].reshape(P, nb, _PANEL, S, 2).permute(0, 1, 3, 2, 4)  # [P,nb,S,16,2]
    chunks = 8 if qtype == "q8_0" else 4
    codes = r[..., 2 * S :].reshape(P, nb, _PANEL, chunks, 4).permute(0, 1, 3, 2, 4)
    # Copied straight into the records: reshaping the permuted views copied each first, and
    # their concatenation again (the load's peak held SmolLM2's 30 MB embedding table 3 times)
    out = raw.new_empty(P, nb, _PANEL * bb)
    out[..., : 2 * S * _PANEL].view(P, nb, S, _PANEL, 2).copy_(head)
    out[..., 2 * S * _PANEL :].view(P, nb, chunks, _PANEL, 4).copy_(codes)
    return out


def quantize_q8_0(w, dtype: torch.dtype = torch.bfloat16, cast: torch.dtype | None = None,
                  panels: torch.Tensor | None = None) -> QuantWeight:  # fmt: skip
    """A float W [out, in] (in % 32 == 0) as Q8_0, by llama.cpp's quantize_row_q8_0_ref:
    d = amax / 127 per block, q = round(w / d) (ties away from zero: roundf), d stored as fp16.

    ``w``: a tensor, or a LazyTensor of a safetensors file (io.weights), read rows a chunk at
    a time, so a matrix is never held whole in float; ``cast``: each chunk rounded to that
    dtype first, as the float matrix placed in it would be. Held on ``w``'s device (a
    LazyTensor's: the CPU); ``panels``: where to write the packed panels, q8_0_panels(*w.shape)
    on the CPU (rows of a stacked matrix: Eagle3Head's fused groups), then held there."""
    packed, (out, in_) = panels, w.shape
    if in_ % _BLOCK:
        raise ValueError(f"--quantize q8_0 needs in % 32 == 0, got a weight of shape {[out, in_]}")
    # Rows a chunk at a time, each packed into its panels at once (a chunk is whole panels, and
    # each row's blocks are quantized on their own: the same bytes as the whole matrix at once).
    # The float32 temporaries of a whole matrix peaked at ~8x its size (the smollm2 head's:
    # +140 MB RSS); its blocks and their packed copy side by side, at ~2x the Q8_0 matrix.
    # A chunk is at most _CHUNK_ELEMENTS weights: its ~10 float32 temporaries of 256 rows of a
    # 1728-wide matrix added ~17 MB to the SmolLM2 head's load peak.
    step = max(_PANEL, _CHUNK_ELEMENTS // in_ // _PANEL * _PANEL)
    if packed is not None and tuple(packed.shape) != q8_0_panels(out, in_):
        raise ValueError(f"panels must be {list(q8_0_panels(out, in_))} for a weight of "
                         f"shape {[out, in_]}, got {list(packed.shape)}")  # fmt: skip
    for r in range(0, out, step):
        rows = w.narrow(0, r, min(step, out - r))
        close = getattr(getattr(w, "owner", None), "close", None)
        if close is not None:  # a LazyTensor's file: unmapped, so the pages read go (io.weights)
            close()
        part = _pack("q8_0", _q8_0_blocks(rows if cast is None else rows.to(dtype=cast)))
        if packed is None:
            packed = torch.empty(q8_0_panels(out, in_), dtype=torch.uint8, device=part.device)
        packed[r // _PANEL : r // _PANEL + len(part)] = part
    return QuantWeight("q8_0", (out, in_), packed.to(getattr(w, "device", "cpu")), dtype)


def q8_0_panels(out: int, in_: int) -> tuple[int, int, int]:
    """The shape of a Q8_0 W [out, in]'s packed panels (_pack): [ceil(out/16), in/32, 16 x 34]."""
    return ((out + _PANEL - 1) // _PANEL, in_ // _BLOCK, _PANEL * (2 + _BLOCK))


_CHUNK_ELEMENTS = 1 << 16  # weights a chunk of quantize_q8_0 (whole panels of rows)


def _q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """Rows of W [r, in] as GGUF Q8_0 blocks [r, in / 32, 34] (fp16 d, then the 32 codes)."""
    rows, in_ = w.shape
    x = w.detach().to("cpu", torch.float32).reshape(rows, in_ // _BLOCK, _BLOCK)
    d = x.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    v = x * inv
    t = torch.trunc(v)
    q = t + torch.sign(v) * ((v - t).abs() >= 0.5)  # roundf: ties away from zero, exactly
    q = q.clamp(-127, 127).to(torch.int8)
    head = d.to(torch.float16).view(torch.uint8).reshape(rows, in_ // _BLOCK, 2)
    return torch.cat([head, q.view(torch.uint8)], -1)


def embedding(tokens: torch.Tensor, table) -> torch.Tensor:
    """F.embedding(tokens, table), a QuantWeight table dequantized at the looked-up rows only."""
    if isinstance(table, QuantWeight):
        return table.rows(tokens)
    return F.embedding(tokens, table)
