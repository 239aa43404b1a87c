"""One-image chat prompts on a vision-language model: the engine against transformers on
the same machine and checkpoint (CPU), and the encoder cache's effect on a repeated image.

    python -m benchmarks.bench_vision [--requests 16 --tokens 64 --repeats 3 --json out.json]
    python -m benchmarks.bench_vision --checkpoint DIR --device cuda --dtype bfloat16 --image-size 448

The checkpoint is `builder tiny --vision` (a random Qwen2-VL: 4 layers of hidden 256,
a 4-block vision tower of width 128; images of 224 x 224 pixels become 64 tokens). Each
request is the chat template over a short question and one image, greedy, `--tokens`
tokens. Measured, median over `repeats`:
- batch 1, each request alone: time to first token (TTFT) and decode tokens/s, for the
  engine (its step loop, offline) and for transformers' generate;
- all requests at once: output tokens/s end to end, the engine against transformers'
  batched generate (left-padded);
- the prefill of all requests at once (one token each), with `--requests` distinct images
  against one image repeated: images encoded, and the time.
With `--checkpoint`, another Qwen2-VL / Qwen2.5-VL folder (one without tokenizer files gets
prompts of random token ids around its image token): benchmarks/gpu_check.py's `vision`
stage runs a Qwen2.5-VL-7B-shaped random model this way on a GPU, in bf16, where tokens
are not expected to match (its sums differ). On CPU in fp32, outputs must be transformers' tokens (both suppress the EOS token before `--tokens`, as
min_tokens does): the run counts requests that differ.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time


def _checkpoint() -> str:
    from builder.tiny_vl import build_tiny_vision
    path = os.path.join(tempfile.gettempdir(), "paged_llm_tiny-qwen2-vl")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        build_tiny_vision(path)
    return path


def _images(n: int, size: int = 224, seed: int = 0) -> list:
    size = _IMAGE_SIZE[0] if size == 224 else size
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _prompts(tok, n: int, image_token: int, vocab: int) -> list[list[int]]:
    if tok is None:                 # a random checkpoint without tokenizer files
        import random
        rng = random.Random(0)
        top = min(vocab - 8, 150000)        # (below the special ids: Qwen's 151643+, or a small vocabulary's last)
        return [[rng.randrange(10, top) for _ in range(8)] + [image_token]
                + [rng.randrange(10, top) for _ in range(12 + i % 5)] for i in range(n)]
    questions = ["what is in this picture", "describe the colours", "how many shapes are there",
                 "is it day or night", "what would you call it", "where was this taken"]
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": [{"type": "image"},
                                                 {"type": "text", "text": f"{questions[i % 6]}? ({i})"}]}]
        out.append(tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"])
    return out


_IMAGE_SIZE = [224]
_DEVICE = ["cpu"]


def _engine_one(llm, prompt, image, tokens: int) -> tuple[float, float, list[int]]:
    """(TTFT s, decode tok/s, tokens) of one request alone, through the engine's steps."""
    from backend import SamplingParams
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt, "multi_modal_data": {"image": [image]}},
                       SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0))
    first, out = None, []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.new_token_ids and first is None:
                first = time.perf_counter()
            out += o.new_token_ids
    end = time.perf_counter()
    return first - start, (len(out) - 1) / (end - first), out


def _hf_inputs(processor, prompts, images, image_token: int, pad: int):
    import torch
    px = processor(images=images, return_tensors="pt")
    counts = (px["image_grid_thw"].prod(-1) // 4).tolist()
    rows = []
    for ids, n in zip(prompts, counts):
        rows.append([t for tok in ids for t in ([image_token] * n if tok == image_token else [tok])])
    width = max(map(len, rows))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    inputs = dict(input_ids=input_ids, attention_mask=mask, pixel_values=px["pixel_values"],
                  image_grid_thw=px["image_grid_thw"], mm_token_type_ids=(input_ids == image_token).int())
    return {k: v.to(_DEVICE[0]) for k, v in inputs.items()}


def _hf_generate(model, inputs, tokens: int) -> tuple[float, list[list[int]]]:
    import torch
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens)
    width = inputs["input_ids"].shape[1]
    return time.perf_counter() - start, [row[width:].tolist() for row in out]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--checkpoint", help="a Qwen2-VL / Qwen2.5-VL folder (default: builder tiny --vision)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--image-size", type=int, default=224, help="square images of this many pixels a side")
    a = ap.parse_args(argv)
    import torch
    import transformers as tf

    from backend import LLM, SamplingParams
    _IMAGE_SIZE[0], _DEVICE[0] = a.image_size, a.device
    path = a.checkpoint or _checkpoint()
    cfg = json.load(open(os.path.join(path, "config.json")))
    image_token = cfg["image_token_id"]
    vocab = (cfg.get("text_config") or cfg).get("vocab_size", cfg.get("vocab_size"))
    hf = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    processor = tf.AutoImageProcessor.from_pretrained(path)
    llm = LLM(path, dtype=a.dtype, device=a.device, block_size=16, num_kv_blocks=2048, max_num_seqs=a.requests,
              max_num_batched_tokens=4096)
    tok = llm.tokenizer
    prompts, images = _prompts(tok, a.requests, image_token, vocab), _images(a.requests)
    _engine_one(llm, prompts[0], images[0], 4)                              # warm-up
    _hf_generate(hf, _hf_inputs(processor, prompts[:1], images[:1], image_token, 0), 2)

    single = {"engine_ttft": [], "engine_decode": [], "hf_ttft": [], "hf_decode": []}
    differ = 0
    for rep in range(a.repeats):
        for i in range(a.requests):
            ttft, rate, out = _engine_one(llm, prompts[i], images[i], a.tokens)
            single["engine_ttft"].append(ttft)
            single["engine_decode"].append(rate)
            # transformers' times include its image processing, as the engine's do.
            start = time.perf_counter()
            inputs = _hf_inputs(processor, prompts[i:i + 1], images[i:i + 1], image_token, 0)
            processing = time.perf_counter() - start
            t1, _ = _hf_generate(hf, inputs, 1)
            t1 += processing
            tall, ref = _hf_generate(hf, inputs, a.tokens)
            tall += processing
            single["hf_ttft"].append(t1)
            single["hf_decode"].append((a.tokens - 1) / max(tall - t1, 1e-9))
            differ += rep == 0 and out != ref[0]
    med = {k: statistics.median(v) for k, v in single.items()}

    params = SamplingParams(max_tokens=a.tokens, min_tokens=a.tokens, temperature=0)
    batch = [{"prompt_token_ids": p, "multi_modal_data": {"image": [im]}} for p, im in zip(prompts, images)]
    eng_t, hf_t = [], []
    for _ in range(a.repeats):
        start = time.perf_counter()
        llm.generate(batch, params)
        eng_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        _hf_generate(hf, _hf_inputs(processor, prompts, images, image_token, 0), a.tokens)
        hf_t.append(time.perf_counter() - start)
    total = a.requests * a.tokens
    batched = {"engine_tok_s": total / statistics.median(eng_t), "hf_tok_s": total / statistics.median(hf_t)}

    cache = {}
    one = SamplingParams(max_tokens=1, temperature=0)
    for name, imgs in (("distinct", _images(a.requests, seed=1)), ("repeated", [_images(1, seed=2)[0]] * a.requests)):
        times, encoded = [], []
        for rep in range(a.repeats):
            # fresh images each repeat (another seed), so that neither run finds the cache warm
            imgs = _images(a.requests, seed=10 + rep) if name == "distinct" else [_images(1, seed=20 + rep)[0]] * a.requests
            llm.reset_prefix_cache()
            before = llm.stats()["encoder_images_encoded"]
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": [im]}}
                          for p, im in zip(prompts, imgs)], one)
            times.append(time.perf_counter() - start)
            encoded.append(llm.stats()["encoder_images_encoded"] - before)
        cache[name] = {"prefill_s": statistics.median(times), "images_encoded": encoded[0]}

    machine = (torch.cuda.get_device_name() if a.device == "cuda" else
               f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads")
    result = {"machine": f"{machine}, torch {torch.__version__}", "checkpoint": path, "dtype": a.dtype,
              "image_size": a.image_size, "requests": a.requests, "tokens": a.tokens,
              "batch1": med, "batched": batched, "encoder_cache": cache, "outputs_differing": differ}
    print(f"batch 1: TTFT engine {med['engine_ttft'] * 1e3:.1f} ms, transformers {med['hf_ttft'] * 1e3:.1f} ms "
          f"({med['hf_ttft'] / med['engine_ttft']:.2f}x); decode engine {med['engine_decode']:.1f} tok/s, "
          f"transformers {med['hf_decode']:.1f} tok/s ({med['engine_decode'] / med['hf_decode']:.2f}x)")
    print(f"{a.requests} at once: engine {batched['engine_tok_s']:.1f} tok/s, transformers "
          f"{batched['hf_tok_s']:.1f} tok/s ({batched['engine_tok_s'] / batched['hf_tok_s']:.2f}x)")
    for name, c in cache.items():
        print(f"prefill of {a.requests}, {name} images: {c['prefill_s'] * 1e3:.0f} ms, "
              f"{c['images_encoded']} images encoded")
    print(f"outputs differing from transformers: {differ} of {a.requests}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
