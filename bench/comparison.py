"""corechat's figures as ratios to llama.cpp's, measured in the same benchmark run (`bench/run.py --peer`)."""

# (key, what it is, how to read it, how to get it from a server's results), in the order the table prints.
FIGURES = (
    ("first_token", "first token, one stream (p50)", "s",
     lambda r: r["scenario_1_short_prompt"]["first_token_p50_seconds"]),
    ("decode", "decode, one stream", "tok/s",
     lambda r: r["scenario_1_short_prompt"]["decode_tokens_per_second"]),
    ("four_streams", "aggregate at 4 streams", "tok/s",
     lambda r: r["scenario_3_concurrency"]["4"]["aggregate_tokens_per_second"]),
    ("eight_streams", "aggregate at 8 streams", "tok/s",
     lambda r: r["scenario_3_concurrency"]["8"]["aggregate_tokens_per_second"]),
    ("five_streams_first_token_p95", "first token p95 at 5 streams", "s",
     lambda r: r["scenario_3_concurrency"]["5"]["first_token_p95_seconds"]),
    ("pss", "PSS of all processes", "GB",
     lambda r: r["scenario_5_memory"]["pss"] / 1e9),
)


def figures_of(results: dict) -> dict[str, float]:
    """Return the compared figures of one server's results."""
    return {key: get(results) for key, _, _, get in FIGURES}


def peer_ratios(results: dict) -> dict[str, dict[str, float]]:
    """Return corechat's figure over llama.cpp's, per llama.cpp quantization and figure."""
    ours = figures_of(results)
    ratios = {}
    for quantization, peer in results["peer"].items():
        theirs = figures_of(peer)
        ratios[quantization] = {key: ours[key] / theirs[key] if theirs[key] else 0.0 for key in ours}
    return ratios


def template_note(results: dict) -> str:
    """Say whether llama.cpp made as many prompt tokens of the same chat as corechat (the same template)."""
    ours = results["prompt_tokens"]
    differing = {name: peer["prompt_tokens"] for name, peer in results["peer"].items() if peer["prompt_tokens"] != ours}
    if not differing:
        return f"Both render the short chat into {ours} prompt tokens: the same chat template and tokenizer."
    theirs = ", ".join(f"{count} ({name})" for name, count in differing.items())
    return (f"**The prompts differ**: corechat renders the short chat into {ours} prompt tokens, llama.cpp into "
            f"{theirs}; first-token figures compare prompts of different lengths.")


def render_peer_table(results: dict) -> str:
    """Render the side-by-side table: each corechat figure, llama.cpp's, and their ratio."""
    ours = figures_of(results)
    peers = {name: figures_of(peer) for name, peer in results["peer"].items()}
    ratios = results.get("peer_ratios") or peer_ratios(results)
    header = "| | corechat | " + " | ".join(f"llama.cpp {name} | ratio" for name in peers) + " |"
    lines = [
        "### corechat against llama.cpp's llama-server, same run, same model folder, same client",
        "",
        "ratio = corechat / llama.cpp: above 1 is better for tok/s, below 1 is better for seconds and GB.",
        "",
        header,
        "|---|---|" + "---|---|" * len(peers),
    ]
    for key, label, unit, _ in FIGURES:
        decimals = 3 if unit in ("s", "GB") else 1
        cells = [f"{peers[name][key]:.{decimals}f} {unit} | {ratios[name][key]:.2f}x" for name in peers]
        lines.append(f"| {label} | {ours[key]:.{decimals}f} {unit} | " + " | ".join(cells) + " |")
    lines += ["", template_note(results), ""]
    lines += [f"llama-server {name}: `{peer['command']}`" for name, peer in results["peer"].items()]
    return "\n".join(lines) + "\n"
