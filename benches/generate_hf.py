"""HF transformers' side of benches/generate.rs (run by hand): SmolLM2-135M-Instruct from the same
GGUF file, dequantized to float32 (or bfloat16), eager attention, a 512-token prefill (logits of
the last position only) and 128 greedy decoding steps with HF's KV cache, best and median of 3.

    bash scripts/fetch_smollm2.sh
    python benches/generate_hf.py            # float32
    python benches/generate_hf.py --bf16

The prompt is the same text as the Rust bench's, tokenized by HF's tokenizer built from the GGUF
and cut to 512 tokens. torch uses every core (torch.set_num_threads(os.cpu_count())).
"""

import argparse
import os
import statistics
import time

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "data", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
PREFILL, DECODE, REPEATS = 512, 128, 3
TEXT = (
    "The history of the printing press begins long before Gutenberg, with carved "
    "wooden blocks pressed onto cloth and paper across East Asia. Movable type made of baked clay and "
    "later of metal followed, yet the sheer number of characters kept the method slow. In Europe a "
    "goldsmith combined an alloy that cast cleanly, an oil-based ink and a screw press borrowed from "
    "wine makers, and the result spread from one city to the next within a few decades. "
)


def run(model, ids):
    with torch.no_grad():
        start = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - start
        past, nxt = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
        start = time.perf_counter()
        for _ in range(DECODE):
            out = model(nxt, past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
        return prefill, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count())
    folder, name = os.path.split(MODEL)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").to(dtype).eval()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = torch.tensor([tok.encode(TEXT * 8, add_special_tokens=False)[:PREFILL]])
    assert ids.shape[1] == PREFILL
    run(model, ids[:, :32])  # warm-up
    runs = [run(model, ids) for _ in range(REPEATS)]
    prefill = [p for p, _ in runs]
    decode = [DECODE / d for _, d in runs]
    print(f"HF transformers {transformers.__version__} (torch {torch.__version__}) / eager, {dtype}: prefill {PREFILL} tokens "
          f"{min(prefill):.3f} s best, {statistics.median(prefill):.3f} s median; decode "
          f"{max(decode):.1f} tokens/s best, {statistics.median(decode):.1f} median "
          f"({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
