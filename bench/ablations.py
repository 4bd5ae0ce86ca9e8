"""Ablations on our pairs: the rheostat m (paper Fig. 3), temperature (Fig. 4), sparse support
S (Table 5). Writes JSON, a markdown table and a PNG plot per ablation into --out-dir.

    python bench/ablations.py                                # weights/default pair, MT-bench
    python bench/ablations.py --pair stories --which m S --limit 4 --max-new-tokens 64

- m in {0, 1, 2, 3}: tau of rheo with leads=m, next to topk (m plays no part in topk).
- T in {0, 0.3, 0.6, 1.0, 1.2}: tau of topk, rrsw and rheo; at T = 0 all three are greedy top-K.
- S in {32, 128, 512, full vocabulary}: tau of rheo, draft coverage (mean q mass inside the
  top-S support over every drafted node: the root and each expanded node), and drafting time
  per step (pool sampler, rerank, tree layout; the head's forwards are not counted).
Within one ablation every configuration runs on every question back to back, in rotating
order (common.run_interleaved). The plots need matplotlib (bench-only; without it the JSON and
markdown are still written).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from common import (
    conditions,
    conditions_line,
    markdown_table,
    run_interleaved,
    summarize,
    write_outputs,
)
from inputs import (
    ROOT,
    ArgumentParser,
    BadInput,
    add_model_args,
    add_prompt_args,
    add_tree_args,
    at_least,
    check_unique,
    checking,
    cli,
    cut_line,
    fit_prompts,
    load_engine,
    prompt_texts,
    resolve_pair,
    tree_options,
)

import rheo_engine.runtime.decoder as decoder_module
from rheo_engine import Engine
from rheo_engine.models.eagle3_drafter import Eagle3Drafter

LEADS: tuple[int, ...] = (0, 1, 2, 3)
TEMPERATURES: tuple[float, ...] = (0.0, 0.3, 0.6, 1.0, 1.2)
SUPPORTS: tuple[int, ...] = (32, 128, 512)  # and the full draft vocabulary
ABLATIONS: tuple[str, ...] = ("m", "T", "S")


# --- draft coverage --------------------------------------------------------------------------


class Coverage:
    """Sums, per configuration, the q mass inside the top-S support of each drafted node."""

    def __init__(self) -> None:
        self.mass: dict[str, float] = {}
        self.rows: dict[str, int] = {}

    def add(self, label: str, logits: torch.Tensor, S: int) -> None:
        rows = logits.reshape(-1, logits.shape[-1]).float()  # [n, Vd]
        q = torch.softmax(rows, -1)  # untempered q: the support is its top S
        top = q.topk(min(S, q.shape[-1]), -1).values.sum(-1)
        self.mass[label] = self.mass.get(label, 0.0) + float(top.sum())
        self.rows[label] = self.rows.get(label, 0) + rows.shape[0]

    def mean(self, label: str) -> float:
        return self.mass[label] / self.rows[label] if self.rows.get(label) else float("nan")


@contextmanager
def recording(coverage: Coverage, label: str, S: int):
    """Runs the engine with a drafter that reports its logits to ``coverage``.

    A hack: the decoder (rheo_engine.runtime.decoder) builds its Eagle3Drafter by name, so the name
    is swapped for a recording subclass while the block runs. A drafter factory on the Engine would
    remove this.
    """

    class Recording(Eagle3Drafter):
        def root_logits(self) -> torch.Tensor:
            out = super().root_logits()
            coverage.add(label, out, S)
            return out

        def expand(
            self, level: int, parent_rank: torch.Tensor, tokens: torch.Tensor
        ) -> torch.Tensor:
            out = super().expand(level, parent_rank, tokens)
            coverage.add(label, out, S)
            return out

    saved = decoder_module.Eagle3Drafter
    decoder_module.Eagle3Drafter = Recording
    try:
        yield
    finally:
        decoder_module.Eagle3Drafter = saved


# --- the three ablations ---------------------------------------------------------------------


def configs_m(args: argparse.Namespace, tree: dict) -> dict[str, dict]:
    base = dict(temperature=args.temperature, **tree)
    out = {"topk": dict(method="topk", **base)}
    out.update(
        {f"rheo m={m}": dict(method="rheo", **{**base, "leads": m}) for m in args.leads_list}
    )
    return out


def configs_T(args: argparse.Namespace, tree: dict) -> dict[str, dict]:
    return {
        f"{method} T={T:g}": dict(method=method, temperature=T, **tree)
        for T in args.temperatures
        for method in ("topk", "rrsw", "rheo")
    }


def supports(args: argparse.Namespace, vocab: int) -> dict[str, int]:
    """{label: S}; S >= the draft vocabulary is the full one, labelled "full"."""
    out: dict[str, int] = {}
    for S in sorted({min(S, vocab) for S in args.supports} | {vocab}):
        out["full" if S == vocab else str(S)] = S
    return out


def configs_S(args: argparse.Namespace, tree: dict, vocab: int) -> dict[str, dict]:
    base = dict(method="rheo", temperature=args.temperature, **tree)
    return {f"rheo S={name}": {**base, "support": S} for name, S in supports(args, vocab).items()}


def results_m(args, summary: dict) -> dict[str, Any]:
    avg = {label: s["average"] for label, s in summary.items()}
    return {
        "m": list(args.leads_list),
        "rheo_tau": [avg[f"rheo m={m}"]["tau_mean"] for m in args.leads_list],
        "rheo_tau_std": [avg[f"rheo m={m}"]["tau_std"] for m in args.leads_list],
        "rheo_tokens": [avg[f"rheo m={m}"]["tokens"] for m in args.leads_list],
        "topk_tau": avg["topk"]["tau_mean"],
        "topk_tau_std": avg["topk"]["tau_std"],
        "topk_tokens": avg["topk"]["tokens"],
    }


def results_T(args, summary: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"T": list(args.temperatures)}
    for method in ("topk", "rrsw", "rheo"):
        avg = [summary[f"{method} T={T:g}"]["average"] for T in args.temperatures]
        out[f"{method}_tau"] = [a["tau_mean"] for a in avg]
        out[f"{method}_tau_std"] = [a["tau_std"] for a in avg]
        out[f"{method}_tokens"] = [a["tokens"] for a in avg]
    return out


def results_S(records, summary: dict, coverage: Coverage, sizes: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "S": list(sizes),
        "support": list(sizes.values()),
        "tau": [],
        "tau_std": [],
        "tokens": [],
        "coverage": [],
        "draft_ms_per_step": [],
    }
    for name in sizes:
        label = f"rheo S={name}"
        mine = [r for r in records if r.label == label]
        out["tau"].append(summary[label]["average"]["tau_mean"])
        out["tau_std"].append(summary[label]["average"]["tau_std"])
        out["tokens"].append(summary[label]["average"]["tokens"])
        out["coverage"].append(coverage.mean(label))
        steps = sum(r.steps for r in mine)
        out["draft_ms_per_step"].append(1e3 * sum(r.draft_s for r in mine) / max(1, steps))
    return out


def tau_cell(tau: float, std: float, tokens: int) -> str:
    """tau ± its std over seeds, with the tokens emitted it was measured over."""
    return f"{tau:.2f} ± {std:.2f} ({tokens} tokens)"


def markdown(which: str, res: dict[str, Any]) -> str:
    if which == "m":
        rows = [
            [str(m), tau_cell(*cell)]
            for m, *cell in zip(
                res["m"], res["rheo_tau"], res["rheo_tau_std"], res["rheo_tokens"], strict=True
            )
        ]
        rows.append(["topk", tau_cell(res["topk_tau"], res["topk_tau_std"], res["topk_tokens"])])
        return markdown_table(["m (leads)", "rheo τ"], rows)
    if which == "T":
        rows = [
            [
                f"{T:g}",
                *(
                    tau_cell(res[m + "_tau"][i], res[m + "_tau_std"][i], res[m + "_tokens"][i])
                    for m in ("topk", "rrsw", "rheo")
                ),
            ]
            for i, T in enumerate(res["T"])
        ]
        return markdown_table(["T", "topk τ", "rrsw τ", "rheo τ"], rows)
    rows = [
        [name, f"{100 * c:.1f}%", tau_cell(t, s, n), f"{ms:.3f}"]
        for name, c, t, s, n, ms in zip(
            res["S"],
            res["coverage"],
            res["tau"],
            res["tau_std"],
            res["tokens"],
            res["draft_ms_per_step"],
            strict=True,
        )
    ]
    return markdown_table(["support S", "coverage of q", "rheo τ", "drafting ms/step"], rows)


# --- plots -----------------------------------------------------------------------------------


def plot_title(which: str, cond: dict[str, Any]) -> str:
    """Short conditions for the figure (the JSON beside it holds them all)."""
    t, d = Path(cond["target"]), Path(cond["draft"])
    pair = f"{t.parent.name}/{t.name} + {d.parent.name}/{d.name}"
    T = "" if which == "T" else f"T={cond['T']}, "
    text = (
        f"ablation {which}: {pair}, {','.join(cond['sets'])}, {T}"
        f"{cond['max_new_tokens']} new tokens, seeds={cond['seeds']}, {cond['hardware']}, "
        f"commit {cond['commit']}"
    )
    return textwrap.fill(text, 75)


def plot(which: str, res: dict[str, Any], path: Path, title: str) -> Path | None:
    """The ablation's PNG, or None (with a message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"matplotlib is not installed: skipped {path.name} (JSON and markdown written); "
            "pip install matplotlib for the plots",
            file=sys.stderr,
        )
        return None
    fig, axes = plt.subplots(
        1, 2 if which == "S" else 1, figsize=(9 if which == "S" else 5, 3.6), squeeze=False
    )
    ax = axes[0][0]
    if which == "m":
        ax.errorbar(res["m"], res["rheo_tau"], yerr=res["rheo_tau_std"], marker="o", label="rheo")
        ax.axhline(res["topk_tau"], color="grey", linestyle="--", label="topk")
        ax.set_xlabel("m (leads)")
        ax.set_xticks(res["m"])
    elif which == "T":
        for method in ("topk", "rrsw", "rheo"):
            ax.errorbar(
                res["T"],
                res[f"{method}_tau"],
                yerr=res[f"{method}_tau_std"],
                marker="o",
                label=method,
            )
        if 0.0 in res["T"]:
            ax.axhline(
                res["topk_tau"][res["T"].index(0.0)],
                color="grey",
                linestyle="--",
                label="T = 0 (greedy)",
            )
        ax.set_xlabel("temperature T")
    else:
        x = list(range(len(res["S"])))
        ax.errorbar(x, res["tau"], yerr=res["tau_std"], marker="o", label="rheo")
        cov = axes[0][1]
        cov.plot(x, [100 * c for c in res["coverage"]], marker="s", color="C2")
        cov.set_ylabel("coverage of q (%)")
        for a in (ax, cov):
            a.set_xticks(x, res["S"])
            a.set_xlabel("support S")
    ax.set_ylabel("τ (mean accepted length)")
    ax.legend()
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the bench -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_prompt_args(p, default_sets=("mt_bench",))
    p.add_argument("--which", nargs="+", default=list(ABLATIONS), choices=ABLATIONS)
    p.add_argument(
        "--seeds", type=at_least(1), default=1, help="runs over all questions (default 1)"
    )
    p.add_argument(
        "--temperature", type=at_least(0.0, float), default=1.0, help="T of the m and S ablations"
    )
    p.add_argument("--max-new-tokens", type=at_least(1), default=128)
    add_tree_args(p)  # --leads: m of the T and S ablations; --support: S of the m and T ones
    p.add_argument("--leads-list", type=at_least(0), nargs="+", default=list(LEADS))
    p.add_argument(
        "--temperatures", type=at_least(0.0, float), nargs="+", default=list(TEMPERATURES)
    )
    p.add_argument(
        "--supports",
        type=at_least(1),
        nargs="+",
        default=list(SUPPORTS),
        help="plus the full draft vocabulary",
    )
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, dict]:
    """Every chosen ablation; returns {which: payload}. Bad options fail before any generation."""
    torch.set_num_threads(args.threads)
    with checking():
        kind, texts = prompt_texts(args)
        for flag, values in (
            ("--which", args.which),
            ("--leads-list", args.leads_list),
            ("--temperatures", args.temperatures),
            ("--supports", args.supports),
        ):
            check_unique(values, flag)  # fmt: skip
        out_dir = Path(args.out_dir)
        if out_dir.exists() and not out_dir.is_dir():
            raise BadInput(f"--out-dir {out_dir} is a file; pass a folder")
        target, draft = resolve_pair(args.pair, args.target, args.draft)
        engine = load_engine(target, draft, args.device, args.dtype)
        tree = tree_options(args)
        vocab = engine.head.cfg.draft_vocab_size
        sizes = supports(args, vocab)
        grids = {
            "m": configs_m(args, tree),
            "T": configs_T(args, tree),
            "S": configs_S(args, tree, vocab),
        }
        for which in args.which:
            for options in grids[which].values():
                engine.request([1], 1, **options)  # raises on a bad leads/support/temperature
        prompts, fit = fit_prompts(engine, texts, args.chat, args.max_new_tokens, args.total_tokens)
        out_dir.mkdir(parents=True, exist_ok=True)  # last: a run that fails its checks makes none
    payloads = {}
    for which in args.which:
        cond = conditions(
            f"ablation_{which}",
            args.device,
            target=target,
            draft=draft,
            prompts=kind,
            sets=list(prompts),
            limit=args.limit,
            **fit,
            seeds=args.seeds,
            sweep={"m": args.leads_list, "T": args.temperatures, "S": list(sizes)}[which],
            T=args.temperature,
            max_new_tokens=args.max_new_tokens,
            **tree,
        )
        print(conditions_line(cond), flush=True)
        print(cut_line(fit, args.max_new_tokens), flush=True)
        payloads[which] = run_one(which, engine, prompts, grids[which], sizes, args, cond)
    return payloads


def run_one(
    which: str,
    engine: Engine,
    prompts: dict[str, list[list[int]]],
    grid: dict[str, dict],
    sizes: dict[str, int],
    args: argparse.Namespace,
    cond: dict[str, Any],
) -> dict[str, Any]:
    """One ablation: run its grid interleaved, then write JSON, markdown and the plot."""
    coverage = Coverage()

    def around(label: str):
        return recording(coverage, label, sizes[label.split("=", 1)[1]])

    seeds = list(range(args.seeds))
    records = run_interleaved(
        engine, prompts, grid, seeds, args.max_new_tokens, not args.quiet,
        around if which == "S" else None,
    )  # fmt: skip
    summary = summarize(records, baseline=None)
    if which == "m":
        res = results_m(args, summary)
    elif which == "T":
        res = results_T(args, summary)
    else:
        res = results_S(records, summary, coverage, sizes)
    md = markdown(which, res)
    print(md, end="")
    stem = Path(args.out_dir) / f"ablation_{which}"
    png = plot(which, res, stem.with_suffix(".png"), plot_title(which, cond))
    payload = {"conditions": cond, "results": res, "summary": summary, "png": png and str(png)}
    write_outputs(str(stem.with_suffix(".json")), str(stem.with_suffix(".md")), payload, md)
    print(f"wrote {stem}.json, {stem}.md" + ("" if png is None else f", {png}"), flush=True)
    return payload


def main(argv: list[str] | None = None) -> dict[str, dict]:
    return run(parse_args(argv))


if __name__ == "__main__":
    cli(main, sys.argv[1:])
