"""The benchmark's llama.cpp glue that runs without building llama.cpp: its command line, cache keys,
the client on llama-server's stream, and the side-by-side table."""

import http.server
import threading

import pytest

from bench.comparison import peer_ratios, render_peer_table
from bench.peer import cpu_flags_key, model_key, server_command, shown_command
from bench.run import stream_chat

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


def server_results(first_token: float, decode: float, tokens_per_second: dict, p95_five: float, pss: int,
                   prompt_tokens: int) -> dict:
    """Return the parts of one server's benchmark results that the comparison reads."""
    return {
        "prompt_tokens": prompt_tokens,
        "scenario_1_short_prompt": {"first_token_p50_seconds": first_token, "decode_tokens_per_second": decode},
        "scenario_3_concurrency": {
            streams: {"aggregate_tokens_per_second": rate, "first_token_p95_seconds": p95_five}
            for streams, rate in tokens_per_second.items()
        },
        "scenario_5_memory": {"pss": pss},
    }


def test_the_table_gives_each_corechat_figure_as_a_ratio_to_llama_cpps():
    """Ratios are corechat over llama.cpp, per quantization, and a template mismatch is called out."""
    results = server_results(0.1, 30.0, {"4": 120.0, "5": 130.0, "8": 160.0}, 0.3, 1_200_000_000, 41)
    results["peer"] = {
        "q8_0": {**server_results(0.05, 60.0, {"4": 80.0, "5": 90.0, "8": 100.0}, 0.2, 800_000_000, 41),
                 "command": "llama-server --model model-q8_0.gguf"},
        "q4_0": {**server_results(0.2, 15.0, {"4": 240.0, "5": 250.0, "8": 320.0}, 0.6, 600_000_000, 40),
                 "command": "llama-server --model model-q4_0.gguf"},
    }
    ratios = peer_ratios(results)
    assert ratios["q8_0"] == pytest.approx({"first_token": 2.0, "decode": 0.5, "four_streams": 1.5,
                                            "eight_streams": 1.6, "five_streams_first_token_p95": 1.5, "pss": 1.5})
    assert ratios["q4_0"]["decode"] == pytest.approx(2.0)
    table = render_peer_table(results)
    assert "| decode, one stream | 30.0 tok/s | 60.0 tok/s | 0.50x | 15.0 tok/s | 2.00x |" in table
    assert "| PSS of all processes | 1.200 GB | 0.800 GB | 1.50x | 0.600 GB | 2.00x |" in table
    assert "**The prompts differ**" in table and "40 (q4_0)" in table
    results["peer"]["q4_0"]["prompt_tokens"] = 41
    assert "the same chat template and tokenizer" in render_peer_table(results)
