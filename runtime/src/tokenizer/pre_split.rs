//! The pieces byte-level BPE merges within: the `tokenizers` crate's regex splits for the patterns
//! the compact tokenizer supports (FORMAT.md §4.5), written out by hand — no regex engine, so no
//! cache that grows with use. The Unicode classes come from `regex-syntax`, the tables the
//! `tokenizers` crate's own regexes use, so both classify every character alike.

use std::sync::OnceLock;

use leanstream_format::bpe_vocab::PreSplit;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// `\p{L}`
    Letter,
    /// `\p{N}`
    Number,
    /// `\s` (Unicode White_Space)
    Space,
    Other,
}

/// Sorted, disjoint code-point ranges of the three named classes; anything else is `Other`.
struct Classes {
    ranges: Vec<(u32, u32, Class)>,
}

impl Classes {
    fn build() -> Self {
        let mut ranges = Vec::new();
        for (pattern, class) in [
            (r"\p{L}", Class::Letter),
            (r"\p{N}", Class::Number),
            (r"\s", Class::Space),
        ] {
            let hir = regex_syntax::parse(pattern).expect("a valid Unicode class");
            let regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(set)) =
                hir.kind()
            else {
                unreachable!("{pattern} parses to a Unicode class")
            };
            ranges.extend(
                set.ranges()
                    .iter()
                    .map(|r| (r.start() as u32, r.end() as u32, class)),
            );
        }
        ranges.sort_unstable_by_key(|r| r.0);
        ranges.shrink_to_fit();
        Self { ranges }
    }

    fn of(&self, c: char) -> Class {
        let c = c as u32;
        let i = self.ranges.partition_point(|r| r.0 <= c);
        match i.checked_sub(1).map(|i| self.ranges[i]) {
            Some((_, end, class)) if c <= end => class,
            _ => Class::Other,
        }
    }

    /// Bytes of the tables (kept for the life of the process once a tokenizer ran).
    fn heap_bytes(&self) -> usize {
        self.ranges.capacity() * std::mem::size_of::<(u32, u32, Class)>()
    }
}

fn classes() -> &'static Classes {
    static CLASSES: OnceLock<Classes> = OnceLock::new();
    CLASSES.get_or_init(Classes::build)
}

/// Bytes the character classes hold once built.
pub fn heap_bytes() -> usize {
    classes().heap_bytes()
}

/// Calls `piece` with each piece of `text`, in order; together they are `text`.
pub fn split(how: PreSplit, text: &str, piece: &mut impl FnMut(&str)) {
    let cls = classes();
    match how {
        PreSplit::Gpt2 => gpt2(cls, text, piece),
        PreSplit::DigitsThenGpt2 => {
            let mut start = 0;
            for (i, c) in text.char_indices() {
                if cls.of(c) == Class::Number {
                    gpt2(cls, &text[start..i], piece);
                    let end = i + c.len_utf8();
                    piece(&text[i..end]);
                    start = end;
                }
            }
            gpt2(cls, &text[start..], piece);
        }
    }
}

/// GPT-2's pattern, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
/// matched leftmost-first from each position as a backtracking engine does.
fn gpt2(cls: &Classes, text: &str, piece: &mut impl FnMut(&str)) {
    let mut i = 0;
    while i < text.len() {
        let end = gpt2_match(cls, text, i);
        piece(&text[i..end]);
        i = end;
    }
}

/// The end of the match starting at `i` (every character matches some alternative).
fn gpt2_match(cls: &Classes, text: &str, i: usize) -> usize {
    let rest = &text[i..];
    for contraction in ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"] {
        if rest.starts_with(contraction) {
            return i + contraction.len();
        }
    }
    let mut chars = rest.chars();
    let first = chars.next().expect("i < text.len()");
    // ` ?X+` for X = letter, number, other: an optional ASCII space, then a run of one class.
    let (run_start, class) = match (first, chars.next()) {
        (' ', Some(next)) if cls.of(next) != Class::Space => (i + 1, cls.of(next)),
        _ => (i, cls.of(first)),
    };
    if class != Class::Space {
        return run_end(cls, text, run_start, class);
    }
    // `\s+(?!\S)`: the whitespace run, less its last character when a non-space follows and the
    // run has more than one; else `\s+`.
    let end = run_end(cls, text, i, Class::Space);
    match text[i..end].char_indices().last() {
        Some((last, _)) if end < text.len() && last > 0 => i + last,
        _ => end,
    }
}

/// The end of the run of `class` characters from `start`.
fn run_end(cls: &Classes, text: &str, start: usize, class: Class) -> usize {
    text[start..]
        .char_indices()
        .find(|&(_, c)| cls.of(c) != class)
        .map_or(text.len(), |(j, _)| start + j)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(how: PreSplit, text: &str) -> Vec<String> {
        let mut out = Vec::new();
        split(how, text, &mut |p| out.push(p.to_string()));
        out
    }

    #[test]
    fn splits_like_gpt2s_regex() {
        assert_eq!(
            pieces(PreSplit::Gpt2, "I'm  here,\tsaid 42 cats!!  \n"),
            ["I", "'m", " ", " here", ",", "\t", "said", " 42", " cats", "!!", "  \n"]
        );
        // One space before a word joins it; the run before it keeps the rest.
        assert_eq!(pieces(PreSplit::Gpt2, "a   b"), ["a", "  ", " b"]);
        assert_eq!(pieces(PreSplit::Gpt2, "x\ny"), ["x", "\n", "y"]);
        assert_eq!(pieces(PreSplit::Gpt2, " "), [" "]);
        assert_eq!(pieces(PreSplit::Gpt2, "é日本 ١٢"), ["é日本", " ١٢"]);
        assert_eq!(
            pieces(PreSplit::DigitsThenGpt2, "in 2026, 3.5x"),
            ["in", " ", "2", "0", "2", "6", ",", " ", "3", ".", "5", "x"]
        );
        assert!(pieces(PreSplit::Gpt2, "").is_empty());
    }
}
