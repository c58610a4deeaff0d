"""The benchmark's llama.cpp glue that runs without building llama.cpp: its command line, cache keys,
the client on llama-server's stream, and the side-by-side table."""

import http.server
import json
import threading

import pytest

from bench.peer import cpu_flags_key, model_key, server_command, shown_command
from bench.versus import default_sampling, render
from harness import stream_chat

# What llama-server (llama.cpp b1-0c1e570, vendored by llama-cpp-python 0.3.36) streamed for a
# 4-token greedy reply on the tiny model, with include_usage; ids, paths and timings shortened.
LLAMA_SERVER_STREAM = b"""\
data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1,"id":"c","model":"m","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}

data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\n"}}],"created":1,"id":"c","model":"m","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}

data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\n"}}],"created":1,"id":"c","model":"m","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}

data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\n"}}],"created":1,"id":"c","model":"m","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}

data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\\n"}}],"created":1,"id":"c","model":"m","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}

data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1,"id":"c","model":"m","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}

data: {"choices":[],"created":1,"id":"c","model":"m","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk","usage":{"completion_tokens":4,"prompt_tokens":41,"total_tokens":45,"prompt_tokens_details":{"cached_tokens":0}},"timings":{"cache_n":0,"prompt_n":41,"prompt_ms":7.4,"predicted_n":4,"predicted_ms":19.9}}

data: [DONE]

"""  # noqa: E501 (verbatim)


@pytest.fixture()
def recorded_llama_server():
    """Serve the recorded stream over real HTTP: a stand-in, since CI does not build llama.cpp."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            """Answer any chat completion with the recorded stream."""
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(LLAMA_SERVER_STREAM)

        def log_message(self, *args):
            """Keep the test output quiet."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_bench_client_reads_llama_servers_stream(recorded_llama_server):
    """Tokens, prompt tokens (the template check) and completion tokens come out of llama-server's chunks."""
    result = stream_chat(recorded_llama_server, [{"role": "user", "content": "hi"}], 4)
    assert result.error == ""
    assert (result.prompt_tokens, result.completion_tokens) == (41, 4)
    assert len(result.gaps) == 3
    assert 0 < result.first_token_seconds <= result.total_seconds


def test_llama_server_gets_corechats_threads_slots_and_context(tmp_path):
    """Each of the parallel slots gets the whole per-sequence context, as each corechat sequence does."""
    command = server_command(tmp_path / "llama-server", tmp_path / "model-q8_0.gguf", port=8123, threads=2, slots=8,
                             context_per_slot=4096)
    options = dict(zip(command[1::2], command[2::2]))
    assert options["--threads"] == options["--threads-batch"] == "2"
    assert options["--parallel"] == "8"
    assert options["--ctx-size"] == str(8 * 4096)
    assert options["--host"] == "127.0.0.1" and options["--port"] == "8123"
    assert shown_command(command).startswith("llama-server --model model-q8_0.gguf ")


def test_build_key_follows_the_cpu_flags_and_conversion_key_follows_the_model(tmp_path):
    """A native build is redone on a CPU with other flags; a rebuilt model folder is converted again."""
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2\n"
    assert cpu_flags_key(avx2) == cpu_flags_key("processor\t: 0\nflags\t\t: avx2 sse2 fpu\n")
    assert cpu_flags_key(avx2) != cpu_flags_key("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).write_text("{}")
    before = model_key(tmp_path)
    (tmp_path / "model.safetensors").write_text("{} ")
    assert model_key(tmp_path) != before


def figures(decode: float, first_850: float, pss: int, prompt_tokens: int) -> dict:
    """Return one server's figures of one round, as bench/versus.py measures them."""
    return {"decode_tokens_per_second": decode, "aggregate_4_tokens_per_second": 2 * decode,
            "aggregate_8_tokens_per_second": 3 * decode, "short_first_token_seconds": 0.1,
            "prompt_850_first_token_seconds": first_850, "prompt_5000_first_token_seconds": 6 * first_850,
            "short_prompt_tokens": prompt_tokens, "pss_bytes": pss, "errors": []}


def int8_results(rounds: list[dict], **extra) -> dict:
    """Return a versus.py results record of int8 rounds on a machine of 40 GB/s and 0.5 GB a token."""
    return {"formats": ["int8"], "rounds": rounds, "sizes": {}, "weight_bytes_per_token": {"int8": 0.5e9},
            "machine_probes": {"read_bytes_per_second": 40e9, "threads": 2,
                               "peak_multiply_adds_per_second": {"avx2": 2e11}}, **extra}


def test_the_table_gives_medians_over_rounds_and_each_rounds_ratio_to_llama_cpp():
    """Medians with their range over the rounds, corechat over llama.cpp per round, a template mismatch called out."""
    theirs = [figures(decode, 2.0, 800_000_000, 41) for decode in (40.0, 40.0, 50.0)]
    mine = [figures(decode, first, 1_200_000_000, 41) for decode, first in ((48.0, 1.0), (60.0, 1.2), (50.0, 0.8))]
    rounds = [{"corechat int8": ours, "llama.cpp int8": peer} for ours, peer in zip(mine, theirs, strict=True)]
    results = int8_results(rounds)
    table = render("test", results)
    assert "| decode, one stream (tok/s) | 50.0 (48.0-60.0) | 40.0 (40.0-50.0) | 1.20x, 1.50x, 1.00x |" in table
    assert "| first token, ~850-token prompt (s) | 1.00 (0.80-1.20) | 2.00 (2.00-2.00) | 0.50x, 0.60x, 0.40x |" in table
    assert "| PSS of all processes (GB) | 1.20 (1.20-1.20) | 0.80 (0.80-0.80) | 1.50x, 1.50x, 1.50x |" in table
    assert "the same template and tokenizer" in table and "Read bandwidth 40.0 GB/s" in table
    assert "reads 0.62 of the read bandwidth" in table  # 50 tokens/s of 80 at 40 GB/s and 0.5 GB a token
    rounds[1]["llama.cpp int8"]["short_prompt_tokens"] = 40
    assert "**The prompts differ** ([40, 41] tokens" in render("test", results)


def test_the_table_names_the_peer_that_ran():
    """A run beside ik_llama.cpp titles its sections, columns and ratios with it and says what was built."""
    rounds = [{"corechat int8": figures(50.0, 1.0, 1_200_000_000, 41),
               "ik_llama.cpp int8": figures(40.0, 2.0, 800_000_000, 41)}]
    results = int8_results(rounds, peer={"name": "ik_llama.cpp", "version": "8337e4cd3861",
                                         "options": "--webui none --jinja -rtr"})
    table = render("test", results)
    assert "## corechat int8 vs ik_llama.cpp q8_0" in table
    assert "| measurement | corechat int8 | ik_llama.cpp q8_0 | corechat / ik_llama.cpp, per round |" in table
    assert "| decode, one stream (tok/s) | 50.0 | 40.0 | 1.25x |" in table
    assert "ik_llama.cpp: 8337e4cd3861, served with --webui none --jinja -rtr." in table
    assert " llama.cpp q8_0" not in table.replace("ik_llama.cpp", "")


def test_a_native_build_on_a_cpu_with_amx_leaves_amx_out():
    """llama.cpp's AMX products crash its server on an AMX CPU: there a native build is compiled without AMX
    (the compiler's -mno-amx-* outrank -march=native); elsewhere, and with --isa avx2, nothing changes."""
    from bench.peer import ISA_OPTIONS, WITHOUT_AMX, cmake_isa_options, leaves_out_amx

    with_amx = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16\n"
    without = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n"
    assert leaves_out_amx("native", with_amx) and cmake_isa_options("native", with_amx) == (*ISA_OPTIONS["native"],
                                                                                           *WITHOUT_AMX)
    assert not leaves_out_amx("native", without) and cmake_isa_options("native", without) == ISA_OPTIONS["native"]
    assert cmake_isa_options("avx2", with_amx) == ISA_OPTIONS["avx2"]
    assert all("-mno-amx-int8" in option for option in WITHOUT_AMX)


def test_the_table_gives_what_default_sampling_costs_each_server_over_greedy(tmp_path):
    """The sampled decode (the model's generation_config, sent to llama-server as its fields) beside greedy."""
    rounds = []
    for sampled_ours, sampled_theirs in ((45.0, 38.0), (46.0, 39.0)):
        ours, theirs = figures(50.0, 1.0, 1_200_000_000, 41), figures(40.0, 2.0, 800_000_000, 41)
        ours["sampled_decode_tokens_per_second"] = sampled_ours
        theirs["sampled_decode_tokens_per_second"] = sampled_theirs
        rounds.append({"corechat int8": ours, "llama.cpp int8": theirs})
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}))
    sampling = default_sampling(tmp_path)
    assert sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repeat_penalty": 1.05, "min_p": 0}
    table = render("test", int8_results(rounds, default_sampling=sampling))
    row = "| decode, one stream, default sampling (tok/s) | 45.5 (45.0-46.0) | 38.5 (38.0-39.0) | 1.18x, 1.18x |"
    assert row in table
    assert "against greedy, one stream's decode time (median over rounds): corechat 1.099x; llama.cpp 1.039x." in table
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert default_sampling(tmp_path) == {"temperature": 0}
