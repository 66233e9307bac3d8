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

use leanstream_format::bpe_vocab::{AddedToken, BpeVocab, NO_TOKEN};

use super::pre_split;

pub struct ByteBpe {
    vocab: BpeVocab,
    /// Ids of the special added tokens, sorted: left out of decoded text.
    special: Vec<u32>,
    /// The added tokens of each pass (`[raw, normalized]`), indexed for matching.
    passes: [AddedIndex; 2],
}

/// One pass's added tokens, so that finding the longest one at a position costs a few binary
/// searches, not a comparison with every token (a padded GGUF vocabulary adds tens of thousands).
#[derive(Default)]
struct AddedIndex {
    /// Indexes into `vocab.added` (non-empty contents), by content, then by position: of equal
    /// contents the last added wins, as it did when every token was compared.
    by_content: Vec<u32>,
    /// The contents' distinct lengths in bytes, longest first.
    lengths: Vec<usize>,
    /// The bytes some content starts with, one bit each.
    first: [u64; 4],
}

impl AddedIndex {
    fn new(vocab: &BpeVocab, normalized: bool) -> Self {
        let added = &vocab.added;
        let mut by_content: Vec<u32> = (0..added.len() as u32)
            .filter(|&i| {
                let a = &added[i as usize];
                a.normalized == normalized && !a.content.is_empty()
            })
            .collect();
        by_content.sort_by(|&a, &b| {
            let (x, y) = (&added[a as usize], &added[b as usize]);
            x.content.cmp(&y.content).then(a.cmp(&b))
        });
        let mut lengths: Vec<usize> = by_content
            .iter()
            .map(|&i| added[i as usize].content.len())
            .collect();
        lengths.sort_unstable_by(|a, b| b.cmp(a));
        lengths.dedup();
        let mut first = [0u64; 4];
        for &i in &by_content {
            let b = added[i as usize].content.as_bytes()[0];
            first[b as usize / 64] |= 1 << (b % 64);
        }
        Self {
            by_content,
            lengths,
            first,
        }
    }

    /// The longest added token `rest` starts with (of equal contents the last added).
    fn longest<'v>(&self, added: &'v [AddedToken], rest: &str) -> Option<&'v AddedToken> {
        let b = *rest.as_bytes().first()?;
        if self.first[b as usize / 64] & (1 << (b % 64)) == 0 {
            return None;
        }
        self.lengths.iter().find_map(|&len| {
            let key = rest.as_bytes().get(..len)?;
            let end = self
                .by_content
                .partition_point(|&i| added[i as usize].content.as_bytes() <= key);
            let a = &added[self.by_content[end.checked_sub(1)?] as usize];
            (a.content.as_bytes() == key).then_some(a)
        })
    }
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
        let passes = [
            AddedIndex::new(&vocab, false),
            AddedIndex::new(&vocab, true),
        ];
        Self {
            vocab,
            special,
            passes,
        }
    }

    /// Bytes held in memory: the tables, and the character classes the pre-split shares.
    pub fn heap_bytes(&self) -> usize {
        let index: usize = self
            .passes
            .iter()
            .map(|p| 4 * p.by_content.capacity() + 8 * p.lengths.capacity())
            .sum();
        self.vocab.heap_bytes() + 4 * self.special.capacity() + index + pre_split::heap_bytes()
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
        let index = &self.passes[normalized as usize];
        let mut start = 0;
        let mut i = 0;
        while i < text.len() {
            let rest = &text[i..];
            match index.longest(&self.vocab.added, rest) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use leanstream_format::bpe_vocab::PreSplit;

    fn added(id: u32, content: &str, normalized: bool) -> AddedToken {
        AddedToken {
            id,
            special: false,
            normalized,
            content: content.into(),
        }
    }

    /// The rule the index replaces: at each position the longest token of the pass (of equal
    /// contents the last added), else the next character.
    fn cut_by_comparing_all(added: &[AddedToken], text: &str, normalized: bool) -> Vec<String> {
        let (mut parts, mut start, mut i) = (Vec::new(), 0, 0);
        while i < text.len() {
            let best = added
                .iter()
                .filter(|a| a.normalized == normalized && !a.content.is_empty())
                .filter(|a| text[i..].starts_with(a.content.as_str()))
                .max_by_key(|a| a.content.len());
            match best {
                Some(a) => {
                    if start < i {
                        parts.push(format!("text {}", &text[start..i]));
                    }
                    parts.push(format!("added {}", a.id));
                    i += a.content.len();
                    start = i;
                }
                None => i += text[i..].chars().next().unwrap().len_utf8(),
            }
        }
        if start < text.len() {
            parts.push(format!("text {}", &text[start..]));
        }
        parts
    }

    #[test]
    fn added_tokens_are_cut_leftmost_longest_as_by_comparing_every_token() {
        let mut tokens = vec![
            added(0, "<a>", false),
            added(1, "<ab>", false),
            added(2, "<a", false),
            added(3, "<ab>", false),
            added(4, "é", false),
            added(5, "éé", true),
            added(6, "", false),
            added(7, "b<", true),
        ];
        // A padded GGUF vocabulary: many tokens sharing their first bytes.
        tokens.extend((0..500).map(|i| added(8 + i, &format!("<pad_{i}>"), i % 3 == 0)));
        let vocab = BpeVocab {
            pre_split: PreSplit::Gpt2,
            blob: Vec::new(),
            ends: Vec::new(),
            byte_tokens: vec![NO_TOKEN; 256],
            merges: Vec::new(),
            added: tokens.clone(),
            prefix: Vec::new(),
            suffix: Vec::new(),
        };
        let bpe = ByteBpe::new(vocab);
        let text = "x<ab><a>b<a<abéééé<pad_12><pad_3><pad_1><pad_499>><pad_<<<a";
        for normalized in [false, true] {
            let mut parts = Vec::new();
            bpe.cut_added(text, normalized, &mut |p| {
                parts.push(match p {
                    Part::Text(t) => format!("text {t}"),
                    Part::Added(id) => format!("added {id}"),
                })
            });
            assert_eq!(parts, cut_by_comparing_all(&tokens, text, normalized));
            let cut = parts.iter().filter(|p| p.starts_with("added")).count();
            assert!(cut >= 4, "{parts:?}");
        }
    }
}
