"""PyTorch baseline for `benches/attention.rs`: the same attention block in PyTorch eager.

Run by hand (CI never needs Python), on the same quiet machine as `cargo bench --bench attention`:

    python benches/pytorch_baseline.py            # B2 H8 T1024 D64, f32, 2 threads
    python benches/pytorch_baseline.py --json     # JSON lines as well
    python benches/pytorch_baseline.py --long     # also one block forward at B1 H8 T16384

Each case is the crate's block written with torch: four bias-free projections of d_model = 512,
`scaled_dot_product_attention` with ALiBi as a float mask (BLOOM's slopes; `-m|i - j|` for the
bidirectional case, `-m (i - j)` plus `-inf` above the diagonal for the causal one), and the
output projection. The attention core alone (SDPA on ready q, k, v) is timed too. Medians of 9
runs after one warm-up. `--long` adds the block without a bias at T = 16384 (B1, SDPA's flash
kernel; ALiBi would need an 8.6 GB float mask there), causal and bidirectional, medians of 3:
the counterpart of `cargo bench --bench attention -- --only long`.
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F


def alibi_slopes(n: int) -> torch.Tensor:
    """BLOOM's slopes for n heads (geometric, with the interleaved extra heads)."""
    c = 2 ** math.floor(math.log2(n))
    base = [2 ** (-8 * (h + 1) / c) for h in range(c)]
    extra = [2 ** (-4 * (2 * h + 1) / c) for h in range(n - c)]
    return torch.tensor(base + extra, dtype=torch.float32)


def alibi_mask(heads: int, t: int, causal: bool) -> torch.Tensor:
    pos = torch.arange(t, dtype=torch.float32)
    dist = pos[None, :] - pos[:, None]  # j - i
    slopes = alibi_slopes(heads)[:, None, None]
    if causal:
        mask = slopes * dist  # -m (i - j) for j <= i
        return mask.masked_fill(dist[None] > 0, float("-inf"))[None]
    return (-slopes * dist.abs())[None]


def median_ms(fn, runs: int = 9) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--long", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    b, h, t, d = 2, 8, 1024, 64
    dm = h * d
    proj = [torch.nn.Linear(dm, dm, bias=False) for _ in range(4)]
    x = torch.randn(b, t, dm)

    def split(y: torch.Tensor) -> torch.Tensor:
        return y.view(b, t, h, d).transpose(1, 2)

    print(f"PyTorch {torch.__version__}, {args.threads} threads, B{b} H{h} T{t} D{d} f32")
    print(f"{'case':<34} {'median ms':>10}")
    with torch.inference_mode():
        q, k, v = (split(p(x)) for p in proj[:3])
        for causal in (False, True):
            mask = alibi_mask(h, t, causal)

            def block(mask=mask, is_causal=False):
                qq, kk, vv = (split(p(x)) for p in proj[:3])
                out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=is_causal)
                return proj[3](out.transpose(1, 2).reshape(b, t, dm))

            rows = [
                (f"block alibi causal={causal}", lambda: block()),
                (f"block no bias causal={causal}", lambda c=causal: block(None, c)),
                (
                    f"sdpa core alibi causal={causal}",
                    lambda mask=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                ),
                (
                    f"sdpa core no bias causal={causal}",
                    lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                ),
            ]
            for name, fn in rows:
                ms = median_ms(fn)
                print(f"{name:<34} {ms:>10.2f}")
                if args.json:
                    print(json.dumps({"bench": "pytorch", "case": name, "median_ms": round(ms, 3)}))
    if args.long:
        long_context(proj, h, d, args.json)


def long_context(proj, h: int, d: int, as_json: bool) -> None:
    """One block forward without a bias at B1 T16384, causal and bidirectional."""
    b, t = 1, 16384
    dm = h * d
    x = torch.randn(b, t, dm)

    def split(y: torch.Tensor) -> torch.Tensor:
        return y.view(b, t, h, d).transpose(1, 2)

    with torch.inference_mode():
        for causal in (True, False):

            def block(c=causal):
                qq, kk, vv = (split(p(x)) for p in proj[:3])
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=c)
                return proj[3](out.transpose(1, 2).reshape(b, t, dm))

            name = f"long T{t} block no bias causal={causal}"
            ms = median_ms(block, runs=3)
            print(f"{name:<34} {ms:>10.2f}")
            if as_json:
                print(json.dumps({"bench": "pytorch", "case": name, "median_ms": round(ms, 3)}))


if __name__ == "__main__":
    main()
