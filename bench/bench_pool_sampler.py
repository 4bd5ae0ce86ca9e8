"""Pool sampler vs the torch-native composition (softmax + topk + masked tempered softmax over the
top-S + multinomial), on the CPU (and CUDA when built). Checks agreement on the deterministic
outputs first, then times both. One CSV row per case.

    python bench/bench_pool_sampler.py [--quick]
"""

from __future__ import annotations

import torch
from common import Timer, check_equal, conditions, conditions_line
from inputs import ArgumentParser

from rheo_engine.spec import kernels


def torch_native(logits: torch.Tensor, K: int, m: int, S: int, T: float, gen: torch.Generator):
    """The same pool built from stock torch ops (float32 math)."""
    x = logits.float()
    log_q = torch.log_softmax(x, -1)  # [n, V]
    top_vals, top_ids = torch.topk(x, S, dim=-1)  # [n, S], descending
    log_q_top = torch.gather(log_q, 1, top_ids)
    q_t = torch.softmax(top_vals / T, -1)  # tempered over the support
    q_t[:, :m] = 0
    q_tilde = q_t / q_t.sum(-1, keepdim=True)
    y = torch.multinomial(q_tilde, 1, generator=gen)  # [n, 1] support index of Y
    z = 1 - log_q_top[:, :m].exp().sum(-1)
    proxy = torch.minimum(log_q_top[:, m - 1], z.log()) if m else log_q_top[:, 0]
    proxy = torch.maximum(proxy, log_q_top[:, m])
    rank = torch.arange(S, device=x.device).expand_as(top_ids)
    rest = torch.where(rank[:, m:] == y, S, rank[:, m:]).sort(-1).values[:, : K - m - 1]
    slots = torch.cat([rank[:, :m], y, rest], 1)
    tokens = torch.gather(top_ids, 1, slots)
    log_proxy = torch.gather(log_q_top, 1, slots)
    log_proxy[:, m] = proxy
    return tokens, log_proxy, q_tilde, top_vals


def check(logits: torch.Tensor, K: int, m: int, S: int, T: float) -> None:
    """Kernel and torch-native agree on the support values, q~, log q of the top-K and the proxy."""
    gen = torch.Generator().manual_seed(0)
    _, log_proxy, q_tilde, top_vals = torch_native(logits, K, m, S, T, gen)
    top = kernels.pool_sampler(logits, K, m, S, T, kind="topk")
    pool = kernels.pool_sampler(logits, K, m, S, T, kind="rheo")
    ids = pool.q_tilde_ids.long()
    check_equal(torch.gather(logits.float(), 1, ids), top_vals, "the kernel's and torch's supports")
    torch.testing.assert_close(pool.q_tilde, q_tilde, rtol=1e-4, atol=1e-6)
    log_q_topk = torch.log_softmax(logits.float(), -1).topk(K, -1).values
    torch.testing.assert_close(top.log_proxy, log_q_topk, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool.log_proxy[:, m], log_proxy[:, m], rtol=1e-4, atol=1e-5)
    assert (pool.sampled_slot == m).all()


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    opts = parser.parse_args()
    reps = 5 if opts.quick else 30
    K, m, S, T = 10, 1, 128, 1.0
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and kernels.has_cuda() else [])
    cond = conditions("pool_sampler", ",".join(devices), K=K, m=m, S=S, T=T, reps=reps)
    print(conditions_line(cond))
    print("device,dtype,n,V,kernel_us,torch_us,speedup,kernel_GBps")
    for dev in devices:
        for V in (32000, 128256):
            for dtype in (torch.float32, torch.bfloat16):
                n = 60
                gen_x = torch.Generator().manual_seed(V)
                logits = (torch.randn(n, V, generator=gen_x) * 3).to(dtype).to(dev)
                check(logits, K, m, S, T)
                gen = torch.Generator(device=dev).manual_seed(1)
                timer = Timer(dev)
                kernel = lambda: kernels.pool_sampler(logits, K, m, S, T, seed=1)
                k_us = timer.median_us(kernel, reps)
                t_us = timer.median_us(lambda: torch_native(logits, K, m, S, T, gen), reps)
                gbps = logits.numel() * logits.element_size() / (k_us * 1e-6) / 1e9
                name = str(dtype).removeprefix("torch.")
                print(f"{dev},{name},{n},{V},{k_us:.1f},{t_us:.1f},{t_us / k_us:.2f},{gbps:.2f}")


if __name__ == "__main__":
    main()
