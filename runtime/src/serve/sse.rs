//! Server-sent events: a streamed reply written straight to the connection, one `data:` event
//! per JSON chunk, flushed at once, ending with `data: [DONE]` (OpenAI; llama.cpp ends without
//! it), or Ollama's newline-delimited JSON. A write that fails means the client went away, which
//! is how the generation learns to stop.

use std::io::Write;

use serde_json::Value;

pub struct EventStream {
    out: Box<dyn Write + Send>,
    open: bool,
    framing: Framing,
}

/// How chunks are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `data: {...}` events ending with `data: [DONE]`.
    Sse,
    /// `data: {...}` events, no `[DONE]` (llama.cpp).
    SseWithoutDone,
    /// One JSON object a line (Ollama).
    Ndjson,
}

impl EventStream {
    /// Sends the response head on `request`'s connection. The body is chunked (HTTP/1.1) and the
    /// connection closes after it.
    pub fn start(request: tiny_http::Request, framing: Framing) -> Self {
        let mut stream = Self {
            out: request.into_writer(),
            open: true,
            framing,
        };
        let content_type = match framing {
            Framing::Ndjson => "application/x-ndjson",
            _ => "text/event-stream",
        };
        stream.write(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nCache-Control: no-cache\r\n\
                 Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            )
            .as_bytes(),
        );
        stream
    }

    /// Sends one event; `false` once the client is gone.
    pub fn send(&mut self, chunk: &Value) -> bool {
        self.event(&chunk.to_string())
    }

    /// Whether the client is still there (as of the last write).
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Ends the stream with `[DONE]`.
    pub fn done(mut self) {
        if self.framing == Framing::Sse {
            self.event("[DONE]");
        }
        self.write(b"0\r\n\r\n");
    }

    fn event(&mut self, data: &str) -> bool {
        let event = match self.framing {
            Framing::Ndjson => format!("{data}\n"),
            _ => format!("data: {data}\n\n"),
        };
        let chunk = format!("{:x}\r\n{event}\r\n", event.len());
        self.write(chunk.as_bytes())
    }

    fn write(&mut self, bytes: &[u8]) -> bool {
        if self.open {
            self.open = self.out.write_all(bytes).is_ok() && self.out.flush().is_ok();
        }
        self.open
    }
}
