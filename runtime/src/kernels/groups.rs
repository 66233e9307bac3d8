//! Row groups: eight rows of a `Q4_0`, `Q4_1` or `Q8_0` matrix laid block by block side by side,
//! so that a mat-vec's vector operations each serve eight rows instead of one.
//!
//! A row's dot product keeps its eight lanes (lane `j`: the exact integer sum over values
//! `4j..4j + 4` of a block, converted, times `d_w·d_x`, added block after block: the portable
//! order, [`super::portable`]). In a group those lanes are transposed: vector `j` holds lane `j`
//! of the eight rows. Each block of a group is laid out so that this transposition costs nothing:
//!
//! - the eight rows' f16 scales (16 bytes), then for `Q4_1` their eight f16 minimums (16 bytes);
//! - then chunks of 32 bytes: chunk `c` holds bytes `4c..4c + 4` of each row's codes, row after
//!   row. A 4-bit block has four: byte `k` of its 16 holds value `k` in its low nibble and value
//!   `k + 16` in its high one, so the low nibbles of chunk `c` are lane `c` of the eight rows and
//!   the high nibbles lane `c + 4`. A `Q8_0` block has eight, chunk `c` lane `c`.
//!
//! So per block, one 256-bit load and three operations give two lanes' codes of eight rows, one
//! VNNI `vpdpbusd` against the input's four values broadcast gives a lane's exact sums for eight
//! rows, and the scales of eight rows convert and multiply in one vector. Per row and block the
//! arithmetic is the portable kernel's, product by product and sum by sum, so a grouped row has
//! the bits of its plain `dot`. A group takes exactly the bytes of its eight rows.

use leanstream_format::quant::{QuantType, BLOCK_LEN};

use super::operand::Q8Vec;
use super::portable::{self, f16_at, Block, BLOCK_LANES};

/// Rows per group.
pub const GROUP_ROWS: usize = 8;

/// The block types that have a grouped layout.
pub fn groupable(qtype: QuantType) -> bool {
    matches!(qtype, QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0)
}

/// Bytes of a grouped block's head: the eight scales, and the eight minimums where the type has
/// them.
pub(super) const fn head_bytes(has_min: bool) -> usize {
    if has_min {
        4 * GROUP_ROWS
    } else {
        2 * GROUP_ROWS
    }
}

/// Where a plain block's code bytes start, and how many 4-byte chunks they make.
fn codes_at(qtype: QuantType) -> (usize, usize) {
    match qtype {
        QuantType::Q4_0 => (2, 4),
        QuantType::Q4_1 => (4, 4),
        _ => (2, 8),
    }
}

/// Lays `rows` (a whole number of groups of plain rows, each `row_bytes` long) out as groups
/// into `out` (as long as `rows`).
///
/// # Panics
/// If `qtype` is not [`groupable`], or the lengths do not make whole groups of whole blocks.
pub fn group_rows(qtype: QuantType, rows: &[u8], row_bytes: usize, out: &mut [u8]) {
    assert!(groupable(qtype), "{} has no grouped layout", qtype.name());
    let bytes = qtype.block_bytes();
    assert!(row_bytes > 0 && row_bytes.is_multiple_of(bytes));
    assert!(rows.len().is_multiple_of(GROUP_ROWS * row_bytes));
    assert_eq!(rows.len(), out.len());
    let ((at, chunks), head) = (codes_at(qtype), head_bytes(qtype == QuantType::Q4_1));
    for (src, dst) in rows
        .chunks_exact(GROUP_ROWS * row_bytes)
        .zip(out.chunks_exact_mut(GROUP_ROWS * row_bytes))
    {
        for (b, dst) in dst.chunks_exact_mut(GROUP_ROWS * bytes).enumerate() {
            for r in 0..GROUP_ROWS {
                let blk = &src[r * row_bytes + b * bytes..][..bytes];
                dst[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
                if at == 4 {
                    dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                }
                for c in 0..chunks {
                    let to = head + 32 * c + 4 * r;
                    dst[to..to + 4].copy_from_slice(&blk[at + 4 * c..at + 4 * c + 4]);
                }
            }
        }
    }
}

/// [`group_rows`] in place over `rows`, a group at a time through a buffer of one group's rows
/// (a matrix or a layer's run is never held twice).
pub fn group_in_place(qtype: QuantType, rows: &mut [u8], row_bytes: usize) {
    group_in_place_with(qtype, rows, row_bytes, &mut Vec::new());
}

/// [`group_in_place`] through `buf` (grown to one group's rows if it is shorter, then reused):
/// a cluster entering the cache is grouped without allocating.
pub fn group_in_place_with(qtype: QuantType, rows: &mut [u8], row_bytes: usize, buf: &mut Vec<u8>) {
    let size = GROUP_ROWS * row_bytes;
    if buf.len() < size {
        buf.resize(size, 0);
    }
    let plain = &mut buf[..size];
    for group in rows.chunks_exact_mut(size) {
        plain.copy_from_slice(group);
        group_rows(qtype, plain, row_bytes, group);
    }
}

/// Rows `first ..` of `run` (rows of `row_bytes` laid out in groups from its start, [`group_rows`])
/// back in their plain layout, as many as `out` holds.
pub fn ungroup_rows(qtype: QuantType, run: &[u8], row_bytes: usize, first: usize, out: &mut [u8]) {
    let size = GROUP_ROWS * row_bytes;
    for (i, row) in out.chunks_exact_mut(row_bytes).enumerate() {
        let n = first + i;
        let group = &run[(n / GROUP_ROWS) * size..][..size];
        ungroup_row(qtype, group, n % GROUP_ROWS, row);
    }
}

/// Row `r` of a group (`GROUP_ROWS · row_bytes` bytes) back in its plain layout, into `out`
/// (`row_bytes`).
pub fn ungroup_row(qtype: QuantType, group: &[u8], r: usize, out: &mut [u8]) {
    let bytes = qtype.block_bytes();
    let ((at, chunks), head) = (codes_at(qtype), head_bytes(qtype == QuantType::Q4_1));
    for (src, blk) in group
        .chunks_exact(GROUP_ROWS * bytes)
        .zip(out.chunks_exact_mut(bytes))
    {
        blk[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
        if at == 4 {
            blk[2..4].copy_from_slice(&src[16 + 2 * r..16 + 2 * r + 2]);
        }
        for c in 0..chunks {
            let from = head + 32 * c + 4 * r;
            blk[at + 4 * c..at + 4 * c + 4].copy_from_slice(&src[from..from + 4]);
        }
    }
}

/// `out[8g + r] = row r of group g · x` for the groups laid one after another in `data`
/// (`out.len() / 8` of them, of equal length), in the portable order: each row bitwise its plain
/// `dot`. The reference the instruction sets' kernels are tested against.
pub(super) fn groups_dot(qtype: QuantType, data: &[u8], x: &Q8Vec, out: &mut [f32]) {
    let kind = match qtype {
        QuantType::Q4_0 => Block::Q4_0,
        QuantType::Q4_1 => Block::Q4_1,
        _ => Block::Q8_0,
    };
    let bytes = kind.bytes();
    let groups = out.len() / GROUP_ROWS;
    if groups == 0 {
        return;
    }
    let group_bytes = data.len() / groups;
    let nx = x
        .scales
        .len()
        .min(x.sums.len())
        .min(x.quants.len() / BLOCK_LEN);
    let nb = (group_bytes / (GROUP_ROWS * bytes)).min(nx);
    let mut blk = [0u8; portable::Q8_0_BYTES];
    let blk = &mut blk[..bytes];
    for (g, out) in out.chunks_exact_mut(GROUP_ROWS).enumerate() {
        let group = &data[g * group_bytes..(g + 1) * group_bytes];
        for (r, o) in out.iter_mut().enumerate() {
            let mut acc = [0.0f32; BLOCK_LANES];
            let mut mins = 0.0f32;
            for b in 0..nb {
                ungroup_row(
                    qtype,
                    &group[b * GROUP_ROWS * bytes..][..GROUP_ROWS * bytes],
                    r,
                    blk,
                );
                let dd = f16_at(blk, 0) * x.scales[b];
                let lanes =
                    portable::lane_isums(&kind.codes(blk), &x.quants[b * BLOCK_LEN..][..BLOCK_LEN]);
                for (a, l) in acc.iter_mut().zip(lanes) {
                    *a += dd * l as f32;
                }
                if kind.has_min() {
                    mins += f16_at(blk, 2) * x.sums[b];
                }
            }
            *o = portable::lanes_total(acc) + mins;
        }
    }
}
