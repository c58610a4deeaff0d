"""Measurements that need torch, run in their own process so the benchmark client stays light
(bench.probes.run_probe runs them):

    python -m bench.probes bandwidth --megabytes 1024 --threads 2
    python -m bench.probes baseline MODEL_DIR --threads 2 --max-tokens 64 --repetitions 5 --prompt TEXT

Each prints one JSON object on stdout.
"""

import argparse
import json
import threading
import time

import torch

BANDWIDTH_ROUNDS = 7


def measure_read_bandwidth(megabytes: int, threads: int) -> dict:
    """Sum a large float32 tensor on `threads` threads; return the best read bandwidth in bytes/s."""
    torch.set_num_threads(threads)
    data = torch.ones(megabytes * 1024 * 1024 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(BANDWIDTH_ROUNDS):
        began = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - began)
    return {"bytes": data.numel() * 4, "threads": threads, "best_seconds": best, "bytes_per_second": data.numel() * 4 / best}


class TimedStreamer:
    """A generate() streamer that records when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.token_times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        """Record the arrival of new tokens."""
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.token_times.extend([time.perf_counter()] * value.numel())

    def end(self) -> None:
        """Nothing to flush."""


def measure_baseline(model_dir: str, threads: int, max_tokens: int, repetitions: int, prompt: str) -> dict:
    """Time plain transformers generate() with a streamer, bf16, as the field reports ran it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    torch.set_num_threads(threads)
    load_began = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    load_seconds = time.perf_counter() - load_began
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt")
    runs = []
    for _ in range(repetitions + 1):
        streamer = TimedStreamer()
        # A TextIteratorStreamer drained by a thread, as a server built on generate() streams.
        text_streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        drain = threading.Thread(target=lambda: [None for _ in text_streamer])
        drain.start()
        began = time.perf_counter()
        model.generate(
            **inputs,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            streamer=_Both(streamer, text_streamer),
        )
        drain.join()
        times = streamer.token_times
        runs.append(
            {
                "first_token_seconds": times[0] - began,
                "decode_tokens_per_second": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0,
            }
        )
    return {
        "threads": threads,
        "prompt_tokens": int(inputs["input_ids"].shape[1]),
        "max_tokens": max_tokens,
        "load_seconds": load_seconds,
        "cold_run": runs[0],
        "runs": runs[1:],
    }


class _Both:
    """Fan one generate() stream out to two streamers."""

    def __init__(self, *streamers):
        self.streamers = streamers

    def put(self, value) -> None:
        """Pass new tokens on."""
        for streamer in self.streamers:
            streamer.put(value)

    def end(self) -> None:
        """Pass the end on."""
        for streamer in self.streamers:
            streamer.end()


def main() -> None:
    """Run the probe named on the command line and print its JSON."""
    parser = argparse.ArgumentParser(prog="python -m bench.probes")
    sub = parser.add_subparsers(dest="probe", required=True)
    bandwidth = sub.add_parser("bandwidth")
    bandwidth.add_argument("--megabytes", type=int, default=1024)
    bandwidth.add_argument("--threads", type=int, required=True)
    baseline = sub.add_parser("baseline")
    baseline.add_argument("model_dir")
    baseline.add_argument("--threads", type=int, required=True)
    baseline.add_argument("--max-tokens", type=int, default=64)
    baseline.add_argument("--repetitions", type=int, default=3)
    baseline.add_argument("--prompt", required=True)
    args = parser.parse_args()
    if args.probe == "bandwidth":
        result = measure_read_bandwidth(args.megabytes, args.threads)
    else:
        result = measure_baseline(args.model_dir, args.threads, args.max_tokens, args.repetitions, args.prompt)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
