//! Key/value cache of one sequence. Laid out `[layer][kv_head][position][head_dim]` so that one
//! head's attention reads contiguous memory.

use crate::config::ModelConfig;

#[derive(Debug, Clone)]
pub struct KvCache {
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    len: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl KvCache {
    /// A cache for up to `capacity` positions, allocated up front so its memory is known.
    pub fn new(config: &ModelConfig, capacity: usize) -> Self {
        let per_layer = capacity * config.num_kv_heads * config.head_dim;
        Self {
            capacity,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            len: 0,
            keys: (0..config.num_layers)
                .map(|_| vec![0.0; per_layer])
                .collect(),
            values: (0..config.num_layers)
                .map(|_| vec![0.0; per_layer])
                .collect(),
        }
    }

    /// Bytes held by a cache of `capacity` positions for `config`.
    pub fn bytes_for(config: &ModelConfig, capacity: usize) -> usize {
        2 * config.num_layers * capacity * config.num_kv_heads * config.head_dim * 4
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

    /// Forgets every position (the buffers are kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Stores keys and values (`kv_heads × head_dim` each) of layer `layer` at position `pos`.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        debug_assert!(pos < self.capacity);
        let hd = self.head_dim;
        for h in 0..self.kv_heads {
            let dst = (h * self.capacity + pos) * hd;
            self.keys[layer][dst..dst + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
            self.values[layer][dst..dst + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
        }
    }

    /// Keys and values of `layer`, `kv_head` for positions `start..end`, `head_dim` per position.
    pub fn head(&self, layer: usize, kv_head: usize, start: usize, end: usize) -> (&[f32], &[f32]) {
        let hd = self.head_dim;
        let base = kv_head * self.capacity;
        let range = (base + start) * hd..(base + end) * hd;
        (&self.keys[layer][range.clone()], &self.values[layer][range])
    }

    /// Marks `n` more positions as stored (after every layer has written them).
    pub fn advance(&mut self, n: usize) {
        self.len += n;
        debug_assert!(self.len <= self.capacity);
    }
}
