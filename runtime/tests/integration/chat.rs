//! Chat templates and `leanstream chat` / `run --chat`: known renderings (SmolLM2's ChatML from
//! its GGUF, a Llama-2 template), templates from a model directory, two turns on the real model
//! with the first turn kept in the KV cache, Ctrl-C, and a full context.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use leanstream::source::gguf::GgufFile;
use leanstream::tokenizer::chat_template::{from_hf_dir, ChatTemplate, Message};
use leanstream::tokenizer::gguf as gguf_tokenizer;
use leanstream::tokenizer::Tokenizer;
use leanstream_format::meta::ChatTemplate as TemplateSource;

const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$LEANSTREAM_SMOLLM2`, else the file in `$LEANSTREAM_CACHE` or `~/.cache/leanstream` (CI puts
/// it there with scripts/fetch-smollm2.sh).
fn smollm2() -> PathBuf {
    let path = match std::env::var_os("LEANSTREAM_SMOLLM2") {
        Some(p) => PathBuf::from(p),
        None => std::env::var_os("LEANSTREAM_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                    .join(".cache/leanstream")
            })
            .join(GGUF_NAME),
    };
    assert!(
        path.is_file(),
        "SmolLM2 is not at {}: run scripts/fetch-smollm2.sh first",
        path.display()
    );
    path
}

fn embedded_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu")
}

fn leanstream(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the leanstream binary runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The one JSON object `run --json` printed.
fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "failed: {}", stderr(out));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

/// The JSON lines `chat --json` printed, one per turn.
fn turns(out: &Output) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "failed: {}", stderr(out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

const SMOLLM2_SYSTEM: &str =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

#[test]
fn smollm2_template_from_gguf_renders_chatml() {
    let file = GgufFile::open(&smollm2()).unwrap();
    let tok = gguf_tokenizer::from_gguf(&file).unwrap();
    let source = tok
        .chat_template
        .expect("SmolLM2's GGUF has a chat template");
    let template = ChatTemplate::new(&source, file.path()).unwrap();
    let question = Message::new("user", "What is the capital of France?");
    assert_eq!(
        template.render(std::slice::from_ref(&question), true).unwrap(),
        format!(
            "{SMOLLM2_SYSTEM}<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        )
    );
    // A system message replaces the default one; no generation prompt after a reply.
    let conversation = [
        Message::new("system", "Be brief."),
        question,
        Message::new("assistant", "Paris."),
    ];
    assert_eq!(
        template.render(&conversation, false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of \
         France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"
    );
    // A reply ends with <|im_end|> (id 2), which the template's markup tokenizes to.
    let ids = template
        .encode(&tok.tokenizer, &[Message::new("user", "Hi")])
        .unwrap();
    assert_eq!(ids[0], 1, "<|im_start|> is one special token");
    assert_eq!(template.end_of_turn(&tok.tokenizer).unwrap(), Some(2));
}

/// meta-llama/Llama-2-7b-chat-hf's `chat_template`.
const LLAMA2: &str = r#"{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"#;

#[test]
fn llama2_template_renders_as_transformers_does() {
    let source = TemplateSource {
        template: LLAMA2.into(),
        bos_token: Some("<s>".into()),
        eos_token: Some("</s>".into()),
    };
    let template = ChatTemplate::new(&source, Path::new("llama2")).unwrap();
    let conversation = [
        Message::new("system", "You are helpful."),
        Message::new("user", "Hi"),
        Message::new("assistant", "  Hello!\n"),
        Message::new("user", "How are you?"),
    ];
    assert_eq!(
        template.render(&conversation, true).unwrap(),
        "<s>[INST] <<SYS>>\nYou are helpful.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] How are \
         you? [/INST]"
    );
    let err = template
        .render(&[Message::new("assistant", "x")], true)
        .unwrap_err();
    assert!(
        format!("{err:#}").contains("Conversation roles must alternate"),
        "{err:#}"
    );
    // The end-of-turn token is the one after a reply: </s> in a vocabulary that has it special.
    let tokenizer = tokenizer_with_specials(&["<s>", "</s>"]);
    assert_eq!(template.end_of_turn(&tokenizer).unwrap(), Some(1));
}

/// A word-level tokenizer whose listed tokens are special (ids 0, 1, ...).
fn tokenizer_with_specials(specials: &[&str]) -> Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> = specials
        .iter()
        .chain(&["[UNK]"])
        .enumerate()
        .map(|(i, t)| (t.to_string(), i.into()))
        .collect();
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap()
}

/// A copy of the embedded model with a chat template in `tokenizer_config.json` (a list of named
/// templates, as some models ship), so the chat loop can be tested in milliseconds per token.
fn austen_with_template(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(embedded_model().join(f), dir.join(f)).unwrap();
    }
    let config = serde_json::json!({
        "bos_token": {"content": "<s>", "special": true},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "unused"},
            {"name": "default", "template": "{% for m in messages %}{% if m.role == 'user' %}{{ m.role | capitalize }}: {% else %}Emma:{% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}Emma:{% endif %}"}
        ]
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn model_directory_templates_are_found() {
    let dir = austen_with_template("austen-template-list");
    let source = from_hf_dir(&dir).unwrap().unwrap();
    assert!(source.template.contains("Emma:"), "the default template");
    assert_eq!(source.bos_token.as_deref(), Some("<s>"));
    assert_eq!(source.eos_token.as_deref(), Some("</s>"));
    // chat_template.jinja takes precedence, as in transformers.
    std::fs::write(dir.join("chat_template.jinja"), "{{ messages[0].content }}").unwrap();
    assert_eq!(
        from_hf_dir(&dir).unwrap().unwrap().template,
        "{{ messages[0].content }}"
    );
    assert!(from_hf_dir(&embedded_model()).unwrap().is_none());
}

#[test]
fn run_chat_sends_one_user_message_through_the_template() {
    let model = smollm2();
    let out = leanstream(
        &[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--chat",
            "-p",
            "What is the capital of France?",
            "--temp",
            "0",
            "-n",
            "24",
            "--json",
        ],
        "",
    );
    let v = json(&out);
    let text = v["text"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text:?}");
    let tok = gguf_tokenizer::from_gguf(&GgufFile::open(&model).unwrap()).unwrap();
    let expected = tok
        .tokenizer
        .encode(
            &format!("{SMOLLM2_SYSTEM}<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
            false,
        )
        .unwrap();
    assert_eq!(v["prompt_tokens"], expected.len());
}

#[test]
fn two_turns_keep_the_first_in_the_kv_cache() {
    let model = smollm2();
    let out = leanstream(
        &[
            "chat",
            "--model",
            model.to_str().unwrap(),
            "--temp",
            "0",
            // Room for the first reply to reach <|im_end|> (88 tokens, 72 for the second).
            "-n",
            "128",
            "--json",
        ],
        "What is the capital of France?\nAnd what is the capital of Italy?\n",
    );
    let t = turns(&out);
    assert_eq!(t.len(), 2, "{t:?}");
    let first = t[0]["reply"].as_str().unwrap();
    assert!(first.contains("Paris"), "{first:?}");
    assert_eq!(t[0]["reused_tokens"], 0);
    assert_eq!(t[0]["stop_reason"], "eos", "the reply ends at <|im_end|>");
    // The second turn computes only its own tokens: everything the first left in the cache is
    // reused, and what is new is the closing of the reply plus the new question's markup.
    let context_after_first = t[0]["context_tokens"].as_u64().unwrap();
    assert_eq!(t[1]["reused_tokens"].as_u64().unwrap(), context_after_first);
    let new = t[1]["prompt_tokens"].as_u64().unwrap();
    assert!(
        (10..30).contains(&new),
        "{new} new tokens for the second turn"
    );
    let second = t[1]["reply"].as_str().unwrap();
    assert!(!second.trim().is_empty(), "{second:?}");
    eprintln!("turn 1: {first:?}\nturn 2: {second:?}");
}

/// The chat loop computes only each turn's new tokens; the reply must still be what the whole
/// conversation computed from scratch gives (greedy, same tokens).
#[test]
fn a_continued_turn_equals_recomputing_the_conversation() {
    let dir = austen_with_template("austen-template-continue");
    let model = dir.to_str().unwrap();
    let args = ["--temp", "0", "-n", "30", "--json"];
    let chat = turns(&leanstream(
        &[&["chat", "--model", model][..], &args].concat(),
        "Good morning, Mr. Knightley.\nWill you walk with me to Hartfield?\n",
    ));
    assert_eq!(chat.len(), 2);
    assert_eq!(chat[1]["reused_tokens"], chat[0]["context_tokens"]);
    let first = chat[0]["reply"].as_str().unwrap();
    let conversation = format!(
        "User: Good morning, Mr. Knightley.\nEmma:{first}\nUser: Will you walk with me to Hartfield?\nEmma:"
    );
    let out = leanstream(
        &[&["run", "--model", model, "-p", &conversation][..], &args].concat(),
        "",
    );
    let run = json(&out);
    assert_eq!(run["text"], chat[1]["reply"]);
    let computed =
        chat[1]["reused_tokens"].as_u64().unwrap() + chat[1]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(run["prompt_tokens"], computed);
}

#[test]
fn a_full_context_starts_a_new_conversation() {
    let dir = austen_with_template("austen-template-full");
    let out = leanstream(
        &[
            "chat",
            "--model",
            dir.to_str().unwrap(),
            "--ctx",
            "48",
            "-n",
            "40",
            "--temp",
            "0",
            "--json",
        ],
        "It was a fine morning.\nShall we walk?\nAnd then?\n",
    );
    let t = turns(&out);
    let err = stderr(&out);
    assert_eq!(t.len(), 3, "{err}");
    assert!(
        t.iter().any(|t| t["stop_reason"] == "context_full"),
        "{t:?}"
    );
    assert!(err.contains("starting a new one"), "{err}");
    for turn in &t {
        assert!(turn["context_tokens"].as_u64().unwrap() <= 48);
    }
}

#[test]
fn chat_without_a_template_is_a_clear_error() {
    let out = leanstream(
        &["chat", "--model", embedded_model().to_str().unwrap()],
        "Hello\n",
    );
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("has no chat template"), "{err}");
    assert!(err.contains("austen-relu"), "{err}");
}

/// What a child writes to a pipe, as it arrives.
fn chunks(mut pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = pipe.read(&mut buf) {
            if tx
                .send(String::from_utf8_lossy(&buf[..n]).into_owned())
                .is_err()
            {
                break;
            }
        }
    });
    rx
}

/// Collects output until it contains `what`.
fn wait_for(rx: &mpsc::Receiver<String>, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = String::new();
    while Instant::now() < deadline {
        if let Ok(chunk) = rx.recv_timeout(Duration::from_millis(50)) {
            seen.push_str(&chunk);
            if seen.contains(what) {
                return seen;
            }
        }
    }
    panic!("no {what:?} within a minute; saw {seen:?}");
}

fn interrupt(child: &Child) {
    // SAFETY: kill(2) sends SIGINT to our own child; it touches no memory of this process.
    let r = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(r, 0);
}

#[test]
fn ctrl_c_stops_a_reply_and_at_the_prompt_ends_the_chat() {
    let dir = austen_with_template("austen-template-ctrl-c");
    let mut child = Command::new(env!("CARGO_BIN_EXE_leanstream"))
        .args(["chat", "--model", dir.to_str().unwrap(), "--temp", "0"])
        .args(["-n", "100000", "--ctx", "1024", "--threads", "1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let err = chunks(child.stderr.take().unwrap());
    let out = chunks(child.stdout.take().unwrap());
    // A reply that would run to the end of the context: Ctrl-C stops it, the session goes on.
    writeln!(stdin, "Tell me everything about Highbury.").unwrap();
    wait_for(&out, "");
    interrupt(&child);
    let seen = wait_for(&err, "generated at");
    assert!(seen.contains("[stopped]"), "{seen}");
    writeln!(stdin, "And Donwell Abbey?").unwrap();
    let seen = wait_for(&err, "generated at");
    assert!(!seen.contains("[stopped]"), "{seen}");
    // Back at the prompt: Ctrl-C ends the chat.
    interrupt(&child);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130));
}
