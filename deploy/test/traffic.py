"""Continuous client traffic for deploy/test/run.py, run inside the test machine (standard library only).

    python3 traffic.py OUT STOP_FILE [--via NAME=[https://]HOST:PORT ...] [--clients KIND=COUNT ...]

Each client sends one kind of request in a loop, each on a fresh connection, until STOP_FILE exists,
and appends one JSON line per request to OUT: when it began, when its response began and ended
(wall-clock seconds, which the host shares), its status, whether it completed, or the error.
Kinds: `stream` (a short SSE stream), `whole` (a two-token reply), `long` (a stream of a few
seconds, for drains) and `probe` (GET /healthz, for refused connections). An `https://` address is
reached over TLS, trusting the certificate install.sh made (nginx serves HTTPS only); its clients
pace themselves to stay together under the shipped site's limit of 10 requests a second per address.
"""

import argparse
import http.client
import json
import os
import ssl
import threading
import time

PROMPT = [{"role": "user", "content": "Count from one to ten."}]
BODIES = {
    "stream": {"messages": PROMPT, "max_tokens": 32, "stream": True},
    "whole": {"messages": PROMPT, "max_tokens": 2},
    "long": {"messages": PROMPT, "max_tokens": 1500, "stream": True},
}
TIMEOUT_SECONDS = 120
PROBE_INTERVAL_SECONDS = 0.05
CERTIFICATE = "/etc/corechat/tls/fullchain.pem"
# Between the starts of one client's requests over TLS: the test's four such clients then send at
# most 8 a second, under nginx's limit_req rate.
TLS_REQUEST_INTERVAL_SECONDS = 0.5


def send(kind: str, host: str, port: int, tls: ssl.SSLContext | None) -> dict:
    """Send one request and describe how it went."""
    result = {"kind": kind, "began": time.time()}
    if tls is None:
        connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_SECONDS)
    else:
        connection = http.client.HTTPSConnection(host, port, timeout=TIMEOUT_SECONDS, context=tls)
    try:
        if kind == "probe":
            connection.request("GET", "/healthz", headers={"Connection": "close"})
        else:
            connection.request("POST", "/v1/chat/completions", body=json.dumps(BODIES[kind]),
                               headers={"Content-Type": "application/json", "Connection": "close",
                                        "Cache-Control": "no-cache"})
        response = connection.getresponse()
        result["first_byte"] = time.time()
        result["status"] = response.status
        text = response.read().decode(errors="replace")
        if kind in ("stream", "long"):
            result["complete"] = text.rstrip().endswith("data: [DONE]") and '"finish_reason":"' in text
        elif kind == "whole":
            result["complete"] = '"finish_reason":"' in text
        else:
            result["complete"] = response.status == 200
    except ConnectionRefusedError:
        result["error"] = "refused"
    except (OSError, http.client.HTTPException) as error:
        result["error"] = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    result["ended"] = time.time()
    return result


def client(kind: str, via: str, address: str, out, lock: threading.Lock, stop_file: str) -> None:
    """Send requests of one kind until the stop file appears."""
    tls = ssl.create_default_context(cafile=CERTIFICATE) if address.startswith("https://") else None
    host, port = address.removeprefix("https://").rsplit(":", 1)
    while not os.path.exists(stop_file):
        result = send(kind, host, int(port), tls) | {"via": via}
        with lock:
            out.write(json.dumps(result) + "\n")
            out.flush()
        if tls is not None:
            time.sleep(max(0.0, result["began"] + TLS_REQUEST_INTERVAL_SECONDS - time.time()))
        elif kind == "probe" or "error" in result:
            time.sleep(PROBE_INTERVAL_SECONDS)


def main() -> None:
    """Run the clients until told to stop."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("stop_file")
    parser.add_argument("--via", action="append", default=[], help="NAME=HOST:PORT; every client kind runs on each")
    parser.add_argument("--clients", action="append", default=[], help="KIND=COUNT")
    args = parser.parse_args()
    lock = threading.Lock()
    with open(args.out, "a") as out:
        threads = [
            threading.Thread(target=client, args=(kind, via, address, out, lock, args.stop_file))
            for via, address in (item.split("=", 1) for item in args.via)
            for kind, count in (item.split("=", 1) for item in args.clients)
            for _ in range(int(count))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


if __name__ == "__main__":
    main()
