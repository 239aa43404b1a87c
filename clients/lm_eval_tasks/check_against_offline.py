"""lm-evaluation-harness' logged samples (`--log_samples`) of the tasks in this folder,
checked against the offline engine on the same checkpoint: each loglikelihood equals the
sum of the offline engine's prompt logprobs over the continuation's tokens, and each
generate_until answer equals its greedy completion (16 tokens, stopped at a newline).

    .venv/bin/python -m clients.lm_eval_tasks.check_against_offline OUTPUT_DIR CHECKPOINT

(docs/evaluation.md). Exits non-zero on a difference above 1e-4 or a different text.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from backend import LLM, SamplingParams


def samples(output_dir: str, task: str) -> list[dict]:
    paths = sorted(glob.glob(os.path.join(output_dir, "**", f"samples_{task}_*.jsonl"), recursive=True))
    if not paths:
        raise SystemExit(f"no samples of {task} under {output_dir} (run lm_eval with --log_samples)")
    with open(paths[-1]) as f:
        return [json.loads(line) for line in f]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("checkpoint")
    args = parser.parse_args()
    llm = LLM(args.checkpoint)
    tok = llm.tokenizer
    worst, count = 0.0, 0
    for sample in samples(args.output_dir, "paged_llm_mc"):
        for key, pair in sample["arguments"].items():
            context, continuation = pair["arg_0"], pair["arg_1"]
            # As lm-eval's _encode_pair: the whole text encoded, split after the context's tokens.
            whole = tok.encode(context + continuation, add_special_tokens=False)
            start = len(tok.encode(context, add_special_tokens=False))
            out = llm.generate(whole, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
            want = sum(out.prompt_logprobs[i][whole[i]].logprob for i in range(start, len(whole)))
            got = float(sample["resps"][int(key.rsplit("_", 1)[1])][0][0])
            worst, count = max(worst, abs(want - got)), count + 1
    print(f"paged_llm_mc: {count} loglikelihoods, largest difference from the offline engine {worst:.1e}")
    same = total = 0
    for sample in samples(args.output_dir, "paged_llm_gen"):
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        text = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, stop=["\n"]))[0].text
        same, total = same + (text == sample["resps"][0][0]), total + 1
    print(f"paged_llm_gen: {same} of {total} answers equal the offline engine's greedy completions")
    return 0 if worst <= 1e-4 and same == total else 1


if __name__ == "__main__":
    sys.exit(main())
