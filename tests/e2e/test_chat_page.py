"""The chat page in a real headless Chromium (Debian's), against real Gunicorn on the tiny model."""

import http.server
import json
import threading
import time

import pytest
import requests
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from harness import REPO, scrape, value
from tests.support import TEST_API_KEY

STATIC_DIR = REPO / "service" / "static"
ARTIFACTS = REPO / "artifacts"
# Every test runs on an emulated phone screen (headless windows cannot be narrower than 500 px),
# so the page is proven usable on a phone.
PHONE_SCREEN = {"width": 390, "height": 844, "pixelRatio": 1.0, "touch": True}
# Far more tokens than the tiny model writes in the liveness bounds below, so a stream that ends
# within them was stopped, not finished.
ENDLESS_MAX_TOKENS = 30000
STOP_BOUND_SECONDS = 15


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Start headless Chromium from Debian's packages through its chromedriver."""
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(argument)
    options.add_experimental_option("mobileEmulation", {"deviceMetrics": PHONE_SCREEN})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    yield driver
    driver.quit()


@pytest.fixture(autouse=True)
def leave_the_page(request):
    """After each test, leave the page: a reply still streaming (a test that failed before pressing
    Stop) is aborted with it, so it neither runs to its length limit nor slows the tests after."""
    yield
    if "browser" in request.fixturenames:
        request.getfixturevalue("browser").get("about:blank")


def open_page(browser, base_url: str, api_key: str | None = TEST_API_KEY) -> None:
    """Load the page with a key already kept in local storage, as after a first visit."""
    browser.get(f"{base_url}/")
    if api_key is None:
        browser.execute_script("localStorage.clear()")
    else:
        browser.execute_script("localStorage.setItem('corechat.apiKey', arguments[0])", api_key)
    browser.get(f"{base_url}/")


def set_field(browser, element_id: str, value) -> None:
    """Set a settings field as the user would leave it."""
    browser.execute_script(
        "const field = document.getElementById(arguments[0]); field.value = arguments[1];"
        "field.dispatchEvent(new Event('change'));",
        element_id,
        str(value),
    )


def send(browser, text: str) -> None:
    """Type a message and press Enter."""
    browser.find_element(By.ID, "prompt").send_keys(text, Keys.ENTER)


def last_reply(browser) -> dict:
    """Return the last reply's text, state and stats line."""
    return browser.execute_script(
        "const replies = document.querySelectorAll('.message.assistant');"
        "const reply = replies[replies.length - 1];"
        "if (!reply) return null;"
        "const stats = reply.querySelector('.stats');"
        "return {text: reply.querySelector('.content').textContent, state: reply.dataset.state,"
        "        stats: stats ? stats.textContent : null};"
    )


def wait_for(browser, condition, timeout: float = 60):
    """Wait until condition(browser) is truthy and return it."""
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(condition)


def error_text(browser, timeout: float = 30) -> str:
    """Wait for an error message and return its text."""
    element = wait_for(browser, lambda driver: driver.find_elements(By.CSS_SELECTOR, ".message.error"), timeout)
    return element[-1].text


def running_requests(server) -> int:
    """Return the server's running-requests gauge (summed over live workers), as operators see it."""
    return value(scrape(server), "corechat_requests_running")


def queue_is_empty(server) -> bool:
    """Tell whether the server's gauges show no request running or waiting."""
    samples = scrape(server)
    return value(samples, "corechat_requests_running") == value(samples, "corechat_requests_waiting") == 0


def test_tokens_appear_before_the_reply_is_complete(browser, keyed_server):
    open_page(browser, keyed_server.url)
    set_field(browser, "max-tokens", ENDLESS_MAX_TOKENS)
    send(browser, "Tell me a very long story.")
    lengths_while_streaming = set()
    deadline = time.monotonic() + 60
    while len(lengths_while_streaming) < 5 and time.monotonic() < deadline:
        reply = last_reply(browser)
        if reply and reply["state"] == "streaming" and reply["text"]:
            lengths_while_streaming.add(len(reply["text"]))
        time.sleep(0.02)
    assert len(lengths_while_streaming) >= 5, "the reply did not grow while it streamed"
    browser.find_element(By.ID, "stop").click()
    wait_for(browser, lambda driver: last_reply(driver)["state"] == "stopped")
    wait_for(browser, lambda driver: queue_is_empty(keyed_server), STOP_BOUND_SECONDS)


def test_stop_aborts_the_request_and_the_server_stops_generating(browser, keyed_server):
    open_page(browser, keyed_server.url)
    set_field(browser, "max-tokens", ENDLESS_MAX_TOKENS)
    send(browser, "Count to a million.")
    wait_for(browser, lambda driver: len((last_reply(driver) or {}).get("text", "")) > 0)
    assert running_requests(keyed_server) == 1
    browser.find_element(By.ID, "stop").click()
    stopped = wait_for(browser, lambda driver: last_reply(driver)["state"] == "stopped" and last_reply(driver))
    assert "stopped" in stopped["stats"]
    began = time.monotonic()
    while running_requests(keyed_server) != 0:
        assert time.monotonic() - began < STOP_BOUND_SECONDS, "the server kept generating after Stop"
        time.sleep(0.1)
    assert browser.find_element(By.ID, "send").is_enabled()


def test_completed_reply_shows_time_to_first_token_speed_and_finish(browser, keyed_server):
    open_page(browser, keyed_server.url)
    browser.get_log("browser")  # start with an empty console
    set_field(browser, "system-prompt", "You are terse.")
    set_field(browser, "max-tokens", 12)
    send(browser, "Hello there!")
    first = wait_for(browser, lambda driver: last_reply(driver)["state"] == "done" and last_reply(driver))
    assert "first token" in first["stats"]
    assert "tokens/s" in first["stats"]
    assert "12 tokens" in first["stats"]
    assert "finish: length" in first["stats"]
    send(browser, "And again?")
    wait_for(browser, lambda driver: len(driver.find_elements(By.CSS_SELECTOR, ".message.assistant .stats")) == 2)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".message.user")) == 2
    problems = [entry["message"] for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    assert problems == [], "the page logged errors (a content security policy violation, say)"
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "chat-page.png"))


@pytest.fixture(scope="module")
def smollm2_server(gunicorn, smollm2_gguf):
    """Serve the real SmolLM2 as `make serve MODEL=smollm2` does: its GGUF file, every other setting at its default."""
    with gunicorn(model=str(smollm2_gguf)) as server:
        yield server


def test_the_real_model_answers_a_real_question_in_words(browser, smollm2_server):
    """The demo a newcomer runs first with a real model: a question typed on the page, answered in words.

    A question whose answer float32's first token already decides: "What is the capital of France?"
    starts with a near tie in float32 itself ("The" 0.152, "L" 0.140), which int8, like q8_0, tips
    to "L'Étoile ...", while the format's faithfulness is measured over thousands of tokens
    (test_real_model.py, bench/quality.py)."""
    open_page(browser, smollm2_server.url, api_key=None)
    set_field(browser, "temperature", 0)
    send(browser, "What is 2 + 2?")
    reply = wait_for(browser, lambda driver: last_reply(driver)["state"] == "done" and last_reply(driver), 120)
    assert "4" in reply["text"]
    assert "finish: stop" in reply["stats"]
    models = requests.get(f"{smollm2_server.url}/v1/models", timeout=10).json()
    assert [model["id"] for model in models["data"]] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_wrong_api_key_shows_a_readable_401(browser, keyed_server):
    open_page(browser, keyed_server.url, api_key="sk-wrong")
    send(browser, "Hello?")
    message = error_text(browser)
    assert "401" in message and "incorrect API key provided" in message
    assert browser.find_element(By.ID, "settings").get_attribute("open") is not None
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "Hello?"


def test_api_key_entered_once_is_kept_across_visits(browser, keyed_server):
    open_page(browser, keyed_server.url, api_key=None)
    browser.find_element(By.CSS_SELECTOR, "#settings summary").click()
    browser.find_element(By.ID, "api-key").send_keys(TEST_API_KEY, Keys.TAB)
    browser.get(f"{keyed_server.url}/")
    assert browser.find_element(By.ID, "api-key").get_attribute("value") == TEST_API_KEY
    set_field(browser, "max-tokens", 2)
    send(browser, "Hi")
    wait_for(browser, lambda driver: last_reply(driver)["state"] == "done")


def test_bad_request_shows_the_servers_400_message(browser, keyed_server):
    open_page(browser, keyed_server.url)
    set_field(browser, "max-tokens", 999999)
    send(browser, "Hello?")
    message = error_text(browser)
    assert "400" in message and "above this server's limit of 32000" in message


def test_full_server_shows_a_503_with_retry_after(browser, keyed_server):
    open_page(browser, keyed_server.url)
    set_field(browser, "max-tokens", 8)
    body = {"messages": [{"role": "user", "content": "fill"}], "max_tokens": ENDLESS_MAX_TOKENS, "stream": True}
    held = []
    try:
        for _ in range(2):  # one running, one waiting: the worker takes no more
            response = requests.post(
                f"{keyed_server.url}/v1/chat/completions", json=body, stream=True, timeout=60,
                headers={"Authorization": f"Bearer {TEST_API_KEY}"},
            )
            assert response.status_code == 200
            held.append(response)
        send(browser, "Anyone there?")
        message = error_text(browser)
    finally:
        for response in held:
            response.close()
    assert "503" in message and "Try again in 1 s" in message
    wait_for(browser, lambda driver: queue_is_empty(keyed_server), STOP_BOUND_SECONDS)


def test_page_fits_a_phone_screen(browser, keyed_server):
    open_page(browser, keyed_server.url)
    layout = browser.execute_script(
        "const composer = document.getElementById('composer').getBoundingClientRect();"
        "return {overflow: document.documentElement.scrollWidth - window.innerWidth,"
        "        composerBottom: composer.bottom, height: window.innerHeight, width: window.innerWidth};"
    )
    assert layout["width"] == PHONE_SCREEN["width"]
    assert layout["overflow"] <= 0, "the page scrolls sideways on a phone"
    assert layout["composerBottom"] <= layout["height"], "the message box is off screen"
    assert browser.find_element(By.ID, "send").is_displayed()
    assert browser.find_element(By.ID, "stop").is_displayed()


# The page's rendering and parsing, driven by a scripted server -------------------------------

HOSTILE_TEXT = (
    '<script>window.__pwned = "script"</script>'
    '<img src=x onerror="window.__pwned = \'img\'; alert(1)">'
    "<b>bold?</b> & done"
)
# An error message is rendered by the page too: it carries the same markup.
IN_BAND_ERROR = {"error": {"message": f"generation failed: RuntimeError {HOSTILE_TEXT}", "type": "server_error",
                           "param": None, "code": "internal_error"}}


def scripted_sse(content_pieces: list[str], *, error: dict | None = None) -> list[bytes]:
    """Return the raw bytes of an OpenAI stream, cut into pieces at awkward places."""
    chunk = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 0, "model": "scripted"}
    opening = {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    events = [": ping\n\n", f"data: {json.dumps(opening)}\n\n"]
    for piece in content_pieces:
        events.append(f"data: {json.dumps({**chunk, 'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n")
        events.append(": ping\r\n\r\n")
    if error:
        events.append(f"data: {json.dumps(error)}\n\n")
    else:
        ending = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        events.append(f"data: {json.dumps(ending)}\n\n")
        usage = {"prompt_tokens": 3, "completion_tokens": len(content_pieces), "total_tokens": 3 + len(content_pieces)}
        events.append(f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage})}\r\n\r\n")
    events.append("data: [DONE]\n\n")
    raw = "".join(events).encode()
    # Cut every 7 bytes: inside field names, JSON, CRLF pairs and multi-byte characters alike.
    return [raw[start : start + 7] for start in range(0, len(raw), 7)]


class ScriptedHandler(http.server.BaseHTTPRequestHandler):
    """Serve the real page files, and answer chat completions with a scripted stream."""

    def log_message(self, *args):
        """Keep the test output quiet."""

    def do_GET(self):
        """Serve / and /static/* from the real static folder."""
        name = "index.html" if self.path == "/" else self.path.removeprefix("/static/")
        path = STATIC_DIR / name
        if "/" in name or not path.is_file():
            self.send_error(404)
            return
        content_type = {".html": "text/html", ".css": "text/css", ".js": "text/javascript",
                        ".svg": "image/svg+xml"}[path.suffix]
        body = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", f"{content_type}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        """Stream the hostile reply, or an in-band error when the user asks for one."""
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        wants_error = request["messages"][-1]["content"] == "fail please"
        pieces = ["Here: ", HOSTILE_TEXT[:30], HOSTILE_TEXT[30:], " — ünïcödé ✓"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("X-Cache", "hit")
        self.send_header("Connection", "close")
        self.end_headers()
        for raw in scripted_sse(pieces[:1] if wants_error else pieces, error=IN_BAND_ERROR if wants_error else None):
            self.wfile.write(raw)
            self.wfile.flush()
            time.sleep(0.002)


@pytest.fixture(scope="module")
def scripted_server():
    """Run the scripted stand-in server on loopback and return its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ScriptedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_hostile_reply_is_shown_as_text_and_never_runs(browser, scripted_server):
    """A reply carrying <script> and <img onerror> shows literally and executes nothing.

    The scripted server is a stand-in for the model: the tiny model's random weights cannot be made
    to write a chosen string, so a local server streams the hostile text through the real page's
    real fetch, SSE parsing and rendering path, in awkwardly split pieces.
    """
    open_page(browser, scripted_server, api_key=None)
    send(browser, "say something nasty")
    reply = wait_for(browser, lambda driver: last_reply(driver)["state"] == "done" and last_reply(driver), 30)
    assert reply["text"] == f"Here: {HOSTILE_TEXT} — ünïcödé ✓"
    time.sleep(0.3)  # give a broken image's onerror the moment it would need to fire
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    assert browser.execute_script("return window.__pwned === undefined")
    assert browser.find_elements(By.CSS_SELECTOR, "#conversation img, #conversation script, #conversation b") == []
    assert "cache hit" in reply["stats"]
    assert "4 tokens" in reply["stats"] and "finish: stop" in reply["stats"]


def test_in_band_stream_error_is_shown_as_text_and_never_runs(browser, scripted_server):
    open_page(browser, scripted_server, api_key=None)
    send(browser, "fail please")
    assert f"failed mid-reply: generation failed: RuntimeError {HOSTILE_TEXT}" in error_text(browser)
    time.sleep(0.3)  # give a broken image's onerror the moment it would need to fire
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text
    assert browser.execute_script("return window.__pwned === undefined")
    assert browser.find_elements(By.CSS_SELECTOR, "#conversation img, #conversation script, #conversation b") == []


def test_sse_parser_gives_the_same_events_however_the_bytes_are_split(browser, scripted_server):
    open_page(browser, scripted_server, api_key=None)
    stream = "".join(piece.decode("latin-1") for piece in scripted_sse(["a", "é✓\nz", "b"]))
    stream += "event: custom\ndata: line one\ndata:line two\r\n\r\ndata: no end"
    outcome = browser.execute_script(
        """
        const bytes = Uint8Array.from(arguments[0], (char) => char.charCodeAt(0));
        function parse(cuts) {
          const seen = [];
          const parser = new SSEParser((event) => seen.push(event), (comment) => seen.push({comment}));
          let start = 0;
          for (const cut of [...cuts, bytes.length]) { parser.push(bytes.slice(start, cut)); start = cut; }
          parser.end();
          return JSON.stringify(seen);
        }
        const whole = parse([]);
        const differing = [];
        for (let cut = 1; cut < bytes.length; cut++) {
          if (parse([cut]) !== whole) differing.push(cut);
        }
        const everyByte = parse(Array.from({length: bytes.length - 1}, (_, index) => index + 1));
        return {whole: JSON.parse(whole), differing, everyByteSame: everyByte === whole};
        """,
        stream,
    )
    assert outcome["differing"] == []
    assert outcome["everyByteSame"]
    events = outcome["whole"]
    assert events[0] == {"comment": "ping"}
    data = [event["data"] for event in events if "data" in event]
    assert json.loads(data[2])["choices"][0]["delta"]["content"] == "é✓\nz"
    assert data[-2] == "[DONE]"
    assert events[-1] == {"type": "custom", "data": "line one\nline two"}


CROSS_ORIGIN_FETCH = """
const [url, key, done] = arguments;
fetch(url, {
  method: "POST",
  headers: {"Content-Type": "application/json", Authorization: `Bearer ${key}`},
  body: JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 2, stream: true}),
}).then(async (response) => done({status: response.status, body: await response.text()}))
  .catch((error) => done({failed: String(error)}));
"""


def test_cors_lets_an_allowed_origin_call_the_api_and_refuses_others(browser, scripted_server, gunicorn):
    """A real browser's preflight and cross-origin stream: 127.0.0.1:port is allowed, localhost:port is not."""
    api = gunicorn(workers=1, api_keys=TEST_API_KEY, cors_origins=scripted_server, warmup=False).start()
    try:
        url = f"{api.url}/v1/chat/completions"
        open_page(browser, scripted_server, api_key=None)
        allowed = browser.execute_async_script(CROSS_ORIGIN_FETCH, url, TEST_API_KEY)
        assert allowed.get("status") == 200, allowed
        assert allowed["body"].rstrip().endswith("data: [DONE]")
        wrong_key = browser.execute_async_script(CROSS_ORIGIN_FETCH, url, "sk-wrong")
        assert wrong_key.get("status") == 401 and "incorrect API key provided" in wrong_key["body"]
        other_origin = scripted_server.replace("127.0.0.1", "localhost")
        open_page(browser, other_origin, api_key=None)
        assert browser.execute_script("return location.origin") == other_origin
        assert browser.find_elements(By.ID, "composer"), "the page did not load from the other origin"
        refused = browser.execute_async_script(CROSS_ORIGIN_FETCH, url, TEST_API_KEY)
        assert "failed" in refused, refused
    finally:
        api.stop()
    assert '"OPTIONS /v1/chat/completions HTTP/1.1" 403' in api.log(), "the refusal was not the preflight's"
