//! Little-endian encoding of the binary index sections, with bounds-checked decoding so that a
//! damaged section is an error, never a panic.

use std::io::Read;

use crate::container::Checksum;

use crate::FormatError;

/// Appends little-endian values to a byte buffer.
#[derive(Default)]
pub struct Enc {
    pub buf: Vec<u8>,
}

impl Enc {
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn f32(&mut self, v: f32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32s(&mut self, v: &[u32]) {
        v.iter().for_each(|x| self.u32(*x));
    }
    pub fn f32s(&mut self, v: &[f32]) {
        v.iter().for_each(|x| self.f32(*x));
    }
    /// f32 values stored as IEEE half precision.
    pub fn f16s(&mut self, v: &[f32]) {
        v.iter()
            .for_each(|x| self.u16(half::f16::from_f32(*x).to_bits()));
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }
    pub fn str(&mut self, s: &str) {
        self.u16(s.len() as u16);
        self.bytes(s.as_bytes());
    }
}

/// Reads little-endian values from a section, naming the section in its errors. The section
/// streams from a reader through a small window: decoding never holds the encoded section and its
/// decoded form at once (a section can be tens of MiB, and the runtime's budget sees that peak).
pub struct Dec<'a> {
    src: Box<dyn Read + 'a>,
    len: usize,
    pos: usize,
    window: Vec<u8>,
    what: &'static str,
}

impl<'a> Dec<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self::from_reader(buf, buf.len(), what)
    }

    /// A section of `len` bytes read from `src`.
    pub fn from_reader(src: impl Read + 'a, len: usize, what: &'static str) -> Self {
        Self {
            src: Box::new(src),
            len,
            pos: 0,
            window: Vec::new(),
            what,
        }
    }

    /// The next `n` bytes, valid until the next call.
    pub fn take(&mut self, n: usize) -> Result<&[u8], FormatError> {
        self.advance(n)?;
        self.window.clear();
        self.window.resize(n, 0);
        self.src
            .read_exact(&mut self.window)
            .map_err(|e| self.invalid(format!("cannot read byte {}: {e}", self.pos - n)))?;
        Ok(&self.window)
    }

    /// The next `n` bytes as an owned buffer.
    pub fn bytes(&mut self, n: usize) -> Result<Vec<u8>, FormatError> {
        self.advance(n)?;
        let mut v = vec![0u8; n];
        self.src
            .read_exact(&mut v)
            .map_err(|e| self.invalid(format!("cannot read byte {}: {e}", self.pos - n)))?;
        Ok(v)
    }

    /// Bytes of the section not read yet.
    pub fn remaining(&self) -> usize {
        self.len - self.pos
    }

    /// Bytes of the section read so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Moves past the next `n` bytes without keeping them and returns their XXH3-64, so that a
    /// part of the section read again later can be checked against what was checksummed now.
    pub fn skip_hashed(&mut self, n: usize) -> Result<u64, FormatError> {
        self.advance(n)?;
        let mut hash = Checksum::new();
        let mut chunk = [0u8; 1 << 14];
        let mut left = n;
        while left > 0 {
            let k = left.min(chunk.len());
            self.src
                .read_exact(&mut chunk[..k])
                .map_err(|e| self.invalid(format!("cannot read byte {}: {e}", self.pos - left)))?;
            hash.update(&chunk[..k]);
            left -= k;
        }
        Ok(hash.digest())
    }

    /// Moves past `n` more bytes, failing if the section ends first.
    fn advance(&mut self, n: usize) -> Result<(), FormatError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.len)
            .ok_or_else(|| {
                FormatError::invalid(format!(
                    "{} section is truncated at byte {}",
                    self.what, self.pos
                ))
            })?;
        self.pos = end;
        Ok(())
    }
    pub fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    pub fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub fn f32(&mut self) -> Result<f32, FormatError> {
        Ok(f32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    /// A count that must fit in what is left of the section (`min_bytes` per item), so a damaged
    /// count cannot trigger a huge allocation.
    pub fn count(&mut self, min_bytes: usize) -> Result<usize, FormatError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_bytes.max(1)) > self.len - self.pos {
            return Err(self.invalid(format!("a count of {n} exceeds the section")));
        }
        Ok(n)
    }
    pub fn u32s(&mut self, n: usize) -> Result<Vec<u32>, FormatError> {
        let b = self.take(
            n.checked_mul(4)
                .ok_or_else(|| self.invalid("count overflow"))?,
        )?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
            .collect())
    }
    pub fn f32s(&mut self, n: usize) -> Result<Vec<f32>, FormatError> {
        let b = self.take(
            n.checked_mul(4)
                .ok_or_else(|| self.invalid("count overflow"))?,
        )?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
            .collect())
    }
    pub fn f16s(&mut self, n: usize) -> Result<Vec<f32>, FormatError> {
        let b = self.take(
            n.checked_mul(2)
                .ok_or_else(|| self.invalid("count overflow"))?,
        )?;
        Ok(b.chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect())
    }
    pub fn str(&mut self) -> Result<String, FormatError> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.invalid("a name is not UTF-8"))
    }
    /// Fails unless every byte was consumed.
    pub fn finish(&self) -> Result<(), FormatError> {
        if self.pos != self.len {
            return Err(self.invalid(format!("{} trailing bytes", self.len - self.pos)));
        }
        Ok(())
    }
    pub fn invalid(&self, msg: impl std::fmt::Display) -> FormatError {
        FormatError::invalid(format!("{} section: {msg}", self.what))
    }
}
