//! A layer's working state and its reduction groups ([`GROUPS`]): the gates and down columns of
//! resident clusters shared out among threads, each group's partial sum adding its clusters in
//! order, so that the bits depend neither on the thread count nor on when reads land.

use super::*;

/// Where a cluster of the layer being computed stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    /// Not needed by this token.
    Skipped,
    /// Needed; its bytes are not here yet.
    Waiting,
    /// Gates computed, active neurons known; down columns not added yet.
    Gated,
    /// Added to its group's sum.
    Added,
}

/// One layer's working state, grown to the largest layer once and reused by every token and
/// layer, so that the token loop does not allocate it.
#[derive(Default)]
pub(super) struct Work {
    /// Exact skip scores of the layer's neurons (NaN: not computed).
    pub(super) scores: Vec<f32>,
    pub(super) lists: Lists,
    /// Reads that landed, held until their down columns are added, then offered to the cache.
    pub(super) held: Vec<Option<AlignedBuf>>,
    /// The groups' partial sums, `GROUPS × hidden`.
    pub(super) acc: Vec<f32>,
    /// Scratch of `compute`: the needed clusters whose bytes have not come yet.
    pub(super) missing: Vec<usize>,
    /// Scratch of a prompt chunk: each row's scores (`rows × neurons`) and group sum
    /// (`rows × hidden`).
    pub(super) chunk_scores: Vec<f32>,
    pub(super) chunk_acc: Vec<f32>,
    /// A prompt chunk's lists of active neurons, one per thread computing it.
    pub(super) chunk_lists: Vec<Lists>,
    /// Kept empty between chunks: the allocations of a chunk's prepared rows and of its threads'
    /// shares, reused ([`crate::model::recycle`]) so that a batched step allocates nothing.
    pub(super) chunk_operands: Vec<Operand<'static>>,
    pub(super) chunk_cells: Vec<Mutex<super::chunk::Share<'static>>>,
    /// A prompt chunk's cluster copied out of its layer's row groups ([`Core::resident_into`]).
    pub(super) chunk_rows: Vec<u8>,
}

/// What the gates of a layer's clusters decided.
#[derive(Default)]
pub(super) struct Lists {
    /// The active neurons of cluster `c` (offsets within it) and their coefficients
    /// `act(g)·(up·x)`, in the slots of its own neurons: `first .. first + n_active[c]`.
    pub(super) active: Vec<u32>,
    pub(super) coef: Vec<f32>,
    pub(super) n_active: Vec<u32>,
    pub(super) stage: Vec<Stage>,
}

impl Lists {
    /// Room for a layer of `neurons` neurons in `clusters` clusters.
    pub(super) fn fit(&mut self, neurons: usize, clusters: usize) {
        if self.active.len() < neurons {
            self.active.resize(neurons, 0);
            self.coef.resize(neurons, 0.0);
        }
        if self.stage.len() < clusters {
            self.n_active.resize(clusters, 0);
            self.stage.resize(clusters, Stage::Skipped);
        }
    }
}

impl Work {
    /// Sized for a layer of `neurons` in `clusters` and `hidden` outputs; scores NaN, sums zero,
    /// every cluster skipped.
    pub(super) fn reset(&mut self, neurons: usize, clusters: usize, hidden: usize) {
        let lists = &mut self.lists;
        if lists.active.len() < neurons {
            lists.active.resize(neurons, 0);
            lists.coef.resize(neurons, 0.0);
        }
        if lists.stage.len() < clusters {
            lists.n_active.resize(clusters, 0);
            lists.stage.resize(clusters, Stage::Skipped);
            self.held.resize_with(clusters, || None);
        }
        self.scores.clear();
        self.scores.resize(neurons, f32::NAN);
        self.acc.clear();
        self.acc.resize(GROUPS * hidden, 0.0);
        lists.stage[..clusters].fill(Stage::Skipped);
        self.held[..clusters].iter_mut().for_each(|h| *h = None);
    }
}

/// The first cluster of each group of a layer of `clusters`, and the end.
pub(super) fn group_bounds(clusters: usize) -> [usize; GROUPS + 1] {
    std::array::from_fn(|g| g * clusters / GROUPS)
}

pub(super) fn group_of(bounds: &[usize; GROUPS + 1], ci: usize) -> usize {
    bounds.partition_point(|&b| b <= ci) - 1
}

/// Adds, in cluster order, the down columns of group `g`'s clusters whose gates are computed, from
/// `next` up to the first whose bytes have not come yet.
#[allow(clippy::too_many_arguments)]
pub(super) fn advance(
    core: &Core,
    work: &mut Work,
    l: usize,
    k: &RowKernels,
    skip: Skip,
    g: usize,
    bounds: &[usize; GROUPS + 1],
    next: &mut usize,
) {
    let plan = &core.plans[l];
    let [mut group] = work.groups(plan, bounds, g..g + 1);
    group.advance(core, l, k, skip, next);
}

/// The resident clusters of layer `l` among the `needed`: each one's gates, then its group's down
/// columns in cluster order as far as the first cluster still waiting for its bytes (`next`), so
/// that a cluster's down columns are added right after its gates while they are still in cache.
/// The groups are independent (each its own clusters, neurons and partial sum), so with more than
/// one thread (`--threads`, the size of rayon's pool) and [`PARALLEL_MIN_BYTES`] of bundles or
/// more they are shared out among this thread and parked helpers ([`parallel::for_each`], which
/// allocates nothing): the same operations on the same values in the same order as on one
/// thread, so the same bits.
#[allow(clippy::too_many_arguments)]
pub(super) fn resident_groups(
    core: &Core,
    work: &mut Work,
    l: usize,
    k: &RowKernels,
    skip: Skip,
    needed: &[usize],
    candidate: &[bool],
    operand: &Operand,
    bounds: &[usize; GROUPS + 1],
    next: &mut [usize; GROUPS],
) -> Result<[u64; 2]> {
    let plan = &core.plans[l];
    let start = *next;
    // Each group's work; returns how many of its clusters were found in memory, and how many
    // of those had their gates computed in row groups.
    let one = |g: usize, group: &mut GroupWork, next: &mut usize| -> Result<[u64; 2]> {
        let lo = needed.partition_point(|&c| c < bounds[g]);
        let hi = needed.partition_point(|&c| c < bounds[g + 1]);
        if let Some(runs) = core.layer_runs(l) {
            let all = hi - lo == bounds[g + 1] - bounds[g];
            if all || runs.is_grouped() {
                // Every cluster of the group needed, and the layer whole in runs: one pass. In
                // row groups, the pass over the group takes the needed clusters' neurons.
                let rows = runs.rows(&plan.layout, group.n0, group.scores.len());
                let needed = &needed[lo..hi];
                let cand = |n: usize| {
                    candidate[n]
                        && (all || needed.binary_search(&(plan.cluster_of[n] as usize)).is_ok())
                };
                let grouped = runs.groups(&plan.layout);
                group.whole(plan, k, skip, rows, grouped, &cand, operand);
                *next = group.end;
                let found = (hi - lo) as u64;
                return Ok([found, if grouped.is_some() { found } else { 0 }]);
            }
        }
        let resident = |ci: usize| -> Result<Option<ClusterOps>> {
            let Some(Resident { rows, grouped }) =
                core.resident((l as u32, ci as u32)).transpose()?
            else {
                return Ok(None);
            };
            Ok(Some(ClusterOps {
                plan,
                k,
                skip,
                ci,
                rows,
                grouped,
            }))
        };
        let mut ahead = needed[lo..hi].iter().map(|&ci| resident(ci)).peekable();
        let mut counts = [0; 2];
        while let Some(ops) = ahead.next() {
            if let Some(ops) = ops? {
                counts[0] += 1;
                counts[1] += ops.grouped.is_some() as u64;
                // The gate pass asks for the next cluster's first rows as it nears its end.
                let then = match ahead.peek() {
                    Some(Ok(Some(next))) => Some(next.rows),
                    _ => None,
                };
                group.gates(&ops, then.as_ref(), candidate, operand)?;
                // Its down columns at once, while the gate pass's requests for them still
                // hold them in cache (unless an earlier cluster of the group is still being
                // read: then they wait for it, and the order of the sums stays the same).
                group.advance(core, l, k, skip, next);
            }
        }
        group.advance(core, l, k, skip, next);
        Ok(counts)
    };
    let groups: [GroupWork; GROUPS] = work.groups(plan, bounds, 0..GROUPS);
    let bytes = needed.len() * plan.cluster_of.len() / plan.clusters.len().max(1)
        * plan.layout.bundle_bytes();
    let threads = if bytes >= PARALLEL_MIN_BYTES {
        rayon::current_num_threads()
    } else {
        1
    };
    // Each group behind its own (uncontended) lock: whichever thread takes it has it alone.
    let cells = groups.map(|group| Mutex::new((group, 0, anyhow::Ok([0u64; 2]))));
    parallel::for_each(threads, GROUPS, &|g| {
        let mut cell = cells[g].lock().unwrap_or_else(|e| e.into_inner());
        let (group, next, result) = &mut *cell;
        *next = start[g];
        *result = one(g, group, next);
    });
    let mut counts = [0; 2];
    for (cell, next) in cells.into_iter().zip(next) {
        let (_, n, result) = cell.into_inner().unwrap_or_else(|e| e.into_inner());
        *next = n;
        let [found, grouped] = result?;
        counts = [counts[0] + found, counts[1] + grouped];
    }
    Ok(counts)
}

/// One reduction group's share of a layer's working state ([`Work::groups`]): its clusters'
/// lists, stages and held reads, its neurons' scores and active lists, and its partial sum.
pub(super) struct GroupWork<'w> {
    /// The group's first cluster and first neuron (indexes of the slices below start there).
    pub(super) c0: usize,
    pub(super) n0: usize,
    pub(super) end: usize,
    pub(super) scores: &'w mut [f32],
    pub(super) active: &'w mut [u32],
    pub(super) coef: &'w mut [f32],
    pub(super) n_active: &'w mut [u32],
    pub(super) stage: &'w mut [Stage],
    pub(super) held: &'w mut [Option<AlignedBuf>],
    pub(super) acc: &'w mut [f32],
}

impl Work {
    /// The shares of groups `gs` (`N` of them, consecutive) of layer `plan`, cut from this
    /// state without copying it.
    pub(super) fn groups<const N: usize>(
        &mut self,
        plan: &LayerPlan,
        bounds: &[usize; GROUPS + 1],
        gs: std::ops::Range<usize>,
    ) -> [GroupWork<'_>; N] {
        assert_eq!(gs.len(), N);
        let h = plan.layout.hidden;
        let neuron = |c: usize| {
            plan.clusters
                .get(c)
                .map_or(plan.cluster_of.len(), |cl| cl.first)
        };
        let (c_start, n_start) = (bounds[gs.start], neuron(bounds[gs.start]));
        let lists = &mut self.lists;
        let mut scores = &mut self.scores[n_start..];
        let mut active = &mut lists.active[n_start..];
        let mut coef = &mut lists.coef[n_start..];
        let mut n_active = &mut lists.n_active[c_start..];
        let mut stage = &mut lists.stage[c_start..];
        let mut held = &mut self.held[c_start..];
        let mut acc = &mut self.acc[gs.start * h..];
        pub(super) fn cut<'a, T>(rest: &mut &'a mut [T], n: usize) -> &'a mut [T] {
            let (head, tail) = std::mem::take(rest).split_at_mut(n);
            *rest = tail;
            head
        }
        std::array::from_fn(|i| {
            let g = gs.start + i;
            let (c0, c1) = (bounds[g], bounds[g + 1]);
            let (n0, n1) = (neuron(c0), neuron(c1));
            GroupWork {
                c0,
                n0,
                end: c1,
                scores: cut(&mut scores, n1 - n0),
                active: cut(&mut active, n1 - n0),
                coef: cut(&mut coef, n1 - n0),
                n_active: cut(&mut n_active, c1 - c0),
                stage: cut(&mut stage, c1 - c0),
                held: cut(&mut held, c1 - c0),
                acc: cut(&mut acc, h),
            }
        })
    }
}

impl GroupWork<'_> {
    /// Computes the gates of cluster `ops.ci` (one of this group's) and records its active
    /// neurons.
    pub(super) fn gates(
        &mut self,
        ops: &ClusterOps,
        then: Option<&ClusterRows>,
        candidate: &[bool],
        x: &Operand,
    ) -> Result<()> {
        let cl = ops.plan.clusters[ops.ci];
        let r = cl.first - self.n0..cl.first - self.n0 + cl.count;
        let m = ops.gate_into(
            then,
            candidate,
            x,
            &mut self.scores[r.clone()],
            &mut self.active[r.clone()],
            &mut self.coef[r],
        )?;
        self.n_active[ops.ci - self.c0] = m as u32;
        self.stage[ops.ci - self.c0] = Stage::Gated;
        Ok(())
    }

    /// Every cluster of the group at once, its neurons `rows` (a layer held in runs): gates and
    /// down columns [`RUN_PASS`] neurons at a time, whose down columns are still in cache when
    /// added; where all of them are candidates, their gate rows read as a mat-vec reads its rows
    /// ([`gate_pass_runs`]). The active neurons' down columns are added in neuron order, as
    /// cluster after cluster adds them ([`RowKernels::axpy_rows`] is bitwise one row after
    /// another), so the sum is bitwise the same.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn whole(
        &mut self,
        plan: &LayerPlan,
        k: &RowKernels,
        skip: Skip,
        rows: ClusterRows,
        grouped: Option<GroupedRuns>,
        candidate: &dyn Fn(usize) -> bool,
        x: &Operand,
    ) {
        let n = self.scores.len();
        let mut start = 0;
        while start < n {
            let end = (start + RUN_PASS).min(n);
            let (here, then) = (rows.from(start), rows.from(end));
            let (n0, scores) = (self.n0 + start, &mut self.scores[start..end]);
            let m = if let Some(runs) = grouped {
                gate_pass_groups(
                    k,
                    &plan.layout,
                    x,
                    runs,
                    n0,
                    &here,
                    |i| candidate(n0 + i),
                    skip,
                    scores,
                    self.active,
                    self.coef,
                )
            } else if (n0..self.n0 + end).all(candidate) {
                gate_pass_runs(
                    k,
                    &plan.layout,
                    x,
                    &here,
                    skip,
                    scores,
                    self.active,
                    self.coef,
                )
            } else {
                gate_pass(
                    k,
                    &plan.layout,
                    x,
                    &here,
                    (end < n).then_some(&then),
                    |i| candidate(n0 + i),
                    skip,
                    scores,
                    self.active,
                    self.coef,
                )
            };
            let m = keep_positive(skip.act, &mut self.active[..m], &mut self.coef[..m]);
            down_pass(
                k,
                &plan.layout,
                &here,
                &self.active[..m],
                &self.coef[..m],
                self.acc,
            );
            start = end;
        }
        self.stage.fill(Stage::Added);
    }

    /// Adds, in cluster order, the down columns of the group's clusters whose gates are computed,
    /// from `next` up to the first whose bytes have not come yet.
    pub(super) fn advance(
        &mut self,
        core: &Core,
        l: usize,
        k: &RowKernels,
        skip: Skip,
        next: &mut usize,
    ) {
        while *next < self.end {
            let (ci, i) = (*next, *next - self.c0);
            match self.stage[i] {
                Stage::Waiting => return,
                Stage::Skipped | Stage::Added => {}
                Stage::Gated => {
                    let plan = &core.plans[l];
                    // Only the down columns are read: they lie as stored in a grouped cluster too.
                    let rows = match &self.held[i] {
                        Some(buf) => ClusterRows::new(&plan.layout, buf, plan.clusters[ci].count),
                        None => core
                            .resident((l as u32, ci as u32))
                            .expect("a gated cluster stays resident until its layer is done")
                            .map(|r| r.rows),
                    }
                    .expect("the gate pass checked the cluster's size");
                    let ops = ClusterOps {
                        plan,
                        k,
                        skip,
                        ci,
                        rows,
                        grouped: None,
                    };
                    let first = ops.plan.clusters[ci].first - self.n0;
                    let r = first..first + self.n_active[i] as usize;
                    ops.add_from(&self.active[r.clone()], &self.coef[r], self.acc);
                    self.stage[i] = Stage::Added;
                }
            }
            *next += 1;
        }
    }
}

/// One cluster's rows and what computing it takes.
pub(super) struct ClusterOps<'a> {
    pub(super) plan: &'a LayerPlan,
    pub(super) k: &'a RowKernels,
    /// A neuron is computed when its score under this rule exceeds the threshold.
    pub(super) skip: Skip,
    pub(super) ci: usize,
    pub(super) rows: ClusterRows<'a>,
    /// The cluster's bytes where its gate and up rows lie in row groups ([`Resident::grouped`]).
    pub(super) grouped: Option<&'a [u8]>,
}

impl<'a> ClusterOps<'a> {
    /// Cluster `ci` of `plan` in `bytes` (read, or cached); an error if they are too few.
    pub(super) fn new(
        plan: &'a LayerPlan,
        k: &'a RowKernels,
        skip: Skip,
        ci: usize,
        bytes: &'a [u8],
    ) -> Result<Self> {
        let rows = ClusterRows::new(&plan.layout, bytes, plan.clusters[ci].count)
            .with_context(|| format!("cluster {ci}"))?;
        Ok(Self {
            plan,
            k,
            skip,
            ci,
            rows,
            grouped: None,
        })
    }

    /// Computes the exact scores of the cluster's candidate neurons into `scores` (the layer's)
    /// and records its active neurons.
    pub(super) fn gates(
        &self,
        candidate: &[bool],
        x: &Operand,
        scores: &mut [f32],
        lists: &mut Lists,
    ) -> Result<()> {
        let cl = self.plan.clusters[self.ci];
        let r = cl.first..cl.first + cl.count;
        let m = self.gate_into(
            None,
            candidate,
            x,
            &mut scores[r.clone()],
            &mut lists.active[r.clone()],
            &mut lists.coef[r],
        )?;
        lists.n_active[self.ci] = m as u32;
        lists.stage[self.ci] = Stage::Gated;
        Ok(())
    }

    /// The cluster's gates: its neurons' exact scores into `scores`, and its active neurons
    /// (offsets within it) and their coefficients into the first slots of `active` and `coef`
    /// (each as long as the cluster); returns how many are active. Under dReLU the gate pass's
    /// coefficient is `relu(g)·relu(u)` ([`Activation::coef`](crate::source::config::Activation::coef)): a neuron whose up value is not
    /// positive adds exactly nothing, so it leaves the list ([`keep_positive`]) and its down
    /// column is not computed — exact skipping by the up projection as well as the gate.
    pub(super) fn gate_into(
        &self,
        then: Option<&ClusterRows>,
        candidate: &[bool],
        x: &Operand,
        scores: &mut [f32],
        active: &mut [u32],
        coef: &mut [f32],
    ) -> Result<usize> {
        let cl = self.plan.clusters[self.ci];
        let m = match self.grouped {
            Some(bytes) => gate_pass_grouped_cluster(
                self.k,
                &self.plan.layout,
                x,
                bytes,
                &self.rows,
                |i| candidate[cl.first + i],
                self.skip,
                scores,
                active,
                coef,
            ),
            None => gate_pass(
                self.k,
                &self.plan.layout,
                x,
                &self.rows,
                then,
                |i| candidate[cl.first + i],
                self.skip,
                scores,
                active,
                coef,
            ),
        };
        Ok(keep_positive(
            self.skip.act,
            &mut active[..m],
            &mut coef[..m],
        ))
    }

    /// Adds the cluster's active neurons' down columns to `acc`, in order.
    pub(super) fn add(&self, lists: &Lists, acc: &mut [f32]) {
        let cl = self.plan.clusters[self.ci];
        let r = cl.first..cl.first + lists.n_active[self.ci] as usize;
        self.add_from(&lists.active[r.clone()], &lists.coef[r], acc);
    }

    /// Adds `coef[j] · down(active[j])` for the cluster's neurons `active`, in order, to `acc`.
    /// The cluster's gates were computed ([`Self::gate_into`] checked its size).
    pub(super) fn add_from(&self, active: &[u32], coef: &[f32], acc: &mut [f32]) {
        down_pass(self.k, &self.plan.layout, &self.rows, active, coef, acc);
    }
}
