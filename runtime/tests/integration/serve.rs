//! `leanstream serve` with real HTTP clients on the embedded model (and SmolLM2 for chat): the
//! same greedy text as `run` and `run --chat`, whole and streamed (server-sent events ending in `[DONE]`), `stop` honoured, `usage`
//! and `finish_reason`, the KV cache reused across requests, each bad request refused with an
//! OpenAI-shaped 4xx naming the field, a client that disconnects mid-stream, and concurrent
//! clients queued one at a time (503 once the queue is full).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub(crate) fn embedded_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu")
}

const PROMPT: &str = "It is a truth universally acknowledged";

/// `leanstream run`'s greedy text for `prompt` (its trailing newline removed).
pub(crate) fn run_text(prompt: &str, n: usize) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .arg("run")
        .arg("--model")
        .arg(embedded_model())
        .args(["-p", prompt, "--temp", "0", "-n", &n.to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    text.strip_suffix('\n').unwrap().to_string()
}

/// A `leanstream serve` process on a free port, killed when dropped.
pub(crate) struct Server {
    child: Child,
    pub(crate) addr: String,
    /// The server's stderr lines after the one naming its address.
    pub(crate) log: mpsc::Receiver<String>,
    /// Its stderr lines before that one.
    pub(crate) startup: Vec<String>,
}

impl Server {
    pub(crate) fn start(model: &Path, extra: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_leanstream"))
            .arg("serve")
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--temp", "0"])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        let (tx, log) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        // The address line, after any notes (the memory split under --memory).
        let mut startup = Vec::new();
        let first = loop {
            let Ok(line) = log.recv_timeout(Duration::from_secs(60)) else {
                let _ = child.kill();
                panic!("the server did not start: {startup:?}");
            };
            if line.contains("http://") {
                break line;
            }
            startup.push(line);
        };
        let addr = first
            .split("http://")
            .nth(1)
            .and_then(|s| s.split('/').next())
            .unwrap_or_else(|| panic!("no address in {first:?}"))
            .to_string();
        assert!(addr.starts_with("127.0.0.1:"), "{first}");
        Self {
            child,
            addr,
            log,
            startup,
        }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// A request and its status and JSON body.
    pub(crate) fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, body.to_string())
    }

    fn post_raw(&self, path: &str, body: String) -> (u16, Value) {
        let mut r = agent()
            .post(&self.url(path))
            .header("Content-Type", "application/json")
            .send(body)
            .unwrap();
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        (status, serde_json::from_str(&text).unwrap())
    }

    fn get(&self, path: &str) -> (u16, String) {
        let mut r = agent().get(&self.url(path)).call().unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    }

    /// A streamed request: its events' JSON, and whether it ended with `[DONE]`.
    fn stream(&self, path: &str, body: &Value) -> (Vec<Value>, bool) {
        let mut r = agent()
            .post(&self.url(path))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(
            r.headers().get("content-type").unwrap(),
            "text/event-stream"
        );
        let mut text = String::new();
        r.body_mut().as_reader().read_to_string(&mut text).unwrap();
        let mut events = Vec::new();
        let mut done = false;
        for block in text.split("\n\n").filter(|b| !b.is_empty()) {
            let data = block.strip_prefix("data: ").expect("a data event");
            assert!(!done, "an event after [DONE]");
            if data == "[DONE]" {
                done = true;
            } else {
                events.push(serde_json::from_str(data).unwrap());
            }
        }
        (events, done)
    }

    /// A metric's value from `/metrics`.
    pub(crate) fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing from {text}"))
            .parse()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// The streamed text of completion chunks.
fn streamed_text(events: &[Value]) -> String {
    events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect()
}

#[test]
fn completions_match_run_whole_and_streamed_with_stop_usage_and_kv_reuse() {
    let expected = run_text(PROMPT, 24);
    let server = Server::start(&embedded_model(), &[]);
    let request =
        json!({ "model": "austen-relu", "prompt": PROMPT, "max_tokens": 24, "temperature": 0 });

    let (status, body) = server.post("/v1/completions", &request);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], "austen-relu");
    assert_eq!(body["choices"][0]["text"], expected.as_str());
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    let usage = &body["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 3, "{usage}");
    assert_eq!(usage["completion_tokens"], 24);
    assert_eq!(usage["total_tokens"], prompt_tokens + 24);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);

    // The same prompt again: all but its last token come from the KV cache, same text.
    let mut stream_request = request.clone();
    stream_request["stream"] = true.into();
    let (events, done) = server.stream("/v1/completions", &stream_request);
    assert!(done, "no [DONE]");
    assert!(events.len() > 5, "{events:?}");
    assert_eq!(streamed_text(&events), expected);
    let last = events.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 24);
    assert_eq!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"],
        prompt_tokens - 1
    );
    assert!(events[..events.len() - 1]
        .iter()
        .all(|e| e["choices"][0]["finish_reason"].is_null()));

    // `stop` ends the text before the stop string, whole and streamed.
    let words: Vec<&str> = expected.split_whitespace().collect();
    let stop = words[words.len() / 2];
    let at = expected.find(stop).unwrap();
    let mut stopped = request.clone();
    stopped["stop"] = json!(["no such text", stop]);
    let (status, body) = server.post("/v1/completions", &stopped);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], &expected[..at]);
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() < 24);
    stopped["stream"] = true.into();
    let (events, done) = server.stream("/v1/completions", &stopped);
    assert!(done);
    assert_eq!(streamed_text(&events), &expected[..at]);
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );

    // The other routes.
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "austen-relu");
    let (status, health) = server.get("/health");
    assert_eq!((status, health.contains("\"ok\"")), (200, true), "{health}");
    assert_eq!(server.metric("leanstream_requests_total"), 4.0);
    assert_eq!(
        server.metric("leanstream_reused_prompt_tokens_total"),
        3.0 * (prompt_tokens - 1) as f64
    );
    assert!(server.metric("leanstream_peak_rss_bytes") > 1e6);
}

#[test]
fn bad_requests_get_openai_errors_naming_the_field() {
    let server = Server::start(&embedded_model(), &["--max-body", "64KiB"]);
    let error = |status: u16, body: &Value, param: Option<&str>, code: Option<&str>| {
        assert_eq!(body["error"]["param"].as_str(), param, "{body}");
        assert_eq!(body["error"]["code"].as_str(), code, "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        assert!(!body["error"]["message"].as_str().unwrap().is_empty());
        status
    };
    let (s, b) = server.post_raw("/v1/completions", "{\"prompt\": ".into());
    assert_eq!(error(s, &b, None, Some("invalid_json")), 400);
    let (s, b) = server.post("/v1/completions", &json!({"model": "gpt-4", "prompt": "x"}));
    assert_eq!(error(s, &b, Some("model"), Some("model_not_found")), 404);
    let (s, b) = server.post(
        "/v1/completions",
        &json!({"prompt": "x", "temperature": "hot"}),
    );
    assert_eq!(error(s, &b, Some("temperature"), None), 400);
    let (s, b) = server.post("/v1/completions", &json!({"prompt": "x", "max_tokens": -1}));
    assert_eq!(error(s, &b, Some("max_tokens"), None), 400);
    let (s, b) = server.post("/v1/completions", &json!({"prompt": ["a", "b"]}));
    assert_eq!(error(s, &b, Some("prompt"), None), 400);
    let (s, b) = server.post("/v1/completions", &json!({"prompt": "x", "stop": 3}));
    assert_eq!(error(s, &b, Some("stop"), None), 400);
    // The embedded model has no chat template.
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}]});
    let (s, b) = server.post("/v1/chat/completions", &chat);
    assert_eq!(error(s, &b, Some("messages"), None), 400);
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("chat template"),
        "{b}"
    );
    // Longer than the model's context (1024 tokens), within the body limit.
    let long = "and ".repeat(1500);
    let (s, b) = server.post("/v1/completions", &json!({ "prompt": long }));
    assert_eq!(
        error(s, &b, Some("prompt"), Some("context_length_exceeded")),
        400
    );
    // Over the body limit.
    let huge = "and ".repeat(20_000);
    let (s, b) = server.post("/v1/completions", &json!({ "prompt": huge }));
    assert_eq!(error(s, &b, None, Some("request_too_large")), 413);
    let (s, b) = server.post("/v1/nothing", &json!({}));
    assert_eq!(error(s, &b, None, Some("not_found")), 404);
    assert_eq!(server.metric("leanstream_bad_requests_total"), 10.0);
    assert_eq!(server.metric("leanstream_requests_total"), 0.0);
    // The server still serves.
    let (s, b) = server.post(
        "/v1/completions",
        &json!({"prompt": PROMPT, "max_tokens": 2}),
    );
    assert_eq!(s, 200, "{b}");
}

/// Sends a streamed completion over a raw connection and reads up to the first text event.
fn open_stream(addr: &str, prompt: &str, max_tokens: usize) -> BufReader<TcpStream> {
    let body = json!({ "prompt": prompt, "max_tokens": max_tokens, "stream": true }).to_string();
    let mut conn = TcpStream::connect(addr).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    while !line.contains("\"text\":\"") || line.contains("\"text\":\"\"") {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "the stream ended");
    }
    reader
}

#[test]
fn clients_queue_in_order_a_full_queue_gets_503_and_a_lost_client_stops_its_generation() {
    let expected = run_text(PROMPT, 16);
    let server = Server::start(&embedded_model(), &["--queue", "1"]);
    // A: a long streamed generation; read its first piece of text.
    let a = open_stream(&server.addr, "Elizabeth", 1000);
    // B waits behind A.
    let url = server.url("/v1/completions");
    let b = std::thread::spawn(move || {
        let started = Instant::now();
        let mut r = agent()
            .post(&url)
            .send(json!({ "prompt": PROMPT, "max_tokens": 16 }).to_string())
            .unwrap();
        let body: Value = serde_json::from_str(&r.body_mut().read_to_string().unwrap()).unwrap();
        (body, started.elapsed())
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric("leanstream_queue_waiting") < 1.0 {
        assert!(Instant::now() < deadline, "B never queued");
        std::thread::sleep(Duration::from_millis(5));
    }
    // C finds the queue (of one) full.
    let (status, body) = server.post("/v1/completions", &json!({ "prompt": "x" }));
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "queue_full");
    assert_eq!(body["error"]["type"], "server_error");
    // A's client goes away: its generation stops and B is served.
    drop(a);
    let (body, _) = b.join().unwrap();
    assert_eq!(body["choices"][0]["text"], expected.as_str(), "{body}");
    assert_eq!(server.metric("leanstream_client_disconnects_total"), 1.0);
    assert_eq!(server.metric("leanstream_rejected_queue_full_total"), 1.0);
    let a_tokens = server.metric("leanstream_completion_tokens_total") - 16.0;
    assert!(
        a_tokens < 500.0,
        "A generated {a_tokens} tokens after its client left"
    );
    let log: Vec<String> = server.log.try_iter().collect();
    assert!(
        log.iter()
            .any(|l| l.starts_with("request 1:") && l.contains("client disconnected")),
        "{log:?}"
    );
    assert!(log.iter().any(|l| l.starts_with("request 2:")), "{log:?}");
}

/// SmolLM2-135M-Instruct (a chat template): `$LEANSTREAM_SMOLLM2`, else the file
/// scripts/fetch-smollm2.sh puts in `$LEANSTREAM_CACHE` or `~/.cache/leanstream`.
fn smollm2() -> PathBuf {
    let path = std::env::var_os("LEANSTREAM_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("LEANSTREAM_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/leanstream")
                })
                .join("SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        path.is_file(),
        "SmolLM2 is not at {}: run scripts/fetch-smollm2.sh",
        path.display()
    );
    path
}

#[test]
fn chat_completions_render_the_template_like_run_chat_and_reuse_the_conversation() {
    let model = smollm2();
    const QUESTION: &str = "What is the capital of France?";
    let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .arg("run")
        .arg("--model")
        .arg(&model)
        .args([
            "--chat", "-p", QUESTION, "--temp", "0", "-n", "12", "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run: Value = serde_json::from_slice(&o.stdout).unwrap();
    let expected = run["text"].as_str().unwrap();
    let finish = if run["stop_reason"] == "eos" {
        "stop"
    } else {
        "length"
    };
    let server = Server::start(&model, &[]);
    let request = json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{ "role": "user", "content": QUESTION }],
        "max_tokens": 12,
        "temperature": 0,
    });
    let (status, body) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["message"]["content"], expected);
    assert_eq!(body["choices"][0]["finish_reason"], finish);
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();

    // The next turn streams, and computes only what follows the first turn's prompt.
    let mut next = request.clone();
    next["messages"] = json!([
        { "role": "user", "content": QUESTION },
        { "role": "assistant", "content": expected },
        { "role": "user", "content": "And of Italy?" },
    ]);
    next["stream"] = true.into();
    let (events, done) = server.stream("/v1/chat/completions", &next);
    assert!(done);
    assert_eq!(events[0]["object"], "chat.completion.chunk");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty());
    let usage = &events.last().unwrap()["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= prompt_tokens,
        "{usage}: the first turn's {prompt_tokens} tokens not reused"
    );
    assert!(cached < usage["prompt_tokens"].as_u64().unwrap());
}

/// The log-softmax of the logits after `prompt`, computed here with the library (the reference
/// for the server's `logprobs`).
fn reference_logprobs(prompt: &str) -> Vec<f64> {
    use leanstream::streaming::{Sparsity, Tuning};
    use leanstream::text::session::{Session, SessionOptions};
    let mut session = Session::open(&SessionOptions {
        model: embedded_model(),
        policy: None,
        memory: None,
        flash: None,
        sparsity: Sparsity::Certified,
        ctx: None,
        default_ctx: 1024,
        kv: Default::default(),
        tuning: Tuning::default(),
        gpu: Default::default(),
    })
    .unwrap();
    let ids = session.tokenizer.encode(prompt, true).unwrap();
    let ctx = session.ctx;
    let model = session.model();
    let mut cache = model.new_cache(ctx);
    let logits = model.forward(&ids, &mut cache, false).unwrap();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z = max
        + logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    logits.iter().map(|&l| l as f64 - z).collect()
}

#[test]
fn logprobs_match_the_models_logits_and_n_seed_min_p_are_honoured() {
    let reference = reference_logprobs(PROMPT);
    let mut best: Vec<(usize, f64)> = reference.iter().copied().enumerate().collect();
    best.sort_by(|a, b| b.1.total_cmp(&a.1));
    let expected = run_text(PROMPT, 8);
    let server = Server::start(&embedded_model(), &[]);

    // Completions: `logprobs: 5`.
    let (status, body) = server.post(
        "/v1/completions",
        &json!({ "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 5 }),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], expected.as_str());
    let lp = &body["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 8, "{lp}");
    assert_eq!(
        tokens
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect::<String>(),
        expected,
        "the tokens spell the text"
    );
    let top0 = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top0.len(), 5);
    let sum: f64 = top0.values().map(|v| v.as_f64().unwrap().exp()).sum();
    assert!(sum <= 1.0 + 1e-6 && sum > 0.0, "{sum}");
    let mut served: Vec<f64> = top0.values().map(|v| v.as_f64().unwrap()).collect();
    served.sort_by(|a, b| b.total_cmp(a));
    for (got, (_, want)) in served.iter().zip(&best) {
        assert!((got - want).abs() < 1e-4, "{got} vs {want}");
    }
    let first = lp["token_logprobs"][0].as_f64().unwrap();
    assert!(
        (first - best[0].1).abs() < 1e-4,
        "greedy takes the best: {first}"
    );
    assert_eq!(lp["text_offset"][0], 0);

    // Chat-shaped logprobs in a stream: every token's entry, its top 3 best first.
    let (events, done) = server.stream(
        "/v1/completions",
        &json!({ "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3, "stream": true }),
    );
    assert!(done);
    assert_eq!(streamed_text(&events), expected);
    let streamed: Vec<f64> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["token_logprobs"].as_array())
        .flatten()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let whole: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    // The stream's prompt comes from the KV cache, computed in other chunks: equal to rounding.
    assert_eq!(streamed.len(), whole.len());
    for (s, w) in streamed.iter().zip(&whole) {
        assert!((s - w).abs() < 1e-4, "{streamed:?} vs {whole:?}");
    }

    // n = 3 sampled choices with a seed: three choices, repeatable, not all the same.
    let sampled = json!({ "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "n": 3,
        "seed": 5, "top_p": 1.0 });
    let (status, a) = server.post("/v1/completions", &sampled);
    assert_eq!(status, 200, "{a}");
    let texts = |b: &Value| -> Vec<String> {
        b["choices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, c)| {
                assert_eq!(c["index"], i);
                c["text"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let ta = texts(&a);
    assert_eq!(ta.len(), 3);
    assert!(ta[0] != ta[1] || ta[1] != ta[2], "{ta:?}");
    assert_eq!(a["usage"]["completion_tokens"], 36, "{a}");
    let (_, b) = server.post("/v1/completions", &sampled);
    assert_eq!(texts(&b), ta, "the same seed gives the same choices");
    let mut other = sampled.clone();
    other["seed"] = 6.into();
    let (_, c) = server.post("/v1/completions", &other);
    assert_ne!(texts(&c), ta);
    // min_p = 1 keeps only the most likely token: sampling turns greedy (the server's repeat
    // penalty applies to both).
    let (_, greedy) = server.post(
        "/v1/completions",
        &json!({ "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "min_p": 1.0 }),
    );
    assert_eq!(greedy["choices"][0]["text"], expected.as_str());
}

#[test]
fn response_format_constrains_the_reply_to_json() {
    let server = Server::start(&embedded_model(), &[]);
    let schema = json!({
        "type": "object",
        "properties": {
            "married": { "type": "boolean" },
            "sisters": { "type": "integer" },
            "mood": { "enum": ["happy", "proud", "prejudiced"] },
            "name": { "type": "string" }
        },
        "required": ["married", "sisters", "mood"]
    });
    let (status, body) = server.post(
        "/v1/completions",
        &json!({ "prompt": "Elizabeth Bennet, as a record:", "max_tokens": 100, "temperature": 0,
            "response_format": { "type": "json_schema",
                "json_schema": { "name": "record", "schema": schema } } }),
    );
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["text"].as_str().unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{text}");
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(v["married"].is_boolean(), "{v}");
    assert!(v["sisters"].is_i64(), "{v}");
    assert!(
        ["happy", "proud", "prejudiced"].contains(&v["mood"].as_str().unwrap()),
        "{v}"
    );
    assert_eq!(v.as_object().unwrap().len(), 3, "{v}");

    // json_object, sampled: any object, streamed.
    let (events, done) = server.stream(
        "/v1/completions",
        &json!({ "prompt": "{", "max_tokens": 200, "temperature": 0.7, "seed": 1,
            "stream": true, "response_format": { "type": "json_object" } }),
    );
    assert!(done);
    let text = streamed_text(&events);
    let last = &events.last().unwrap()["choices"][0]["finish_reason"];
    if last == "stop" {
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v.is_object(), "{v}");
    } else {
        // Cut by max_tokens: still a valid prefix, starting an object.
        assert!(text.trim_start().starts_with('{'), "{text}");
    }

    // Unsupported schemas are refused, naming the field and the keyword.
    let (status, body) = server.post(
        "/v1/completions",
        &json!({ "prompt": "x", "response_format": { "type": "json_schema", "json_schema": {
            "name": "r", "schema": { "type": "object",
                "properties": { "a": { "type": "string", "pattern": "^a" } } } } } }),
    );
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "response_format");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("pattern"),
        "{body}"
    );
}

#[test]
fn chat_takes_tools_tool_results_and_json_object() {
    let server = Server::start(&smollm2(), &[]);
    let tools = json!([{ "type": "function", "function": { "name": "get_weather",
        "description": "The weather in a city", "parameters": { "type": "object",
        "properties": { "city": { "type": "string" } }, "required": ["city"] } } }]);
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({
            "messages": [
                { "role": "user", "content": "What is the weather in Paris?" },
                { "role": "assistant", "content": null, "tool_calls": [{ "id": "call_1",
                    "type": "function", "function": { "name": "get_weather",
                    "arguments": "{\"city\": \"Paris\"}" } }] },
                { "role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C" }
            ],
            "tools": tools, "max_tokens": 16, "temperature": 0, "logprobs": true,
            "top_logprobs": 2
        }),
    );
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    let entries = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        entries.len() as u64,
        body["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
    }

    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({
            "messages": [{ "role": "user",
                "content": "What is the capital of France? Answer in JSON." }],
            "max_tokens": 120, "temperature": 0, "response_format": { "type": "json_object" }
        }),
    );
    assert_eq!(status, 200, "{body}");
    let text = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{text}");
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert!(v.is_object(), "{v}");
}

/// A request's body as lines of JSON (Ollama's streams), with the content type.
fn ndjson(server: &Server, path: &str, body: &Value) -> (String, Vec<Value>) {
    let mut r = agent()
        .post(&server.url(path))
        .header("Content-Type", "application/json")
        .send(body.to_string())
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let content_type = r
        .headers()
        .get("content-type")
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let text = r.body_mut().read_to_string().unwrap();
    let lines = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    (content_type, lines)
}

#[test]
fn ollama_and_llama_cpp_endpoints_answer_like_their_servers() {
    let expected = run_text(PROMPT, 10);
    let server = Server::start(&embedded_model(), &[]);

    // Ollama /api/generate, streamed by default: NDJSON lines, the last one `done` with counts.
    let request = json!({ "model": "austen-relu:latest", "prompt": PROMPT,
        "options": { "temperature": 0, "num_predict": 10 } });
    let (content_type, lines) = ndjson(&server, "/api/generate", &request);
    assert_eq!(content_type, "application/x-ndjson");
    let text: String = lines
        .iter()
        .filter_map(|l| l["response"].as_str())
        .collect();
    assert_eq!(text, expected);
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true, "{last}");
    assert_eq!(last["done_reason"], "length");
    assert_eq!(last["eval_count"], 10);
    assert_eq!(last["model"], "austen-relu");
    assert!(last["prompt_eval_count"].as_u64().unwrap() > 3, "{last}");
    assert!(last["eval_duration"].as_u64().unwrap() > 1000, "{last}");
    assert!(last["total_duration"].as_u64() >= last["eval_duration"].as_u64());
    assert!(last["created_at"].as_str().unwrap().ends_with('Z'));
    assert!(lines[..lines.len() - 1].iter().all(|l| l["done"] == false));
    // "stream": false: one object.
    let mut whole = request.clone();
    whole["stream"] = false.into();
    let (status, body) = server.post("/api/generate", &whole);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["response"], expected.as_str());
    assert_eq!(
        (body["done"].clone(), body["eval_count"].clone()),
        (json!(true), json!(10))
    );
    // Errors are Ollama's {"error": "..."}.
    let (status, body) = server.post(
        "/api/generate",
        &json!({ "model": "llama3", "prompt": "x" }),
    );
    assert_eq!(status, 404);
    assert!(body["error"].as_str().unwrap().contains("llama3"), "{body}");
    let (status, body) = server.post(
        "/api/generate",
        &json!({ "model": "austen-relu", "prompt": "x", "options": { "top_p": 5 } }),
    );
    assert_eq!(status, 400);
    assert!(
        body["error"].as_str().unwrap().contains("options.top_p"),
        "{body}"
    );

    // /api/tags, /api/show, /api/version.
    let (status, tags) = server.get("/api/tags");
    assert_eq!(status, 200);
    let tags: Value = serde_json::from_str(&tags).unwrap();
    assert_eq!(tags["models"][0]["name"], "austen-relu:latest");
    let (status, show) = server.post("/api/show", &json!({ "model": "austen-relu" }));
    assert_eq!(status, 200, "{show}");
    assert_eq!(show["model_info"]["general.context_length"], 1024);
    let (status, version) = server.get("/api/version");
    assert_eq!(status, 200);
    assert!(version.contains("\"version\""), "{version}");

    // llama.cpp /completion, whole and streamed (events without [DONE]).
    let (status, body) = server.post(
        "/completion",
        &json!({ "prompt": PROMPT, "n_predict": 10, "temperature": 0 }),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["content"], expected.as_str());
    assert_eq!(body["stop"], true);
    assert_eq!(body["tokens_predicted"], 10);
    assert_eq!(body["stop_type"], "limit");
    let mut r = agent()
        .post(&server.url("/completion"))
        .send(
            json!({ "prompt": PROMPT, "n_predict": 10, "temperature": 0, "stream": true })
                .to_string(),
        )
        .unwrap();
    let text = r.body_mut().read_to_string().unwrap();
    assert!(!text.contains("[DONE]"));
    let events: Vec<Value> = text
        .split("\n\n")
        .filter(|b| !b.is_empty())
        .map(|b| serde_json::from_str(b.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    let streamed: String = events
        .iter()
        .filter_map(|e| e["content"].as_str())
        .collect();
    assert_eq!(streamed, expected);
    assert_eq!(events.last().unwrap()["stop"], true);
    let (status, body) = server.post("/completion", &json!({ "prompt": PROMPT, "n_predict": 0 }));
    assert_eq!(
        (status, body["error"]["param"].clone()),
        (400, json!("n_predict"))
    );

    // /tokenize and /detokenize round-trip.
    let (status, tokens) = server.post("/tokenize", &json!({ "content": PROMPT }));
    assert_eq!(status, 200, "{tokens}");
    let ids = tokens["tokens"].as_array().unwrap();
    assert!(ids.len() > 3 && ids.len() < PROMPT.len(), "{tokens}");
    let (status, text) = server.post("/detokenize", &json!({ "tokens": ids }));
    assert_eq!(status, 200);
    assert_eq!(text["content"], PROMPT);
    let (status, body) = server.post("/detokenize", &json!({ "tokens": ["a"] }));
    assert_eq!(
        (status, body["error"]["param"].clone()),
        (400, json!("tokens"))
    );
}

#[test]
fn ollama_chat_streams_the_template_reply() {
    let model = smollm2();
    const QUESTION: &str = "What is the capital of France?";
    let o = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .arg("run")
        .arg("--model")
        .arg(&model)
        .args([
            "--chat", "-p", QUESTION, "--temp", "0", "-n", "12", "--json",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let run: Value = serde_json::from_slice(&o.stdout).unwrap();
    let server = Server::start(&model, &[]);
    let request = json!({ "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{ "role": "user", "content": QUESTION }],
        "options": { "temperature": 0, "num_predict": 12 } });
    let (_, lines) = ndjson(&server, "/api/chat", &request);
    let text: String = lines
        .iter()
        .filter_map(|l| l["message"]["content"].as_str())
        .collect();
    assert_eq!(text, run["text"].as_str().unwrap());
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(last["message"]["role"], "assistant");
    assert_eq!(last["eval_count"], run["generated_tokens"], "{last} {run}");
    // Not streamed: one object (its prompt mostly from the KV cache).
    let mut whole = request.clone();
    whole["stream"] = false.into();
    let (status, body) = server.post("/api/chat", &whole);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["done"], true);
    assert!(
        !body["message"]["content"].as_str().unwrap().is_empty(),
        "{body}"
    );
    assert_eq!(
        body["prompt_eval_count"], 1,
        "all but the last prompt token reused: {body}"
    );
}
