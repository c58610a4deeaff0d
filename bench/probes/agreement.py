"""How far each weight format's logits are from float32's, on the 0.5B dev model.

`python bench/probes/agreement.py [--tokens 24]` loads the dev model in float32 (the reference) and in every
other DTYPE the engine serves (bfloat16, int8, int4), and feeds each the same token sequences as the engine
does: one prompt pass, then one token per step with the KV cache, the tokens being float32's greedy
choices (teacher forcing, so an early disagreement does not change what is compared later). For the
logits of the prompt pass's last position and of every step it reports the relative error
(|l - l_fp32| / |l_fp32|) and the top-1 agreement with float32. It prints a table and writes
bench/results/<machine>/agreement.json and .md.

The dev model has random weights: its logits are nearly flat, so near-ties make top-1 agreement
look worse than on a trained model, and no figure here is a quality figure for real weights.
"""

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from bench import save_results  # noqa: E402
from bench.probes.dev_model import load_dev_model  # noqa: E402

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about memory bandwidth.",
    "What is the capital of Australia?",
    "Translate 'good morning, how are you?' into French and German.",
    "List three differences between TCP and UDP. " * 4,
    "Summarize the following text. " + "Servers stream tokens to clients as server-sent events. " * 20,
]
FORMATS = ["bfloat16", "int8", "int4"]


def run(model, prompt_ids: list[int], forced: list[int] | None, tokens: int) -> tuple[list[torch.Tensor], list[int]]:
    """Prompt pass then single-token steps; return each call's last logits and the tokens fed."""
    cache = DynamicCache(config=model.config)
    logits_seen, fed = [], []
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True, logits_to_keep=1).logits
        for step in range(tokens):
            logits_seen.append(logits[0, -1].float())
            token = forced[step] if forced else int(torch.argmax(logits[0, -1]))
            fed.append(token)
            logits = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True, logits_to_keep=1).logits
    return logits_seen, fed


def main() -> None:
    """Compare every variant with float32 and report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=24, help="logits compared per prompt")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reference, tokenizer = load_dev_model("float32")
    prompts = [
        tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        for text in PROMPTS
    ]
    references = [run(reference, ids, None, args.tokens) for ids in prompts]
    del reference
    results = {"prompt_tokens": [len(ids) for ids in prompts], "tokens_per_prompt": args.tokens, "variants": {}}
    for name in FORMATS:
        model, _ = load_dev_model(name)
        errors, agreements, first_errors = [], [], []
        for ids, (expected, fed) in zip(prompts, references, strict=True):
            seen, _ = run(model, ids, fed, args.tokens)
            for position, (got, want) in enumerate(zip(seen, expected, strict=True)):
                error = float((got - want).norm() / want.norm())
                errors.append(error)
                agreements.append(int(torch.argmax(got)) == int(torch.argmax(want)))
                if position == 0:
                    first_errors.append(error)
        results["variants"][name] = {
            "relative_error_mean": statistics.fmean(errors),
            "relative_error_first_token_mean": statistics.fmean(first_errors),
            "top1_agreement": sum(agreements) / len(agreements),
        }
        del model
    rows = ["| format | relative logits error (all / first token) | top-1 agreement with float32 |", "|---|---|---|"]
    for name, figures in results["variants"].items():
        rows.append(f"| {name} | {figures['relative_error_mean']:.3f} / {figures['relative_error_first_token_mean']:.3f} | "
                    f"{figures['top1_agreement']:.3f} |")
    table = (f"## Agreement with float32: qwen2.5-0.5b dev model (random weights), {len(prompts)} prompts of "
             f"{min(results['prompt_tokens'])}-{max(results['prompt_tokens'])} tokens, {args.tokens} positions each\n\n"
             + "\n".join(rows) + "\n")
    save_results("agreement", results, table)


if __name__ == "__main__":
    main()
