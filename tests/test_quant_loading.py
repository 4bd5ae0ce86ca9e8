"""Quantized targets end to end (models/quant.py, io/gguf.py, LlamaModel.from_gguf / from_weights).

- SmolLM2-135M-Instruct's Q4_1 file loads with its Q4_1 / Q8_0 tensors kept quantized, in at most
  1.2x the file's bytes; its logits stay near the dequantized model's (the figures are printed:
  pytest -s); greedy decoding by every method equals greedy `ar` token for token, and a batch
  equals single calls.
- ``quantized=False`` gives the dequantized float model (head training loads it so).
- A GGUF file whose quantized tensor has the wrong byte count fails in one line.
- ``quantize="q8_0"`` on the default pair: speculation stays lossless with respect to the
  quantized target (G-test of the first two tokens against its exact law, with the negative
  control at a wrong temperature) and greedy methods equal `ar`.
- The head follows a quantized target: its matrices are held in Q8_0 (Eagle3Head.quantize), its
  draft logits stay near the float head's, the cost profile's key names it, and the tests above
  (greedy, the G-test with drafts accepted) run with it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_engine import first_two_law, law_p_value, sample_first_two

from rheo_engine.io.gguf import read_gguf
from rheo_engine.models.llama import LlamaModel, resident_weight_bytes
from rheo_engine.models.eagle3 import Eagle3Head
from rheo_engine.models.quant import QuantWeight
from rheo_engine.runtime.engine import DEFAULT_PAIR, Engine
from rheo_engine.runtime.pairs import resolve_pair, smollm2_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTION = "Write a Python function is_prime(n) that returns True when n is prime."
TREE = dict(tree="fixed", topk=4, depth=4, total_tokens=12)


def _smollm2():
    try:
        resolve_pair("smollm2")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return smollm2_gguf()


@pytest.fixture(scope="module")
def smollm2_q() -> Engine:
    return Engine.from_pretrained(pair="smollm2")  # bf16, Q4_1 / Q8_0 kept quantized


def test_smollm2_q4_1_stays_quantized_within_1_2x_the_file():
    path = _smollm2()
    model = LlamaModel.from_gguf(read_gguf(path))
    layer = model.layers[0]
    assert all(isinstance(w, QuantWeight) and w.qtype == "q4_1"
               for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))  # fmt: skip
    assert isinstance(model.embed_tokens, QuantWeight) and model.embed_tokens.qtype == "q8_0"
    assert model.lm_head is model.embed_tokens  # tied: the projection runs on the Q8_0 table
    assert model.weight_formats == "kept quantized: Q4_1 x210, Q8_0 x1; dequantized: F32 x61"
    ratio = resident_weight_bytes(model) / os.path.getsize(path)
    print(f"resident weights / file size = {ratio:.3f}")
    assert ratio <= 1.2
    dense = LlamaModel.from_gguf(read_gguf(path), quantized=False)
    assert not isinstance(dense.layers[0].w_qkv, QuantWeight)
    assert resident_weight_bytes(dense) / os.path.getsize(path) > 2.5
    # the embedding rows equal the dequantized model's (same float32 values, one rounding)
    ids = torch.tensor([[0, 17, 49151]])
    assert torch.equal(model.embed_tokens[ids], dense.embed_tokens[ids])
    _logit_error(model, dense)


def _logit_error(model: LlamaModel, dense: LlamaModel) -> None:
    """Logits of the kept-quantized model against the dequantized bf16 one over 48 positions of
    a chat prompt: printed (max abs, relative to the largest |logit|, top-1 agreement)."""
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3717, 411, 22107, 28, 1]
    ids = (ids * 4)[:48]
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        lq, _ = model.forward(torch.tensor([ids]), pos, model.new_cache(64))
        ld, _ = dense.forward(torch.tensor([ids]), pos, dense.new_cache(64))
    err = (lq - ld).abs().max().item()
    rel = err / ld.abs().max().item()
    top1 = (lq.argmax(-1) == ld.argmax(-1)).float().mean().item()
    print(f"SmolLM2 Q4_1 kept vs dequantized bf16: max |dlogit| {err:.3f}, relative {rel:.4f}, "
          f"top-1 agreement {top1:.3f} over {len(ids)} positions")  # fmt: skip
    assert rel < 0.15 and top1 >= 0.75


def test_smollm2_quantized_greedy_methods_equal_ar(smollm2_q):
    assert smollm2_q.head.weight_formats == "Q8_0 x9"  # the head follows its Q4_1 target
    want = smollm2_q.generate(QUESTION, 32, method="ar", temperature=0, chat=True).token_ids
    for method in ("topk", "rrsw", "rheo"):
        gen = smollm2_q.generate(QUESTION, 32, method=method, temperature=0, chat=True, **TREE)
        assert gen.token_ids == want, method
        assert gen.mean_accept_length > 1.3, (method, gen.mean_accept_length)


def test_smollm2_quantized_batch_equals_single_calls(smollm2_q):
    prompts = ["Once upon a time", "def fib(n):", "The capital of France is"]
    ids = [smollm2_q.tokenizer.encode(p) for p in prompts]
    for method in ("ar", "rheo"):
        tree = {} if method == "ar" else TREE
        alone = [smollm2_q.generate(i, 16, method=method, temperature=0, **tree).token_ids
                 for i in ids]  # fmt: skip
        decoder = smollm2_q.decoder(max_batch=3, max_len=64)
        reqs = [smollm2_q.request(i, 16, method=method, temperature=0, ignore_eos=True, **tree)
                for i in ids]  # fmt: skip
        together = [g.token_ids for g in decoder.run(reqs)]
        assert together == [a[: len(t)] for a, t in zip(alone, together, strict=True)], method
        assert all(len(t) == 16 or len(t) == len(a) for a, t in zip(alone, together, strict=True))


def test_a_quantized_tensor_with_the_wrong_byte_count_fails_in_one_line(tmp_path):
    """The reader sizes each tensor from its declared shape (a truncated file fails there, see
    test_gguf); the packer checks the bytes it is handed against the shape once more."""
    import gguf

    path = _smollm2()
    t = next(t for t in gguf.GGUFReader(path, "r").tensors if t.name == "blk.0.attn_q.weight")
    short = np.asarray(t.data).reshape(-1)[:-20]  # one Q4_1 block too few
    with pytest.raises(ValueError) as info:
        QuantWeight.from_blocks("q4_1", short, (576, 576), f"{path}: tensor {t.name}")
    msg = str(info.value)
    assert "\n" not in msg and t.name in msg and "207340" in msg and "re-download" in msg, msg


@pytest.fixture(scope="module")
def engine_q8() -> Engine:
    return Engine.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft",
                                  dtype=torch.float32, quantize="q8_0")  # fmt: skip


def test_quantize_q8_0_keeps_what_has_whole_blocks(engine_q8):
    layer = engine_q8.target.layers[0]
    assert isinstance(layer.w_qkv, QuantWeight) and layer.w_qkv.qtype == "q8_0"
    assert isinstance(engine_q8.target.embed_tokens, QuantWeight)
    assert not isinstance(layer.w_down, QuantWeight)  # in = 688 is not whole 32-column blocks
    assert engine_q8.target.weight_formats == "Q8_0 x25, float32 x25"


def test_quantized_default_pair_greedy_methods_equal_ar(engine_q8):
    want = engine_q8.generate("def quicksort(xs):", 40, method="ar", temperature=0).token_ids
    for method in ("topk", "rrsw", "rheo"):
        gen = engine_q8.generate("def quicksort(xs):", 40, method=method, temperature=0, **TREE)
        assert gen.token_ids == want, method


def test_the_head_follows_a_quantized_target_in_q8_0(engine_q8):
    """Eagle3Head.quantize: every matrix with whole 32-column blocks in Q8_0 (down_proj, 688
    columns, stays float), draft logits within the weights' rounding of the float head's on
    the same inputs, the profile key naming it; a float target keeps a float head."""
    head = engine_q8.head
    assert head.weight_formats == "Q8_0 x8, float x1"
    assert head.quantized_kinds() == "q8_0"
    assert isinstance(head.w["lm_head.weight"], QuantWeight)
    dense = Eagle3Head.from_pretrained(DEFAULT_PAIR / "draft", engine_q8.target)
    assert dense.quantized_kinds() == "" and dense.weight_formats == "float x9"
    c, g = head.cfg, torch.Generator().manual_seed(3)
    k, seen = 6, 20
    features = torch.randn(1, k, len(c.feature_layers) * c.target_hidden_size, generator=g)
    tokens = torch.randint(0, c.vocab_size, (1, k), generator=g)
    positions = torch.full((1, k), seen)
    past = torch.randn(1, seen, c.num_key_value_heads, c.head_dim, generator=g)
    mask = torch.ones(1, k, seen + k, dtype=torch.bool)

    def level(x: Eagle3Head) -> torch.Tensor:
        with torch.no_grad():
            h2 = x.layer(x.fuse(features), tokens, positions, past, past, mask)[0]
            return x.logits(h2)

    got, want = level(head), level(dense)
    err = (got - want).abs().max() / want.abs().max()
    print(f"q8_0 head vs float head: max |logit error| / max |logit| = {err:.4f}")
    assert 0 < err < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 5 / 6
    from rheo_engine.runtime.tree_policy import profile_key

    t = engine_q8.target
    key = profile_key(t.cfg, c, t.device, t.dtype, "pool", 4, 1, t.quantized_kinds(),
                      head.quantized_kinds())  # fmt: skip
    assert "Vd" in key and key.split(", head ")[1].split(",")[0].endswith(" q8_0")
    with pytest.raises(ValueError, match="'q8_0' only, got 'q4_0'"):
        dense.quantize("q4_0")


def test_the_head_borrows_the_targets_quantized_embedding(engine_q8):
    """No float copy of the vocabulary for the head (SmolLM2's would be 54 MB in bf16 beside
    its 29 MB Q8_0 table): it looks its rows up in the target's table, with the bits that the
    dequantized copy it used to hold gives."""
    head, target = engine_q8.head, engine_q8.target
    assert isinstance(target.embed_tokens, QuantWeight) and head.embed_tokens is target.embed_tokens
    ids = torch.tensor([[0, 5, 17, target.cfg.vocab_size - 1], [3, 3, 2, 1]])
    copy = target.embed_tokens.dequantize(head.dtype)  # what the head held before
    rows = head.embed(ids)
    assert rows.dtype == head.dtype and torch.equal(rows, copy[ids])


def test_a_load_gives_the_parsers_freed_memory_back():
    """machine.trim_heap after a load (glibc): the GGUF reader's ~150 MB of freed parser objects
    leave the process (bench/load_memory.py measures it)."""
    import ctypes.util
    import platform

    from rheo_engine.machine import trim_heap

    if platform.system() != "Linux" or not ctypes.util.find_library("c"):
        pytest.skip("malloc_trim is glibc's (Linux)")
    assert trim_heap() is True


def test_a_float_target_keeps_a_float_head():
    engine = Engine.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft")
    assert engine.head.quantized_kinds() == "" and engine.target.quantized_kinds() == ""


G_RUNS, G_TREE = 300, dict(topk=4, depth=2, total_tokens=10, tree="fixed")


def test_speculation_is_lossless_for_the_quantized_target(engine_q8):
    """rheo's first two tokens at T = 1 follow the exact law of the quantized target, and the
    same samples fail against the law at T = 0.85 (the test can see an error)."""
    ids = engine_q8.tokenizer.encode("for i in")
    pairs, accepts = sample_first_two(engine_q8, ids, "rheo", 1.0, 1.0, G_RUNS, G_TREE)
    p_value = law_p_value(*first_two_law(engine_q8, ids, 1.0, 1.0, G_RUNS), pairs)
    wrong = law_p_value(*first_two_law(engine_q8, ids, 0.85, 1.0, G_RUNS), pairs)
    print(f"quantized target: p = {p_value:.3g}; against T = 0.85: p = {wrong:.3g}")
    assert p_value > 1e-4 and wrong < 1e-5
    assert sum(a > 1 for a in accepts) > G_RUNS // 4, "drafts rarely accepted: weak test"


@pytest.mark.parametrize("qtype, formats", [
    ("Q4_0", "kept quantized: Q4_0 x49; dequantized: F32 x17, F16 x8"),
    ("Q5_0", "dequantized: Q5_0 x49, F32 x17, F16 x8"),
])  # fmt: skip
def test_a_written_gguf_keeps_q4_0_and_dequantizes_q5_0_saying_which(tmp_path, qtype, formats):
    """Files written as llama.cpp's converter writes them (tests/gguf_files.py; down_proj, 688
    columns, stays F16 as llama-quantize leaves it): Q4_0 runs kept, Q5_0 is dequantized, and
    the formats line says so; kept logits stay near the dequantized model's."""
    import json

    from tests.gguf_files import write_llama_gguf

    from rheo_engine.io.weights import load_safetensors

    target = DEFAULT_PAIR / "target"
    cfg = json.loads((target / "config.json").read_text())
    path = write_llama_gguf(tmp_path / f"{qtype}.gguf", cfg, load_safetensors(target), qtype,
                            target / "tokenizer.model")  # fmt: skip
    ckpt = read_gguf(path)
    assert ckpt.formats == formats
    kept = LlamaModel.from_gguf(ckpt, dtype=torch.float32)
    dense = LlamaModel.from_gguf(read_gguf(path, quantized=False), dtype=torch.float32)
    assert isinstance(kept.layers[0].w_qkv, QuantWeight) == (qtype == "Q4_0")
    ids = [1, 450, 338, 7, 900, 2000, 3, 4095]
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        a, _ = kept.forward(torch.tensor([ids]), pos, kept.new_cache(len(ids)))
        b, _ = dense.forward(torch.tensor([ids]), pos, dense.new_cache(len(ids)))
    if qtype == "Q5_0":
        assert torch.equal(a, b)
    else:  # only x's Q8 rounding apart
        assert (a - b).abs().max() < 0.05 * b.abs().max()


def test_cli_quantize_and_dequantize_say_which_weights_run(capsys):
    from rheo_engine.entrypoints.generate import main

    args = ["--prompt", "def f(x):", "--max-new-tokens", "2", "--temperature", "0",
            "--threads", "1", "--method", "ar"]  # fmt: skip
    assert main(args + ["--quantize", "q8_0"]) == 0
    assert "weights: Q8_0 x25, bfloat16 x25; head Q8_0 x8, float x1" in capsys.readouterr().err
    assert main(args) == 0
    assert "weights:" not in capsys.readouterr().err  # a float target: nothing to say
    _smollm2()
    for opt in ("--dequantize", "--no-quantized"):
        assert main(args + ["--pair", "smollm2", opt, "--no-chat"]) == 0
        assert "weights: dequantized: Q4_1 x210, F32 x61, Q8_0 x1" in capsys.readouterr().err


def test_quantize_q8_0_by_row_chunks_gives_the_whole_matrix_bytes(monkeypatch):
    """quantize_q8_0 runs a chunk of rows at a time (its float temporaries of a whole matrix
    had peaked at ~8x its size): the same packed bytes as the matrix in one piece, a last
    chunk part-filled."""
    from rheo_engine.models import quant

    w = torch.randn(600, 96, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 96 * 40)  # 32 rows a chunk (whole panels)
    chunked = quant.quantize_q8_0(w)
    monkeypatch.setattr(quant, "_CHUNK_ELEMENTS", 10**9)
    assert torch.equal(chunked.packed, quant.quantize_q8_0(w).packed)
    # Into given panels (a stacked matrix's rows): the same bytes, held there; a wrong shape
    # is refused, naming the shape it needs.
    rows = torch.zeros(quant.q8_0_panels(600, 96), dtype=torch.uint8)  # 38 panels: 37.5 used
    into = quant.quantize_q8_0(w, panels=rows)
    assert torch.equal(into.packed, chunked.packed)
    assert into.packed.data_ptr() == rows.data_ptr()
    with pytest.raises(ValueError, match=r"panels must be \[38, 3, 544\]"):
        quant.quantize_q8_0(w, panels=rows[:37])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_quantized_as_it_is_read_holds_the_same_bytes(dtype, tmp_path):
    """Eagle3Head.from_pretrained(quantize="q8_0") reads the file a tensor at a time and each
    matrix 256 rows at a time (the load's peak, BENCHMARKS.md "Memory"): every weight equals
    the float head's, placed in ``dtype`` then quantized whole (Eagle3Head.quantize)."""
    from rheo_engine.io.weights import open_safetensors, save_safetensors
    from rheo_engine.models.eagle3 import Eagle3Head
    from rheo_engine.models.quant import QuantWeight, quantize_q8_0
    from rheo_engine.runtime.engine import DEFAULT_PAIR

    target = LlamaModel.from_pretrained(DEFAULT_PAIR / "target")
    eager = Eagle3Head.from_pretrained(DEFAULT_PAIR / "draft", target, dtype=dtype)
    eager.quantize("q8_0")
    read = Eagle3Head.from_pretrained(DEFAULT_PAIR / "draft", target, dtype=dtype,
                                      quantize="q8_0")  # fmt: skip
    assert read.weight_formats == eager.weight_formats and "Q8_0" in read.weight_formats
    assert read.w.keys() == eager.w.keys()
    for name, w in eager.w.items():
        got = read.w[name]
        assert type(got) is type(w), name
        if isinstance(w, QuantWeight):
            assert got.shape == w.shape and torch.equal(got.packed, w.packed), name
        else:
            assert got.dtype == w.dtype and torch.equal(got, w), name
    # Rows in chunks: a float32 matrix of 300 rows in a file (a whole chunk of 256, then 44:
    # the last panel padded), cast to ``dtype`` a chunk at a time, equals it cast and
    # quantized whole.
    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    save_safetensors({"w": w}, tmp_path / "w.safetensors")
    lazy = open_safetensors(tmp_path / "w.safetensors")
    want = quantize_q8_0(w.to(dtype)).packed
    assert torch.equal(quantize_q8_0(lazy["w"], dtype, cast=dtype).packed, want)
    assert torch.equal(quantize_q8_0(w.to(dtype)[:256]).packed, want[: 256 // 16])
    with pytest.raises(ValueError, match="'q8_0' only, got 'q4_0'"):
        Eagle3Head.from_pretrained(DEFAULT_PAIR / "draft", target, quantize="q4_0")


@pytest.mark.parametrize("how", ["float", "quantized after", "quantized as read"])
def test_the_head_holds_q_k_v_and_gate_up_once(how, monkeypatch):
    """After a level stacked q/k/v and gate/up (Eagle3Head._fused_weights), each part is a view
    of its stacked matrix, so the head does not hold them twice; a level gives the same bits.
    Quantized as read (the engine's load), each part is quantized straight into its rows of the
    stacked matrix (_placed_stacked), kept from the load on: never a part beside its copy."""
    from rheo_engine.models.eagle3 import Eagle3Head
    from rheo_engine.models.quant import QuantWeight
    from rheo_engine.runtime.engine import DEFAULT_PAIR

    from rheo_engine.models import eagle3

    target = LlamaModel.from_pretrained(DEFAULT_PAIR / "target")
    q8 = how != "float"
    calls, quantize = [], eagle3.quantize_q8_0
    monkeypatch.setattr(eagle3, "quantize_q8_0", lambda *a, **k: (calls.append(1),
                                                                 quantize(*a, **k))[1])
    head = Eagle3Head.from_pretrained(DEFAULT_PAIR / "draft", target,
                                      quantize="q8_0" if how == "quantized as read" else None)
    if how == "quantized as read":  # each matrix quantized once, a group's parts included
        assert len(calls) == sum(isinstance(head.w[n], QuantWeight) for n in head.MATRICES)
    if how == "quantized after":
        head.quantize("q8_0")
    kept = getattr(head, "_fused", None)
    assert (kept is not None) == (how == "quantized as read")
    qkv, gate_up, _ = head._fused_weights()
    if kept is not None:
        assert qkv is kept[1] and gate_up is kept[2]
    for stacked, parts in ((qkv, ("q_proj", "k_proj", "v_proj")), (gate_up, ("gate_proj",
                                                                            "up_proj"))):
        base = (stacked.packed if q8 else stacked).untyped_storage().data_ptr()
        for p in parts:
            name = f"midlayer.{'self_attn' if p[0] in 'qkv' else 'mlp'}.{p}.weight"
            t = head.w[name]
            assert isinstance(t, QuantWeight) == q8
            assert (t.packed if q8 else t).untyped_storage().data_ptr() == base, name
    assert head._fused_weights()[0] is qkv  # kept: the views' versions are the key's


def test_a_head_read_for_q8_0_holds_nothing_of_its_file(tmp_path):
    """Eagle3Head.from_pretrained(quantize="q8_0") (the engine's load beside a quantized target)
    keeps no view of the file's mapping: a file written over in place (cp onto it: a new export
    to the same folder) changes nothing in a loaded head. Its norms were views of the mapping
    until they were copied (a run then drafted with the new file's norms and the old matrices)."""
    import shutil

    from rheo_engine.io.weights import load_safetensors, save_safetensors
    from rheo_engine.models.eagle3 import Eagle3Head
    from rheo_engine.models.quant import QuantWeight
    from rheo_engine.runtime.engine import DEFAULT_PAIR

    target = LlamaModel.from_pretrained(DEFAULT_PAIR / "target")
    folder = tmp_path / "head"
    shutil.copytree(DEFAULT_PAIR / "draft", folder)
    head = Eagle3Head.from_pretrained(folder, target, quantize="q8_0")
    held = {k: (v.packed if isinstance(v, QuantWeight) else v).clone() for k, v in head.w.items()}
    other = {k: t.clone() + 1 for k, t in load_safetensors(folder).items()}
    save_safetensors(other, tmp_path / "other.safetensors")
    with open(tmp_path / "other.safetensors", "rb") as src, \
            open(folder / "model.safetensors", "r+b") as dst:  # the same inode, rewritten
        dst.write(src.read())
    for k, v in head.w.items():
        assert torch.equal(v.packed if isinstance(v, QuantWeight) else v, held[k]), k
