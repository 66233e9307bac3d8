//! LeanStream's C API: what an app needs to run a model under a memory budget without the
//! command line. Open a model with a budget and options, generate with a per-token callback and
//! a cancel flag, read the metrics, close. Every function returns a status code and leaves a
//! message for `ls_last_error`; no Rust panic crosses into C (each entry point catches it and
//! returns `LS_STATUS_PANIC`). The header `include/leanstream.h` is generated from this file by
//! cbindgen (`scripts/capi-header.sh`) and checked in, so apps build without cbindgen.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use leanstream::model::kv_cache::KvCache;
use leanstream::model::{install, OnPool};
use leanstream::platform::elastic::{BudgetHandle, BudgetWatch};
use leanstream::storage::FlashProfile;
use leanstream::streaming::{Sparsity, Tuning};
use leanstream::text::generate::{generate_after, GenerateOptions, StopReason};
use leanstream::text::sampler::{Sampler, SamplerConfig};
use leanstream::text::session::{GpuChoice, PolicyChoice, Session, SessionOptions};
use leanstream::tokenizer::chat_template::Message;

/// What a call did.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LsStatus {
    Ok = 0,
    /// A null pointer, text that is not UTF-8, an unknown policy or flash name.
    InvalidArgument = 1,
    /// The model could not be opened: a missing or invalid file, a budget it cannot fit.
    Open = 2,
    /// Generation failed (a prompt longer than the context, a read error).
    Generate = 3,
    /// A bug inside the library, caught before it reached the caller.
    Panic = 4,
}

/// How a model is opened; start from `ls_open_options_default()`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LsOpenOptions {
    /// Hard cap on peak memory in bytes; 0: no cap (everything fits).
    pub memory_bytes: u64,
    /// Context length in tokens; 0: 2048, or the model's maximum if smaller.
    pub ctx: u32,
    /// Compute threads of this model: it computes on a pool of its own with this many threads,
    /// whichever thread calls it; 0: on the process's shared pool (all cores). Callbacks run on
    /// the calling thread, never on a compute thread.
    pub threads: u32,
    /// `leanstream`, `resident`, `dense`, `mmap`, `powerinfer2`, `llm-in-flash`; NULL: leanstream
    /// for converted files, dense otherwise.
    pub policy: *const c_char,
    /// Flash device: `none` (the real disk), `ufs4`, `ufs31`, `nvme` or a profile file; NULL: none.
    pub flash: *const c_char,
}

/// How text is generated; start from `ls_generate_options_default()` (the command line's
/// defaults: temperature 0.8, top-k 40, top-p 0.95, repetition penalty 1.1).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LsGenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
    /// 1: off.
    pub repeat_penalty: f32,
    pub seed: u64,
    /// Send the prompt as one user message through the model's chat template.
    pub chat: bool,
}

/// Why the last generation ended.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LsStopReason {
    /// Nothing generated yet.
    None = 0,
    /// The model ended its text.
    Eos = 1,
    MaxTokens = 2,
    ContextFull = 3,
    /// `ls_cancel` or the callback stopped it.
    Cancelled = 4,
}

/// The last generation's figures and the model's running totals.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LsMetrics {
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Decode rate of the last generation.
    pub tokens_per_s: f64,
    /// Time to the first token of the last generation.
    pub ttft_ms: f64,
    pub stop_reason: LsStopReason,
    /// Flash bytes read per token since the model was opened (0 for dense).
    pub bytes_read_per_token: f64,
    /// Neuron-cluster cache hit rate since the model was opened (0 for dense).
    pub cache_hit_rate: f64,
    /// The memory budget in bytes (0: none).
    pub memory_budget_bytes: u64,
    /// The process's peak resident set size in bytes (0 where unknown).
    pub peak_rss_bytes: u64,
    /// The threads this model computes on (`options.threads`, or the shared pool's count).
    pub threads: u32,
}

/// Receives each piece of generated text: `len` bytes of UTF-8 at `piece` (NUL-terminated too),
/// and the `user_data` given to `ls_generate`. Return false to stop the generation. It runs on
/// the thread that called `ls_generate` or `ls_chat` (between the compute steps, which run on
/// the model's threads), so it may use that thread's state (a JNI environment, a UI loop).
pub type LsTokenCallback =
    Option<extern "C" fn(piece: *const c_char, len: usize, user_data: *mut c_void) -> bool>;

/// An open model. Any thread may use it, one at a time (the caller orders the calls: the model
/// moves between threads but is not shared by them), except `ls_cancel` and
/// `ls_set_memory_budget`, which any thread may call at any time. Each model computes on its own
/// threads (`LsOpenOptions.threads`), so two models used from two threads at once do not share
/// them.
pub struct LsModel {
    /// Locked by each call that uses it, so `ls_set_memory_budget` from another thread can tell
    /// whether it is in use.
    session: Mutex<Session>,
    /// The budget a streaming model follows (`None`: opened without one, or dense).
    budget: Option<BudgetHandle>,
    cancel: AtomicBool,
    last: Cell<LsMetrics>,
    /// The token-level calls' sequence: `ls_eval`'s tokens, their KV cache and the last logits.
    sequence: RefCell<Sequence>,
    /// The model's own compute threads (`None`: the process's shared pool).
    pool: Option<rayon::ThreadPool>,
}

impl LsModel {
    /// Runs `f`, a computation that calls nothing of the caller's, on the model's threads.
    fn on_threads<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        install(self.pool.as_ref(), f)
    }

    /// How many threads the model computes on.
    fn threads(&self) -> u32 {
        self.pool.as_ref().map_or_else(
            rayon::current_num_threads,
            rayon::ThreadPool::current_num_threads,
        ) as u32
    }
}

// A model may move between threads (used by one at a time): checked at compile time.
const _: () = {
    const fn is_send<T: Send>() {}
    is_send::<LsModel>();
};

#[derive(Default)]
struct Sequence {
    cache: Option<KvCache>,
    tokens: Vec<u32>,
    logits: Vec<f32>,
}

/// The most compute threads one model may ask for.
const MAX_THREADS: u32 = 1024;

/// The ABI this header describes: a library whose `ls_abi_version()` differs is not compatible.
pub const LEANSTREAM_ABI_VERSION: u32 = 3;

/// One message of a conversation: `role` is `system`, `user`, `assistant` or `tool`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct LsMessage {
    pub role: *const c_char,
    pub content: *const c_char,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).expect("NULs replaced");
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, turning its error into a status and a message, and a panic into `LsStatus::Panic`.
fn guard(f: impl FnOnce() -> Result<(), (LsStatus, String)>) -> LsStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => LsStatus::Ok,
        Ok(Err((status, message))) => {
            set_error(&message);
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            set_error(&format!("internal error (a bug in leanstream): {what}"));
            LsStatus::Panic
        }
    }
}

fn invalid(message: impl Into<String>) -> (LsStatus, String) {
    (LsStatus::InvalidArgument, message.into())
}

/// Text at `p`, or `None` for NULL.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>, (LsStatus, String)> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller passes a NUL-terminated string (the header's contract).
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| invalid(format!("{what} is not UTF-8 text")))
}

/// The command line's defaults: no budget, ctx 2048, the shared pool (all cores), the file's
/// default policy.
#[no_mangle]
pub extern "C" fn ls_open_options_default() -> LsOpenOptions {
    LsOpenOptions {
        memory_bytes: 0,
        ctx: 0,
        threads: 0,
        policy: std::ptr::null(),
        flash: std::ptr::null(),
    }
}

/// The command line's defaults: 128 tokens, temperature 0.8, top-k 40, top-p 0.95, repetition
/// penalty 1.1, seed 299792458, no chat template.
#[no_mangle]
pub extern "C" fn ls_generate_options_default() -> LsGenerateOptions {
    LsGenerateOptions {
        max_tokens: 128,
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        repeat_penalty: 1.1,
        seed: 299792458,
        chat: false,
    }
}

/// Opens the model at `path` (a converted LeanStream file, a GGUF file or a Hugging Face model
/// directory) with `options` (NULL: the defaults) and stores it in `*out`.
///
/// # Safety
/// `path` is a NUL-terminated string; `options` is NULL or valid; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ls_open(
    path: *const c_char,
    options: *const LsOpenOptions,
    out: *mut *mut LsModel,
) -> LsStatus {
    guard(|| {
        if out.is_null() {
            return Err(invalid("ls_open: out is NULL"));
        }
        // SAFETY: `out` is valid for a write (the header's contract) and not NULL.
        unsafe { *out = std::ptr::null_mut() };
        // SAFETY: the caller passes a string or NULL.
        let path = unsafe { text(path, "the model path") }?
            .ok_or_else(|| invalid("ls_open: the model path is NULL"))?;
        let o = if options.is_null() {
            ls_open_options_default()
        } else {
            // SAFETY: `options` points to a valid LsOpenOptions (the header's contract).
            unsafe { *options }
        };
        // SAFETY: the option strings are NULL or NUL-terminated (the header's contract).
        let policy = match unsafe { text(o.policy, "options.policy") }? {
            None => None,
            Some(name) => Some(PolicyChoice::from_name(name).ok_or_else(|| {
                invalid(format!(
                    "options.policy `{name}` is unknown: use leanstream, resident, dense, mmap, \
                     powerinfer2 or llm-in-flash"
                ))
            })?),
        };
        // SAFETY: as above.
        let flash = unsafe { text(o.flash, "options.flash") }?.unwrap_or("none");
        let flash = FlashProfile::from_flash_arg(flash)
            .map_err(|e| invalid(format!("options.flash: {e:#}")))?;
        let pool = match o.threads {
            0 => None,
            n if n > MAX_THREADS => {
                return Err(invalid(format!(
                    "options.threads {n}: at most {MAX_THREADS} (0: the shared pool, all cores)"
                )))
            }
            n => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n as usize)
                    .thread_name(|i| format!("leanstream-{i}"))
                    .build()
                    .map_err(|e| {
                        (
                            LsStatus::Open,
                            format!("options.threads {n}: cannot start the threads: {e}"),
                        )
                    })?,
            ),
        };
        leanstream::platform::memory::startup_rss_bytes();
        let options = SessionOptions {
            model: PathBuf::from(path),
            policy,
            memory: (o.memory_bytes > 0).then_some(o.memory_bytes),
            flash,
            sparsity: Sparsity::Certified,
            ctx: (o.ctx > 0).then_some(o.ctx as usize),
            default_ctx: 2048,
            kv: Default::default(),
            tuning: Tuning::default(),
            // As the environment asks (LEANSTREAM_GPU, LEANSTREAM_GPU_MEMORY): docs/gpu.md.
            gpu: GpuChoice::from_env(),
        };
        // Opening computes (a converted file's plan, dequantized weights): on the model's threads.
        let mut session = install(pool.as_ref(), || Session::open(&options))
            .map_err(|e| (LsStatus::Open, format!("{e:#}")))?;
        // A streaming model follows the budget `ls_set_memory_budget` sets, between tokens.
        let budget = match session.report()["memory_budget_bytes"].as_u64() {
            Some(bytes) => {
                let (watch, handle) = BudgetWatch::manual(bytes);
                session
                    .follow_budget(watch)
                    .map_err(|e| (LsStatus::Open, format!("{e:#}")))?;
                Some(handle)
            }
            None => None,
        };
        let model = LsModel {
            session: Mutex::new(session),
            budget,
            cancel: AtomicBool::new(false),
            last: Cell::new(metrics_of(None)),
            sequence: RefCell::new(Sequence::default()),
            pool,
        };
        model.last.set(LsMetrics {
            threads: model.threads(),
            ..model.last.get()
        });
        // SAFETY: as above; ownership passes to the caller until `ls_close`.
        unsafe { *out = Box::into_raw(Box::new(model)) };
        Ok(())
    })
}

/// Generates from `prompt`, calling `callback` (may be NULL) with each piece of text. Stops at the
/// end of the text, `max_tokens`, a full context, `ls_cancel`, or when the callback returns false
/// (those two still return `LS_STATUS_OK`; `ls_metrics` tells why it stopped). Clears an earlier
/// `ls_cancel` when it starts.
///
/// # Safety
/// `model` comes from `ls_open` and is not closed; `prompt` is a NUL-terminated string; `options`
/// is NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn ls_generate(
    model: *mut LsModel,
    prompt: *const c_char,
    options: *const LsGenerateOptions,
    callback: LsTokenCallback,
    user_data: *mut c_void,
) -> LsStatus {
    guard(|| {
        // SAFETY: `model` comes from `ls_open` and is open (the header's contract).
        let model =
            unsafe { model.as_ref() }.ok_or_else(|| invalid("ls_generate: model is NULL"))?;
        // SAFETY: the caller passes a string or NULL.
        let prompt = unsafe { text(prompt, "the prompt") }?
            .ok_or_else(|| invalid("ls_generate: the prompt is NULL"))?;
        let o = if options.is_null() {
            ls_generate_options_default()
        } else {
            // SAFETY: `options` points to a valid LsGenerateOptions (the header's contract).
            unsafe { *options }
        };
        model.cancel.store(false, Ordering::SeqCst);
        let messages = [Message::new("user", prompt)];
        let prompt = if o.chat {
            Prompt::Chat(&messages)
        } else {
            Prompt::Text(prompt)
        };
        generate(model, prompt, &o, callback, user_data)
    })
}

/// A multi-turn chat: `messages` (`n_messages` of them, in order) through the model's chat
/// template, the reply generated as `ls_generate` does (`options.chat` is ignored). The caller
/// keeps the conversation: append the reply as an `assistant` message for the next turn.
///
/// # Safety
/// `model` comes from `ls_open` and is not closed; `messages` points to `n_messages` messages
/// whose strings are NUL-terminated; `options` is NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn ls_chat(
    model: *mut LsModel,
    messages: *const LsMessage,
    n_messages: usize,
    options: *const LsGenerateOptions,
    callback: LsTokenCallback,
    user_data: *mut c_void,
) -> LsStatus {
    guard(|| {
        // SAFETY: `model` comes from `ls_open` and is open (the header's contract).
        let model = unsafe { model.as_ref() }.ok_or_else(|| invalid("ls_chat: model is NULL"))?;
        if messages.is_null() || n_messages == 0 {
            return Err(invalid("ls_chat: give at least one message"));
        }
        // SAFETY: `messages` points to `n_messages` messages (the header's contract).
        let list = unsafe { std::slice::from_raw_parts(messages, n_messages) };
        let messages = list
            .iter()
            .enumerate()
            .map(|(i, m)| {
                // SAFETY: each message's strings are NUL-terminated or NULL.
                let role = unsafe { text(m.role, "a message's role") }?
                    .ok_or_else(|| invalid(format!("ls_chat: messages[{i}].role is NULL")))?;
                if !matches!(role, "system" | "user" | "assistant" | "tool") {
                    return Err(invalid(format!(
                        "ls_chat: messages[{i}].role is `{role}`: expected system, user, \
                         assistant or tool"
                    )));
                }
                // SAFETY: as above.
                let content = unsafe { text(m.content, "a message's content") }?
                    .ok_or_else(|| invalid(format!("ls_chat: messages[{i}].content is NULL")))?;
                Ok(Message::new(role, content))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let o = if options.is_null() {
            ls_generate_options_default()
        } else {
            // SAFETY: `options` points to a valid LsGenerateOptions (the header's contract).
            unsafe { *options }
        };
        model.cancel.store(false, Ordering::SeqCst);
        generate(model, Prompt::Chat(&messages), &o, callback, user_data)
    })
}

/// What a generation starts from.
enum Prompt<'a> {
    Text(&'a str),
    Chat(&'a [Message]),
}

fn generate(
    model: &LsModel,
    prompt: Prompt,
    o: &LsGenerateOptions,
    callback: LsTokenCallback,
    user_data: *mut c_void,
) -> Result<(), (LsStatus, String)> {
    let failed = |e: anyhow::Error| (LsStatus::Generate, format!("{e:#}"));
    let mut session = model
        .session
        .try_lock()
        .map_err(|_| invalid("the model is already generating (called from its own callback?)"))?;
    let (ids, eos_token_ids) = match prompt {
        Prompt::Chat(messages) => {
            let format = leanstream::text::chat::ChatFormat::new(&session).map_err(failed)?;
            let ids = format
                .template
                .encode(&session.tokenizer, messages)
                .map_err(failed)?;
            (ids, format.eos_token_ids)
        }
        Prompt::Text(prompt) => {
            let ids = session.tokenizer.encode(prompt, true).map_err(failed)?;
            (ids, session.eos_token_ids.clone())
        }
    };
    let opts = GenerateOptions {
        max_tokens: o.max_tokens.max(1) as usize,
        ctx: session.ctx,
        sampler: SamplerConfig {
            temperature: o.temperature,
            top_k: o.top_k as usize,
            top_p: o.top_p,
            repeat_penalty: o.repeat_penalty,
            seed: o.seed,
            ..Default::default()
        },
        eos_token_ids,
    };
    let tokenizer = session.tokenizer.clone();
    let mut cache = session.model().new_cache(opts.ctx);
    // Called on this thread: only the forward passes run on the model's threads.
    let on_piece = |piece: &str| {
        let Some(callback) = callback else { return };
        let c = CString::new(piece.replace('\0', " ")).expect("NULs replaced");
        if !callback(c.as_ptr(), piece.len(), user_data) {
            model.cancel.store(true, Ordering::SeqCst);
        }
    };
    let lm = OnPool {
        model: session.model(),
        pool: model.pool.as_ref(),
    };
    let generation = generate_after(
        lm,
        &tokenizer,
        &mut cache,
        &[],
        &ids,
        &opts,
        &model.cancel,
        on_piece,
    )
    .map_err(failed)?;
    let mut m = metrics_of(Some(&session));
    m.threads = model.threads();
    let stats = &generation.stats;
    m.prompt_tokens = stats.prompt_tokens as u64;
    m.generated_tokens = stats.generated_tokens as u64;
    m.tokens_per_s = stats.tokens_per_s;
    m.ttft_ms = stats.ttft_ms;
    m.stop_reason = match stats.stop_reason {
        StopReason::Eos => LsStopReason::Eos,
        StopReason::MaxTokens => LsStopReason::MaxTokens,
        StopReason::ContextFull => LsStopReason::ContextFull,
        StopReason::Interrupted => LsStopReason::Cancelled,
    };
    model.last.set(m);
    Ok(())
}

/// The library's version, e.g. `0.2.0` (a static string).
#[no_mangle]
pub extern "C" fn ls_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The library's ABI version: equal to the header's `LEANSTREAM_ABI_VERSION` when they match.
#[no_mangle]
pub extern "C" fn ls_abi_version() -> u32 {
    LEANSTREAM_ABI_VERSION
}

/// The model from a caller's pointer.
///
/// # Safety
/// `model` is NULL or comes from `ls_open` and is not closed.
unsafe fn model_ref<'a>(
    model: *const LsModel,
    call: &str,
) -> Result<&'a LsModel, (LsStatus, String)> {
    // SAFETY: the caller's contract.
    unsafe { model.as_ref() }.ok_or_else(|| invalid(format!("{call}: model is NULL")))
}

/// The token ids of `text` into `tokens` (room for `capacity`); `*n_tokens` is set to how many
/// there are, also when they do not fit (then `LS_STATUS_INVALID_ARGUMENT`: call again with
/// room for `*n_tokens`). With `add_special`, the tokenizer adds its special tokens (BOS where
/// the model has one).
///
/// # Safety
/// `model` comes from `ls_open`; `text` is NUL-terminated; `tokens` has room for `capacity`
/// ids (or is NULL with `capacity` 0); `n_tokens` is valid.
#[no_mangle]
pub unsafe extern "C" fn ls_tokenize(
    model: *const LsModel,
    text_in: *const c_char,
    add_special: bool,
    tokens: *mut u32,
    capacity: usize,
    n_tokens: *mut usize,
) -> LsStatus {
    guard(|| {
        // SAFETY: the header's contract, for each pointer.
        let model = unsafe { model_ref(model, "ls_tokenize") }?;
        let t = unsafe { text(text_in, "the text") }?
            .ok_or_else(|| invalid("ls_tokenize: text is NULL"))?;
        let n_tokens =
            unsafe { n_tokens.as_mut() }.ok_or_else(|| invalid("ls_tokenize: n_tokens is NULL"))?;
        let session = model
            .session
            .try_lock()
            .map_err(|_| invalid("ls_tokenize: the model is generating"))?;
        let ids = session
            .tokenizer
            .encode(t, add_special)
            .map_err(|e| invalid(format!("ls_tokenize: {e:#}")))?;
        *n_tokens = ids.len();
        if ids.len() > capacity || (tokens.is_null() && !ids.is_empty()) {
            return Err(invalid(format!(
                "ls_tokenize: the text has {} tokens, more than the room for {capacity}",
                ids.len()
            )));
        }
        // SAFETY: `tokens` has room for `capacity` >= ids.len() ids.
        unsafe { std::ptr::copy_nonoverlapping(ids.as_ptr(), tokens, ids.len()) };
        Ok(())
    })
}

/// The text of `tokens` (special tokens left out) into `buf` (room for `capacity` bytes, NUL
/// included); `*len` is set to the text's length in bytes without the NUL, also when it does not
/// fit (then `LS_STATUS_INVALID_ARGUMENT`).
///
/// # Safety
/// `model` comes from `ls_open`; `tokens` points to `n_tokens` ids; `buf` has room for
/// `capacity` bytes; `len` is valid.
#[no_mangle]
pub unsafe extern "C" fn ls_detokenize(
    model: *const LsModel,
    tokens: *const u32,
    n_tokens: usize,
    buf: *mut c_char,
    capacity: usize,
    len: *mut usize,
) -> LsStatus {
    guard(|| {
        // SAFETY: the header's contract, for each pointer.
        let model = unsafe { model_ref(model, "ls_detokenize") }?;
        let len = unsafe { len.as_mut() }.ok_or_else(|| invalid("ls_detokenize: len is NULL"))?;
        if tokens.is_null() && n_tokens > 0 {
            return Err(invalid("ls_detokenize: tokens is NULL"));
        }
        let ids = if n_tokens == 0 {
            &[][..]
        } else {
            // SAFETY: `tokens` points to `n_tokens` ids.
            unsafe { std::slice::from_raw_parts(tokens, n_tokens) }
        };
        let mut session = model
            .session
            .try_lock()
            .map_err(|_| invalid("ls_detokenize: the model is generating"))?;
        let vocab = session.model().config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(format!(
                "ls_detokenize: token {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let text = session
            .tokenizer
            .decode(ids)
            .map_err(|e| invalid(format!("ls_detokenize: {e:#}")))?;
        *len = text.len();
        if text.len() + 1 > capacity || buf.is_null() {
            return Err(invalid(format!(
                "ls_detokenize: the text has {} bytes (and a NUL), more than the room for {capacity}",
                text.len()
            )));
        }
        // SAFETY: `buf` has room for `capacity` > text.len() bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
            *buf.add(text.len()) = 0;
        }
        Ok(())
    })
}

/// Appends `tokens` to the model's token-level sequence (computing them into its KV cache) and
/// keeps the logits of the last one for `ls_logits` and `ls_sample`. The sequence is separate
/// from `ls_generate`'s and `ls_chat`'s; `ls_reset` empties it.
///
/// # Safety
/// `model` comes from `ls_open`; `tokens` points to `n_tokens` ids.
#[no_mangle]
pub unsafe extern "C" fn ls_eval(
    model: *mut LsModel,
    tokens: *const u32,
    n_tokens: usize,
) -> LsStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let model = unsafe { model_ref(model, "ls_eval") }?;
        if tokens.is_null() || n_tokens == 0 {
            return Err(invalid("ls_eval: give at least one token"));
        }
        // SAFETY: `tokens` points to `n_tokens` ids.
        let ids = unsafe { std::slice::from_raw_parts(tokens, n_tokens) };
        let mut session = model
            .session
            .try_lock()
            .map_err(|_| invalid("ls_eval: the model is generating"))?;
        let mut seq = model.sequence.borrow_mut();
        let ctx = session.ctx;
        let vocab = session.model().config().vocab_size;
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(format!(
                "ls_eval: token {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if seq.tokens.len() + ids.len() > ctx {
            return Err(invalid(format!(
                "ls_eval: {} tokens after the sequence's {} are over the context of {ctx} (ls_reset starts again)",
                ids.len(),
                seq.tokens.len()
            )));
        }
        let Sequence {
            cache,
            tokens: seq_tokens,
            logits,
        } = &mut *seq;
        let m = session.model();
        let cache = cache.get_or_insert_with(|| m.new_cache(ctx));
        let chunk = m.prompt_chunk();
        model
            .on_threads(|| {
                ids.chunks(chunk)
                    .try_for_each(|part| m.forward_into(part, cache, false, logits))
            })
            .map_err(|e| (LsStatus::Generate, format!("ls_eval: {e:#}")))?;
        seq_tokens.extend_from_slice(ids);
        Ok(())
    })
}

/// The logits of the last token `ls_eval` computed (`*n_vocab` of them), valid until the next
/// `ls_eval`, `ls_reset` or `ls_close`; NULL (and `*n_vocab` 0) before any.
///
/// # Safety
/// `model` comes from `ls_open`; `n_vocab` is NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn ls_logits(model: *const LsModel, n_vocab: *mut usize) -> *const f32 {
    // SAFETY: the header's contract.
    let Some(model) = (unsafe { model.as_ref() }) else {
        return std::ptr::null();
    };
    let Ok(seq) = model.sequence.try_borrow() else {
        return std::ptr::null();
    };
    // SAFETY: the header's contract.
    if let Some(n) = unsafe { n_vocab.as_mut() } {
        *n = seq.logits.len();
    }
    if seq.logits.is_empty() {
        std::ptr::null()
    } else {
        seq.logits.as_ptr()
    }
}

/// Picks the next token from the last logits with `options`' sampling (temperature, top-k,
/// top-p, repetition penalty over the sequence; the seed mixed with the sequence length, so a
/// run repeats). Does not append it: pass it to `ls_eval`.
///
/// # Safety
/// `model` comes from `ls_open`; `options` is NULL or valid; `token` is valid.
#[no_mangle]
pub unsafe extern "C" fn ls_sample(
    model: *const LsModel,
    options: *const LsGenerateOptions,
    token: *mut u32,
) -> LsStatus {
    guard(|| {
        // SAFETY: the header's contract, for each pointer.
        let model = unsafe { model_ref(model, "ls_sample") }?;
        let token = unsafe { token.as_mut() }.ok_or_else(|| invalid("ls_sample: token is NULL"))?;
        let o = if options.is_null() {
            ls_generate_options_default()
        } else {
            // SAFETY: `options` points to a valid LsGenerateOptions.
            unsafe { *options }
        };
        let seq = model.sequence.borrow();
        if seq.logits.is_empty() {
            return Err(invalid("ls_sample: no logits yet: ls_eval a token first"));
        }
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: o.temperature,
            top_k: o.top_k as usize,
            top_p: o.top_p,
            repeat_penalty: o.repeat_penalty,
            seed: o.seed ^ (seq.tokens.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            ..Default::default()
        });
        let mut logits = seq.logits.clone();
        *token = sampler.sample(&mut logits, &seq.tokens);
        Ok(())
    })
}

/// Saves the token-level sequence (its tokens, KV cache and last logits) into `buf` (room for
/// `capacity` bytes); `*size` is set to the bytes it takes, also when they do not fit (then
/// `LS_STATUS_INVALID_ARGUMENT`: call again with room for `*size`, or with `buf` NULL to ask).
/// `ls_state_load` puts it back, on this model or another open of the same file.
///
/// # Safety
/// `model` comes from `ls_open`; `buf` has room for `capacity` bytes or is NULL; `size` is valid.
#[no_mangle]
pub unsafe extern "C" fn ls_state_save(
    model: *const LsModel,
    buf: *mut u8,
    capacity: usize,
    size: *mut usize,
) -> LsStatus {
    guard(|| {
        // SAFETY: the header's contract, for each pointer.
        let model = unsafe { model_ref(model, "ls_state_save") }?;
        let size =
            unsafe { size.as_mut() }.ok_or_else(|| invalid("ls_state_save: size is NULL"))?;
        let seq = model
            .sequence
            .try_borrow()
            .map_err(|_| invalid("ls_state_save: the sequence is in use"))?;
        let mut state = Vec::new();
        state.extend_from_slice(&(seq.tokens.len() as u64).to_le_bytes());
        for t in &seq.tokens {
            state.extend_from_slice(&t.to_le_bytes());
        }
        state.extend_from_slice(&(seq.logits.len() as u64).to_le_bytes());
        for l in &seq.logits {
            state.extend_from_slice(&l.to_le_bytes());
        }
        if let Some(cache) = &seq.cache {
            state.extend_from_slice(&cache.save());
        }
        *size = state.len();
        if buf.is_null() || capacity < state.len() {
            return Err(invalid(format!(
                "ls_state_save: the state takes {} bytes, more than the room for {capacity}",
                state.len()
            )));
        }
        // SAFETY: `buf` has room for `capacity` >= state.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(state.as_ptr(), buf, state.len()) };
        Ok(())
    })
}

/// Replaces the token-level sequence with one `ls_state_save` wrote (`size` bytes at `buf`).
///
/// # Safety
/// `model` comes from `ls_open`; `buf` points to `size` bytes.
#[no_mangle]
pub unsafe extern "C" fn ls_state_load(
    model: *mut LsModel,
    buf: *const u8,
    size: usize,
) -> LsStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let model = unsafe { model_ref(model, "ls_state_load") }?;
        if buf.is_null() {
            return Err(invalid("ls_state_load: buf is NULL"));
        }
        // SAFETY: `buf` points to `size` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(buf, size) };
        let bad = |why: &str| invalid(format!("ls_state_load: {why}"));
        let mut at = 0;
        let mut take = |n: usize| -> Result<&[u8], (LsStatus, String)> {
            let part = bytes
                .get(at..at + n)
                .ok_or_else(|| bad("the state is cut short"))?;
            at += n;
            Ok(part)
        };
        let count = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize;
        let n_tokens = count(take(8)?);
        let tokens: Vec<u32> = take(4 * n_tokens)?
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let n_logits = count(take(8)?);
        let logits: Vec<f32> = take(4 * n_logits)?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let kv = &bytes[at..];
        let mut session = model
            .session
            .try_lock()
            .map_err(|_| invalid("ls_state_load: the model is generating"))?;
        let ctx = session.ctx;
        let mut seq = model
            .sequence
            .try_borrow_mut()
            .map_err(|_| invalid("ls_state_load: the sequence is in use"))?;
        let m = session.model();
        if !logits.is_empty() && logits.len() != m.config().vocab_size {
            return Err(bad("the state is of a model with another vocabulary"));
        }
        let cache = seq.cache.get_or_insert_with(|| m.new_cache(ctx));
        if kv.is_empty() {
            cache.clear();
        } else {
            cache.restore(kv).map_err(|e| bad(&e))?;
        }
        if cache.len() != tokens.len() {
            cache.clear();
            return Err(bad("its KV cache and its tokens disagree"));
        }
        seq.tokens = tokens;
        seq.logits = logits;
        Ok(())
    })
}

/// Whether `token` ends the model's text (one of its end-of-sequence tokens); false for a NULL
/// model.
///
/// # Safety
/// `model` is NULL or comes from `ls_open` and is not closed.
#[no_mangle]
pub unsafe extern "C" fn ls_is_end_token(model: *const LsModel, token: u32) -> bool {
    // SAFETY: the header's contract.
    let Some(model) = (unsafe { model.as_ref() }) else {
        return false;
    };
    model
        .session
        .try_lock()
        .is_ok_and(|s| s.eos_token_ids.contains(&token))
}

/// Empties the token-level sequence (`ls_eval`'s tokens and cache).
///
/// # Safety
/// `model` comes from `ls_open` and is not closed.
#[no_mangle]
pub unsafe extern "C" fn ls_reset(model: *mut LsModel) -> LsStatus {
    guard(|| {
        // SAFETY: the header's contract.
        let model = unsafe { model_ref(model, "ls_reset") }?;
        let mut seq = model
            .sequence
            .try_borrow_mut()
            .map_err(|_| invalid("ls_reset: the sequence is in use"))?;
        if let Some(cache) = seq.cache.as_mut() {
            cache.clear();
        }
        seq.tokens.clear();
        seq.logits.clear();
        Ok(())
    })
}

/// The runtime's running figures (no generation figures yet).
fn metrics_of(session: Option<&Session>) -> LsMetrics {
    let report = session.map(Session::report).unwrap_or_default();
    let number = |key: &str| report.get(key).and_then(|v| v.as_f64()).unwrap_or(0.0);
    LsMetrics {
        prompt_tokens: 0,
        generated_tokens: 0,
        tokens_per_s: 0.0,
        ttft_ms: 0.0,
        stop_reason: LsStopReason::None,
        bytes_read_per_token: number("bytes_read_per_token"),
        cache_hit_rate: number("cache_hit_rate"),
        memory_budget_bytes: number("memory_budget_bytes") as u64,
        peak_rss_bytes: leanstream::platform::memory::peak_rss_bytes().unwrap_or(0),
        threads: 0,
    }
}

/// Asks the generation running on `model` to stop after its current token; safe from any thread.
///
/// # Safety
/// `model` comes from `ls_open` and is not closed.
#[no_mangle]
pub unsafe extern "C" fn ls_cancel(model: *const LsModel) -> LsStatus {
    guard(|| {
        if model.is_null() {
            return Err(invalid("ls_cancel: model is NULL"));
        }
        // SAFETY: `model` comes from `ls_open` and is open (the header's contract). Only the
        // atomic flag is referenced, never the model as a whole: the thread generating may hold
        // a reference to it.
        let cancel = unsafe { &*std::ptr::addr_of!((*model).cancel) };
        cancel.store(true, Ordering::SeqCst);
        Ok(())
    })
}

/// Sets the memory budget of a model opened with one (`memory_bytes` > 0). Called while no other
/// call runs on the model (from any thread), it takes the budget now: the neuron cache shrinks
/// and the memory is returned to the OS before this returns, and a budget below what the model
/// needs fails with `LS_STATUS_INVALID_ARGUMENT` (the old budget stays). Called while a
/// generation runs (from another thread, or from the token callback), it returns at once and the
/// budget is taken before the next token (a refused one is reported on stderr and leaves the old
/// budget); `ls_metrics`' `memory_budget_bytes` says when it was taken.
///
/// # Safety
/// `model` comes from `ls_open` and is not closed.
#[no_mangle]
pub unsafe extern "C" fn ls_set_memory_budget(model: *const LsModel, bytes: u64) -> LsStatus {
    guard(|| {
        if model.is_null() {
            return Err(invalid("ls_set_memory_budget: model is NULL"));
        }
        if bytes == 0 {
            return Err(invalid("ls_set_memory_budget: the budget must be positive"));
        }
        // SAFETY: `model` comes from `ls_open` and is open (the header's contract). From any
        // thread only the session's lock and the budget handle (an atomic) are referenced, never
        // the model as a whole, whose other parts the thread using it may be changing.
        let (session, handle) = unsafe {
            (
                &*std::ptr::addr_of!((*model).session),
                &*std::ptr::addr_of!((*model).budget),
            )
        };
        let Some(handle) = handle else {
            return Err(invalid(
                "ls_set_memory_budget: the model was opened without a budget (options.memory_bytes 0) or with the dense policy",
            ));
        };
        // Not in use (no call runs on it): take the budget now.
        if let Ok(mut session) = session.try_lock() {
            session
                .set_memory_budget(bytes)
                .map_err(|e| invalid(format!("{e:#}")))?;
        }
        // Idle: already taken, and taking it again changes nothing. Generating: taken before
        // the next token.
        handle.set(bytes);
        Ok(())
    })
}

/// Copies the last generation's figures and the model's running totals into `*out`.
///
/// # Safety
/// `model` comes from `ls_open` and is not closed; `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn ls_metrics(model: *const LsModel, out: *mut LsMetrics) -> LsStatus {
    guard(|| {
        // SAFETY: `model` comes from `ls_open` and is open (the header's contract).
        let model =
            unsafe { model.as_ref() }.ok_or_else(|| invalid("ls_metrics: model is NULL"))?;
        if out.is_null() {
            return Err(invalid("ls_metrics: out is NULL"));
        }
        let m = LsMetrics {
            peak_rss_bytes: leanstream::platform::memory::peak_rss_bytes().unwrap_or(0),
            ..model.last.get()
        };
        // SAFETY: `out` is valid for a write (the header's contract) and not NULL.
        unsafe { *out = m };
        Ok(())
    })
}

/// Closes `model` and frees its memory; NULL is ignored.
///
/// # Safety
/// `model` comes from `ls_open` and is closed only once; nothing uses it afterwards.
#[no_mangle]
pub unsafe extern "C" fn ls_close(model: *mut LsModel) {
    guard(|| {
        if !model.is_null() {
            // SAFETY: `model` came from `Box::into_raw` in `ls_open` and is closed only once.
            drop(unsafe { Box::from_raw(model) });
        }
        Ok(())
    });
}

/// The message of the last failed call on this thread ("" if none): valid until the next failed
/// call on this thread.
#[no_mangle]
pub extern "C" fn ls_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: ls_last_error returns a NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(ls_last_error()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let status = guard(|| panic!("boom {}", 7));
        assert_eq!(status, LsStatus::Panic);
        assert!(last_error().contains("boom 7"), "{}", last_error());
    }

    #[test]
    fn bad_arguments_are_refused_with_a_message() {
        let mut model = std::ptr::null_mut();
        // SAFETY: the arguments follow the contract (NULL is allowed and refused).
        let status = unsafe { ls_open(std::ptr::null(), std::ptr::null(), &mut model) };
        assert_eq!(status, LsStatus::InvalidArgument);
        assert!(last_error().contains("path is NULL"), "{}", last_error());
        let policy = CString::new("fastest").unwrap();
        let path = CString::new("/nonexistent").unwrap();
        let options = LsOpenOptions {
            policy: policy.as_ptr(),
            ..ls_open_options_default()
        };
        // SAFETY: valid strings and options.
        let status = unsafe { ls_open(path.as_ptr(), &options, &mut model) };
        assert_eq!(status, LsStatus::InvalidArgument);
        assert!(
            last_error().contains("`fastest` is unknown"),
            "{}",
            last_error()
        );
        assert!(model.is_null());
        // SAFETY: NULL models are refused, not dereferenced.
        unsafe {
            assert_eq!(ls_cancel(std::ptr::null()), LsStatus::InvalidArgument);
            assert_eq!(
                ls_generate(
                    std::ptr::null_mut(),
                    path.as_ptr(),
                    std::ptr::null(),
                    None,
                    std::ptr::null_mut()
                ),
                LsStatus::InvalidArgument
            );
            ls_close(std::ptr::null_mut());
            assert_eq!(
                ls_set_memory_budget(std::ptr::null(), 1 << 30),
                LsStatus::InvalidArgument
            );
        }
    }

    /// What a token callback saw: the text, how many calls, and how many of them ran elsewhere
    /// than on the thread that called `ls_generate` (or on a compute thread).
    struct Seen {
        text: String,
        caller: std::thread::ThreadId,
        calls: usize,
        elsewhere: usize,
    }

    extern "C" fn record(piece: *const c_char, len: usize, user_data: *mut c_void) -> bool {
        // SAFETY: `user_data` is the `Seen` that `greedy` passes, `piece` has `len` bytes.
        let (seen, bytes) = unsafe {
            (
                &mut *user_data.cast::<Seen>(),
                std::slice::from_raw_parts(piece.cast::<u8>(), len),
            )
        };
        seen.text.push_str(std::str::from_utf8(bytes).unwrap());
        seen.calls += 1;
        if std::thread::current().id() != seen.caller || rayon::current_thread_index().is_some() {
            seen.elsewhere += 1;
        }
        true
    }

    /// 24 greedy tokens of austen-relu from `model` (an `LsModel` address) on this thread: the
    /// text, the callback's calls, those made elsewhere, and the model's thread count.
    fn greedy(model: usize) -> (String, usize, usize, u32) {
        let model = model as *mut LsModel;
        let prompt = CString::new("It is a truth universally").unwrap();
        let options = LsGenerateOptions {
            max_tokens: 24,
            temperature: 0.0,
            ..ls_generate_options_default()
        };
        let mut seen = Seen {
            text: String::new(),
            caller: std::thread::current().id(),
            calls: 0,
            elsewhere: 0,
        };
        let mut m = metrics_of(None);
        // SAFETY: `model` is open and used by this thread alone during the call; `seen` outlives it.
        unsafe {
            let status = ls_generate(
                model,
                prompt.as_ptr(),
                &options,
                Some(record),
                std::ptr::addr_of_mut!(seen).cast(),
            );
            assert_eq!(status, LsStatus::Ok, "{}", last_error());
            assert_eq!(ls_metrics(model, &mut m), LsStatus::Ok);
        }
        assert_eq!(m.generated_tokens, 24);
        (seen.text, seen.calls, seen.elsewhere, m.threads)
    }

    #[test]
    fn models_with_their_own_threads_give_their_tokens_and_call_back_on_the_caller() {
        let path = CString::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/austen-relu"
        ))
        .unwrap();
        let open = |threads| {
            let mut model = std::ptr::null_mut();
            let options = LsOpenOptions {
                threads,
                ..ls_open_options_default()
            };
            // SAFETY: a valid path, options and out pointer.
            let status = unsafe { ls_open(path.as_ptr(), &options, &mut model) };
            assert_eq!(status, LsStatus::Ok, "{}", last_error());
            model as usize
        };
        let (one, two) = (open(1), open(2));
        let alone = [greedy(one), greedy(two)];
        for ((text, calls, elsewhere, threads), want) in alone.iter().zip([1, 2]) {
            assert!(*calls > 0 && !text.is_empty(), "{text:?}");
            assert_eq!(*elsewhere, 0, "every callback on the calling thread");
            assert_eq!(*threads, want);
        }
        assert_eq!(
            alone[0].0, alone[1].0,
            "the same greedy text on 1 and 2 threads"
        );
        // Both at once, each from a thread of its own: each gives what it gave alone.
        let together = std::thread::scope(|s| {
            let a = s.spawn(|| greedy(one));
            let b = s.spawn(|| greedy(two));
            [a.join().unwrap(), b.join().unwrap()]
        });
        assert_eq!(together, alone);
        // A thread count no machine has is refused with a message, not tried.
        let mut model = std::ptr::null_mut();
        let options = LsOpenOptions {
            threads: MAX_THREADS + 1,
            ..ls_open_options_default()
        };
        // SAFETY: valid pointers; the models are closed once.
        unsafe {
            let status = ls_open(path.as_ptr(), &options, &mut model);
            assert_eq!(status, LsStatus::InvalidArgument);
            assert!(last_error().contains("at most 1024"), "{}", last_error());
            ls_close(one as *mut LsModel);
            ls_close(two as *mut LsModel);
        }
    }

    #[test]
    fn a_model_without_a_budget_refuses_a_new_one() {
        let path = CString::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/austen-relu"
        ))
        .unwrap();
        let mut model = std::ptr::null_mut();
        // SAFETY: a valid path, default options, a valid out pointer.
        let status = unsafe { ls_open(path.as_ptr(), std::ptr::null(), &mut model) };
        assert_eq!(status, LsStatus::Ok, "{}", last_error());
        // SAFETY: `model` is open; closed once below.
        unsafe {
            assert_eq!(ls_set_memory_budget(model, 0), LsStatus::InvalidArgument);
            assert!(last_error().contains("positive"), "{}", last_error());
            assert_eq!(
                ls_set_memory_budget(model, 1 << 30),
                LsStatus::InvalidArgument
            );
            assert!(
                last_error().contains("opened without a budget"),
                "{}",
                last_error()
            );
            ls_close(model);
        }
    }

    #[test]
    fn a_saved_state_gives_the_same_logits_again() {
        let path = CString::new(
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/austen-relu").to_string(),
        )
        .unwrap();
        let mut model = std::ptr::null_mut();
        let options = ls_open_options_default();
        // SAFETY: valid pointers throughout; the model is closed at the end.
        unsafe {
            assert_eq!(ls_open(path.as_ptr(), &options, &mut model), LsStatus::Ok);
            let prompt = CString::new("It is a truth universally").unwrap();
            let mut tokens = [0u32; 64];
            let mut n = 0;
            let status = ls_tokenize(
                model,
                prompt.as_ptr(),
                true,
                tokens.as_mut_ptr(),
                64,
                &mut n,
            );
            assert_eq!(status, LsStatus::Ok);
            assert_eq!(ls_eval(model, tokens.as_ptr(), n), LsStatus::Ok);
            let mut size = 0;
            assert_eq!(
                ls_state_save(model, std::ptr::null_mut(), 0, &mut size),
                LsStatus::InvalidArgument
            );
            let mut state = vec![0u8; size];
            assert_eq!(
                ls_state_save(model, state.as_mut_ptr(), size, &mut size),
                LsStatus::Ok
            );
            let logits = |model| {
                let mut v = 0;
                let p = ls_logits(model, &mut v);
                std::slice::from_raw_parts(p, v).to_vec()
            };
            let before = logits(model);
            let next = [tokens[1]];
            assert_eq!(ls_eval(model, next.as_ptr(), 1), LsStatus::Ok);
            let after_next = logits(model);
            assert_ne!(after_next, before);
            // Back to the saved state, on a model with other tokens in between.
            assert_eq!(ls_eval(model, next.as_ptr(), 1), LsStatus::Ok);
            assert_eq!(ls_state_load(model, state.as_ptr(), size), LsStatus::Ok);
            assert_eq!(logits(model), before);
            assert_eq!(ls_eval(model, next.as_ptr(), 1), LsStatus::Ok);
            assert_eq!(logits(model), after_next, "bit-identical after a restore");
            // A damaged state is refused with a message.
            assert_eq!(
                ls_state_load(model, state.as_ptr(), size - 1),
                LsStatus::InvalidArgument
            );
            assert!(last_error().contains("ls_state_load"), "{}", last_error());
            // The model moves to another thread, which uses it and closes it.
            let address = model as usize;
            let on_other = std::thread::spawn(move || {
                let model = address as *mut LsModel;
                let status = ls_state_load(model, state.as_ptr(), size);
                let status2 = ls_eval(model, next.as_ptr(), 1);
                let logits = logits(model);
                ls_close(model);
                (status, status2, logits)
            });
            let (status, status2, moved) = on_other.join().unwrap();
            assert_eq!((status, status2), (LsStatus::Ok, LsStatus::Ok));
            assert_eq!(moved, after_next, "the same logits on another thread");
        }
    }
}
