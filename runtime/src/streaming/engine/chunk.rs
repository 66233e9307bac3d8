//! A prompt chunk's FFN: every cluster any row of the chunk needs is read once and computed for
//! each row that needs it.

use super::*;

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
        let operands: Vec<Operand> = x
            .chunks_exact(h)
            .map(|xr| Operand::new(xr, QuantType::Q8_0))
            .collect();
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
        for g in 0..GROUPS {
            acc.fill(0.0);
            for ci in (bounds[g]..bounds[g + 1]).filter(|&ci| is_needed[ci]) {
                let key = (l as u32, ci as u32);
                let read = match self.core.resident(key) {
                    Some(_) => None,
                    None => {
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
                let bytes = match &read {
                    Some(buf) => &buf[..],
                    None => core.resident(key).expect("resident"),
                };
                let t = Instant::now();
                let plan = &core.plans[l];
                let work = &mut self.work;
                for (r, sel) in selections.iter().enumerate() {
                    if sel.needed.binary_search(&ci).is_err() {
                        continue;
                    }
                    let ops = ClusterOps {
                        plan,
                        k,
                        skip,
                        ci,
                        bytes,
                    };
                    ops.gates(
                        &sel.candidate,
                        &operands[r],
                        &mut scores[r * n..(r + 1) * n],
                        &mut work.lists,
                    )?;
                    ops.add(&work.lists, &mut acc[r * h..(r + 1) * h]);
                }
                self.core.metrics.compute_s += t.elapsed().as_secs_f64();
                if let Some(buf) = read {
                    self.core.offer(key, Bytes::Read(buf));
                }
            }
            for (o, a) in out.chunks_exact_mut(h).zip(acc.chunks_exact(h)) {
                o.iter_mut().zip(a).for_each(|(o, a)| *o += a);
            }
        }
        for (r, (sel, g)) in selections.iter().zip(scores.chunks_exact(n)).enumerate() {
            self.retain_and_measure(l, first + r, sel, g)?;
        }
        self.rows = rows;
        self.marks.is_needed = is_needed;
        self.work.chunk_scores = scores;
        self.work.chunk_acc = acc;
        Ok(())
    }
}
