"""Split a reply's text into content and OpenAI tool calls, as it streams.

Qwen2.5 (and the Hermes format many models share) writes each call as
`<tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>`. The parser turns those blocks into
`tool_calls` deltas (the id and name first, then argument pieces as they arrive) and passes the
rest on as content, without the whitespace that only separates blocks. A block that does not parse
is shown as the text the model wrote.
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from . import nesting

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The start of a block whose arguments can stream: the name, then the arguments value.
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    """Return a fresh tool call id in OpenAI's style."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _prefix_overlap(text: str, marker: str) -> int:
    """Return the length of the longest end of `text` that begins `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


@dataclass
class _OpenCall:
    """A block being read: its text so far and how much of its arguments went out."""

    text: str = ""
    header_end: int | None = None  # where the arguments value starts, once the name is known
    sent: int = 0  # characters of the arguments value sent so far


@dataclass
class ToolCallParser:
    """Turn text pieces into (content, tool-call deltas) pieces; `finish` flushes what was held back."""

    calls: list[dict] = field(default_factory=list)  # one {"id", "name"} per call sent
    _pending: str = ""
    _space: str = ""  # whitespace held back: dropped if a block follows it
    _after_call: bool = False
    _open: _OpenCall | None = None

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Take the next piece of text; return the content and tool-call deltas it completes."""
        self._pending += text
        content, deltas = [], []
        while self._pending:
            if self._open is None:
                start = self._pending.find(OPEN)
                if start < 0:
                    keep = _prefix_overlap(self._pending, OPEN)
                    content.append(self._text(self._pending[: len(self._pending) - keep]))
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                content.append(self._text(self._pending[:start]))
                self._space = ""
                self._pending, self._open = self._pending[start + len(OPEN) :], _OpenCall()
            else:
                self._open.text += self._pending
                self._pending = ""
                end = self._open.text.find(CLOSE)
                if end < 0:
                    deltas.extend(self._stream_arguments())
                    break
                self._pending = self._open.text[end + len(CLOSE) :]
                closed, self._open.text = self._open, self._open.text[:end]
                self._open = None
                made, shown = self._close(closed)
                deltas.extend(made)
                content.append(self._text(shown))
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict]]:
        """Return what is left at the end of the reply: held-back text, or the rest of an unclosed block."""
        content, deltas = "", []
        if self._open is not None:
            call = self._open
            if call.header_end is not None:
                deltas.append(self._arguments_piece(call.text[call.header_end + call.sent :]))
            else:
                content = self._text(OPEN + call.text)
        content += self._text(self._pending)
        if not self.calls:
            content += self._space
        self._pending, self._space, self._open = "", "", None
        return content, deltas

    def _text(self, text: str) -> str:
        """Return text to show as content, holding back trailing whitespace and dropping it next to blocks."""
        if not text:
            return ""
        combined = self._space + text
        body = combined.rstrip()
        self._space = combined[len(body) :]
        if body and self._after_call:
            body, self._after_call = body.lstrip(), False
        return body

    def _stream_arguments(self) -> list[dict]:
        """Send the header once the name is known, then the arguments except what may be the block's end."""
        call, deltas = self._open, []
        if call.header_end is None:
            match = HEADER.match(call.text)
            # Wait for the value's first character, so whitespace before it is not taken for arguments.
            if match is None or match.end() == len(call.text):
                return deltas
            try:
                name = json.loads(f'"{match.group(1)}"')
            except ValueError:
                return deltas
            call.header_end = match.end()
            deltas.append(self._header(name, ""))
        arguments = call.text[call.header_end :]
        # The block's closing brace, whitespace and the start of CLOSE may follow: hold them back.
        tail = arguments.rstrip()
        held_close = _prefix_overlap(tail, CLOSE)
        if held_close:
            tail = tail[:-held_close].rstrip()
        if tail.endswith("}"):
            tail = tail[:-1]
        if len(tail) > call.sent:
            deltas.append(self._arguments_piece(arguments[call.sent : len(tail)]))
            call.sent = len(tail)
        return deltas

    def _close(self, call: _OpenCall) -> tuple[list[dict], str]:
        """Finish a block: send the rest of its arguments, or give its text back when it is no tool call."""
        try:
            body = nesting.loads(call.text)
            valid = isinstance(body, dict) and isinstance(body.get("name"), str) and "arguments" in body
        except ValueError:
            body, valid = None, False
        if call.header_end is not None:
            arguments = call.text[call.header_end :].rstrip()
            arguments = arguments[:-1].rstrip() if arguments.endswith("}") else arguments
            self._after_call = True
            rest = arguments[call.sent :]
            return ([self._arguments_piece(rest)] if rest else []), ""
        if not valid:
            return [], OPEN + call.text + CLOSE
        arguments = body["arguments"]
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self._after_call = True
        return [self._header(body["name"], text)], ""

    def _header(self, name: str, arguments: str) -> dict:
        """Open a new call: its index, id, type and name (and arguments when known whole)."""
        call_id = new_call_id()
        self.calls.append({"id": call_id, "name": name})
        return {"index": len(self.calls) - 1, "id": call_id, "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def _arguments_piece(self, piece: str) -> dict:
        """Continue the latest call's arguments."""
        return {"index": len(self.calls) - 1, "function": {"arguments": piece}}


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Join streamed tool-call deltas into whole OpenAI tool calls."""
    calls: list[dict] = []
    for delta in deltas:
        if "id" in delta:
            calls.append({"id": delta["id"], "type": "function",
                          "function": {"name": delta["function"]["name"], "arguments": delta["function"]["arguments"]}})
        else:
            calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls
