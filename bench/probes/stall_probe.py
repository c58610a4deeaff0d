"""How PREFILL_STALL_SECONDS trades running streams' gaps for a long prompt's first token.

`python bench/probes/stall_probe.py [--stalls 0 0.25 0.5] [--rounds 2]` starts corechat with the defaults
on the 0.5B dev model (int8) once per stall value, in turn, and runs the benchmark's scenario 8 on
each: two short streams per worker decode while a cold 512-token prompt arrives; it reports the
long prompt's first token and the streams' inter-token gaps. It prints a table and writes
bench/results/<machine>/stall.json and .md.
"""

import argparse
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import save_results, start_corechat  # noqa: E402
from bench.probes.dev_model import DEV_MODEL_DIR  # noqa: E402
from bench.run import FULL, Plan, scenario_long_prompt_arrives  # noqa: E402
from devtools.devmodel import build_dev_model  # noqa: E402
from harness import RedisServer  # noqa: E402


def main() -> None:
    """Measure scenario 8 at each stall and report them side by side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stalls", nargs="+", type=float, default=[0.0, 0.25, 0.5])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    plan = replace(Plan(model_dir=DEV_MODEL_DIR, **FULL), repetitions=2 * args.rounds)
    build_dev_model(plan.model_dir, plan.preset)
    results = {"rounds": args.rounds, "stalls": []}
    with tempfile.TemporaryDirectory(prefix="corechat-stall-") as scratch:
        scratch = Path(scratch)
        redis = RedisServer(scratch).start() if shutil.which("redis-server") else None
        try:
            for stall in args.stalls:
                server, _ = start_corechat(scratch, plan.model_dir, redis.url if redis else "",
                                           prefill_stall_seconds=stall)
                try:
                    results["stalls"].append({"prefill_stall_seconds": stall,
                                              **scenario_long_prompt_arrives(server.url, plan, server.workers)})
                finally:
                    server.stop()
        finally:
            if redis:
                redis.stop()
    lines = [f"## A cold 512-token prompt arrives while 4 streams decode (int8, defaults but the stall; "
             f"median of {args.rounds} rounds)", "",
             "| PREFILL_STALL_SECONDS | long prompt's first token | streams' inter-token p50 | streams' longest gap |",
             "|---|---|---|---|"]
    for row in results["stalls"]:
        lines.append(f"| {row['prefill_stall_seconds']:g} | {row['long_prompt_first_token_seconds']:.2f} s | "
                     f"{row['inter_token_p50_seconds'] * 1000:.0f} ms | {row['inter_token_max_seconds'] * 1000:.0f} ms |")
    save_results("stall", results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
