//! Key/value cache of one sequence, stored as f32, f16 (the default, as in llama.cpp) or Q8_0
//! rows, and attention over it.
//!
//! Laid out `[layer][kv_head][position][head_dim]` so that one head's attention reads contiguous
//! memory. Each layer's keys and values are one anonymous mapping sized for the whole context
//! ([`AlignedBuf`]): the OS commits its pages as positions are written, so a short sequence holds
//! only what it wrote while the planner still reserves the full context. Attention reads the rows
//! as stored — the dot products and weighted sums decode f16 or Q8_0 in registers through the row
//! kernels — so no step converts the cache to f32.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use half::f16;
use leanstream_format::quant::{dequantize_row, row_bytes, QuantType, BLOCK_LEN};
use serde::Serialize;

use crate::kernels::{dot, RowKernels};
use crate::source::config::ModelConfig;
use crate::storage::AlignedBuf;

/// How the cache stores keys and values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvType {
    /// Exactly what attention computed (the reference).
    F32,
    /// Half the bytes; perplexity within 0.1 % of f32 on the embedded model and SmolLM2.
    #[default]
    F16,
    /// Blocks of 32 int8 values with an f16 scale: 34 bytes per 32 values.
    Q8_0,
}

impl KvType {
    /// Every storage, most bytes first.
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Q8_0];

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    fn qtype(self) -> QuantType {
        match self {
            KvType::F32 => QuantType::F32,
            KvType::F16 => QuantType::F16,
            KvType::Q8_0 => QuantType::Q8_0,
        }
    }

    /// Bytes of one head's keys (or values) at one position, or why `head_dim` cannot be stored.
    pub fn row_bytes(self, head_dim: usize) -> Result<usize, String> {
        row_bytes(self.qtype(), head_dim).map_err(|_| {
            format!(
                "--kv {} needs a head dimension that is a multiple of {BLOCK_LEN}, not {head_dim}: use --kv f16",
                self.name()
            )
        })
    }
}

/// The first bytes of a saved cache ([`KvCache::save`]), with the layout's version.
const STATE_MAGIC: &[u8; 8] = b"LSKVST01";

pub struct KvCache {
    kv: KvType,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Bytes of one head's row at one position.
    row: usize,
    len: usize,
    keys: Vec<AlignedBuf>,
    values: Vec<AlignedBuf>,
    kernels: &'static RowKernels,
    /// Positions whose pages are counted in `ledger` (all that were written, and more).
    counted: usize,
    ledger: Option<Arc<KvLedger>>,
}

/// Positions a cache counts at a time in its [`KvLedger`] ([`KvCache::reserve`]): a reservation
/// changes once every this many tokens, not every token.
pub const RESERVE_STEP: usize = 64;

/// The bytes of KV pages that the caches of one model may have committed, counted before they are
/// written: the streaming engine lends the neuron cache the part of the KV cache's planned bytes
/// that no cache has reached yet, and takes it back before a cache reaches it.
#[derive(Debug, Default)]
pub struct KvLedger(AtomicU64);

impl KvLedger {
    /// Bytes counted by the live caches that share this ledger.
    pub fn committed(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

impl KvCache {
    /// A cache for up to `capacity` positions; memory is committed as positions are written.
    ///
    /// # Panics
    /// If `kv` cannot store rows of the model's head dimension (see [`KvType::row_bytes`]; the
    /// command line checks that first).
    pub fn new(config: &ModelConfig, capacity: usize, kv: KvType) -> Self {
        let row = kv
            .row_bytes(config.head_dim)
            .unwrap_or_else(|e| panic!("{e}"));
        let layer = Self::layer_bytes(config, capacity, row);
        Self {
            kv,
            capacity,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            row,
            len: 0,
            keys: (0..config.num_layers)
                .map(|_| AlignedBuf::new(layer))
                .collect(),
            values: (0..config.num_layers)
                .map(|_| AlignedBuf::new(layer))
                .collect(),
            kernels: RowKernels::best(),
            counted: 0,
            ledger: None,
        }
    }

    /// This (new) cache, counting the pages it will commit in `ledger` ([`KvCache::reserve`]).
    pub fn with_ledger(mut self, ledger: Arc<KvLedger>) -> Self {
        debug_assert_eq!(self.counted, 0);
        self.ledger = Some(ledger);
        self
    }

    /// Whether this cache counts its pages in `ledger`.
    pub fn counts_in(&self, ledger: &Arc<KvLedger>) -> bool {
        self.ledger.as_ref().is_some_and(|l| Arc::ptr_eq(l, ledger))
    }

    /// Counts in the ledger the pages that writing positions `0..positions` commits, before they
    /// are written: a whole [`RESERVE_STEP`] of positions at a time, at most the capacity.
    /// Storing a position beyond the count reserves it first, so the ledger never holds less
    /// than the pages written.
    pub fn reserve(&mut self, positions: usize) {
        if positions <= self.counted {
            return;
        }
        let to = reserve_end(positions, self.capacity);
        if let Some(ledger) = &self.ledger {
            let more = self.pages_bytes(to) - self.pages_bytes(self.counted);
            ledger.0.fetch_add(more, Ordering::AcqRel);
        }
        self.counted = to;
    }

    /// Bytes of the pages that positions `0..positions` of every layer, head, keys and values
    /// touch (a head's rows may start inside a page: that page counts).
    fn pages_bytes(&self, positions: usize) -> u64 {
        Self::pages_for(
            self.keys.len(),
            self.kv_heads,
            self.capacity,
            self.row,
            positions,
        )
    }

    fn pages_for(
        layers: usize,
        heads: usize,
        capacity: usize,
        row: usize,
        positions: usize,
    ) -> u64 {
        if positions == 0 {
            return 0;
        }
        let page = AlignedBuf::ALIGN;
        let per_layer: usize = (0..heads)
            .map(|h| {
                let start = h * capacity.max(1) * row;
                (start + positions * row).div_ceil(page) - start / page
            })
            .sum();
        (2 * layers * per_layer * page) as u64
    }

    /// What [`KvCache::reserve`] counts for the first `positions` positions of a cache of
    /// `capacity`: the start of a run, before any cache exists, reserves the first step.
    pub fn reserved_for(
        config: &ModelConfig,
        capacity: usize,
        kv: KvType,
        positions: usize,
    ) -> u64 {
        let row = kv
            .row_bytes(config.head_dim)
            .unwrap_or_else(|e| panic!("{e}"));
        let to = reserve_end(positions, capacity);
        Self::pages_for(config.num_layers, config.num_kv_heads, capacity, row, to)
    }

    /// Gives layer `l`'s pages back to the OS (fresh, uncommitted buffers take their place): the
    /// converter runs one layer at a time over many windows and is done with a layer's cache
    /// when it moves to the next. The cache's other layers and its length are unchanged.
    pub fn release_layer(&mut self, l: usize) {
        let bytes =
            (self.kv_heads * self.capacity.max(1) * self.row).next_multiple_of(AlignedBuf::ALIGN);
        self.keys[l] = AlignedBuf::new(bytes);
        self.values[l] = AlignedBuf::new(bytes);
    }

    /// One layer's keys (or values), in whole pages.
    fn layer_bytes(config: &ModelConfig, capacity: usize, row: usize) -> usize {
        (config.num_kv_heads * capacity.max(1) * row).next_multiple_of(AlignedBuf::ALIGN)
    }

    /// Bytes a full cache of `capacity` positions commits: what the planner reserves.
    pub fn bytes_for(config: &ModelConfig, capacity: usize, kv: KvType) -> usize {
        let row = kv
            .row_bytes(config.head_dim)
            .unwrap_or_else(|e| panic!("{e}"));
        2 * config.num_layers * Self::layer_bytes(config, capacity, row)
    }

    pub fn kv_type(&self) -> KvType {
        self.kv
    }

    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Keeps the first `len` positions and forgets the rest (a conversation that diverges there).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Forgets every position (the memory stays committed).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The stored positions as bytes (a sequence's state to save): a header (format, storage
    /// type, shape, length), then each layer's keys and values for positions `0..len`, head by
    /// head.
    pub fn save(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(64 + 2 * self.keys.len() * self.kv_heads * self.len * self.row);
        out.extend_from_slice(STATE_MAGIC);
        let name = self.kv.name().as_bytes();
        for n in [
            name.len(),
            self.keys.len(),
            self.kv_heads,
            self.head_dim,
            self.len,
        ] {
            out.extend_from_slice(&(n as u32).to_le_bytes());
        }
        out.extend_from_slice(name);
        for layer in 0..self.keys.len() {
            for buf in [&self.keys[layer], &self.values[layer]] {
                for h in 0..self.kv_heads {
                    out.extend_from_slice(&buf[self.rows(h, 0, self.len)]);
                }
            }
        }
        out
    }

    /// Replaces the stored positions with a state [`save`](Self::save) wrote for a cache of the
    /// same model and storage type; the error says what differs.
    pub fn restore(&mut self, bytes: &[u8]) -> Result<(), String> {
        let rest = bytes
            .strip_prefix(STATE_MAGIC)
            .ok_or("not a saved KV cache (its magic is wrong)")?;
        let word = |i: usize| -> Result<usize, String> {
            rest.get(4 * i..4 * i + 4)
                .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
                .ok_or_else(|| "the saved KV cache is cut short".to_string())
        };
        let (name_len, layers, heads, head_dim, len) =
            (word(0)?, word(1)?, word(2)?, word(3)?, word(4)?);
        let name = rest
            .get(20..20 + name_len)
            .ok_or("the saved KV cache is cut short")?;
        if name != self.kv.name().as_bytes() {
            return Err(format!(
                "the saved KV cache stores {} rows, this one {}",
                String::from_utf8_lossy(name),
                self.kv.name()
            ));
        }
        if (layers, heads, head_dim) != (self.keys.len(), self.kv_heads, self.head_dim) {
            return Err(format!(
                "the saved KV cache is of another model: {layers} layers, {heads} KV heads of \
                 {head_dim}, not {}, {} of {}",
                self.keys.len(),
                self.kv_heads,
                self.head_dim
            ));
        }
        if len > self.capacity {
            return Err(format!(
                "the saved KV cache holds {len} positions, more than this context of {}",
                self.capacity
            ));
        }
        let data = &rest[20 + name_len..];
        self.reserve(len);
        let span = len * self.row;
        if data.len() != 2 * layers * heads * span {
            return Err("the saved KV cache has the wrong size".into());
        }
        let mut chunks = data.chunks_exact(span.max(1));
        for layer in 0..layers {
            for keys in [true, false] {
                for h in 0..heads {
                    let at = self.rows(h, 0, len);
                    let buf = if keys {
                        &mut self.keys[layer]
                    } else {
                        &mut self.values[layer]
                    };
                    if span > 0 {
                        buf[at].copy_from_slice(chunks.next().expect("the size was checked"));
                    }
                }
            }
        }
        self.len = len;
        Ok(())
    }

    /// `kv_head`'s keys (`keys`) or values of `layer` at positions `0..len()`, decoded to f32 into
    /// `out` (`len() × head_dim` values, position by position): what a copy of the cache kept
    /// elsewhere (the GPU's) is filled from.
    pub fn decode_head(&self, layer: usize, keys: bool, kv_head: usize, out: &mut [f32]) {
        let buf = if keys {
            &self.keys[layer]
        } else {
            &self.values[layer]
        };
        let rows = &buf[self.rows(kv_head, 0, self.len)];
        let hd = self.head_dim;
        for (row, o) in rows.chunks_exact(self.row).zip(out.chunks_exact_mut(hd)) {
            dequantize_row(self.kv.qtype(), row, o).expect("rows of this cache's own storage");
        }
    }

    /// Byte range of `kv_head`'s rows for positions `start..end` within a layer's buffer.
    fn rows(&self, kv_head: usize, start: usize, end: usize) -> std::ops::Range<usize> {
        let base = kv_head * self.capacity;
        (base + start) * self.row..(base + end) * self.row
    }

    /// Stores keys and values (`kv_heads × head_dim` each) of layer `layer` at position `pos`.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        debug_assert!(pos < self.capacity);
        if pos >= self.counted {
            self.reserve(pos + 1);
        }
        let hd = self.head_dim;
        for h in 0..self.kv_heads {
            let at = self.rows(h, pos, pos + 1);
            let src = h * hd..(h + 1) * hd;
            encode(self.kv, &k[src.clone()], &mut self.keys[layer][at.clone()]);
            encode(self.kv, &v[src], &mut self.values[layer][at]);
        }
    }

    /// One head's attention over positions `lo..hi` of `layer`:
    /// `out = softmax(scale · K q) · V`, with `K` and `V` the rows of `kv_head`, each score soft-capped
    /// to `cap · tanh(score / cap)` first when `softcap` is given (Gemma 2). `scores` is working
    /// space of `hi − lo` values.
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        layer: usize,
        kv_head: usize,
        lo: usize,
        hi: usize,
        q: &[f32],
        scale: f32,
        softcap: Option<f32>,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        debug_assert!(hi <= self.capacity && scores.len() == hi - lo);
        let range = self.rows(kv_head, lo, hi);
        let (keys, values) = (&self.keys[layer][range.clone()], &self.values[layer][range]);
        let k = self.kernels;
        // The float caches' rows go to the kernels all at once (several dots side by side, each
        // output kept in registers across the values' rows): each score and output has the bits
        // of one row at a time.
        let float = match self.kv {
            KvType::F32 => Some(QuantType::F32),
            KvType::F16 => Some(QuantType::F16),
            KvType::Q8_0 => None,
        };
        match float {
            Some(qtype) => {
                k.dots_next(qtype, keys, self.row, q, scores);
                scores.iter_mut().for_each(|s| *s *= scale);
            }
            None => {
                let keys = keys.chunks_exact(self.row);
                // Each key row is decoded into registers-sized pieces on the stack, then dotted.
                let mut piece = [0.0f32; Q8_PIECE];
                let piece_bytes = Q8_PIECE / BLOCK_LEN * QuantType::Q8_0.block_bytes();
                for (s, row) in scores.iter_mut().zip(keys) {
                    let mut acc = 0.0;
                    for (r, qp) in row.chunks(piece_bytes).zip(q.chunks(Q8_PIECE)) {
                        let p = &mut piece[..qp.len()];
                        p.fill(0.0);
                        (k.axpy_q8_0)(1.0, r, p);
                        acc += dot(p, qp);
                    }
                    *s = acc * scale;
                }
            }
        }
        if let Some(cap) = softcap {
            scores.iter_mut().for_each(|s| *s = (*s / cap).tanh() * cap);
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        out.fill(0.0);
        match float {
            Some(qtype) => {
                scores.iter_mut().for_each(|s| *s /= sum);
                k.axpy_next(qtype, scores, values, self.row, out);
            }
            None => {
                for (w, row) in scores.iter().zip(values.chunks_exact(self.row)) {
                    (k.axpy_q8_0)(w / sum, row, out);
                }
            }
        }
    }

    /// Marks `n` more positions as stored (after every layer has written them).
    pub fn advance(&mut self, n: usize) {
        self.len += n;
        debug_assert!(self.len <= self.capacity);
    }
}

/// Where a reservation of positions `0..positions` ends: the next whole [`RESERVE_STEP`], at most
/// the capacity.
fn reserve_end(positions: usize, capacity: usize) -> usize {
    positions
        .next_multiple_of(RESERVE_STEP)
        .min(capacity.max(1))
}

impl Drop for KvCache {
    fn drop(&mut self) {
        if let Some(ledger) = &self.ledger {
            ledger
                .0
                .fetch_sub(self.pages_bytes(self.counted), Ordering::AcqRel);
        }
    }
}

/// Values of a Q8_0 key row decoded at a time (on the stack) in [`KvCache::attend`].
const Q8_PIECE: usize = 8 * BLOCK_LEN;

/// Writes `x` into `out` as `kv` rows. Values beyond f16's range become ±inf under f16, as they
/// do in llama.cpp's f16 cache.
fn encode(kv: KvType, x: &[f32], out: &mut [u8]) {
    match kv {
        KvType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        KvType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        KvType::Q8_0 => {
            let block = QuantType::Q8_0.block_bytes();
            for (o, xb) in out.chunks_exact_mut(block).zip(x.chunks_exact(BLOCK_LEN)) {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                let inv = if d.to_f32() > 0.0 {
                    1.0 / d.to_f32()
                } else {
                    0.0
                };
                o[..2].copy_from_slice(&d.to_le_bytes());
                for (q, v) in o[2..].iter_mut().zip(xb) {
                    *q = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn config(head_dim: usize) -> ModelConfig {
        let mut c = crate::source::config::from_hf_json(include_str!(
            "../../../models/austen-relu/config.json"
        ))
        .unwrap();
        c.head_dim = head_dim;
        c
    }

    /// A reproducible pseudo-random vector with values in about ±`scale`.
    fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Attention written out in f32 from the keys and values as the cache stores them decoded.
    fn reference(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>], scale: f32) -> Vec<f32> {
        let s: Vec<f64> = keys
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| (a * b) as f64).sum::<f64>() * scale as f64)
            .collect();
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let mut out = vec![0.0f64; q.len()];
        for (w, v) in e.iter().zip(values) {
            for (o, x) in out.iter_mut().zip(v) {
                *o += w / sum * *x as f64;
            }
        }
        out.into_iter().map(|v| v as f32).collect()
    }

    fn decoded(kv: KvType, x: &[f32]) -> Vec<f32> {
        let mut bytes = vec![0u8; kv.row_bytes(x.len()).unwrap()];
        encode(kv, x, &mut bytes);
        let mut out = vec![0.0; x.len()];
        leanstream_format::quant::dequantize_row(kv.qtype(), &bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn attention_over_each_storage_matches_f32_attention_over_its_decoded_rows() {
        let c = config(64);
        let (hd, kvh, len) = (c.head_dim, c.num_kv_heads, 37);
        for kv in [KvType::F32, KvType::F16, KvType::Q8_0] {
            let mut cache = KvCache::new(&c, 64, kv);
            let mut stored: Vec<Vec<Vec<f32>>> = vec![vec![]; 2 * kvh];
            for pos in 0..len {
                for l in 0..c.num_layers {
                    let k = noise(kvh * hd, (pos * 10 + l) as u64, 3.0);
                    let v = noise(kvh * hd, (pos * 10 + l + 5000) as u64, 1.0);
                    cache.store(l, pos, &k, &v);
                    if l == 1 {
                        for h in 0..kvh {
                            stored[h].push(decoded(kv, &k[h * hd..(h + 1) * hd]));
                            stored[kvh + h].push(decoded(kv, &v[h * hd..(h + 1) * hd]));
                        }
                    }
                }
                cache.advance(1);
            }
            // Each head's rows decoded at once are the rows stored, decoded one by one.
            for (h, rows) in stored.iter().enumerate() {
                let mut all = vec![f32::NAN; len * hd];
                cache.decode_head(1, h < kvh, h % kvh, &mut all);
                assert_eq!(all, rows.concat(), "{kv:?} decode_head of row set {h}");
            }
            let q = noise(hd, 99, 1.0);
            let scale = 1.0 / (hd as f32).sqrt();
            for (h, lo) in [(0, 0), (1, 5)] {
                let mut scores = vec![0.0; len - lo];
                let mut out = vec![0.0; hd];
                cache.attend(1, h, lo, len, &q, scale, None, &mut scores, &mut out);
                let want = reference(&q, &stored[h][lo..], &stored[kvh + h][lo..], scale);
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() < 1e-5, "{kv:?} head {h} [{i}]: {a} vs {b}");
                }
            }
            // The storage is what it claims: f16 and q8_0 lose a little, f32 nothing.
            let x = noise(hd, 7, 3.0);
            let err = decoded(kv, &x)
                .iter()
                .zip(&x)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            let bound = match kv {
                KvType::F32 => 0.0,
                KvType::F16 => 3.0 / 2048.0,
                KvType::Q8_0 => 3.0 / 127.0,
            };
            assert!(err <= bound, "{kv:?}: error {err} above {bound}");
            if kv != KvType::F32 {
                assert!(err > 0.0, "{kv:?} stored exactly: not the encoding claimed");
            }
        }
    }

    #[test]
    fn the_ledger_counts_pages_before_they_are_written_and_forgets_a_dropped_cache() {
        let c = config(64);
        let ledger = Arc::new(KvLedger::default());
        // 2 heads of 512 positions of 128 B (f16): a head's rows start on a page, 32 to a page.
        let mut a = KvCache::new(&c, 512, KvType::F16).with_ledger(Arc::clone(&ledger));
        let page = AlignedBuf::ALIGN as u64;
        let per_step = 2 * c.num_layers as u64 * 2 * 2 * page; // 64 positions: 2 pages a head
        assert_eq!(ledger.committed(), 0);
        a.reserve(5);
        assert_eq!(ledger.committed(), per_step);
        assert_eq!(
            KvCache::reserved_for(&c, 512, KvType::F16, 5),
            ledger.committed()
        );
        a.reserve(64);
        assert_eq!(ledger.committed(), per_step, "within the step: no change");
        // Storing past the count reserves the next step first.
        let (k, v) = (noise(128, 1, 1.0), noise(128, 2, 1.0));
        a.store(0, 64, &k, &v);
        assert_eq!(ledger.committed(), 2 * per_step);
        // A second cache counts in the same ledger; dropping one takes its pages out.
        let mut b = KvCache::new(&c, 512, KvType::F16).with_ledger(Arc::clone(&ledger));
        b.reserve(1);
        assert_eq!(ledger.committed(), 3 * per_step);
        assert!(a.counts_in(&ledger) && b.counts_in(&ledger));
        assert!(!KvCache::new(&c, 512, KvType::F16).counts_in(&ledger));
        drop(a);
        assert_eq!(ledger.committed(), per_step);
        // Never past the capacity; a head whose rows start inside a page counts that page too.
        let mut small = KvCache::new(&c, 40, KvType::F16).with_ledger(Arc::clone(&ledger));
        small.reserve(40);
        // Head 0: 40 × 128 B = 2 pages; head 1 starts at 5,120 B: pages 1 and 2.
        assert_eq!(
            ledger.committed(),
            per_step + 2 * c.num_layers as u64 * 4 * page
        );
        // A restored state is counted before it is copied in.
        drop(small);
        let mut src = KvCache::new(&c, 512, KvType::F16);
        for pos in 0..100 {
            for l in 0..c.num_layers {
                src.store(l, pos, &k, &v);
            }
        }
        src.advance(100);
        drop(b);
        let mut restored = KvCache::new(&c, 512, KvType::F16).with_ledger(Arc::clone(&ledger));
        restored.restore(&src.save()).unwrap();
        assert_eq!(ledger.committed(), 2 * per_step);
        drop(restored);
        assert_eq!(ledger.committed(), 0);
    }

    #[test]
    fn sizes_follow_the_storage_and_commit_as_positions_are_written() {
        let c = config(64);
        let per_position = |kv| 2 * c.num_layers * c.num_kv_heads * kv;
        // Whole pages per layer: 2 heads × 512 positions × 128 B is 32 pages.
        assert_eq!(
            KvCache::bytes_for(&c, 512, KvType::F16),
            512 * per_position(128)
        );
        assert_eq!(
            KvCache::bytes_for(&c, 512, KvType::F32),
            2 * KvCache::bytes_for(&c, 512, KvType::F16)
        );
        assert_eq!(
            KvCache::bytes_for(&c, 512, KvType::Q8_0),
            (2 * 512 * 68usize).next_multiple_of(4096) * 2 * c.num_layers
        );
        let odd = config(48);
        let err = KvType::Q8_0.row_bytes(odd.head_dim).unwrap_err();
        assert!(
            err.contains("multiple of 32") && err.contains("--kv f16"),
            "{err}"
        );
        #[cfg(target_os = "linux")]
        {
            // A large cache commits memory only where positions were written.
            let mut big = config(64);
            big.num_layers = 32;
            let before = crate::platform::memory::current_rss_bytes().unwrap();
            let mut cache = KvCache::new(&big, 32 * 1024, KvType::F32);
            let reserved = KvCache::bytes_for(&big, 32 * 1024, KvType::F32) as u64;
            let (k, v) = (noise(128, 1, 1.0), noise(128, 2, 1.0));
            for pos in 0..64 {
                for l in 0..big.num_layers {
                    cache.store(l, pos, &k, &v);
                }
            }
            let grown = crate::platform::memory::current_rss_bytes()
                .unwrap()
                .saturating_sub(before);
            // 64 positions of 256 B per head: 4 pages per head and layer, 1 MiB in all.
            assert!(
                grown < reserved / 16,
                "committed {grown} B of a {reserved} B cache after 64 of 32768 positions"
            );
        }
    }
}
