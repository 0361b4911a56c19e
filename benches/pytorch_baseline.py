"""PyTorch baseline for `benches/attention.rs`: the same attention block in PyTorch eager.

Run by hand (CI never needs Python), on the same quiet machine as `cargo bench --bench attention`:

    python benches/pytorch_baseline.py            # B2 H8 T1024 D64, f32, 2 threads
    python benches/pytorch_baseline.py --json     # JSON lines as well
    python benches/pytorch_baseline.py --long     # also one block forward at B1 H8 T16384
    python benches/pytorch_baseline.py --train    # also training steps (forward + backward)
    python benches/pytorch_baseline.py --decode   # also one decoding step against a cache
    python benches/pytorch_baseline.py --lengths --json > pytorch.jsonl   # T = 1k..32k, for the plot
    python benches/pytorch_baseline.py --small    # only a small model's layer (SmolLM2's shape)
    python benches/pytorch_baseline.py --train-peaks  # only T = 8192 training steps: time, peak memory
    python benches/pytorch_baseline.py --half     # only the block without a bias in f32, bf16, f16

Each case is the crate's block written with torch: four bias-free projections of d_model = 512,
`scaled_dot_product_attention` with ALiBi as a float mask (BLOOM's slopes; `-m|i - j|` for the
bidirectional case, `-m (i - j)` plus `-inf` above the diagonal for the causal one), and the
output projection. The attention core alone (SDPA on ready q, k, v) is timed too. Medians of 9
runs after one warm-up. `--long` adds the block without a bias at T = 16384 (B1, SDPA's flash
kernel; ALiBi would need an 8.6 GB float mask there), causal and bidirectional, medians of 3:
the counterpart of `cargo bench --bench attention -- --only long`. `--train` times one training
step of the block per encoding (forward, then autograd's backward of `sum(probe * out)` to the
input and every weight and table), medians of 7: no encoding and RoPE (HF's rotate-half, θ 10000)
through SDPA's causal flag; ALiBi, T5 (32 buckets, 128 distance) and the clipped bias (k = 64) as
a float mask that tracks gradients; Shaw (k = 64, keys and values) as eager attention whose
relative terms are gathered from `q aᴷᵀ` rows and scattered back per distance; FoX (both halves of
gates, as x-transformers' `DataDependentAlibi`) as its dense float mask; Inkling's relative
logits (d_rel 16, a bank of 1024 distances, log-n scaling from 256 with alpha 0.1) as HF 5.24's
`InklingAttention` builds them, a dense `(B, H, T, T)` bias gathered from each query's row. The counterpart of
`cargo bench --bench attention -- --only training`. `--decode` times one decoding step of the
block (B1, one token) against a preallocated cache of L = 1024, 4096 and 16384 keys, the new
key and value written in place: RoPE at the token's position (cos and sin of one row), or ALiBi
as a float mask of one row; medians of 200 steps. The counterpart of `--only decode`.
`--lengths` times one block forward without a bias (B1, SDPA's flash kernel) at T = 1024 to
32768, causal and bidirectional (medians of 3 up to T = 8192, then one run after a warm-up):
the PyTorch side of `cargo bench --bench attention -- --only lengths --pytorch FILE`.
`--train-peaks` runs one causal training step at B1 T8192 (after a warm-up step) for no
encoding, FoX and Inkling's dense forms, each in a fresh process, reporting its time and the
process's peak resident memory: the counterpart of the crate's T = 8192 training memory.
`--small` times only SmolLM2-135M's attention layer (d_model 576, 9 heads, 3 KV heads of 64,
HF's rotate-half RoPE with θ 1e5 from a precomputed table, SDPA with grouped KV heads, causal,
B1): a 30-token and a 512-token prefill (medians of 125), and one decoding step against a
preallocated cache of 100 and 2048 keys (medians of 625): the counterpart of `--only small`.
`--half` times only the block without a bias (B2 T1024, SDPA) with its weights and input in
float32, bfloat16 and float16, causal and bidirectional, medians of 9 after two: the
counterpart of `--only half`.

`--device cuda` runs the GPU table instead (bf16, B4 d_model 1024 H16 D64; B1 at T = 16384),
the counterpart of `cargo bench --features cuda --bench attention -- --only cuda`: per scheme
(none, RoPE, ALiBi, T5, the clipped bias, Shaw's keys), causal and bidirectional, inference at
T = 1024, 4096 and 16384 and training (forward + backward) at 1024 and 4096, each through SDPA
(biases as a float mask) and through FlexAttention (a compiled `score_mod`, with a causal block
mask), reporting both and the best; then one decoding step against a preallocated cache of
4096 and 16384 keys. The device is synchronised before every clock reading; medians of 9 runs
(3 at T = 16384) after a warm-up. Shaw's value term has no FlexAttention form: its rows are
timed with the key term only (say so next to the figure). `--tiny` shrinks every shape, to check
the script on a CPU (`--device cpu --tiny`, f32).
"""

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
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
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--decode", action="store_true")
    parser.add_argument("--lengths", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--half", action="store_true")
    parser.add_argument("--train-peaks", action="store_true")
    parser.add_argument("--train-peak", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--train-step", nargs=2, metavar=("NAME", "CAUSAL"), default=None,
                        help="one case's training step alone in this process (median of 9 after "
                             "two), the counterpart of the bench's --train-steps-child")
    parser.add_argument("--infer-step", nargs=2, metavar=("NAME", "CAUSAL"), default=None,
                        help="the same block's inference forward alone in this process (median "
                             "of 9 after two), the counterpart of the bench's --infer-steps-child")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--max-t", type=int, default=None,
                        help="with --device cuda: only lengths up to this (a short GPU session)")
    parser.add_argument("--sdpa-only", action="store_true",
                        help="with --device cuda: SDPA alone, without FlexAttention's compiles")
    args = parser.parse_args()
    if args.device != "cpu" or args.tiny:
        gpu_table(torch.device(args.device), args.tiny, args.json, args.max_t, args.sdpa_only)
        return
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.small:
        small_layer(args.json)
        return
    if args.half:
        half_precision(args.json)
        return
    if args.train_peak:
        train_peak(args.train_peak, 8, 64)
        return
    if args.train_step or args.infer_step:
        name, causal = args.train_step or args.infer_step
        step = train_step(name, 2, 8, 1024, 64, causal == "true", train=bool(args.train_step))
        step()  # (median_ms runs one more first: two, as the bench's child)
        print(f"{median_ms(step, runs=9):.2f}")
        return
    if args.train_peaks:
        train_peaks(8, 64, args.threads)
        return
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
    if args.train:
        training(b, h, t, d, args.json)
    if args.decode:
        decode(proj, h, d, args.json)
    if args.lengths:
        lengths(proj, h, d, args.json)
    if args.long:
        long_context(proj, h, d, args.json)


def lengths(proj, h: int, d: int, as_json: bool) -> None:
    """One block forward without a bias at B1 and T = 1024 .. 32768, causal and bidirectional."""
    dm = h * d
    print(f"\nblock forward without a bias, B1 H{h} D{d}, by length")
    with torch.inference_mode():
        for t in (1024, 2048, 4096, 8192, 16384, 32768):
            x = torch.randn(1, t, dm)

            def split(y: torch.Tensor, t=t) -> torch.Tensor:
                return y.view(1, t, h, d).transpose(1, 2)

            for causal in (True, False):

                def block(c=causal, x=x, t=t):
                    qq, kk, vv = (split(p(x)) for p in proj[:3])
                    out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=c)
                    return proj[3](out.transpose(1, 2).reshape(1, t, dm))

                ms = median_ms(block, runs=3 if t <= 8192 else 1)
                case = f"length T{t} causal={causal}"
                print(f"{case:<34} {ms:>10.2f}")
                if as_json:
                    print(json.dumps({"bench": "pytorch", "case": case, "median_ms": round(ms, 3)}))


def decode(proj, h: int, d: int, as_json: bool) -> None:
    """One decoding step (B1) against a preallocated cache of L keys, RoPE or ALiBi."""
    dm = h * d
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    slopes = alibi_slopes(h)[None, :, None, None]
    print(f"\ndecoding step, B1 H{h} D{d}, preallocated cache")
    with torch.inference_mode():
        for name in ("rope", "alibi"):
            for n in (1024, 4096, 16384):
                cache_k = torch.randn(1, h, n + 1, d)
                cache_v = torch.randn(1, h, n + 1, d)
                x = torch.randn(1, 1, dm)
                dist = torch.arange(n + 1, dtype=torch.float32) - n  # j - i, i = n
                row = (slopes * dist)[:, :, None, :].reshape(1, h, 1, n + 1)

                def step(n=n, row=row, cache_k=cache_k, cache_v=cache_v, x=x, name=name):
                    q, k, v = (p(x).view(1, 1, h, d).transpose(1, 2) for p in proj[:3])
                    mask = None
                    if name == "rope":
                        ang = n * inv
                        cos = torch.cat([ang, ang]).cos()
                        sin = torch.cat([ang, ang]).sin()
                        rot = lambda y: y * cos + torch.cat([-y[..., d // 2 :], y[..., : d // 2]], -1) * sin
                        q, k = rot(q), rot(k)
                    else:
                        mask = row
                    cache_k[:, :, n : n + 1] = k
                    cache_v[:, :, n : n + 1] = v
                    out = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask)
                    return proj[3](out.transpose(1, 2).reshape(1, 1, dm))

                ms = median_ms(step, runs=200)
                case = f"decode {name} cache={n}"
                print(f"{case:<34} {ms:>10.3f}")
                if as_json:
                    print(json.dumps({"bench": "pytorch", "case": case, "median_ms": round(ms, 4)}))


def small_layer(as_json: bool) -> None:
    """SmolLM2-135M's attention layer (B1): prefills of 30 and 512 tokens, decoding steps."""
    dm, h, kv, d, theta = 576, 9, 3, 64, 1e5
    q_proj, o_proj = (torch.nn.Linear(dm, h * d, bias=False), torch.nn.Linear(h * d, dm, bias=False))
    k_proj, v_proj = (torch.nn.Linear(dm, kv * d, bias=False) for _ in range(2))
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(4096, dtype=torch.float32), inv)
    cos_all, sin_all = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(y, cos, sin):
        return y * cos + torch.cat([-y[..., d // 2 :], y[..., : d // 2]], -1) * sin

    def heads(p, x, n):
        return p(x).view(1, x.shape[1], n, d).transpose(1, 2)

    def prefill(x):
        t = x.shape[1]
        cos, sin = cos_all[:t], sin_all[:t]
        q, k = rot(heads(q_proj, x, h), cos, sin), rot(heads(k_proj, x, kv), cos, sin)
        out = F.scaled_dot_product_attention(q, k, heads(v_proj, x, kv), is_causal=True, enable_gqa=True)
        return o_proj(out.transpose(1, 2).reshape(1, t, h * d))

    print(f"\na small model's layer (SmolLM2-135M: d_model {dm}, {h} heads, {kv} KV heads), causal, B1")
    with torch.inference_mode():
        rows = []
        for t in (30, 512):
            x = torch.randn(1, t, dm)
            rows.append((f"prefill {t}", median_ms(lambda x=x: prefill(x), runs=125)))
        for n in (100, 2048):
            cache_k, cache_v = torch.randn(1, kv, n + 1, d), torch.randn(1, kv, n + 1, d)
            x = torch.randn(1, 1, dm)

            def step(n=n, cache_k=cache_k, cache_v=cache_v, x=x):
                cos, sin = cos_all[n : n + 1], sin_all[n : n + 1]
                q, k = rot(heads(q_proj, x, h), cos, sin), rot(heads(k_proj, x, kv), cos, sin)
                cache_k[:, :, n : n + 1] = k
                cache_v[:, :, n : n + 1] = heads(v_proj, x, kv)
                out = F.scaled_dot_product_attention(q, cache_k, cache_v, enable_gqa=True)
                return o_proj(out.transpose(1, 2).reshape(1, 1, h * d))

            rows.append((f"decode at {n}", median_ms(step, runs=625)))
        for case, ms in rows:
            print(f"{case:<34} {ms:>10.3f}")
            if as_json:
                print(json.dumps({"bench": "pytorch_small", "case": case, "median_ms": round(ms, 4)}))


def half_precision(as_json: bool) -> None:
    b, h, t, d = 2, 8, 1024, 64
    dm = h * d
    print(f"block without a bias, B{b} H{h} T{t} D{d}, by dtype (ms)")
    for causal in (False, True):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            proj = [torch.nn.Linear(dm, dm, bias=False).to(dtype) for _ in range(4)]
            x = torch.randn(b, t, dm).to(dtype)

            def block(proj=proj, x=x, causal=causal):
                with torch.no_grad():
                    q, k, v = (p(x).view(b, t, h, d).transpose(1, 2) for p in proj[:3])
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    return proj[3](o.transpose(1, 2).reshape(b, t, dm))

            block()
            ms = median_ms(block)
            name = str(dtype).removeprefix("torch.")
            print(f"causal={causal!s:<5} {name:<8} {ms:8.2f}")
            if as_json:
                print(json.dumps({"bench": "pytorch_half", "causal": causal, "dtype": name,
                                  "median_ms": round(ms, 3)}))


def rope(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE with θ = 10000 on (B, H, T, D)."""
    t, d = x.shape[-2], x.shape[-1]
    f32 = dict(dtype=torch.float32, device=x.device)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, **f32) / d)
    ang = torch.outer(torch.arange(t, **f32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def t5_buckets(t: int, causal: bool) -> torch.Tensor:
    """T5's relative position buckets (HF's `_relative_position_bucket`) of keys j for queries i."""
    return t5_buckets_of(torch.arange(t)[None, :] - torch.arange(t)[:, None], causal)


TRAINED = ("none", "rope", "alibi", "t5", "clipped_bias", "shaw_k64", "fox", "inkling")


def train_step(name: str, b: int, h: int, t: int, d: int, causal: bool, train: bool = True):
    """One training step of the block with encoding `name` (see the module docs): a closure
    running the forward and autograd's backward of `sum(probe * out)`; with `train` false, the
    same block's forward alone under `torch.inference_mode()`."""
    dm = h * d
    k_clip = 64
    rel = torch.arange(t)[None, :] - torch.arange(t)[:, None]  # j - i
    tri = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    torch.manual_seed(0)
    proj = [torch.nn.Linear(dm, dm, bias=False) for _ in range(4)]
    # FoX's gates, both halves (x-transformers' DataDependentAlibi, bidirectional).
    gates = torch.nn.Linear(dm, 2 * h)
    # Inkling's relative states and bank (HF's r_proj and rel_logits_proj.proj).
    r_proj = torch.nn.Linear(dm, h * 16, bias=False)
    bank = torch.nn.Parameter(0.02 * torch.randn(16, 1024))
    x = torch.randn(b, t, dm, requires_grad=True)
    probe = torch.randn(b, t, dm)
    table = {
        "t5": torch.nn.Parameter(torch.randn(32, h) * 0.1),
        "clipped_bias": torch.nn.Parameter(torch.randn(2 * k_clip + 1, h) * 0.1),
    }.get(name)
    a_k = torch.nn.Parameter(torch.randn(2 * k_clip + 1, d) * 0.1)
    a_v = torch.nn.Parameter(torch.randn(2 * k_clip + 1, d) * 0.1)
    buckets = t5_buckets(t, causal) if name == "t5" else None
    clipped = rel.clamp(-k_clip, k_clip) + k_clip

    def split(y: torch.Tensor) -> torch.Tensor:
        return y.view(b, t, h, d).transpose(1, 2)

    def forward() -> torch.Tensor:
        q, k, v = (split(p(x)) for p in proj[:3])
        mask, is_causal = None, causal
        if name == "rope":
            q, k = rope(q), rope(k)
        elif name == "inkling":
            # The dense bias, as HF's InklingRelativeLogits gathers it, scaled with q.
            pos = torch.arange(t)
            tau = 1.0 + 0.1 * torch.log(((pos + 1) / 256).clamp(min=1.0)).view(1, 1, t, 1)
            rows = (r_proj(x).view(b, t, h, 16) @ bank).transpose(1, 2)
            dist = pos[:, None] - pos[None, :]
            index = dist.clamp(0, 1023).expand(b, h, t, t)
            mask = rows.gather(-1, index).masked_fill((dist < 0) | (dist >= 1024), 0.0)
            q, mask = q * tau, mask * tau
            if causal:
                mask = mask.masked_fill(tri, float("-inf"))
            is_causal = False
        elif name == "fox":
            # The dense (B, H, T, T) bias, as x-transformers builds it.
            c = F.logsigmoid(gates(x)).transpose(1, 2).cumsum(-1)
            fwd, rev = c[:, :h], c[:, h:]
            mask = (fwd[..., :, None] - fwd[..., None, :]).tril() + (
                rev[..., None, :] - rev[..., :, None]).triu()
            if causal:
                mask = mask.masked_fill(tri, float("-inf"))
            is_causal = False
        elif name == "alibi":
            mask = alibi_mask(h, t, causal)
            is_causal = False
        elif name in ("t5", "clipped_bias"):
            index = buckets if name == "t5" else clipped
            mask = table[index].permute(2, 0, 1)[None]
            if causal:
                mask = mask.masked_fill(tri, float("-inf"))
            is_causal = False
        if name == "shaw_k64":
            s = q @ k.transpose(-1, -2) / math.sqrt(d)
            rows = q @ a_k.T / math.sqrt(d)  # (B, H, T, 2k + 1)
            s = s + rows.gather(-1, clipped.expand(b, h, t, t))
            if causal:
                s = s.masked_fill(tri, float("-inf"))
            p = s.softmax(-1)
            sums = torch.zeros(b, h, t, 2 * k_clip + 1).scatter_add(
                -1, clipped.expand(b, h, t, t), p)
            out = p @ v + sums @ a_v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return proj[3](out.transpose(1, 2).reshape(b, t, dm))

    def step() -> None:
        (forward() * probe).sum().backward()

    def infer() -> None:
        with torch.inference_mode():
            forward()

    return step if train else infer


def training(b: int, h: int, t: int, d: int, as_json: bool) -> None:
    """One training step of the block per encoding, causal and bidirectional."""
    print(f"\ntraining step (forward + backward), B{b} H{h} T{t} D{d}")
    for causal in (False, True):
        for name in TRAINED:
            ms = median_ms(train_step(name, b, h, t, d, causal), runs=7)
            case = f"train {name} causal={causal}"
            print(f"{case:<34} {ms:>10.2f}")
            if as_json:
                print(json.dumps({"bench": "pytorch", "case": case, "median_ms": round(ms, 3)}))


def train_peak(name: str, h: int, d: int) -> None:
    """One causal training step at B1 T8192 after a warm-up step, in this process (run one
    per process): its time, the resident memory before the first step and the process's
    peak, the counterpart of the crate's T = 8192 training memory in `--only training`."""
    step = train_step(name, 1, h, 8192, d, True)
    before = next(int(line.split()[1]) for line in open("/proc/self/status")
                  if line.startswith("VmRSS:")) / 1024
    step()
    start = time.perf_counter()
    step()
    ms = (time.perf_counter() - start) * 1e3
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"bench": "pytorch", "case": f"train peak {name} T=8192 causal",
                      "ms": round(ms, 1), "before_mib": round(before, 1),
                      "peak_mib": round(peak, 1)}))


def train_peaks(h: int, d: int, threads: int) -> None:
    """`train_peak` for the encodings without a table, each in a fresh process."""
    for name in ("none", "fox", "inkling"):
        subprocess.run([sys.executable, __file__, "--train-peak", name,
                        "--threads", str(threads)], check=True)


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


def gpu_table(dev: torch.device, tiny: bool, as_json: bool, max_t=None, sdpa_only=False) -> None:
    """The GPU table of `--device cuda` (see the module docs)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    b, h, d = (2, 2, 16) if tiny else (4, 16, 64)
    dm, k_clip = h * d, 64
    infer_lengths = (64, 128) if tiny else (1024, 4096, 16384)
    train_lengths = (64,) if tiny else (1024, 4096)
    if max_t is not None:
        infer_lengths = tuple(t for t in infer_lengths if t <= max_t)
        train_lengths = tuple(t for t in train_lengths if t <= max_t)
    # Each scheme, length and mask is a compile of its own; past dynamo's default limit of 8
    # later ones would run FlexAttention unfused, and PyTorch's figure would be too slow.
    from torch import _dynamo
    for limit in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(_dynamo.config, limit):
            setattr(_dynamo.config, limit, 1024)
    flex = torch.compile(flex_attention, dynamic=False)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name() if gpu else dev}, "
          f"{dtype}, H{h} D{d} d_model {dm}")

    def timed(fn, runs):
        def run():
            fn()
            sync()
        return median_ms(run, runs)

    def report(case: str, ms, why: str = "oom") -> None:
        text = why if ms is None else f"{ms:.3f}"
        print(f"{case:<52} {text:>10}")
        if as_json and ms is not None:
            print(json.dumps({"bench": "pytorch-gpu", "case": case, "median_ms": round(ms, 4)}))

    for train, lengths in ((False, infer_lengths), (True, train_lengths)):
        for t in lengths:
            bt = 1 if t >= 16384 else b
            runs = 3 if t >= 16384 else 9
            proj = [torch.nn.Linear(dm, dm, bias=False, device=dev, dtype=dtype) for _ in range(4)]
            x = torch.randn(bt, t, dm, device=dev, dtype=dtype, requires_grad=train)
            probe = torch.randn(bt, t, dm, device=dev, dtype=dtype)
            slopes = alibi_slopes(h).to(dev)
            rel = torch.arange(t, device=dev)[None, :] - torch.arange(t, device=dev)[:, None]
            t5_table = (torch.randn(32, h, device=dev) * 0.1).requires_grad_(train)
            clip_table = (torch.randn(2 * k_clip + 1, h, device=dev) * 0.1).requires_grad_(train)
            a_k = (torch.randn(2 * k_clip + 1, d, device=dev, dtype=dtype) * 0.1).requires_grad_(train)
            dist = torch.arange(-(t - 1), t, device=dev)  # j − i, per diagonal
            for causal in (True, False):
                # One row per head over the 2T − 1 distances (FlexAttention reads it by
                # kv_idx − q_idx), and the same as a dense float mask for SDPA.
                t5_cols = t5_buckets_of(dist, causal)
                clip_cols = dist.clamp(-k_clip, k_clip) + k_clip
                tri = rel > 0
                block_mask = (
                    create_block_mask(lambda b_, h_, q, kv: q >= kv, None, None, t, t, device=dev)
                    if causal else None
                )
                for name in ("none", "rope", "alibi", "t5", "clipped_bias", "shaw_k64"):
                    def qkv():
                        q, k, v = (p(x).view(bt, t, h, d).transpose(1, 2) for p in proj[:3])
                        if name == "rope":
                            q, k = rope(q.float()).to(dtype), rope(k.float()).to(dtype)
                        return q, k, v

                    def rows_of():
                        if name == "alibi":
                            r = slopes[:, None] * (dist if causal else -dist.abs())[None, :]
                        elif name == "t5":
                            r = t5_table[t5_cols].T
                        else:
                            r = clip_table[clip_cols].T
                        return r  # (H, 2T − 1), f32

                    def finish(out):
                        y = proj[3](out.transpose(1, 2).reshape(bt, t, dm))
                        if train:
                            (y.float() * probe).sum().backward()
                        return y

                    def sdpa():
                        q, k, v = qkv()
                        mask = None
                        if name in ("alibi", "t5", "clipped_bias"):
                            r = rows_of()
                            mask = r[:, rel + t - 1][None].to(dtype)
                        elif name == "shaw_k64":
                            rows = (q @ a_k.T) / math.sqrt(d)  # (B, H, T, 2k + 1)
                            mask = rows.gather(-1, (rel.clamp(-k_clip, k_clip) + k_clip).expand(bt, h, t, t))
                        if mask is not None and causal:
                            mask = mask.masked_fill(tri, float("-inf"))
                        out = F.scaled_dot_product_attention(
                            q, k, v, attn_mask=mask, is_causal=causal and mask is None)
                        return finish(out)

                    def flex_block():
                        q, k, v = qkv()
                        score_mod = None
                        if name in ("alibi", "t5", "clipped_bias"):
                            r = rows_of()

                            def score_mod(score, b_, h_, qi, kj, r=r):
                                return score + r[h_, kj - qi + t - 1]
                        elif name == "shaw_k64":
                            rows = (q @ a_k.T).float() / math.sqrt(d)

                            def score_mod(score, b_, h_, qi, kj, rows=rows):
                                return score + rows[b_, h_, qi, (kj - qi).clamp(-k_clip, k_clip) + k_clip]
                        out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
                        return finish(out)

                    kind = "train" if train else "infer"
                    best = None
                    ways = (("sdpa", sdpa),) if sdpa_only else (("sdpa", sdpa), ("flex", flex_block))
                    for how, fn in ways:
                        why = "oom"
                        try:
                            with torch.inference_mode(not train):
                                ms = timed(fn, runs)
                        except torch.OutOfMemoryError:
                            ms = None
                            torch.cuda.empty_cache() if gpu else None
                        except NotImplementedError:  # FlexAttention's backward on a CPU
                            ms, why = None, "n/a"
                        except Exception as e:  # e.g. Triton out of shared memory for a score_mod
                            ms, why = None, type(e).__name__
                            print(f"{kind} {name} T{t} causal={causal} {how}: {str(e)[-160:]}")
                        report(f"{kind} {name} T{t} causal={causal} {how}", ms, why)
                        if ms is not None:
                            best = ms if best is None else min(best, ms)
                    report(f"{kind} {name} T{t} causal={causal} best", best)
    gpu_decode(dev, dtype, (128,) if tiny else (4096, 16384), h, d, report, timed)


def t5_buckets_of(dist: torch.Tensor, causal: bool, buckets: int = 32, max_distance: int = 128):
    """T5's bucket of each distance j − i (HF's `_relative_position_bucket`), elementwise."""
    rel, out = dist.clone(), torch.zeros_like(dist)
    if not causal:
        buckets //= 2
        out += (rel > 0).long() * buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    exact = buckets // 2
    large = exact + (
        torch.log(rel.float().clamp(min=1) / exact) / math.log(max_distance / exact) * (buckets - exact)
    ).long()
    return out + torch.where(rel < exact, rel, torch.clamp(large, max=buckets - 1))


def gpu_decode(dev, dtype, lengths, h: int, d: int, report, timed) -> None:
    """One decoding step (B1) with RoPE against a preallocated cache, on `dev`."""
    dm = h * d
    proj = [torch.nn.Linear(dm, dm, bias=False, device=dev, dtype=dtype) for _ in range(4)]
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=dev) / d)
    with torch.inference_mode():
        for n in lengths:
            cache_k = torch.randn(1, h, n + 1, d, device=dev, dtype=dtype)
            cache_v = torch.randn(1, h, n + 1, d, device=dev, dtype=dtype)
            x = torch.randn(1, 1, dm, device=dev, dtype=dtype)
            ang = n * inv
            cos, sin = torch.cat([ang, ang]).cos().to(dtype), torch.cat([ang, ang]).sin().to(dtype)

            def step(n=n, cache_k=cache_k, cache_v=cache_v, x=x, cos=cos, sin=sin):
                q, k, v = (p(x).view(1, 1, h, d).transpose(1, 2) for p in proj[:3])
                rot = lambda y: y * cos + torch.cat([-y[..., d // 2 :], y[..., : d // 2]], -1) * sin
                q, k = rot(q), rot(k)
                cache_k[:, :, n : n + 1] = k
                cache_v[:, :, n : n + 1] = v
                out = F.scaled_dot_product_attention(q, cache_k, cache_v)
                return proj[3](out.transpose(1, 2).reshape(1, 1, dm))

            report(f"decode rope cache={n}", timed(step, 200))


if __name__ == "__main__":
    main()
