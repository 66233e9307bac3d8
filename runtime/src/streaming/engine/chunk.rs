//! A prompt chunk's FFN: every cluster any row of the chunk needs is read once and computed for
//! each row that needs it, the rows shared out among threads.

use std::sync::MutexGuard;

use smallvec::SmallVec;

use super::*;
use crate::kernels::bundles::{
    gate_pass_inputs, gate_pass_inputs_fits, keep_positive, prefetch_head, InputPass,
};
use crate::kernels::INPUTS;

/// Neurons of a cluster whose down columns [`Share::rows_together`] adds for each of its rows
/// before it moves on to the next ones.
const DOWN_WINDOW: usize = 8;

/// One thread's share of a chunk: rows `first..` (as many as `acc` holds), their group sums, their
/// scores, and its own lists of active neurons (one per row computed together, [`INPUTS`]).
pub(super) struct Share<'a> {
    first: usize,
    acc: &'a mut [f32],
    scores: &'a mut [f32],
    lists: &'a mut [Lists],
    result: Result<()>,
}

impl Share<'_> {
    /// Cluster `ops.ci` for each of this share's rows that needs it: [`INPUTS`] rows at a time
    /// where [`gate_pass_inputs_fits`] (each neuron's rows decoded once for all of them), else
    /// row by row; either way each row's bits are those of computing it alone.
    fn cluster(
        &mut self,
        ops: &ClusterOps,
        selections: &[Selection],
        operands: &[Operand],
        n: usize,
        h: usize,
    ) -> Result<()> {
        let rows = self.acc.len() / h;
        let together = gate_pass_inputs_fits(ops.k, &ops.plan.layout, ops.skip);
        let mut group = [0usize; INPUTS];
        let mut len = 0;
        for r in self.first..self.first + rows {
            if selections[r].needed.binary_search(&ops.ci).is_err() {
                continue;
            }
            if !together {
                let i = r - self.first;
                let scores = &mut self.scores[i * n..(i + 1) * n];
                ops.gates(
                    &selections[r].candidate,
                    &operands[r],
                    scores,
                    &mut self.lists[0],
                )?;
                ops.add(&self.lists[0], &mut self.acc[i * h..(i + 1) * h]);
                continue;
            }
            group[len] = r;
            len += 1;
            if len == INPUTS {
                self.rows_together(ops, selections, operands, &group, n, h)?;
                len = 0;
            }
        }
        if len > 0 {
            self.rows_together(ops, selections, operands, &group[..len], n, h)?;
        }
        Ok(())
    }

    /// The cluster's gates for the rows `group` (ascending) at once, then each row's down columns.
    fn rows_together(
        &mut self,
        ops: &ClusterOps,
        selections: &[Selection],
        operands: &[Operand],
        group: &[usize],
        n: usize,
        h: usize,
    ) -> Result<()> {
        let cl = ops.plan.clusters[ops.ci];
        let span = cl.first..cl.first + cl.count;
        let cluster_rows = ops.rows;
        let mut scores = self.scores.chunks_exact_mut(n).enumerate();
        let mut passes: SmallVec<[InputPass; INPUTS]> = SmallVec::new();
        for (&r, lists) in group.iter().zip(self.lists.iter_mut()) {
            let i = r - self.first;
            let row_scores = scores
                .find(|(j, _)| *j == i)
                .expect("a row of this share")
                .1;
            passes.push(InputPass {
                x: &operands[r],
                candidate: &selections[r].candidate[span.clone()],
                scores: &mut row_scores[span.clone()],
                active: &mut lists.active[span.clone()],
                coef: &mut lists.coef[span.clone()],
                m: 0,
            });
        }
        gate_pass_inputs(
            ops.k,
            &ops.plan.layout,
            &cluster_rows,
            ops.skip,
            &mut passes,
        );
        let counts: SmallVec<[usize; INPUTS]> = passes.iter().map(|p| p.m).collect();
        drop(passes);
        // The cluster's first rows again, for the next group's gate pass (the down columns and
        // the other rows read since have mostly pushed them out of the L1 cache).
        prefetch_head(&cluster_rows, ops.skip);
        let mut ends = [0usize; INPUTS];
        for ((lists, m), end) in self.lists.iter_mut().zip(counts).zip(&mut ends) {
            *end = keep_positive(
                ops.skip.act,
                &mut lists.active[span.clone()][..m],
                &mut lists.coef[span.clone()][..m],
            );
            lists.n_active[ops.ci] = *end as u32;
            lists.stage[ops.ci] = Stage::Gated;
        }
        // The down columns a window of the cluster's neurons at a time, added to each row's sum
        // in turn, so that the rows after the first find the window's columns in the L1 cache:
        // each row still adds its own active columns in order, so the same bits.
        let mut at = [0usize; INPUTS];
        let mut w = 0;
        while w < cl.count {
            let stop = (w + DOWN_WINDOW) as u32;
            for (j, (&r, lists)) in group.iter().zip(self.lists.iter()).enumerate() {
                let (active, coef) = (
                    &lists.active[span.clone()][..ends[j]],
                    &lists.coef[span.clone()][..ends[j]],
                );
                let start = at[j];
                while at[j] < ends[j] && active[at[j]] < stop {
                    at[j] += 1;
                }
                if at[j] > start {
                    let i = r - self.first;
                    ops.add_from(
                        &active[start..at[j]],
                        &coef[start..at[j]],
                        &mut self.acc[i * h..(i + 1) * h],
                    );
                }
            }
            w += DOWN_WINDOW;
        }
        Ok(())
    }
}

fn lock<'m, 'a>(m: &'m Mutex<Share<'a>>) -> MutexGuard<'m, Share<'a>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl StreamEngine {
    /// A prompt chunk's FFN of layer `l` (`x` holds one row per token): every cluster any row
    /// needs is read once for the chunk — all requested at once, so that neighbours merge into
    /// long sequential reads — and each is computed for the rows that need it. Each row sums its
    /// clusters in the groups decoding uses ([`GROUPS`]), so every row's output is bitwise what
    /// decoding that token alone gives.
    pub(super) fn ffn_chunk(&mut self, l: usize, x: &[f32], out: &mut [f32]) -> Result<()> {
        let h = self.core.plans[l].layout.hidden;
        let first = self.call_token;
        let n_rows = x.len() / h;
        let mut operands: Vec<Operand> =
            crate::model::recycle(std::mem::take(&mut self.work.chunk_operands));
        operands.extend(
            x.chunks_exact(h)
                .map(|xr| Operand::new(xr, QuantType::Q8_0)),
        );
        let mut rows = std::mem::take(&mut self.rows);
        if rows.len() < n_rows {
            rows.resize_with(n_rows, Selection::default);
        }
        for (r, xr) in x.chunks_exact(h).enumerate() {
            self.select(l, first + r, xr, &operands[r], &mut rows[r])?;
        }
        let selections = &rows[..n_rows];
        let clusters = self.core.plans[l].clusters.len();
        let mut is_needed = std::mem::take(&mut self.marks.is_needed);
        is_needed.clear();
        is_needed.resize(clusters, false);
        for sel in selections {
            sel.needed.iter().for_each(|&c| is_needed[c] = true);
        }
        self.core.refine(l, &is_needed, self.schedule.refine());
        let n = self.core.plans[l].cluster_of.len();
        self.work.reset(n, clusters, h);
        let mut scores = std::mem::take(&mut self.work.chunk_scores);
        scores.clear();
        scores.resize(n_rows * n, f32::NAN);
        let mut acc = std::mem::take(&mut self.work.chunk_acc);
        acc.clear();
        acc.resize(n_rows * h, 0.0);
        let (k, skip) = (RowKernels::best(), self.skip(l));
        let bounds = group_bounds(clusters);
        // The rows are shared out among threads, each row's clusters computed in order by one of
        // them: a row's bits are those of one thread computing it alone.
        let plan = &self.core.plans[l];
        let needed_bytes: usize = is_needed.iter().filter(|&&b| b).count()
            * (n / clusters.max(1))
            * plan.layout.bundle_bytes();
        let threads = if needed_bytes * n_rows >= PARALLEL_MIN_BYTES {
            rayon::current_num_threads().min(n_rows)
        } else {
            1
        };
        let per = n_rows.div_ceil(threads);
        let mut lists = std::mem::take(&mut self.work.chunk_lists);
        lists.resize_with(threads * INPUTS, Lists::default);
        lists.iter_mut().for_each(|t| t.fit(n, clusters));
        let mut cells: Vec<Mutex<Share>> =
            crate::model::recycle(std::mem::take(&mut self.work.chunk_cells));
        cells.extend(
            acc.chunks_mut(per * h)
                .zip(scores.chunks_mut(per * n))
                .zip(lists.chunks_mut(INPUTS))
                .enumerate()
                .map(|(i, ((acc, scores), lists))| {
                    Mutex::new(Share {
                        first: i * per,
                        acc,
                        scores,
                        lists,
                        result: Ok(()),
                    })
                }),
        );
        let mut scratch = std::mem::take(&mut self.work.chunk_rows);
        for g in 0..GROUPS {
            cells.iter().for_each(|c| lock(c).acc.fill(0.0));
            for ci in (bounds[g]..bounds[g + 1]).filter(|&ci| is_needed[ci]) {
                let key = (l as u32, ci as u32);
                let read = match self.core.has_resident(key) {
                    true => None,
                    false => {
                        if !self.core.is_pending(key) {
                            // Resident when the chunk was refined, then evicted by a read offered
                            // to the cache since (this chunk's, or a speculative one): read again.
                            self.core.request(key, URGENT);
                            self.core.metrics.late_reads += 1;
                        }
                        Some(self.core.take(key)?)
                    }
                };
                let core = &self.core;
                let ops = match &read {
                    Some(buf) => ClusterOps::new(&core.plans[l], k, skip, ci, buf)?,
                    None => ClusterOps {
                        plan: &core.plans[l],
                        k,
                        skip,
                        ci,
                        rows: core.resident_into(key, &mut scratch).expect("resident")?,
                        grouped: None,
                    },
                };
                let t = Instant::now();
                parallel::for_each(threads, cells.len(), &|i| {
                    let mut share = lock(&cells[i]);
                    if share.result.is_ok() {
                        share.result = share.cluster(&ops, selections, &operands, n, h);
                    }
                });
                self.core.metrics.compute_s += t.elapsed().as_secs_f64();
                if let Some(buf) = read {
                    self.core.offer(key, Bytes::Read(buf));
                }
            }
            for c in &cells {
                let share = lock(c);
                let rows = out[share.first * h..].chunks_exact_mut(h);
                for (o, a) in rows.zip(share.acc.chunks_exact(h)) {
                    o.iter_mut().zip(a).for_each(|(o, a)| *o += a);
                }
            }
        }
        let mut failed = Ok(());
        for c in cells.drain(..) {
            let share = c.into_inner().unwrap_or_else(|e| e.into_inner());
            if failed.is_ok() {
                failed = share.result;
            }
        }
        self.work.chunk_cells = crate::model::recycle(cells);
        self.work.chunk_rows = scratch;
        failed?;
        self.work.chunk_lists = lists;
        for (r, (sel, g)) in selections.iter().zip(scores.chunks_exact(n)).enumerate() {
            self.retain_and_measure(l, first + r, sel, g)?;
        }
        self.rows = rows;
        self.marks.is_needed = is_needed;
        self.work.chunk_scores = scores;
        self.work.chunk_acc = acc;
        self.work.chunk_operands = crate::model::recycle(operands);
        Ok(())
    }
}
