//! A weight matrix kept in one of the file format's encodings, with batch-1 mat-vec (decode) that
//! decodes in registers, and mat-mat (prompt chunks) that decodes tiles of rows to f32 for `gemm`.

use anyhow::{bail, Result};
use leanstream_format::quant::{quantize_row, row_bytes, QuantType};
use rayon::prelude::*;
use smallvec::SmallVec;

use std::borrow::Cow;

use super::gemm::gemm_rows;
use super::groups::{group_in_place, ungroup_row, ungroup_rows, GROUP_ROWS};
use super::matrix::{gemm_inputs, gemm_t_blocked, Matrix};
use super::operand::Operand;
use super::portable::Q8_0_BYTES;
use super::rows::{RowKernels, DOT_ROWS};
use crate::storage::AlignedBuf;

/// Rows per rayon task in a mat-vec: enough work to amortize the task, few enough to balance.
const ROWS_PER_TASK: usize = 32;
/// Below this many encoded bytes a mat-vec runs on the calling thread: waking a parked worker
/// costs more than the second thread saves (measured on this project's 2-vCPU machines).
const PARALLEL_MIN_BYTES: usize = 1 << 20;
/// Inputs per `gemm` block in a mat-mat ([`super::matrix::gemm_inputs`]): decoding every row to
/// f32 for `gemm` costs about as much as ten mat-vecs.
pub(super) const GEMM_MIN_TOKENS: usize = 16;
/// Weights per decoded tile in a mat-mat: a tile (f32) stays within L2 while `gemm` reads it.
const TILE_WEIGHTS: usize = 1 << 18;

/// `rows × cols` values, row-major, each row `row_bytes(qtype, cols)` bytes; the first
/// `grouped` rows may lie in row groups ([`QMatrix::in_groups`]).
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub qtype: QuantType,
    data: Encoded,
    row_bytes: usize,
    /// Rows laid out in groups of eight ([`super::groups`]), from the first: 0, or the whole
    /// groups of the matrix (a last few rows stay plain after them).
    grouped: usize,
}

/// Rows a prompt chunk's product takes out of their groups at a time (into a buffer of the
/// thread's) before multiplying them as plain rows.
const UNGROUP_ROWS: usize = 256;

/// Inputs up to which a grouped matrix's product runs a mat-vec over the groups per input rather
/// than taking the rows out of their groups for the prompt kernels (a short prompt, a batched
/// decode step). The 4-layer 7B shape `resident`, AMD EPYC Zen 4, time to the first token of a
/// 5 / 7 / 8-token prompt: 199–203 / 247–257 / 274–281 ms taking rows out, 175–193 / 225–228 /
/// 237–238 ms a mat-vec each; 9 tokens (rows taken out either way) 306–348.
const GROUPED_INPUTS: usize = 8;

thread_local! {
    /// The plain rows of a grouped matrix's product in progress.
    static UNGROUPED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Where a matrix's encoded rows are: a vector of its own, or the read buffer they landed in
/// (streamed projections are computed where they were read, not copied first).
enum Encoded {
    Owned(Vec<u8>),
    /// The first `.1` bytes of a read.
    Read(AlignedBuf, usize),
}

impl std::ops::Deref for Encoded {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Encoded::Owned(v) => v,
            Encoded::Read(buf, len) => &buf[..*len],
        }
    }
}

/// A copy owns its bytes.
impl Clone for Encoded {
    fn clone(&self) -> Self {
        Encoded::Owned(self.to_vec())
    }
}

impl std::fmt::Debug for Encoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} encoded bytes", self.len())
    }
}

/// `out[r] = row r · x` over `out.len()` encoded rows laid end to end in `data` (each row's bytes
/// from `qtype` and `x`'s length): [`QMatrix::matvec`] on borrowed bytes, for weights streamed in
/// row blocks, with the same result for each row.
pub fn matvec_rows(k: &RowKernels, qtype: QuantType, data: &[u8], x: &Operand, out: &mut [f32]) {
    let row_bytes = data.len() / out.len().max(1);
    assert_eq!(data.len(), out.len() * row_bytes);
    // `DOT_ROWS` consecutive rows at a time share the input's loads (bitwise each row's `dot`);
    // kernels that take one row at a time keep the plain loop.
    let rows = |r0: usize, chunk: &mut [f32]| {
        if k.dot_rows() == 1 {
            for (i, o) in chunk.iter_mut().enumerate() {
                let r = r0 + i;
                *o = k.dot(qtype, &data[r * row_bytes..(r + 1) * row_bytes], x);
            }
            return;
        }
        let mut views: [&[u8]; DOT_ROWS] = [&[]; DOT_ROWS];
        for (c, o) in chunk.chunks_mut(DOT_ROWS).enumerate() {
            let r = r0 + c * DOT_ROWS;
            for (j, v) in views[..o.len()].iter_mut().enumerate() {
                *v = &data[(r + j) * row_bytes..(r + j + 1) * row_bytes];
            }
            k.dots_ahead(qtype, &views[..o.len()], x, o);
        }
    };
    if data.len() >= PARALLEL_MIN_BYTES && rayon::current_num_threads() > 1 {
        out.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(c, chunk)| rows(c * ROWS_PER_TASK, chunk));
    } else {
        rows(0, out);
    }
}

impl QMatrix {
    /// Wraps encoded rows (e.g. a GGUF tensor as stored); checks the length.
    pub fn new(rows: usize, cols: usize, qtype: QuantType, data: Vec<u8>) -> Result<Self> {
        Self::wrap(rows, cols, qtype, Encoded::Owned(data))
    }

    /// The matrix whose rows are the first `len` bytes of a read, used where they landed; checks
    /// the length. [`into_read`](Self::into_read) gives the buffer back.
    pub fn in_read(
        rows: usize,
        cols: usize,
        qtype: QuantType,
        buf: AlignedBuf,
        len: usize,
    ) -> Result<Self> {
        if len > buf.len() {
            bail!("a read of {} bytes holds no {len}-byte matrix", buf.len());
        }
        Self::wrap(rows, cols, qtype, Encoded::Read(buf, len))
    }

    /// The read buffer of a matrix made by [`in_read`](Self::in_read).
    pub fn into_read(self) -> Option<AlignedBuf> {
        match self.data {
            Encoded::Read(buf, _) if self.grouped == 0 => Some(buf),
            _ => None,
        }
    }

    /// The same matrix with its rows in groups of eight ([`super::groups`]), where the kernels
    /// in use have a grouped mat-vec for its type (`Q8_0`, `Q4_0` and `Q4_1` on x86-64: 2.2×,
    /// 1.7× and 2.4× a plain 7B-wide mat-vec's bytes per second on one core); else unchanged. The
    /// bytes and every result keep their values; for a matrix that stays in memory (a resident
    /// model's weights), laid out once at load, in place.
    pub fn in_groups(self) -> Self {
        self.in_groups_for(RowKernels::best())
    }

    /// [`in_groups`](Self::in_groups) where kernel set `k` has a grouped mat-vec (tests compare
    /// the sets).
    pub fn in_groups_for(mut self, k: &RowKernels) -> Self {
        let groups = self.rows / GROUP_ROWS;
        if self.grouped > 0 || groups == 0 || !k.has_groups(self.qtype) {
            return self;
        }
        let len = groups * GROUP_ROWS * self.row_bytes;
        let mut data = match std::mem::replace(&mut self.data, Encoded::Owned(Vec::new())) {
            Encoded::Owned(v) => v,
            read => read.to_vec(),
        };
        group_in_place(self.qtype, &mut data[..len], self.row_bytes);
        self.data = Encoded::Owned(data);
        self.grouped = groups * GROUP_ROWS;
        self
    }

    /// Whether the rows lie in groups ([`in_groups`](Self::in_groups)).
    pub fn is_grouped(&self) -> bool {
        self.grouped > 0
    }

    fn wrap(rows: usize, cols: usize, qtype: QuantType, data: Encoded) -> Result<Self> {
        let row_bytes = row_bytes(qtype, cols)?;
        if data.len() != rows * row_bytes {
            bail!(
                "{} bytes do not hold a {rows}×{cols} {qtype} matrix ({} bytes)",
                data.len(),
                rows * row_bytes
            );
        }
        Ok(Self {
            rows,
            cols,
            qtype,
            data,
            row_bytes,
            grouped: 0,
        })
    }

    /// Encodes an f32 matrix row by row.
    pub fn quantize(m: &Matrix, qtype: QuantType) -> Result<Self> {
        let mut data = Vec::with_capacity(m.rows * row_bytes(qtype, m.cols)?);
        for r in 0..m.rows {
            data.extend(quantize_row(qtype, m.row(r))?);
        }
        Self::new(m.rows, m.cols, qtype, data)
    }

    /// Every row's bytes, end to end, as stored (out of their groups where grouped).
    pub fn encoded(&self) -> Cow<'_, [u8]> {
        if self.grouped == 0 {
            return Cow::Borrowed(&self.data);
        }
        let mut plain = vec![0u8; self.data.len()];
        for (r, row) in plain.chunks_exact_mut(self.row_bytes).enumerate() {
            self.row_into(r, row);
        }
        Cow::Owned(plain)
    }

    /// Row `r`'s bytes, of a matrix whose rows are not grouped ([`row_into`](Self::row_into)
    /// takes either).
    ///
    /// # Panics
    /// If row `r` lies in a group.
    pub fn row(&self, r: usize) -> &[u8] {
        assert!(
            r >= self.grouped,
            "row {r} lies in a group: QMatrix::row_into"
        );
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Row `r`'s bytes as stored, into `out` (`row_bytes`).
    pub fn row_into(&self, r: usize, out: &mut [u8]) {
        if r >= self.grouped {
            out.copy_from_slice(self.row(r));
            return;
        }
        ungroup_rows(self.qtype, &self.data, self.row_bytes, r, out);
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Decodes row `r` into `out`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols);
        let k = RowKernels::best();
        if r >= self.grouped {
            return k.dequantize(self.qtype, self.row(r), out);
        }
        // One block at a time out of its group (`Q8_0`'s the largest): no allocation (an
        // embedding lookup per token).
        let bytes = self.qtype.block_bytes();
        let group = &self.data[(r / GROUP_ROWS) * GROUP_ROWS * self.row_bytes..];
        let mut blk = [0u8; Q8_0_BYTES];
        for (b, out) in out.chunks_exact_mut(self.qtype.block_len()).enumerate() {
            let g = &group[b * GROUP_ROWS * bytes..][..GROUP_ROWS * bytes];
            ungroup_row(self.qtype, g, r % GROUP_ROWS, &mut blk[..bytes]);
            k.dequantize(self.qtype, &blk[..bytes], out);
        }
    }

    /// `out[r] = row r · x`, with `x` prepared for this matrix's encoding.
    pub fn matvec(&self, x: &Operand, out: &mut [f32]) {
        self.matvec_with(RowKernels::best(), x, out)
    }

    /// [`matvec`](Self::matvec) with a given kernel set (tests and benches compare them).
    pub fn matvec_with(&self, k: &RowKernels, x: &Operand, out: &mut [f32]) {
        assert_eq!(x.x.len(), self.cols);
        assert_eq!(out.len(), self.rows);
        let split = self.grouped * self.row_bytes;
        let (groups, plain) = self.data.split_at(split);
        let (out_groups, out_plain) = out.split_at_mut(self.grouped);
        if !groups.is_empty() {
            let task = ROWS_PER_TASK * self.row_bytes;
            if groups.len() >= PARALLEL_MIN_BYTES && rayon::current_num_threads() > 1 {
                out_groups
                    .par_chunks_mut(ROWS_PER_TASK)
                    .zip(groups.par_chunks(task))
                    .for_each(|(o, d)| k.groups_dot(self.qtype, d, x, o));
            } else {
                k.groups_dot(self.qtype, groups, x, out_groups);
            }
        }
        matvec_rows(k, self.qtype, plain, x, out_plain);
    }

    /// `out (t × rows) = X (t × cols) · Wᵀ` for `t` row-major input vectors.
    pub fn matmul_t(&self, x: &[f32], t: usize, out: &mut [f32]) {
        if self.grouped == 0 {
            return RowStream::new(self.qtype, self.rows, self.cols, self.row_bytes, x, t)
                .push(&self.data, out);
        }
        if t <= GROUPED_INPUTS {
            // A few inputs (a short prompt, a batched decode step): a mat-vec over the groups for
            // each, bitwise a decoded token's.
            for (x, out) in x
                .chunks_exact(self.cols)
                .zip(out.chunks_exact_mut(self.rows))
            {
                self.matvec(&Operand::new(x, self.qtype), out);
            }
            return;
        }
        // More inputs: the rows out of their groups a slice at a time, multiplied as plain rows
        // (the same kernels, so the same bits).
        let mut stream = RowStream::new(self.qtype, self.rows, self.cols, self.row_bytes, x, t);
        let mut push = |plain: &mut Vec<u8>| {
            for r0 in (0..self.rows).step_by(UNGROUP_ROWS) {
                let n = UNGROUP_ROWS.min(self.rows - r0);
                plain.resize(n * self.row_bytes, 0);
                for (i, row) in plain.chunks_exact_mut(self.row_bytes).enumerate() {
                    self.row_into(r0 + i, row);
                }
                stream.push(plain, out);
            }
        };
        // The thread's buffer, or one of its own where a product that this thread took up while
        // waiting on its pool's workers holds it already.
        UNGROUPED.with(|cell| match cell.try_borrow_mut() {
            Ok(mut plain) => push(&mut plain),
            Err(_) => push(&mut Vec::new()),
        });
    }
}

/// Inputs a [`RowStream`] holds without allocating: a batched decode step of up to this many
/// sequences (a longer prompt chunk allocates its list once per product).
const INLINE_INPUTS: usize = 16;

/// [`QMatrix::matmul_t`] over rows that arrive in order, a block at a time (a matrix streamed from
/// flash): the same kernels on the same bytes, so the same result. Block types multiply every input
/// on the integer kernels ([`gemm_rows`]: each result bitwise a decoded token's mat-vec). Float
/// types: the inputs [`gemm_inputs`] names multiply tiles of rows decoded to f32 (a tile gathered
/// across blocks); a single one left is a mat-vec.
pub struct RowStream<'x> {
    qtype: QuantType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    x: &'x [f32],
    t: usize,
    /// Block types with more than one input: every input prepared for the encoding (held in place
    /// up to [`INLINE_INPUTS`], so that a batched decode step allocates nothing).
    block: SmallVec<[Operand<'x>; INLINE_INPUTS]>,
    /// The first inputs, through `gemm`.
    gemm_tokens: usize,
    /// The input left after them, prepared for the encoding in place (a decoded token's mat-vec
    /// allocates nothing).
    operand: Option<Operand<'x>>,
    /// The decoded rows of the tile being gathered, which starts at `tile_start`.
    tile: Vec<f32>,
    tile_rows: usize,
    tile_start: usize,
    tile_fill: usize,
    /// Rows pushed so far.
    done: usize,
}

impl<'x> RowStream<'x> {
    pub fn new(
        qtype: QuantType,
        rows: usize,
        cols: usize,
        row_bytes: usize,
        x: &'x [f32],
        t: usize,
    ) -> Self {
        assert_eq!(x.len(), t * cols);
        let block: SmallVec<[Operand; INLINE_INPUTS]> = if qtype.is_block() && t > 1 {
            x.chunks_exact(cols)
                .map(|x| Operand::new(x, qtype))
                .collect()
        } else {
            SmallVec::new()
        };
        let gemm_tokens = if qtype.is_block() { 0 } else { gemm_inputs(t) };
        let operand = (gemm_tokens < t && block.is_empty())
            .then(|| Operand::new(&x[gemm_tokens * cols..], qtype));
        let tile_rows = (TILE_WEIGHTS / cols).clamp(1, rows);
        Self {
            qtype,
            rows,
            cols,
            row_bytes,
            x,
            t,
            block,
            gemm_tokens,
            operand,
            tile: if gemm_tokens > 0 {
                vec![0.0; tile_rows * cols]
            } else {
                Vec::new()
            },
            tile_rows,
            tile_start: 0,
            tile_fill: 0,
            done: 0,
        }
    }

    /// Takes the next whole rows (`data`) and writes their columns of `out` (`t × rows`).
    pub fn push(&mut self, data: &[u8], out: &mut [f32]) {
        let (rows, cols) = (self.rows, self.cols);
        assert_eq!(out.len(), self.t * rows);
        assert!(data.len().is_multiple_of(self.row_bytes));
        let n = data.len() / self.row_bytes;
        assert!(self.done + n <= rows, "more rows than the matrix has");
        let k = RowKernels::best();
        if !self.block.is_empty() {
            let out = &mut out[self.done..];
            gemm_rows(k, self.qtype, data, self.row_bytes, &self.block, out, rows);
        }
        if self.gemm_tokens > 0 {
            for row in data.chunks_exact(self.row_bytes) {
                let f = self.tile_fill;
                k.dequantize(self.qtype, row, &mut self.tile[f * cols..(f + 1) * cols]);
                self.tile_fill += 1;
                if self.tile_fill == self.tile_rows.min(rows - self.tile_start) {
                    let tile = &self.tile[..self.tile_fill * cols];
                    let xs = &self.x[..self.gemm_tokens * cols];
                    let dst = &mut out[self.tile_start..];
                    gemm_t_blocked(tile, self.tile_fill, cols, xs, self.gemm_tokens, dst, rows);
                    self.tile_start += self.tile_fill;
                    self.tile_fill = 0;
                }
            }
        }
        if let Some(x) = &self.operand {
            let o = &mut out[self.gemm_tokens * rows..];
            matvec_rows(k, self.qtype, data, x, &mut o[self.done..self.done + n]);
        }
        self.done += n;
    }
}
