"""What a CPU user would run instead, timed beside rheo-engine on the same GGUF file.

    python bench/peers.py --pair smollm2 --sets mt_bench humaneval gsm8k --limit 8 \\
        --temperatures 0 1 --max-new-tokens 128 --threads 1 --md bench/results/peers.md

Systems (each skipped with a reason when it cannot run here):
- ``llama.cpp``: llama-cpp-python (a bench-only extra, built from source: docs/benchmarks.md "Peers") on the
  GGUF file itself, plain decoding; ``llama.cpp pld``: its prompt-lookup speculative decoding.
- ``hf``: HF transformers ``generate`` on the same weights dequantized (bf16 by default).
- rheo-engine ``ar``, ``topk``, ``rrsw``, ``rheo`` with the auto tree, and ``rheo fixed`` (the
  paper's 60/8/10 tree).
Every system gets the same prompt token ids (the chat template applied once, by the engine's
tokenizer), the same cap on new tokens, T and seed; a reply ends at EOS. Per prompt the systems
run back to back in an order rotated by one each prompt. Each system runs each prompt twice: once
for one new token (the prefill, plus one step) and once for the whole reply. Prefill tokens/s =
prompt tokens / the first call's wall time; decode tokens/s = (new tokens - 1) / (the whole
call's wall time - the first's): a long prompt no longer hides the decode gap. "vs llama.cpp" is
the median over prompts of the paired ratio (decode, and the whole call, prefill included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import Timer, conditions, conditions_line, markdown_table, write_outputs
from inputs import (
    ArgumentParser,
    add_model_args,
    add_prompt_args,
    at_least,
    checking,
    cli,
    fit_prompts,
    load_pair,
    prompt_texts,
)

from rheo_engine.io.gguf import is_gguf, read_gguf

RHEO = {
    "ar": dict(method="ar"),
    "topk": dict(method="topk"),
    "rrsw": dict(method="rrsw"),
    "rheo": dict(method="rheo"),
    "rheo fixed": dict(method="rheo", tree="fixed", topk=10, depth=8, total_tokens=60),
}


def llama_cpp_runners(gguf: Path, threads: int, context: int) -> dict[str, Any]:
    """{label: run(ids, max_new, T, seed) -> new token count}, or {} with a printed reason."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        print(f"# llama.cpp skipped: llama-cpp-python is not installed ({e}); docs/benchmarks.md 'Peers'")
        return {}
    print(f"# llama.cpp: llama-cpp-python {llama_cpp.__version__}; system line: "
          f"{llama_cpp.llama_print_system_info().decode().strip()}")  # fmt: skip
    common = dict(
        model_path=str(gguf),
        n_ctx=context,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )
    models = {
        "llama.cpp": llama_cpp.Llama(**common),
        "llama.cpp pld": llama_cpp.Llama(
            **common, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10)
        ),
    }

    def runner(llm):
        def run(ids: list[int], max_new: int, T: float, seed: int) -> int:
            llm.reset()  # no prefix reuse: every system prefills the whole prompt
            llm.set_seed(seed)
            out = llm.create_completion(
                ids,
                max_tokens=max_new,
                temperature=T,
                top_p=1.0,
                top_k=0,
                min_p=0.0,
                repeat_penalty=1.0,
                seed=seed,
            )
            return int(out["usage"]["completion_tokens"])

        return run

    return {label: runner(llm) for label, llm in models.items()}


def hf_runner(target: Path, dtype: torch.dtype, eos: tuple[int, ...]):
    """transformers' generate on the target's weights (a GGUF file dequantized once, as the
    engine does), or None with a printed reason."""
    try:
        import transformers
    except ImportError as e:
        print(f"# hf skipped: transformers is not installed ({e})")
        return None
    if is_gguf(target):
        hf_dir = Path(__file__).resolve().parent / "results" / f"hf-{target.stem}-{dtype}"
        if not (hf_dir / "model.safetensors").is_file():
            read_gguf(target).save(hf_dir, dtype)
        target = hf_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()

    def run(ids: list[int], max_new: int, T: float, seed: int) -> int:
        torch.manual_seed(seed)
        sample = (
            dict(do_sample=True, temperature=T, top_k=0, top_p=1.0)
            if T > 0
            else dict(do_sample=False)
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new,
                eos_token_id=list(eos),
                pad_token_id=eos[0],
                **sample,
            )
        new = out[0, len(ids) :].tolist()
        return next((i + 1 for i, t in enumerate(new) if t in eos), len(new))

    return run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, default_pair="smollm2")
    add_prompt_args(p, default_sets=("mt_bench", "humaneval", "gsm8k"))
    p.add_argument("--temperatures", nargs="+", type=at_least(0.0, float), default=[0.0, 1.0])
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    p.add_argument("--systems", nargs="+", help="subset of the labels (default: all)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--md", help="write the markdown table here")
    p.set_defaults(chat=True)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    with checking():
        kind, texts = prompt_texts(args)
        target, draft, engine = load_pair(args)
        prompts, fit = fit_prompts(engine, texts, args.chat, args.max_new_tokens, 60)
    systems: dict[str, Any] = {}
    if is_gguf(target):
        context = max(len(ids) for v in prompts.values() for ids in v) + args.max_new_tokens + 64
        systems |= llama_cpp_runners(target, args.threads, context)
    hf = hf_runner(target, engine.target.dtype, engine.eos_ids)
    if hf is not None:
        systems["hf"] = hf
    for label, options in RHEO.items():
        systems[label] = (
            lambda o: (
                lambda ids, n, T, seed: len(
                    engine.generate(ids, n, temperature=T, seed=seed, **o).token_ids
                )
            )
        )(options)
    if args.systems:
        systems = {k: v for k, v in systems.items() if k in args.systems}
    cond = conditions(
        "peers",
        args.device,
        target=target,
        draft=draft,
        sets=list(prompts),
        questions_per_set=[len(v) for v in prompts.values()],
        chat=args.chat,
        temperatures=args.temperatures,
        max_new_tokens=args.max_new_tokens,
        dtype=str(engine.target.dtype),
        **fit,
    )
    print(conditions_line(cond), flush=True)
    gbs, mb = read_bandwidth_gbs(args.threads), weight_bytes(engine) / 1e6
    print(
        f"# memory floor: {mb:.0f} MB of target weights (as held) a token at {gbs:.1f} GB/s "
        f"read ({args.threads} thread) = {gbs * 1e3 / mb:.1f} tokens/s at most",
        flush=True,
    )
    labels = list(systems)
    for label in labels:  # warm-up: first calls allocate and fault in weights
        systems[label](next(iter(prompts.values()))[0], 4, 0.0, 0)
    records, done = [], 0
    for T in args.temperatures:
        for name, ids_list in prompts.items():
            for q, ids in enumerate(ids_list):
                shift = done % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    t0 = time.perf_counter()
                    systems[label](ids, 1, T, 1000 * done + q)
                    t1 = time.perf_counter()
                    n = systems[label](ids, args.max_new_tokens, T, 1000 * done + q)
                    records.append(
                        dict(
                            label=label,
                            T=T,
                            set=name,
                            q=q,
                            prompt_tokens=len(ids),
                            tokens=n,
                            prefill_s=t1 - t0,
                            wall_s=time.perf_counter() - t1,
                        )
                    )
                done += 1
                print(f"[{done}] T={T} {name} q{q}", file=sys.stderr, flush=True)
    md = table(records, labels, args.temperatures)
    print(md, end="")
    payload = {"conditions": cond, "records": records}
    write_outputs(args.out, args.md, payload, md)
    return payload


def read_bandwidth_gbs(threads: int, mib: int = 512) -> float:
    """GB/s of one pass over a buffer much larger than the caches (median of 5 float32 sums)."""
    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / Timer("cpu").median_us(x.sum, 5, warmup=1) / 1e3


def weight_bytes(engine) -> int:
    """Bytes of the target's weights a decode step reads (tied embeddings read once: lm_head);
    a quantized matrix counts its stored blocks (QuantWeight.nbytes)."""
    t = engine.target

    def nbytes(w) -> int:
        return int(w.nbytes) if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()

    layers = sum(nbytes(w) for layer in t.layers for w in vars(layer).values())
    return layers + nbytes(t.lm_head) + t.norm.numel() * 2


def paired_median(rs: list[dict], by: dict, base: str, rate) -> float:
    """Median over prompts of rate(record) / rate(the base's record of the same prompt)."""
    ratios = [rate(r) / rate(b) for r in rs
              if rate(b := by[(base, r["set"], r["q"])]) > 0]  # fmt: skip
    return statistics.median(ratios) if ratios else float("nan")


def decode_rate(r: dict) -> float:
    """New tokens after the first, per second of the whole call beyond the one-token call."""
    return (r["tokens"] - 1) / max(r["wall_s"] - r["prefill_s"], 1e-9) if r["tokens"] > 1 else 0.0


def table(records: list[dict], labels: list[str], temperatures: list[float]) -> str:
    base = "llama.cpp" if "llama.cpp" in labels else "ar"
    rows = []
    for T in temperatures:
        mine = [r for r in records if r["T"] == T]
        by = {(r["label"], r["set"], r["q"]): r for r in mine}
        for label in labels:
            rs = [r for r in mine if r["label"] == label]
            tokens, wall = sum(r["tokens"] for r in rs), sum(r["wall_s"] for r in rs)
            decode = sum(r["tokens"] - 1 for r in rs) / max(
                sum(r["wall_s"] - r["prefill_s"] for r in rs), 1e-9)
            prefill = sum(r["prompt_tokens"] for r in rs) / sum(r["prefill_s"] for r in rs)
            whole = paired_median(rs, by, base, lambda r: r["tokens"] / r["wall_s"])
            dec = paired_median(rs, by, base, decode_rate)
            rows.append([f"{T:g}", label, str(tokens), f"{tokens / wall:.1f}", f"{decode:.1f}",
                         f"{prefill:.0f}", f"{dec:.2f}x", f"{whole:.2f}x"])  # fmt: skip
    return markdown_table(
        ["T", "system", "new tokens", "tokens/s", "decode tokens/s", "prefill tokens/s",
         f"decode vs {base}", f"whole call vs {base}"], rows  # fmt: skip
    )


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    cli(main, sys.argv[1:], freeze=True)  # a script: the load's objects out of every collection
