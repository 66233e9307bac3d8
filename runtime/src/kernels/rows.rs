//! One instruction set's row kernels as a table of function pointers, picked once at run time, and
//! the dispatch from a row's [`QuantType`] to its kernel.
//!
//! A row kernel works on one encoded row: `dot` (the row times the input vector) and `axpy`
//! (`out += a · row`, which is also how rows are decoded: `a = 1` into zeros, exactly). `axpy_rows`
//! adds several rows at once (a cluster's active down columns): the same operations in the same
//! order as `axpy` row after row, so the same bits, with each output block loaded and stored once
//! for all the rows instead of once per row. An instruction set without its own `axpy_rows` runs
//! its `axpy` row by row. `dots` takes up to [`DOT_ROWS`] rows against one input vector at once
//! (a mat-vec's consecutive rows, a bundle's gate and up rows): each block of the input is loaded
//! once for all of them and the rows' sums run side by side, each row with the operations, in the
//! order, of its own `dot`, so the same bits. Where a set takes several rows at once
//! ([`RowKernels::dot_rows`]), the dense mat-vec takes its rows four at a time
//! ([`super::matvec_rows`], which asks for the rows ahead itself: four rows read side by side stop
//! the hardware prefetcher) and the bundle gate pass the gate and up rows of two bundles (the
//! `gate_up` rule) or four gates (`gate`). `dot_inputs` is the other way round: one row against
//! up to [`INPUTS`] inputs (a prompt chunk's tokens; [`WIDE_INPUTS`] where a set's kernel for the
//! type takes more, [`RowKernels::inputs_width`]), the row's codes decoded once for all of them,
//! each result again bitwise its own `dot`. `dots_ahead` is `dots` for a dense mat-vec's rows, which
//! lie one after another in one matrix: its kernels ask for the bytes a fixed distance ahead as they
//! go (the hardware prefetcher alone left one core's mat-vec from DRAM at half a plain read's
//! bandwidth), with the same bits.
//!
//! The environment variable `LEANSTREAM_KERNELS` forces one set by its name (`avx512`, `avx2`,
//! `neon-dotprod`, `neon`, `portable`), so that every path can be run and compared on a CPU that
//! has a faster one (`scripts/test-aarch64.sh` runs each NEON path in turn). It is read once; a
//! name this CPU does not run is an error that lists the ones it does.

use std::sync::OnceLock;

use anyhow::anyhow;

use leanstream_format::quant::{row_bytes, QuantType};

use super::operand::{Operand, Q8Vec};
use super::portable;

type FloatDot = fn(&[u8], &[f32]) -> f32;
type BlockDot = fn(&[u8], &Q8Vec) -> f32;
/// `out[j] = rows[j] · x` for 1 to [`DOT_ROWS`] rows (`out` as long as `rows`).
type BlockDots = fn(&[&[u8]], &Q8Vec, &mut [f32]);
/// `out[i] = row · xs[i]` for 1 to [`INPUTS`] inputs, or to [`WIDE_INPUTS`] where the set says
/// so ([`RowKernels::inputs_width`]) (`out` as long as `xs`).
pub(crate) type BlockInputs = fn(&[u8], &[&Q8Vec], &mut [f32]);
type Axpy = fn(f32, &[u8], &mut [f32]);
/// `out[8g + r] = row r of group g · x` over the row groups laid one after another in the bytes
/// ([`super::groups`]; `out.len() / 8` groups).
type GroupsDot = fn(&[u8], &Q8Vec, &mut [f32]);
/// `out[i] = row · xs[i]` for 1 to [`INPUTS`] inputs whose block scales and sums are also laid
/// side by side in `packed` (`out` as long as `xs`).
type PackedInputs = fn(&[u8], &[&Q8Vec], &Packed, &mut [f32]);
type AxpyRows = fn(&[f32], &[&[u8]], &mut [f32]);
/// `out[j] = row_j · x` for the rows laid one after another in `rows`, each `row_bytes` long
/// (a KV cache's keys): `(rows, row_bytes, x, out)`.
type FloatDotsNext = fn(&[u8], usize, &[f32], &mut [f32]);
/// `out += Σ a[j] · row_j` for the rows laid one after another in `rows`, each `row_bytes` long
/// (a KV cache's values), in order: `(a, rows, row_bytes, out)`.
type FloatAxpyNext = fn(&[f32], &[u8], usize, &mut [f32]);
/// `Σ_{bit i of bits set} q_i` ([`super::sketch`]): one row of a sign sketch against an int8 input.
pub(crate) type SignSum = fn(&[u8], &[i8]) -> i32;

/// The row kernels of one instruction set.
#[derive(Clone, Copy)]
pub struct RowKernels {
    pub isa: &'static str,
    pub(crate) dot_f32: FloatDot,
    pub(crate) dot_f16: FloatDot,
    pub(crate) dot_bf16: FloatDot,
    pub(crate) dot_q8_0: BlockDot,
    pub(crate) dot_q4_0: BlockDot,
    pub(crate) dot_q4_1: BlockDot,
    /// `dot` of up to [`DOT_ROWS`] rows at once, bitwise the `dot` of each.
    pub(crate) dots_q8_0: BlockDots,
    pub(crate) dots_q4_0: BlockDots,
    pub(crate) dots_q4_1: BlockDots,
    /// [`dots_q8_0`](Self::dots_q8_0), `Q4_0`'s and `Q4_1`'s for rows that lie one after another
    /// in one matrix (a dense mat-vec, [`RowKernels::dots_ahead`]), reading ahead in them, where
    /// the set has such kernels.
    pub(crate) dots_ahead: Option<[BlockDots; 3]>,
    /// `Q8_0`'s, `Q4_0`'s and `Q4_1`'s mat-vec over row groups ([`super::groups`]), bitwise
    /// each row's `dot`, where the set has a kernel that gains from the layout (else rows stay
    /// plain).
    pub(crate) groups_dot: Option<[GroupsDot; 3]>,
    /// Rows [`RowKernels::dots`] gives these kernels at once: [`DOT_ROWS`], or 1 where sharing the
    /// input was measured slower in the token loop (AVX-512: SmolLM2 q4 `resident` 8.7–8.9 against
    /// 7.8–8.2 ms of CPU per token; AVX2 gained about 5 %).
    pub(crate) dot_rows: usize,
    /// One row against up to [`INPUTS`] inputs at once, bitwise the `dot` of each, where the
    /// instruction set has it (a prompt chunk's mat-mat; else one `dot` per input).
    pub(crate) inputs_q8_0: Option<BlockInputs>,
    pub(crate) inputs_q4_0: Option<BlockInputs>,
    pub(crate) inputs_q4_1: Option<BlockInputs>,
    /// [`inputs_q8_0`](Self::inputs_q8_0) … with the inputs' scales and sums packed side by
    /// side ([`Packed`]), where the set has it.
    pub(crate) packed_inputs: Option<[PackedInputs; 3]>,
    pub(crate) axpy_f32: Axpy,
    pub(crate) axpy_f16: Axpy,
    pub(crate) axpy_bf16: Axpy,
    pub(crate) axpy_q8_0: Axpy,
    pub(crate) axpy_q4_0: Axpy,
    pub(crate) axpy_q4_1: Axpy,
    /// `axpy` of several rows at once, where the instruction set has one (else row by row).
    pub(crate) axpy_rows_q8_0: Option<AxpyRows>,
    pub(crate) axpy_rows_q4_0: Option<AxpyRows>,
    pub(crate) axpy_rows_q4_1: Option<AxpyRows>,
    /// `dot` of each of many rows laid one after another (`[f32, f16]`), bitwise the `dot` of
    /// each, where the set has it (else one `dot` per row).
    pub(crate) dots_next: Option<[FloatDotsNext; 2]>,
    /// `axpy` of each of many rows laid one after another (`[f32, f16]`), bitwise `axpy` row
    /// after row, where the set has it (else one `axpy` per row).
    pub(crate) axpy_next: Option<[FloatAxpyNext; 2]>,
    /// The 5-bit types and the K-quants (`Q5_0` … `Q6_K`).
    pub(crate) more: MoreKernels,
    /// A sign sketch row's masked sum (refine sparsity's scores), the portable integer exactly.
    pub(crate) sign_sum: SignSum,
}

/// The kernels of `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K` and `Q6_K`, indexed in that order (the
/// [`QuantType`] value minus 6): an instruction set without its own takes the portable ones.
#[derive(Clone, Copy)]
pub(crate) struct MoreKernels {
    pub(crate) dot: [BlockDot; MORE],
    pub(crate) dots: [BlockDots; MORE],
    /// `dots` of consecutive rows reading ahead, where the set has it ([`RowKernels::dots_ahead`]).
    pub(crate) dots_ahead: [Option<BlockDots>; MORE],
    /// One row against several inputs, where the set has it (`dot_inputs`).
    pub(crate) inputs: [Option<BlockInputs>; MORE],
    /// How many inputs each of those takes at once: [`INPUTS`], or [`WIDE_INPUTS`].
    pub(crate) inputs_width: [usize; MORE],
    pub(crate) axpy: [Axpy; MORE],
}

/// How many types [`MoreKernels`] holds.
pub(crate) const MORE: usize = 5;

/// The index of `qtype` in [`MoreKernels`] (a type of value 6 or more).
#[inline(always)]
fn more_index(qtype: QuantType) -> usize {
    qtype as usize - QuantType::Q5_0 as usize
}

pub(crate) const PORTABLE_MORE: MoreKernels = MoreKernels {
    dot: [
        portable::dot_q5_0,
        portable::dot_q5_1,
        portable::dot_q4_k,
        portable::dot_q5_k,
        portable::dot_q6_k,
    ],
    dots: [
        portable::dots_q5_0,
        portable::dots_q5_1,
        portable::dots_q4_k,
        portable::dots_q5_k,
        portable::dots_q6_k,
    ],
    dots_ahead: [None; MORE],
    inputs: [None; MORE],
    inputs_width: [INPUTS; MORE],
    axpy: [
        portable::axpy_q5_0,
        portable::axpy_q5_1,
        portable::axpy_q4_k,
        portable::axpy_q5_k,
        portable::axpy_q6_k,
    ],
};

/// The most rows a kernel's `dots` takes at once; [`RowKernels::dots`] takes any number, this many
/// at a time.
pub const DOT_ROWS: usize = 4;

/// The most inputs a kernel's `dot_inputs` takes at once; [`RowKernels::dot_inputs`] takes any
/// number, this many at a time.
pub const INPUTS: usize = 4;

/// The most inputs a wide `dot_inputs` kernel takes at once (the 5-bit types' on AVX2: their
/// codes cost more to decode than a 4-bit block's, and a row's per-call work, its scales and
/// the sums of its lanes, is shared by twice the inputs).
pub const WIDE_INPUTS: usize = 8;

/// The most blocks per input [`Packed`] holds (rows of up to 4096 values).
pub const PACKED_BLOCKS: usize = 128;

/// Up to [`INPUTS`] q8 inputs' block scales and sums laid side by side (`scales[b][i]` is input
/// `i`'s scale of block `b`), so that a kernel taking one row against all of them computes the
/// scale products and the minimum terms of every input in one vector operation each, with the
/// bits of each input's own scalar ones.
pub struct Packed {
    pub(crate) scales: [[f32; INPUTS]; PACKED_BLOCKS],
    pub(crate) sums: [[f32; INPUTS]; PACKED_BLOCKS],
    /// Inputs and blocks packed.
    pub(crate) inputs: usize,
    pub(crate) blocks: usize,
}

impl Packed {
    /// The scales and sums of `xs` (1 to [`INPUTS`] operands made for `qtype`, of the same
    /// length, at most [`PACKED_BLOCKS`] blocks: else `None`).
    /// Only the types with a packed kernel are packed (`Q8_0`, `Q4_0`, `Q4_1`).
    pub fn new(qtype: QuantType, xs: &[&Operand]) -> Option<Self> {
        if !matches!(qtype, QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1) {
            return None;
        }
        let blocks = xs.first()?.q8().scales.len();
        if xs.len() > INPUTS || blocks > PACKED_BLOCKS {
            return None;
        }
        let mut p = Packed {
            scales: [[0.0; INPUTS]; PACKED_BLOCKS],
            sums: [[0.0; INPUTS]; PACKED_BLOCKS],
            inputs: xs.len(),
            blocks,
        };
        for (i, x) in xs.iter().enumerate() {
            let q = x.q8();
            if q.scales.len() != blocks || q.sums.len() != blocks {
                return None;
            }
            for b in 0..blocks {
                p.scales[b][i] = q.scales[b];
                p.sums[b][i] = q.sums[b];
            }
        }
        Some(p)
    }
}

/// The environment variable that forces a kernel set by name.
pub const FORCE_ENV: &str = "LEANSTREAM_KERNELS";

/// The set named `forced` among `available` (fastest first), or the fastest when none is named.
pub(super) fn pick(forced: Option<&str>, available: &[RowKernels]) -> Result<RowKernels, String> {
    match forced {
        None | Some("") => Ok(available[0]),
        Some(name) => available
            .iter()
            .find(|k| k.isa == name)
            .copied()
            .ok_or_else(|| {
                let names: Vec<&str> = available.iter().map(|k| k.isa).collect();
                format!(
                    "{FORCE_ENV}={name}: this CPU does not run those kernels; it runs {} \
                     (set one of them, or unset {FORCE_ENV} for the fastest)",
                    names.join(", ")
                )
            }),
    }
}

pub(crate) const PORTABLE: RowKernels = RowKernels {
    isa: "portable",
    dot_f32: portable::dot_f32,
    dot_f16: portable::dot_f16,
    dot_bf16: portable::dot_bf16,
    dot_q8_0: portable::dot_q8_0,
    dot_q4_0: portable::dot_q4_0,
    dot_q4_1: portable::dot_q4_1,
    dots_q8_0: portable::dots_q8_0,
    dots_q4_0: portable::dots_q4_0,
    dots_q4_1: portable::dots_q4_1,
    dots_ahead: None,
    groups_dot: None,
    dot_rows: DOT_ROWS,
    inputs_q8_0: None,
    inputs_q4_0: None,
    inputs_q4_1: None,
    packed_inputs: None,
    axpy_f32: portable::axpy_f32,
    axpy_f16: portable::axpy_f16,
    axpy_bf16: portable::axpy_bf16,
    axpy_q8_0: portable::axpy_q8_0,
    axpy_q4_0: portable::axpy_q4_0,
    axpy_q4_1: portable::axpy_q4_1,
    axpy_rows_q8_0: None,
    axpy_rows_q4_0: None,
    axpy_rows_q4_1: None,
    dots_next: None,
    axpy_next: None,
    more: PORTABLE_MORE,
    sign_sum: super::sketch::sign_sum,
};

impl RowKernels {
    /// The kernels used everywhere: the fastest this CPU runs, or those `LEANSTREAM_KERNELS` names
    /// (the binary checks it at start-up with [`RowKernels::check_forced`], so a bad name is an
    /// error there, not a panic here).
    pub fn best() -> &'static RowKernels {
        Self::selected().as_ref().unwrap_or_else(|e| panic!("{e}"))
    }

    /// The name of the kernels [`best`](Self::best) uses, or the error for a bad
    /// `LEANSTREAM_KERNELS`.
    pub fn check_forced() -> anyhow::Result<&'static str> {
        Self::selected()
            .as_ref()
            .map(|k| k.isa)
            .map_err(|e| anyhow!("{e}"))
    }

    fn selected() -> &'static Result<RowKernels, String> {
        static SELECTED: OnceLock<Result<RowKernels, String>> = OnceLock::new();
        SELECTED.get_or_init(|| {
            let forced = std::env::var_os(FORCE_ENV).map(|v| v.to_string_lossy().into_owned());
            pick(forced.as_deref(), &Self::available())
        })
    }

    /// Every kernel set this CPU runs, fastest first (tests and benches compare them).
    pub fn available() -> Vec<RowKernels> {
        let mut sets = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if super::avx512::detected() {
                // SAFETY: the CPU has the features the AVX-512 kernels are compiled for.
                sets.push(unsafe { super::avx512::kernels() });
            }
            if super::avx2::detected() {
                // SAFETY: the CPU has the features the AVX2 kernels are compiled for.
                sets.push(unsafe { super::avx2::kernels() });
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if super::neon::dotprod_detected() {
                // SAFETY: the CPU has FEAT_DotProd.
                sets.push(unsafe { super::neon::dotprod_kernels() });
            }
            sets.push(super::neon::kernels());
        }
        sets.push(PORTABLE);
        sets
    }

    /// `row · x` for a row of `x.x.len()` values encoded as `qtype`.
    #[inline]
    pub fn dot(&self, qtype: QuantType, row: &[u8], x: &Operand) -> f32 {
        debug_assert_eq!(Ok(row.len()), row_bytes(qtype, x.x.len()));
        match qtype {
            QuantType::F32 => (self.dot_f32)(row, x.x),
            QuantType::F16 => (self.dot_f16)(row, x.x),
            QuantType::BF16 => (self.dot_bf16)(row, x.x),
            QuantType::Q8_0 => (self.dot_q8_0)(row, x.q8()),
            QuantType::Q4_0 => (self.dot_q4_0)(row, x.q8()),
            QuantType::Q4_1 => (self.dot_q4_1)(row, x.q8()),
            _ => (self.more.dot[more_index(qtype)])(row, x.q8()),
        }
    }

    /// `out[j] = rows[j] · x` for rows of `x.x.len()` values encoded as `qtype`: bitwise
    /// [`dot`](Self::dot) of each row, with the block types' input shared by [`DOT_ROWS`] rows
    /// at a time.
    #[inline]
    pub fn dots(&self, qtype: QuantType, rows: &[&[u8]], x: &Operand, out: &mut [f32]) {
        self.dots_by(qtype, rows, x, out, self.dot_rows)
    }

    /// [`dots`](Self::dots) of consecutive rows of one matrix, in order (a dense mat-vec's rows):
    /// the same bits, with the set's kernels that read ahead in the matrix where it has them.
    #[inline]
    pub fn dots_ahead(&self, qtype: QuantType, rows: &[&[u8]], x: &Operand, out: &mut [f32]) {
        let kernel = match (qtype, &self.dots_ahead) {
            (QuantType::Q8_0, Some(k)) => k[0],
            (QuantType::Q4_0, Some(k)) => k[1],
            (QuantType::Q4_1, Some(k)) => k[2],
            (QuantType::F32 | QuantType::F16 | QuantType::BF16, _)
            | (QuantType::Q8_0 | QuantType::Q4_0 | QuantType::Q4_1, None) => {
                return self.dots(qtype, rows, x, out)
            }
            _ => match self.more.dots_ahead[more_index(qtype)] {
                Some(k) => k,
                None => return self.dots(qtype, rows, x, out),
            },
        };
        assert_eq!(rows.len(), out.len());
        let q8 = x.q8();
        for (rows, out) in rows.chunks(DOT_ROWS).zip(out.chunks_mut(DOT_ROWS)) {
            kernel(rows, q8, out);
        }
    }

    /// Whether this set computes `qtype`'s mat-vec over row groups ([`super::groups`]) with a
    /// kernel of its own: where it does not, a matrix is better kept in plain rows.
    pub fn has_groups(&self, qtype: QuantType) -> bool {
        self.groups_dot.is_some() && super::groups::groupable(qtype)
    }

    /// `out[8g + r] = row r of group g · x` over the row groups of a [`groupable`] type laid one
    /// after another in `data` (`out.len()` a multiple of 8): bitwise each row's
    /// [`dot`](Self::dot). A set without its own kernel runs the portable one.
    ///
    /// [`groupable`]: super::groups::groupable
    pub fn groups_dot(&self, qtype: QuantType, data: &[u8], x: &Operand, out: &mut [f32]) {
        assert!(
            super::groups::groupable(qtype),
            "{} has no groups",
            qtype.name()
        );
        assert!(out.len().is_multiple_of(super::groups::GROUP_ROWS));
        if out.is_empty() {
            return;
        }
        let row = row_bytes(qtype, x.x.len()).expect("a whole number of blocks");
        assert_eq!(
            data.len(),
            out.len() * row,
            "groups of rows of {} values",
            x.x.len()
        );
        let which = match qtype {
            QuantType::Q8_0 => 0,
            QuantType::Q4_0 => 1,
            _ => 2,
        };
        match self.groups_dot {
            Some(k) => k[which](data, x.q8(), out),
            None => super::groups::groups_dot(qtype, data, x.q8(), out),
        }
    }

    /// [`dots`](Self::dots) with `at_once` rows (1 to [`DOT_ROWS`]) per call of the multi-row
    /// kernel whatever this set's own choice (tests and benches compare them); 1 is each row's
    /// `dot`.
    #[inline]
    pub fn dots_by(
        &self,
        qtype: QuantType,
        rows: &[&[u8]],
        x: &Operand,
        out: &mut [f32],
        at_once: usize,
    ) {
        assert_eq!(rows.len(), out.len());
        debug_assert!(rows
            .iter()
            .all(|r| Ok(r.len()) == row_bytes(qtype, x.x.len())));
        let many = match qtype {
            QuantType::Q8_0 if at_once > 1 => self.dots_q8_0,
            QuantType::Q4_0 if at_once > 1 => self.dots_q4_0,
            QuantType::Q4_1 if at_once > 1 => self.dots_q4_1,
            QuantType::F32
            | QuantType::F16
            | QuantType::BF16
            | QuantType::Q8_0
            | QuantType::Q4_0
            | QuantType::Q4_1 => {
                for (o, row) in out.iter_mut().zip(rows) {
                    *o = self.dot(qtype, row, x);
                }
                return;
            }
            _ if at_once > 1 => self.more.dots[more_index(qtype)],
            _ => {
                for (o, row) in out.iter_mut().zip(rows) {
                    *o = self.dot(qtype, row, x);
                }
                return;
            }
        };
        let q8 = x.q8();
        let at_once = at_once.min(DOT_ROWS);
        for (rows, out) in rows.chunks(at_once).zip(out.chunks_mut(at_once)) {
            many(rows, q8, out);
        }
    }

    /// Whether this set has a kernel that takes several inputs at once for `qtype`
    /// ([`dot_inputs`](Self::dot_inputs) is one `dot` per input otherwise).
    pub fn has_dot_inputs(&self, qtype: QuantType) -> bool {
        self.inputs(qtype).is_some()
    }

    /// How many inputs the set's [`dot_inputs`](Self::dot_inputs) kernel for `qtype` takes at
    /// once ([`INPUTS`] or [`WIDE_INPUTS`]; a mat-mat takes its inputs in groups of this many).
    pub fn inputs_width(&self, qtype: QuantType) -> usize {
        match qtype {
            QuantType::F32
            | QuantType::F16
            | QuantType::BF16
            | QuantType::Q8_0
            | QuantType::Q4_0
            | QuantType::Q4_1 => INPUTS,
            _ => self.more.inputs_width[more_index(qtype)],
        }
    }

    /// The set's kernel taking one row encoded as `qtype` against 1 to
    /// [`inputs_width`](Self::inputs_width) inputs at once, where it has one: what
    /// [`dot_inputs`](Self::dot_inputs) calls, for a caller that keeps its inputs' q8 forms and
    /// their grouping across many rows.
    pub(crate) fn inputs(&self, qtype: QuantType) -> Option<BlockInputs> {
        match qtype {
            QuantType::Q8_0 => self.inputs_q8_0,
            QuantType::Q4_0 => self.inputs_q4_0,
            QuantType::Q4_1 => self.inputs_q4_1,
            QuantType::F32 | QuantType::F16 | QuantType::BF16 => None,
            _ => self.more.inputs[more_index(qtype)],
        }
    }

    /// `out[i] = row · xs[i]` for a row encoded as `qtype` and any number of inputs: bitwise
    /// [`dot`](Self::dot) of each, [`inputs_width`](Self::inputs_width) inputs at a time through
    /// the set's kernel where it has one for `qtype` (the row decoded once for all of them).
    #[inline]
    pub fn dot_inputs(&self, qtype: QuantType, row: &[u8], xs: &[&Operand], out: &mut [f32]) {
        assert_eq!(xs.len(), out.len());
        let Some(many) = self.inputs(qtype) else {
            for (o, x) in out.iter_mut().zip(xs) {
                *o = self.dot(qtype, row, x);
            }
            return;
        };
        let width = self.inputs_width(qtype);
        for (xs, out) in xs.chunks(width).zip(out.chunks_mut(width)) {
            let mut q8: [&Q8Vec; WIDE_INPUTS] = [xs[0].q8(); WIDE_INPUTS];
            for (q, x) in q8.iter_mut().zip(xs) {
                *q = x.q8();
            }
            many(row, &q8[..xs.len()], out);
        }
    }

    /// [`dot_inputs`](Self::dot_inputs) of all the inputs `packed` was made of (`xs`, in that
    /// order), through the set's packed kernel where it has one for `qtype`: the same bits.
    #[inline]
    pub fn dot_packed(
        &self,
        qtype: QuantType,
        row: &[u8],
        xs: &[&Operand],
        packed: &Packed,
        out: &mut [f32],
    ) {
        let which = match qtype {
            QuantType::Q8_0 => 0,
            QuantType::Q4_0 => 1,
            QuantType::Q4_1 => 2,
            _ => return self.dot_inputs(qtype, row, xs, out),
        };
        let Some(kernels) = self.packed_inputs else {
            return self.dot_inputs(qtype, row, xs, out);
        };
        assert!(xs.len() == packed.inputs && out.len() == xs.len());
        debug_assert!(xs.iter().all(|x| x.q8().scales.len() == packed.blocks));
        let mut q8: [&Q8Vec; INPUTS] = [xs[0].q8(); INPUTS];
        for (q, x) in q8.iter_mut().zip(xs) {
            *q = x.q8();
        }
        kernels[which](row, &q8[..xs.len()], packed, out);
    }

    /// How many rows [`dots`](Self::dots) takes at once (1: one `dot` per row, and the callers keep
    /// their one-row loops).
    pub fn dot_rows(&self) -> usize {
        self.dot_rows
    }

    /// `out += a · row` for a row of `out.len()` values encoded as `qtype`.
    #[inline]
    pub fn axpy(&self, qtype: QuantType, a: f32, row: &[u8], out: &mut [f32]) {
        debug_assert_eq!(Ok(row.len()), row_bytes(qtype, out.len()));
        let f = match qtype {
            QuantType::F32 => self.axpy_f32,
            QuantType::F16 => self.axpy_f16,
            QuantType::BF16 => self.axpy_bf16,
            QuantType::Q8_0 => self.axpy_q8_0,
            QuantType::Q4_0 => self.axpy_q4_0,
            QuantType::Q4_1 => self.axpy_q4_1,
            _ => self.more.axpy[more_index(qtype)],
        };
        f(a, row, out)
    }

    /// `out += Σ a[j] · rows[j]` for rows of `out.len()` values encoded as `qtype`: bitwise
    /// [`axpy`](Self::axpy) of each row in order.
    #[inline]
    pub fn axpy_rows(&self, qtype: QuantType, a: &[f32], rows: &[&[u8]], out: &mut [f32]) {
        debug_assert_eq!(a.len(), rows.len());
        let many = match qtype {
            QuantType::Q8_0 => self.axpy_rows_q8_0,
            QuantType::Q4_0 => self.axpy_rows_q4_0,
            QuantType::Q4_1 => self.axpy_rows_q4_1,
            _ => None,
        };
        match many {
            Some(f) => {
                debug_assert!(rows
                    .iter()
                    .all(|r| Ok(r.len()) == row_bytes(qtype, out.len())));
                f(a, rows, out)
            }
            None => a
                .iter()
                .zip(rows)
                .for_each(|(&a, row)| self.axpy(qtype, a, row, out)),
        }
    }

    /// `out[j] = row_j · x` for the rows of `x.len()` values encoded as `qtype` (`F32` or `F16`)
    /// laid one after another in `rows`, `row_bytes` each (a KV cache's keys): bitwise the float
    /// [`dot`](Self::dot) of each row, several rows at once where the set has a kernel for it.
    pub fn dots_next(
        &self,
        qtype: QuantType,
        rows: &[u8],
        row_bytes: usize,
        x: &[f32],
        out: &mut [f32],
    ) {
        assert!(row_bytes > 0 && rows.len() >= out.len() * row_bytes);
        let (one, which) = match qtype {
            QuantType::F32 => (self.dot_f32, 0),
            QuantType::F16 => (self.dot_f16, 1),
            _ => panic!("dots_next takes float rows, not {qtype}"),
        };
        match self.dots_next {
            Some(many) => many[which](rows, row_bytes, x, out),
            None => {
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
                    *o = one(row, x);
                }
            }
        }
    }

    /// `out += Σ a[j] · row_j`, in order, for the rows of `out.len()` values encoded as `qtype`
    /// (`F32` or `F16`) laid one after another in `rows`, `row_bytes` each (a KV cache's values):
    /// bitwise [`axpy`](Self::axpy) row after row, each output kept in a register across the rows
    /// where the set has a kernel for it.
    pub fn axpy_next(
        &self,
        qtype: QuantType,
        a: &[f32],
        rows: &[u8],
        row_bytes: usize,
        out: &mut [f32],
    ) {
        assert!(row_bytes > 0 && rows.len() >= a.len() * row_bytes);
        let (one, which) = match qtype {
            QuantType::F32 => (self.axpy_f32, 0),
            QuantType::F16 => (self.axpy_f16, 1),
            _ => panic!("axpy_next takes float rows, not {qtype}"),
        };
        match self.axpy_next {
            Some(many) => many[which](a, rows, row_bytes, out),
            None => {
                for (&a, row) in a.iter().zip(rows.chunks_exact(row_bytes)) {
                    one(a, row, out);
                }
            }
        }
    }

    /// Decodes a row into `out` (exactly as the scalar reference does).
    pub fn dequantize(&self, qtype: QuantType, row: &[u8], out: &mut [f32]) {
        out.fill(0.0);
        self.axpy(qtype, 1.0, row, out);
    }
}

/// Runs a kernel generic over its row count `R` (a `[&[u8]; R]` of rows in, `[f32; R]` out) on
/// 1 to [`DOT_ROWS`] rows: `dots_by_count!(rows, out, |arr: R| kernel::<.., R>(arr, x))` binds
/// `arr` to the rows as an array and `R` to their count, and writes the results to `out`.
macro_rules! dots_by_count {
    ($rows:expr, $out:expr, |$arr:ident : $r:ident| $call:expr) => {{
        let (rows, out): (&[&[u8]], &mut [f32]) = ($rows, $out);
        match rows.len().min(out.len()) {
            0 => {}
            1 => {
                const $r: usize = 1;
                let $arr: [&[u8]; $r] = [rows[0]];
                out[..$r].copy_from_slice(&$call);
            }
            2 => {
                const $r: usize = 2;
                let $arr: [&[u8]; $r] = [rows[0], rows[1]];
                out[..$r].copy_from_slice(&$call);
            }
            3 => {
                const $r: usize = 3;
                let $arr: [&[u8]; $r] = [rows[0], rows[1], rows[2]];
                out[..$r].copy_from_slice(&$call);
            }
            _ => {
                const $r: usize = 4;
                let $arr: [&[u8]; $r] = [rows[0], rows[1], rows[2], rows[3]];
                out[..$r].copy_from_slice(&$call);
            }
        }
    }};
}
pub(super) use dots_by_count;

/// `dots` as one `dot` per row (each row streams its own bytes; the input is in cache).
#[inline(always)]
pub(super) fn each_row(
    rows: &[&[u8]],
    x: &Q8Vec,
    out: &mut [f32],
    dot: impl Fn(&[u8], &Q8Vec) -> f32,
) {
    for (o, w) in out.iter_mut().zip(rows) {
        *o = dot(w, x);
    }
}

/// One row against 1 to [`WIDE_INPUTS`] inputs (`out[i]` the `dot` of the row and `xs[i]`),
/// through `$call`, generic over the input count `$n`, on an array `$arr` of the inputs of the
/// right width: five to seven run as eight with the first input repeated, the extra results
/// dropped.
macro_rules! by_inputs {
    ($xs:expr, $out:expr, |$n:ident, $arr:ident| $call:expr) => {{
        let (xs, out) = ($xs, $out);
        match xs.len().min(out.len()) {
            0 => {}
            1 => {
                const $n: usize = 1;
                let $arr: [&$crate::kernels::Q8Vec; $n] = [xs[0]];
                out[..$n].copy_from_slice(&$call);
            }
            2 => {
                const $n: usize = 2;
                let $arr: [&$crate::kernels::Q8Vec; $n] = [xs[0], xs[1]];
                out[..$n].copy_from_slice(&$call);
            }
            3 => {
                const $n: usize = 3;
                let $arr: [&$crate::kernels::Q8Vec; $n] = [xs[0], xs[1], xs[2]];
                out[..$n].copy_from_slice(&$call);
            }
            4 => {
                const $n: usize = $crate::kernels::INPUTS;
                let $arr: [&$crate::kernels::Q8Vec; $n] = std::array::from_fn(|i| xs[i]);
                out[..$n].copy_from_slice(&$call);
            }
            m => {
                const $n: usize = $crate::kernels::WIDE_INPUTS;
                let m = m.min($n);
                let $arr: [&$crate::kernels::Q8Vec; $n] =
                    std::array::from_fn(|i| xs[if i < m { i } else { 0 }]);
                out[..m].copy_from_slice(&$call[..m]);
            }
        }
    }};
}

pub(super) use by_inputs;
