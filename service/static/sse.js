"use strict";

/**
 * An incremental Server-Sent Events parser, per the WHATWG event-stream rules.
 *
 * Feed it the response body's bytes as they arrive, split anywhere (inside a line, between CR and
 * LF, inside a multi-byte character): it calls onEvent({type, data}) for each complete event and
 * onComment(text) for comment lines such as the server's ": ping" keep-alives.
 */
class SSEParser {
  constructor(onEvent, onComment = () => {}) {
    this.onEvent = onEvent;
    this.onComment = onComment;
    this.decoder = new TextDecoder("utf-8");
    this.buffer = "";
    this.dataLines = [];
    this.eventType = "";
  }

  /** Parse the next piece of the body (a Uint8Array). */
  push(bytes) {
    this.feed(this.decoder.decode(bytes, { stream: true }));
  }

  /** Parse what is left at the end of the body; an event without its closing blank line is dropped. */
  end() {
    this.feed(this.decoder.decode() + (this.buffer.endsWith("\r") ? "\n" : ""));
  }

  feed(text) {
    this.buffer += text;
    // A CR at the very end may be the first half of a CRLF split across two pieces: wait for more.
    const lineEnd = /\r\n|\n|\r(?!$)/g;
    let consumed = 0;
    let match;
    while ((match = lineEnd.exec(this.buffer)) !== null) {
      this.processLine(this.buffer.slice(consumed, match.index));
      consumed = lineEnd.lastIndex;
    }
    this.buffer = this.buffer.slice(consumed);
  }

  processLine(line) {
    if (line === "") {
      if (this.dataLines.length > 0) {
        this.onEvent({ type: this.eventType || "message", data: this.dataLines.join("\n") });
      }
      this.dataLines = [];
      this.eventType = "";
      return;
    }
    if (line.startsWith(":")) {
      this.onComment(line.slice(1).trimStart());
      return;
    }
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) {
      value = value.slice(1);
    }
    if (field === "data") {
      this.dataLines.push(value);
    } else if (field === "event") {
      this.eventType = value;
    }
  }
}
