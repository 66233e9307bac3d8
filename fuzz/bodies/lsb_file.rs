//! A converted LeanStream file: opened (header, every index section decoded and cross-checked), its
//! embedded tokenizer parsed and every checksum verified, or an error — never a panic. Read from
//! memory (no temporary file).
//!
//! The first input byte chooses whether the header's checksums are recomputed over the rest before
//! it is read: random bytes rarely match a checksum, so this is how the fuzzer reaches the section
//! decoders behind them.

use std::io::Cursor;
use std::path::Path;

use leanstream_format::container::{checksum, MAX_SECTIONS, PAGE};

/// Runs the target on `data`; whether the file opened.
pub fn run(data: &[u8]) -> bool {
    let Some((&mode, rest)) = data.split_first() else {
        return false;
    };
    let mut bytes = rest.to_vec();
    if mode & 1 == 1 {
        repair_checksums(&mut bytes);
    }
    let name = Path::new("fuzz-input.lsb");
    let Ok(file) = leanstream_format::LsbFile::read(&mut Cursor::new(&bytes), name) else {
        return false;
    };
    let _ = leanstream::tokenizer::Tokenizer::from_bytes(&file.tokenizer_json);
    let _ = leanstream_format::verify_reader(&mut Cursor::new(&bytes), name, |_, _| {});
    true
}

/// Makes the header's file size, section checksums and header checksum match `b`.
fn repair_checksums(b: &mut [u8]) {
    let page = PAGE as usize;
    if b.len() < page {
        return;
    }
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let len = b.len() as u64;
    b[16..24].copy_from_slice(&len.to_le_bytes());
    let count = (u32::from_le_bytes(b[24..28].try_into().unwrap()) as usize).min(MAX_SECTIONS);
    for i in 0..count {
        let o = 32 + i * 48;
        let (offset, size) = (u64_at(b, o + 8), u64_at(b, o + 16));
        let Some(end) = offset.checked_add(size).filter(|&e| e <= len) else {
            continue;
        };
        let sum = checksum(&b[offset as usize..end as usize]);
        b[o + 32..o + 40].copy_from_slice(&sum.to_le_bytes());
    }
    let sum = checksum(&b[..page - 8]);
    b[page - 8..page].copy_from_slice(&sum.to_le_bytes());
}
