"""Checks examples/generate.rs against HF transformers on the fetched SmolLM2 GGUF (run by hand).

    bash scripts/fetch_smollm2.sh
    python scripts/smollm2_hf.py            # parity: greedy ids and logits, then exits 1 on a miss
    python scripts/smollm2_hf.py --f64      # and both float32 evaluations against float64

HF's side is transformers' own GGUF loading of the same file (dequantized to float32, its q/k
rows un-permuted by transformers), eager attention. Two checks:
  1. a fixed chat prompt: 40 greedy ids from the example (`--greedy --ignore-eos
     --print-ids`) against HF's greedy decoding with its KV cache, and the logits at every
     prompt position (`--save-logits`) within 2e-4;
  2. a long plain prompt (about 512 tokens): the logits at every position within 2e-4.
The prompt ids are the example's tokenizer's; HF's tokenizer built from the GGUF is compared on
the same text and any difference printed (its pre-tokenizer for `smollm` keeps digit runs
together, SmolLM2's own tokenizer.json splits each digit, as the example does).

Needs: torch, transformers 5.24.0, gguf 0.19.0, accelerate (transformers' GGUF loading asks for
it), safetensors; cargo on the PATH.
"""

import argparse
import copy
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "data", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
CHAT_PROMPT = "Explain in a few sentences why the sky is blue."
LONG_PROMPT = " ".join(
    [
        "The history of the printing press begins long before Gutenberg, with carved wooden",
        "blocks pressed onto cloth and paper across East Asia. Movable type made of baked clay",
        "and later of metal followed, yet the sheer number of characters in the written language",
        "kept the method slow. In Europe a goldsmith combined an alloy that cast cleanly, an",
        "oil-based ink and a screw press borrowed from wine makers, and the result spread from",
        "one city to the next within a few decades. Books became cheaper, scholars could compare",
        "identical copies, and ideas that once travelled by hand now moved by the cartload.",
    ]
)
TOL = 2e-4


def run_example(prompt, new_tokens, logits_path):
    cmd = [
        "cargo", "run", "--quiet", "--release", "--example", "generate", "--",
        "--model", MODEL, "--prompt", prompt, "--greedy", "--ignore-eos", "--print-ids",
        "--max-new-tokens", str(new_tokens), "--save-logits", logits_path,
    ]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    ids = {}
    for line in out.splitlines():
        for key in ("prompt ids: ", "generated ids: "):
            if line.startswith(key):
                ids[key.split()[0]] = [int(x) for x in line[len(key):].split(",") if x]
    return ids["prompt"], ids["generated"], load_file(logits_path)["logits"]


def hf_greedy(model, prompt, n):
    ids, past, out = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(n):
            step = model(ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            nxt = int(step.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def compare_logits(name, model, prompt, ours, exact):
    """Ours against HF's float32 logits; with `exact` (HF's model in float64), how far each
    float32 evaluation is from the float64 one."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = model(ids).logits[0].float()
    diff = (theirs - ours).abs().amax(dim=-1)
    same_argmax = int((theirs.argmax(-1) == ours.argmax(-1)).sum())
    print(f"{name}: {len(prompt)} positions, max |logit diff| {diff.max():.2e} "
          f"(median over positions {diff.median():.2e}, {int((diff > TOL).sum())} positions over "
          f"{TOL:.0e}), argmax equal at {same_argmax}/{len(prompt)}")
    if exact is not None:
        with torch.no_grad():
            truth = exact(ids).logits[0]
        for who, x in (("ours", ours), ("HF float32", theirs)):
            d = (x.double() - truth).abs().amax(dim=-1)
            print(f"  {who} vs HF in float64: max {d.max():.2e}, median {d.median():.2e}")
    return float(diff.max()) <= TOL and same_argmax == len(prompt)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--f64", action="store_true",
                        help="also measure both float32 evaluations against HF's model in float64")
    args = parser.parse_args()
    if not os.path.exists(MODEL):
        sys.exit(f"no model at {MODEL}: run bash scripts/fetch_smollm2.sh")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count())
    folder, name = os.path.split(MODEL)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    exact = None
    if args.f64:
        # The dequantized model widened: plain Linear layers, so every product runs in float64.
        exact = copy.deepcopy(model).double()
        kind = type(exact.model.layers[0].self_attn.q_proj)
        assert kind is torch.nn.Linear, f"HF kept the weights packed ({kind}); float64 needs them dequantized"
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        prompt, generated, logits = run_example(CHAT_PROMPT, args.new_tokens, os.path.join(tmp, "chat.safetensors"))
        text = hf_tok.decode(prompt)
        if hf_tok.encode(text, add_special_tokens=False) != prompt:
            print("note: HF's GGUF tokenizer splits the chat prompt differently")
        ok &= compare_logits("chat prompt", model, prompt, logits, exact)
        theirs = hf_greedy(model, prompt, args.new_tokens)
        same = sum(a == b for a, b in zip(generated, theirs))
        print(f"greedy: {same}/{args.new_tokens} ids equal; first difference at "
              f"{next((i for i, (a, b) in enumerate(zip(generated, theirs)) if a != b), None)}")
        print(f"  ours: {generated}\n  HF's: {theirs}")
        print(f"  text: {hf_tok.decode(generated)!r}")
        ok &= generated == theirs
        prompt, _, logits = run_example(LONG_PROMPT * 4, 1, os.path.join(tmp, "long.safetensors"))
        prompt_len = len(prompt)
        print(f"long prompt: {prompt_len} tokens (chat template included)")
        ok &= compare_logits("long prompt", model, prompt, logits, exact)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
