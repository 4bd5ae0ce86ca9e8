"""The paper's three targets (Vicuna-13B-v1.3, Llama-3.1-8B-Instruct, DeepSeek-R1-Distill-Llama-8B)
as Hugging Face ships them, and their EAGLE-3 heads in both released layouts (tests/
paper_layouts.py: real config fields, shrunk sizes, random bf16 weights in sharded safetensors),
load unchanged and decode greedily as transformers does on the same directory.

Each target runs with a stand-in tokenizer (the default pair's SentencePiece model for Vicuna, a
tiny BPE under the real special tokens and templates for the Llama-3 family) and, with
../shared, with the real Llama-2 / Llama-3 vocabularies (32000 / 128256 ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import shared_file
from paper_layouts import GENERATION_CONFIGS, SPECS, write_heads, write_target
from test_eagle3_layouts import one_line
from test_engine import Golden, assert_greedy, near_tie

from rheo_engine import Engine
from rheo_engine.io.weights import load_safetensors
from rheo_engine.runtime.engine import DEFAULT_PAIR

pytestmark = pytest.mark.usefixtures("one_thread")

# variant -> (target, where its tokenizer comes from: a hf_layouts fixture or a SentencePiece file)
VARIANTS = {
    "vicuna-standin": ("vicuna", DEFAULT_PAIR / "target" / "tokenizer.model"),
    "vicuna-llama2": ("vicuna", "fixtures/llama2c/llama2_tokenizer.model"),
    "llama31-standin": ("llama31", "hf_tiny_llama31_dir"),
    "llama31-llama3": ("llama31", "hf_llama31_dir"),
    "deepseek-standin": ("deepseek", "hf_tiny_deepseek_dir"),
    "deepseek-llama3": ("deepseek", "hf_deepseek_dir"),
}
QUESTION = "What is the capital of France? Answer in one word."
NEW = 8
FIXED_TREE = dict(tree="fixed", topk=2, depth=2, total_tokens=5)


@dataclass
class Layout:
    variant: str
    name: str  # "vicuna", "llama31", "deepseek"
    target: Path
    heads: dict[str, Path]  # "authors_src", "authors" (converted), "specforge"
    engines: dict[str, Engine] = field(default_factory=dict)

    def engine(self, head: str) -> Engine:
        if head not in self.engines:
            self.engines[head] = Engine.from_pretrained(self.target, self.heads[head],
                                                        dtype=torch.float32)  # fmt: skip
        return self.engines[head]


@pytest.fixture(scope="module", params=list(VARIANTS))
def layout(request, tmp_path_factory: pytest.TempPathFactory) -> Layout:
    name, source = VARIANTS[request.param]
    if isinstance(source, Path):
        tokenizer = source
    elif source.startswith("fixtures/"):
        tokenizer = shared_file(source)  # skips without ../shared
    else:
        tokenizer = request.getfixturevalue(source)  # hf_layouts; the real ones skip likewise
    root = tmp_path_factory.mktemp(request.param)
    target = write_target(root / "target", name, tokenizer)
    return Layout(request.param, name, target, write_heads(target, root / "heads"))


def listing(d: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in d.rglob("*")}


def prompt_ids(layout: Layout, engine: Engine) -> list[int]:
    """The chat prompt: the directory's own template (checked against transformers'
    apply_chat_template) or, for Vicuna, which ships none, the built-in vicuna_v1.1."""
    tok = engine.tokenizer
    messages = [{"role": "user", "content": QUESTION}]
    ids = tok.encode_chat(messages)
    if SPECS[layout.name].chat:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(layout.target), local_files_only=True)
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert tok.default_chat_template == "model"
        assert ids == want
    else:
        assert tok.kind == "sentencepiece" and tok.default_chat_template == "vicuna_v1.1"
        assert tok.render_chat(messages).endswith(f"USER: {QUESTION} ASSISTANT:")
        assert ids[0] == tok.bos_id == 1
    return ids


_HF_CACHE: dict[str, list[int]] = {}


def hf_greedy(layout: Layout, ids: list[int], eos: tuple[int, ...]) -> list[int]:
    """transformers' greedy decoding of the same directory, cut before its first EOS id (HF
    emits the EOS and stops; the engine stops without emitting it)."""
    key = f"{layout.variant}:{ids}"
    if key not in _HF_CACHE:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(str(layout.target), dtype=torch.float32,
                                                 local_files_only=True)  # fmt: skip
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 temperature=None, top_p=None, max_new_tokens=NEW,
                                 output_scores=True, return_dict_in_generate=True)  # fmt: skip
        tokens = out.sequences[0, len(ids) :].tolist()
        # Cut before a near tie of HF's scores: past it the machine decides (test_engine).
        tie = next((i for i, s in enumerate(out.scores) if near_tie(s[0])), None)
        _HF_CACHE[key] = (tokens if tie is None else tokens[:tie], tie is not None)
    new, tied = _HF_CACHE[key]
    cut = next((i for i, t in enumerate(new) if t in eos), None)
    golden = Golden(new if cut is None else new[:cut])
    golden.cut = tied and cut is None
    return golden


@pytest.mark.parametrize("head", ["authors", "specforge"])
def test_loads_unchanged_and_decodes_like_transformers(layout: Layout, head: str):
    before = listing(layout.target)
    engine = layout.engine(head)
    assert listing(layout.target) == before  # read as shipped: nothing written, nothing needed
    # The head drafts over its own draft vocabulary (d2t), fusing EAGLE's default layers.
    t2d = load_safetensors(layout.heads["specforge"] / "model.safetensors")["t2d"]
    assert torch.equal(engine.head.draft_to_target, t2d.nonzero().flatten())
    assert engine.head.feature_layers == (2, 4, 5)
    ids = prompt_ids(layout, engine)
    rheo = engine.generate(ids, method="rheo", temperature=0, max_new_tokens=NEW, **FIXED_TREE)
    ar = engine.generate(ids, method="ar", temperature=0, max_new_tokens=NEW)
    hf = hf_greedy(layout, ids, engine.eos_ids)
    assert len(hf) == NEW or ar.stop_reason == "eos" or hf.cut, (hf, ar.token_ids)
    assert len(hf) >= 8, "HF's greedy hits a near tie at once: pick another prompt"
    assert_greedy(ar.token_ids, hf)
    assert rheo.token_ids == ar.token_ids, (rheo.token_ids, hf, rheo.accept_lengths)
    assert rheo.stop_reason == ar.stop_reason
    assert len(set(hf)) >= 2 or len(hf) < NEW  # not one token repeated: a real comparison


def test_generation_config_defaults(layout: Layout):
    engine = layout.engine("specforge")
    gen_config = GENERATION_CONFIGS[layout.name](engine.tokenizer.bos_id)
    eos = gen_config["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else eos
    assert set(eos) <= set(engine.eos_ids)
    if layout.name == "llama31":  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
        assert len(eos) == 3 and engine.eos_ids[0] == engine.tokenizer.bos_id + 9  # tokenizer's
    ids = prompt_ids(layout, engine)
    gen = engine.generate(ids, max_new_tokens=3, seed=7, **FIXED_TREE)
    if layout.name == "vicuna":  # Vicuna's generation_config.json sets no sampling control
        assert gen.sampling.temperature == 1.0 and gen.sampling.top_p == 1.0
        assert gen.sampling_sources["temperature"] == "default"
        return
    assert gen.sampling.temperature == 0.6
    assert gen.sampling.top_p == {"llama31": 0.9, "deepseek": 0.95}[layout.name]
    assert gen.sampling_sources["temperature"] == "generation_config.json"
    assert gen.sampling_sources["top_p"] == "generation_config.json"
    asked = engine.generate(ids, max_new_tokens=1, temperature=0, seed=7, **FIXED_TREE)
    assert asked.sampling.temperature == 0 and asked.sampling_sources["temperature"] == "request"


def test_head_of_another_target_is_refused(layout: Layout, tmp_path: Path):
    """The authors' release before conversion, and a head of another target (the authors'
    layout with another vocabulary, SpecForge's with another width): one-line ValueErrors, the
    last two naming the head and the target directories."""
    vocab = json.loads((layout.target / "config.json").read_text())["vocab_size"]
    other = 32000 if vocab != 32000 else 128256  # a Vicuna head on a Llama-3 target, and back
    with pytest.raises(ValueError, match="holds pytorch_model.bin only") as err:
        Engine.from_pretrained(layout.target, layout.heads["authors_src"])
    assert "python -m rheo_engine.io.convert eagle3" in one_line(err)
    vocab_head = write_heads(layout.target, tmp_path / "vocab", vocab=other)["authors"]
    wide_head = write_heads(layout.target, tmp_path / "wide", hidden=96)["specforge"]
    cases = ((vocab_head, f"head vocab_size={other} != target vocab_size={vocab}"),
             (wide_head, r"fuses 3 target features of width 96, but this target's hidden_size "
                         r"is 64 \(a head for a target of hidden_size 96\)"))  # fmt: skip
    for head, match in cases:
        with pytest.raises(ValueError, match=match) as err:
            Engine.from_pretrained(layout.target, head)
        message = one_line(err)
        assert f"head {head}" in message and f"target {layout.target}" in message, message


def test_vicuna_pickle_shards_are_refused(tmp_path: Path):
    """Vicuna-13B-v1.3 as it really ships (pytorch_model-0000x-of-00003.bin pickles) is refused
    in one line that names the directory and the files found, and says to save safetensors."""
    target = write_target(tmp_path / "vicuna", "vicuna", VARIANTS["vicuna-standin"][1])
    weights = load_safetensors(target)
    names = list(weights)
    bins = [f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)]
    weight_map = {k: bins[i * 3 // len(names)] for i, k in enumerate(names)}
    for b in bins:
        torch.save({k: weights[k] for k in names if weight_map[k] == b}, target / b)
    for p in target.glob("model*.safetensors*"):
        p.unlink()
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (target / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors nor") as err:
        Engine.from_pretrained(target)
    message = one_line(err)
    assert str(target) in message and all(b in message for b in bins)
    assert "safe_serialization=True" in message
