//! The compact byte-level BPE tokenizer: encodes and decodes from a file's BPE_VOCAB tables
//! (FORMAT.md §4.5) with the same ids as the `tokenizers` crate on the `tokenizer.json` they were
//! built from, in about the tables' size (no maps, no word cache, no regex engine).
//!
//! Encoding, as `tokenizers` does it: added tokens are cut out of the raw text (leftmost-longest,
//! non-normalized ones first, then normalized ones in what is left); the rest is pre-split
//! ([`super::pre_split`]); each piece starts as one token per byte and merges the lowest-ranked
//! adjacent pair first (leftmost on ties), with the same expiry rule for stale queue entries.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use leanstream_format::bpe_vocab::{BpeVocab, NO_TOKEN};

use super::pre_split;

pub struct ByteBpe {
    vocab: BpeVocab,
    /// Ids of the special added tokens, sorted: left out of decoded text.
    special: Vec<u32>,
}

/// One symbol of a piece being merged: a token and its live neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

const NONE: usize = usize::MAX;

/// Buffers reused across the pieces of one text.
#[derive(Default)]
struct Scratch {
    symbols: Vec<Symbol>,
    /// `(rank, position, result)`, lowest rank then leftmost first.
    queue: BinaryHeap<Reverse<(u32, usize, u32)>>,
}

impl ByteBpe {
    pub fn new(vocab: BpeVocab) -> Self {
        let mut special: Vec<u32> = vocab
            .added
            .iter()
            .filter(|a| a.special)
            .map(|a| a.id)
            .collect();
        special.sort_unstable();
        special.dedup();
        Self { vocab, special }
    }

    /// Bytes held in memory: the tables, and the character classes the pre-split shares.
    pub fn heap_bytes(&self) -> usize {
        self.vocab.heap_bytes() + 4 * self.special.capacity() + pre_split::heap_bytes()
    }

    /// Token ids of `text`; with `special`, the BOS/EOS template's ids around them.
    pub fn encode(&self, text: &str, special: bool) -> Vec<u32> {
        let mut ids = Vec::new();
        if special {
            ids.extend_from_slice(&self.vocab.prefix);
        }
        let mut scratch = Scratch::default();
        self.cut_added(text, false, &mut |part| match part {
            Part::Added(id) => ids.push(id),
            Part::Text(rest) => self.cut_added(rest, true, &mut |part| match part {
                Part::Added(id) => ids.push(id),
                Part::Text(plain) => pre_split::split(self.vocab.pre_split, plain, &mut |piece| {
                    self.merge_piece(piece.as_bytes(), &mut scratch, &mut ids)
                }),
            }),
        });
        if special {
            ids.extend_from_slice(&self.vocab.suffix);
        }
        ids
    }

    /// The text of `ids`: special tokens and ids outside the vocabulary left out, invalid UTF-8
    /// replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if (id as usize) < self.vocab.tokens() && self.special.binary_search(&id).is_err() {
                bytes.extend_from_slice(self.vocab.token(id));
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Splits `text` at the added tokens of one pass (`normalized` or not), leftmost-longest.
    fn cut_added<'t>(&self, text: &'t str, normalized: bool, out: &mut impl FnMut(Part<'t>)) {
        let mut start = 0;
        let mut i = 0;
        while i < text.len() {
            let rest = &text[i..];
            let best = self
                .vocab
                .added
                .iter()
                .filter(|a| a.normalized == normalized && rest.starts_with(a.content.as_str()))
                .max_by_key(|a| a.content.len());
            match best {
                Some(a) => {
                    if start < i {
                        out(Part::Text(&text[start..i]));
                    }
                    out(Part::Added(a.id));
                    i += a.content.len();
                    start = i;
                }
                None => i += rest.chars().next().map_or(1, char::len_utf8),
            }
        }
        if start < text.len() {
            out(Part::Text(&text[start..]));
        }
    }

    /// Byte-level BPE of one piece, appending its ids.
    fn merge_piece(&self, piece: &[u8], s: &mut Scratch, ids: &mut Vec<u32>) {
        let v = &self.vocab;
        s.symbols.clear();
        // A byte without a token is dropped, its neighbours joined (as `tokenizers` does for a
        // character outside the vocabulary when there is no unknown token).
        let tokens = piece
            .iter()
            .map(|&b| v.byte_tokens[b as usize])
            .filter(|&id| id != NO_TOKEN);
        s.symbols.extend(tokens.enumerate().map(|(i, id)| Symbol {
            id,
            prev: i.wrapping_sub(1),
            next: i + 1,
            alive: true,
        }));
        if let Some(last) = s.symbols.last_mut() {
            last.next = NONE;
        }
        s.queue.clear();
        for pos in 0..s.symbols.len().saturating_sub(1) {
            if let Some(m) = v.merge(s.symbols[pos].id, s.symbols[pos + 1].id) {
                s.queue.push(Reverse((m.rank, pos, m.result)));
            }
        }
        while let Some(Reverse((_, pos, result))) = s.queue.pop() {
            let here = s.symbols[pos];
            if !here.alive || here.next == NONE {
                continue;
            }
            let right = s.symbols[here.next];
            // A stale entry: the pair at `pos` changed since it was queued.
            if v.merge(here.id, right.id).map(|m| m.result) != Some(result) {
                continue;
            }
            s.symbols[here.next].alive = false;
            s.symbols[pos].id = result;
            s.symbols[pos].next = right.next;
            if right.next != NONE {
                s.symbols[right.next].prev = pos;
            }
            if here.prev != NONE {
                if let Some(m) = v.merge(s.symbols[here.prev].id, result) {
                    s.queue.push(Reverse((m.rank, here.prev, m.result)));
                }
            }
            if right.next != NONE {
                if let Some(m) = v.merge(result, s.symbols[right.next].id) {
                    s.queue.push(Reverse((m.rank, pos, m.result)));
                }
            }
        }
        ids.extend(s.symbols.iter().filter(|s| s.alive).map(|s| s.id));
    }
}

/// A run of text between added tokens, or one added token.
enum Part<'t> {
    Text(&'t str),
    Added(u32),
}
