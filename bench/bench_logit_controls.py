"""Benchmark kernels.logit_controls (CPU) against one verification call of the same tree.

The controls run before every verification when a penalty or min_new_tokens is on, so their
cost reads as a share of the verification they feed. Trees of N = 1, 8 and 60 nodes (the first
N nodes of bench_verification's tree: depth 8, a few levels accepted), fp32 logits [1, N, V],
a history of H distinct tokens (three quarters prompt, the rest generated, some generated
again) with repetition 1.1, presence 0.2, frequency 0.3 and an EOS ban below depth 2. The
kernel must equal reference.logit_controls_ref on the trees of N <= 8 before timing; the two
kernels are timed in interleaved repeats (medians). controls_share = controls / (controls +
verification): what the controls add to the verification of a step.
Usage: python bench/bench_logit_controls.py [--quick]
"""

from __future__ import annotations

import statistics

import torch
from bench_verification import make_tree
from common import Timer, check_equal, commit_id
from inputs import ArgumentParser

from rheo_engine.config import SamplingConfig
from rheo_engine.spec import kernels, reference
from rheo_engine.spec.verify import History

SAMPLING = SamplingConfig(repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3)
SAMPLING_ARGS = (SAMPLING.repetition_penalty, SAMPLING.presence_penalty, SAMPLING.frequency_penalty)
EOS, MIN_NEW = 2, 2  # the ban: EOS at nodes of depth < MIN_NEW


def make_history(V: int, H: int, seed: int = 3) -> tuple[list[int], list[int]]:
    """A prompt and generated tokens with H distinct tokens in all (the root's token last)."""
    g = torch.Generator().manual_seed(seed)
    distinct = torch.randperm(V, generator=g)[:H].tolist()
    prompt, new = distinct[: 3 * H // 4], distinct[3 * H // 4 :]
    again = [prompt[i] for i in torch.randint(0, len(prompt), (H // 4,), generator=g).tolist()]
    return prompt, new + again


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    opt = ap.parse_args()
    reps = 3 if opt.quick else 20
    timer = Timer("cpu")
    sizes = [(V, H) for V in (32000, 128256) for H in (100, 2000)]
    if opt.quick:
        sizes = [(32000, 100), (32000, 2000)]
    print(f"# device=cpu, torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, commit={commit_id()}")  # fmt: skip
    print("kernel,dtype,N,V,H,us_controls,us_verification,controls_share")
    for V, H in sizes:
        logits60, tokens60, parents60, sampled60, q_ids, q_tilde = make_tree(V, 12.0)
        prompt, generated = make_history(V, H)
        history = History(prompt, SAMPLING, ban_ids=[EOS], min_new_tokens=len(generated) + MIN_NEW)
        history.extend(generated)
        inputs = history.kernel_inputs(torch.device("cpu"))
        assert inputs[0].shape[1] == H
        for N in (1, 8, 60):
            logits, tokens = logits60[:, :N].contiguous(), tokens60[:, :N].contiguous()
            parents, sampled = parents60[:, :N].contiguous(), sampled60[:, :N].contiguous()
            if N <= 8:  # the reference is a Python loop per row: the small trees only
                controlled = logits.clone()
                kernels.logit_controls(controlled, tokens, parents, *inputs, *SAMPLING_ARGS)
                want = reference.logit_controls_ref(
                    logits, tokens, parents, prompt, generated, *SAMPLING_ARGS, [EOS],
                    history.min_new_tokens,
                )  # fmt: skip
                check_equal(controlled, want, f"logit_controls and the reference, N={N} H={H}")
            # Interleaved: each repeat times the controls, then the verification they feed.
            us_c, us_v = [], []
            for step in range(reps + 1):
                work = logits.clone()
                t_c = timer.once_us(lambda: kernels.logit_controls(work, tokens, parents, *inputs,
                                                                   *SAMPLING_ARGS))  # fmt: skip
                t_v = timer.once_us(lambda: kernels.verification(
                    work, tokens, parents, sampled, q_ids, q_tilde, "rheo", 1.0, seed=1, step=step
                ))  # fmt: skip
                if step > 0:  # the first repeat warms up
                    us_c.append(t_c)
                    us_v.append(t_v)
            c, v = statistics.median(us_c), statistics.median(us_v)
            print(f"logit_controls_cpu,float32,{N},{V},{H},{c:.1f},{v:.1f},{c / (c + v):.3f}")


if __name__ == "__main__":
    main()
