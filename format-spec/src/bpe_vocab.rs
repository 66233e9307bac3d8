//! BPE_VOCAB (since 1.2): the model's byte-level BPE tokenizer as flat tables — token bytes, merges
//! sorted for binary search, added tokens, the BOS/EOS template — so a runtime can tokenize in
//! about the section's own size instead of parsing `tokenizer.json` (ten times its size in memory).
//! The converter writes it only for tokenizers it reproduces exactly. See FORMAT.md §4.5.

use crate::codec::{Dec, Enc};
use crate::FormatError;

/// How text is split into pieces before BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum PreSplit {
    /// GPT-2's regex: `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2 = 0,
    /// Every `\p{N}` character its own piece, then GPT-2's regex inside the other pieces.
    DigitsThenGpt2 = 1,
}

/// A byte with no token of its own (in `byte_tokens`): it is dropped from the text.
pub const NO_TOKEN: u32 = u32::MAX;

/// One merge: `left` and `right` adjacent become `result`; lower `rank` merges first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Merge {
    pub left: u32,
    pub right: u32,
    pub rank: u32,
    pub result: u32,
}

/// A token matched in the raw text before splitting (HF `added_tokens`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedToken {
    pub id: u32,
    /// Left out of decoded text.
    pub special: bool,
    /// Matched in a second pass, over the text the first pass left (HF `normalized`; the format
    /// has no normalizer, so both passes see the raw text).
    pub normalized: bool,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BpeVocab {
    pub pre_split: PreSplit,
    /// Decoded bytes of every token, back to back.
    pub blob: Vec<u8>,
    /// Token `i` is `blob[ends[i-1]..ends[i]]` (`ends[-1] = 0`).
    pub ends: Vec<u32>,
    /// The one-byte token of each byte value, or [`NO_TOKEN`].
    pub byte_tokens: Vec<u32>,
    /// Sorted by `(left, right)`, strictly ascending.
    pub merges: Vec<Merge>,
    pub added: Vec<AddedToken>,
    /// Ids put before and after the text when special tokens are asked for.
    pub prefix: Vec<u32>,
    pub suffix: Vec<u32>,
}

impl BpeVocab {
    pub fn tokens(&self) -> usize {
        self.ends.len()
    }

    /// The decoded bytes of token `id`.
    pub fn token(&self, id: u32) -> &[u8] {
        let i = id as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.blob[start..self.ends[i] as usize]
    }

    /// The merge of `left` then `right`, if any.
    pub fn merge(&self, left: u32, right: u32) -> Option<&Merge> {
        self.merges
            .binary_search_by(|m| (m.left, m.right).cmp(&(left, right)))
            .ok()
            .map(|i| &self.merges[i])
    }

    /// Bytes the tables hold in memory (what a runtime keeps resident).
    pub fn heap_bytes(&self) -> usize {
        self.blob.capacity()
            + 4 * (self.ends.capacity() + self.byte_tokens.capacity())
            + std::mem::size_of::<Merge>() * self.merges.capacity()
            + self
                .added
                .iter()
                .map(|a| std::mem::size_of::<AddedToken>() + a.content.capacity())
                .sum::<usize>()
            + 4 * (self.prefix.capacity() + self.suffix.capacity())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.pre_split as u32);
        e.u32(self.ends.len() as u32);
        e.u32(self.blob.len() as u32);
        e.bytes(&self.blob);
        e.u32s(&self.ends);
        e.u32s(&self.byte_tokens);
        e.u32(self.merges.len() as u32);
        for m in &self.merges {
            e.u32s(&[m.left, m.right, m.rank, m.result]);
        }
        e.u32(self.added.len() as u32);
        for a in &self.added {
            e.u32(a.id);
            e.u32(a.special as u32 | (a.normalized as u32) << 1);
            e.str(&a.content);
        }
        e.u32(self.prefix.len() as u32);
        e.u32s(&self.prefix);
        e.u32(self.suffix.len() as u32);
        e.u32s(&self.suffix);
        e.buf
    }

    /// Decodes and checks the section's content held in memory.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut d = Dec::new(bytes, "BPE_VOCAB");
        let v = Self::decode(&mut d)?;
        d.finish()?;
        Ok(v)
    }

    /// Decodes and checks the section: every id within the vocabulary, the token extents in
    /// order, the merges strictly sorted.
    pub fn decode(d: &mut Dec) -> Result<Self, FormatError> {
        let pre_split = match d.u32()? {
            0 => PreSplit::Gpt2,
            1 => PreSplit::DigitsThenGpt2,
            v => return Err(d.invalid(format!("unknown pre-split {v}"))),
        };
        let n = d.count(4)?;
        if n == 0 {
            return Err(d.invalid("no tokens"));
        }
        let blob_len = d.count(1)?;
        let blob = d.bytes(blob_len)?;
        let ends = d.u32s(n)?;
        if ends.windows(2).any(|w| w[0] > w[1]) || ends[n - 1] as usize != blob_len {
            return Err(d.invalid("token extents are out of order"));
        }
        let id = |d: &Dec, v: u32| -> Result<u32, FormatError> {
            if (v as usize) < n {
                Ok(v)
            } else {
                Err(d.invalid(format!("token id {v} is outside the {n} tokens")))
            }
        };
        let byte_tokens = d.u32s(256)?;
        for &t in byte_tokens.iter().filter(|&&t| t != NO_TOKEN) {
            id(d, t)?;
        }
        let m = d.count(16)?;
        let mut merges = Vec::with_capacity(m);
        for _ in 0..m {
            let v = d.u32s(4)?;
            merges.push(Merge {
                left: id(d, v[0])?,
                right: id(d, v[1])?,
                rank: v[2],
                result: id(d, v[3])?,
            });
        }
        if merges
            .windows(2)
            .any(|w| (w[0].left, w[0].right) >= (w[1].left, w[1].right))
        {
            return Err(d.invalid("merges are not strictly sorted by (left, right)"));
        }
        let a = d.count(10)?;
        let mut added = Vec::with_capacity(a);
        for _ in 0..a {
            let tid = d.u32()?;
            let flags = d.u32()?;
            if flags > 3 {
                return Err(d.invalid(format!("unknown added-token flags {flags}")));
            }
            let content = d.str()?;
            if content.is_empty() {
                return Err(d.invalid("an added token is empty"));
            }
            added.push(AddedToken {
                id: id(d, tid)?,
                special: flags & 1 != 0,
                normalized: flags & 2 != 0,
                content,
            });
        }
        let ids = |d: &mut Dec| -> Result<Vec<u32>, FormatError> {
            let k = d.count(4)?;
            let v = d.u32s(k)?;
            v.iter().try_for_each(|&t| id(d, t).map(|_| ()))?;
            Ok(v)
        };
        let prefix = ids(d)?;
        let suffix = ids(d)?;
        Ok(Self {
            pre_split,
            blob,
            ends,
            byte_tokens,
            merges,
            added,
            prefix,
            suffix,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> BpeVocab {
        // Tokens: 0..=255 the bytes, 256 "ab", 257 "<s>".
        let mut blob: Vec<u8> = (0..=255u8).collect();
        blob.extend_from_slice(b"ab<s>");
        let mut ends: Vec<u32> = (1..=256).collect();
        ends.extend([258, 261]);
        BpeVocab {
            pre_split: PreSplit::DigitsThenGpt2,
            blob,
            ends,
            byte_tokens: (0..256).collect(),
            merges: vec![Merge {
                left: b'a' as u32,
                right: b'b' as u32,
                rank: 0,
                result: 256,
            }],
            added: vec![AddedToken {
                id: 257,
                special: true,
                normalized: false,
                content: "<s>".into(),
            }],
            prefix: vec![257],
            suffix: vec![],
        }
    }

    #[test]
    fn round_trips_and_rejects_damage() {
        let v = sample();
        let bytes = v.encode();
        let back = BpeVocab::from_bytes(&bytes).unwrap();
        assert!(BpeVocab::from_bytes(&[bytes.as_slice(), &[0]].concat()).is_err());
        assert_eq!(back, v);
        assert_eq!(back.token(256), b"ab");
        assert_eq!(back.token(0), [0]);
        assert_eq!(back.merge(b'a' as u32, b'b' as u32).unwrap().result, 256);
        assert!(back.merge(b'b' as u32, b'a' as u32).is_none());
        // An id past the vocabulary (the prefix's last byte is its high byte: 257 → 0x0101_0101).
        let mut bad = bytes.clone();
        let at = bytes.len() - 8;
        bad[at..at + 4].copy_from_slice(&9999u32.to_le_bytes());
        let err = BpeVocab::decode(&mut Dec::new(&bad, "BPE_VOCAB")).unwrap_err();
        assert!(err.to_string().contains("outside"), "{err}");
        // An unknown pre-split.
        let mut bad = bytes.clone();
        bad[0] = 7;
        assert!(BpeVocab::decode(&mut Dec::new(&bad, "BPE_VOCAB")).is_err());
        // Unsorted merges.
        let mut two = sample();
        two.merges.push(Merge {
            left: 0,
            right: 0,
            rank: 1,
            result: 256,
        });
        let bytes = two.encode();
        let err = BpeVocab::decode(&mut Dec::new(&bytes, "BPE_VOCAB")).unwrap_err();
        assert!(err.to_string().contains("sorted"), "{err}");
    }
}
