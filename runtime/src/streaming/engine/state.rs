//! The state every policy works on ([`Core`]): the layers' plans, the read queue, the cache,
//! the reads in flight and the counters; and what a policy may do to queued reads ([`Refine`]).

use super::*;

/// What a policy may do to the layer's queued reads once its needed clusters are known.
#[derive(Debug, Clone, Copy)]
pub(in crate::streaming) struct Refine {
    /// Raise reads of needed clusters to top priority.
    pub boost: bool,
    /// Withdraw not-yet-issued reads of clusters not needed.
    pub cancel: bool,
    /// Hand completed reads of clusters not needed to the cache (they belong to this token).
    pub reap: bool,
}

/// The state every policy works on: the layers' plans, the read queue, the cache, the reads in
/// flight and the counters.
pub(in crate::streaming) struct Core {
    pub plans: Vec<LayerPlan>,
    /// How the run chooses neurons.
    pub sparsity: Sparsity,
    /// Tokens in the current forward call (1 while decoding, more in a prompt chunk).
    pub call_len: usize,
    /// Shared with the dense weights' stream ([`crate::streaming::dense_stream`]): one queue per device.
    pub io: Arc<IoQueue>,
    pub cache: NeuronCache<Bytes>,
    /// The file mapped into memory (`mmap` policy): every cluster is addressable, the OS pages.
    pub mapping: Option<Mapping>,
    /// Per layer: its bundles held whole as runs ([`Core::pin_layer_in_runs`]); empty when no
    /// layer is. The cache still counts such a layer's clusters, pinned (so only a smaller budget
    /// evicts them, and then the layer gives its runs up: [`Core::unpack_runs`]), their entries
    /// empty.
    pub(super) runs: Vec<Option<LayerRuns>>,
    /// The file's clusters numbered densely, shared with the cache: lookups are indexes.
    pub(super) slots: ClusterSlots,
    /// The queued read of each cluster (by slot) and its size.
    pub(super) pending: Vec<Option<(Ticket, u64)>>,
    /// Scratch of [`Core::request_all`]: the slots of its batch (all false between calls).
    pub(super) in_batch: Vec<bool>,
    /// Per slot: evicted when the budget shrank and not read since ([`Metrics::reread_bytes`]).
    pub(super) shrunk: Vec<bool>,
    /// Per slot: the queued read refills the cache ([`crate::streaming::refill`]): refinement leaves it.
    pub(super) refilling: Vec<bool>,
    /// Scratch of [`Core::refine`]: the late reads.
    pub(super) late: Vec<(ClusterKey, u32)>,
    /// Scratch of [`Core::request_all`]: the tickets of its batch.
    pub(super) tickets: Vec<Ticket>,
    /// Scratch of [`Core::request_all`]: the reads of its batch.
    pub(super) reads: Vec<(AlignedBuf, u64, u32)>,
    /// Bytes of reads in flight; reads ahead stop at `io_budget`.
    pub(super) in_flight: u64,
    pub io_budget: u64,
    /// Read buffers done with (up to `io_budget` bytes), for the next reads of their size.
    pub(super) spare: SpareBuffers,
    /// Scratch of [`Core::group_kept`]: one row group's plain rows.
    pub(super) group_buf: Vec<u8>,
    pub metrics: Metrics,
}

/// A cluster's rows where they lie in memory ([`Core::resident`]).
pub(super) struct Resident<'a> {
    pub rows: ClusterRows<'a>,
    /// The cluster's bytes where the cache laid its gate and up rows out in row groups
    /// ([`Core::group_kept`]): its gate pass reads them through
    /// [`crate::kernels::grouped_cluster::gate_pass_grouped_cluster`]; `rows` then serves for
    /// the down columns and the rows after the last group only.
    pub grouped: Option<&'a [u8]>,
}

impl Core {
    /// Whether layer `l` needs every cluster whatever its input, so that its uncached clusters are
    /// read on every token: exact modes, and certified layers without a certificate (nothing
    /// proves a neuron inactive before its bundle is read).
    pub fn needs_every_cluster(&self, l: usize) -> bool {
        match self.sparsity {
            Sparsity::Exact | Sparsity::Dense => true,
            Sparsity::Certified => self.plans[l].certificate.is_none(),
            Sparsity::Predicted | Sparsity::Refine { .. } => false,
        }
    }

    pub fn is_pending(&self, key: ClusterKey) -> bool {
        self.pending[self.slots.of(key)].is_some()
    }

    /// Whether a read ahead of `size` bytes fits the I/O budget now.
    pub fn has_room(&self, size: u64) -> bool {
        self.in_flight + size <= self.io_budget
    }

    /// Queues a read of cluster `key` unless it is cached or already queued; true if queued.
    pub fn request(&mut self, key: ClusterKey, priority: u32) -> bool {
        self.request_all(&[(key, priority)]) == 1
    }

    /// Queues reads of the clusters not cached or queued yet, in one submission (one lock and
    /// one wake-up of the read queue for all); returns how many were queued.
    pub fn request_all(&mut self, wanted: &[(ClusterKey, u32)]) -> usize {
        // A key listed twice is queued once: its slot is marked while the batch is formed.
        let mut reads = std::mem::take(&mut self.reads);
        for &(key, priority) in wanted {
            let s = self.slots.of(key);
            if self.cache.contains(key) || self.pending[s].is_some() || self.in_batch[s] {
                continue;
            }
            self.in_batch[s] = true;
            let cl = self.plans[key.0 as usize].clusters[key.1 as usize];
            let buf = self.spare.take(cl.size as usize);
            reads.push((buf, cl.offset, priority));
        }
        if reads.is_empty() {
            self.reads = reads;
            return 0;
        }
        let mut tickets = std::mem::take(&mut self.tickets);
        // Hashed by the thread that moves the bytes (see `check_read`).
        self.io
            .submit_batch_into(reads.drain(..), &mut tickets, true);
        self.reads = reads;
        let n = tickets.len();
        let mut tickets_in_order = tickets.iter();
        for &(key, _) in wanted {
            let s = self.slots.of(key);
            if !self.in_batch[s] {
                continue;
            }
            // Unmarked once queued: a later duplicate in `wanted` is not queued again.
            self.in_batch[s] = false;
            let ticket = *tickets_in_order.next().expect("one ticket per marked key");
            let size = self.plans[key.0 as usize].clusters[key.1 as usize].size;
            self.refilling[s] = false;
            if std::mem::take(&mut self.shrunk[s]) {
                self.metrics.reread_bytes += size;
            }
            self.pending[s] = Some((ticket, size));
            self.in_flight += size;
        }
        self.tickets = tickets;
        n
    }

    /// Queues refill reads ([`crate::streaming::refill`]): like [`Core::request_all`], but refinement
    /// neither withdraws them nor counts them as wasted.
    pub fn request_refill(&mut self, wanted: &[(ClusterKey, u32)]) {
        self.metrics.refill_reads += self.request_all(wanted) as u64;
        for &(key, _) in wanted {
            let s = self.slots.of(key);
            self.refilling[s] = self.pending[s].is_some();
        }
    }

    /// Bytes of reads in flight.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }

    /// Offers a cluster just read to the cache; what the cache declines or evicts is recycled.
    pub fn offer(&mut self, key: ClusterKey, bytes: Bytes) -> bool {
        let declined = self.cache.offer(key, bytes);
        let kept = declined.is_none();
        if kept {
            self.group_kept(key);
        }
        let spare = &mut self.spare;
        for b in declined.into_iter().chain(self.cache.drain_evicted()) {
            if let Bytes::Read(buf) = b {
                spare.give(buf);
            }
        }
        kept
    }

    /// Pins a cluster in the cache ([`NeuronCache::pin`]); true if it fit.
    pub fn pin(&mut self, key: ClusterKey, bytes: Bytes, freq: f32) -> bool {
        let pinned = self.cache.pin(key, bytes, freq);
        if pinned {
            self.group_kept(key);
        }
        pinned
    }

    /// Whether the cache holds cluster `key` in row groups ([`Core::group_kept`]).
    fn kept_in_groups(&self, key: ClusterKey) -> bool {
        let plan = &self.plans[key.0 as usize];
        groupable_cluster(
            RowKernels::best(),
            &plan.layout,
            plan.clusters[key.1 as usize].count,
        )
    }

    /// Lays the gate and up rows of a cluster the cache has just kept out in row groups, where
    /// the kernels have them ([`group_cluster`]): done once, it makes the gate pass of every
    /// later token that finds the cluster cached compute eight neurons per vector operation
    /// (the same bits). A read computed at once and not kept is never regrouped.
    fn group_kept(&mut self, key: ClusterKey) {
        if !self.kept_in_groups(key) {
            return;
        }
        let plan = &self.plans[key.0 as usize];
        let count = plan.clusters[key.1 as usize].count;
        if let Some(bytes) = self.cache.get_mut(key) {
            group_cluster(&plan.layout, bytes, count, &mut self.group_buf);
        }
    }

    /// Reads a cluster now (warming the cache at start-up), checking its checksum.
    pub fn read_now(&self, key: ClusterKey) -> Result<Bytes> {
        let (l, c) = (key.0 as usize, key.1 as usize);
        let cl = self.plans[l].clusters[c];
        let buf = self
            .io
            .wait(self.io.submit(cl.offset, cl.size as usize, URGENT))?;
        self.check_cluster(l, c, &buf)?;
        Ok(Bytes::Read(buf))
    }

    /// Checks a cluster read against its checksum; the error names the file, layer and cluster.
    pub(super) fn check_cluster(
        &self,
        l: usize,
        c: usize,
        bytes: &[u8],
    ) -> Result<(), FormatError> {
        let cl = self.plans[l].clusters[c];
        check_extent(bytes, cl.checksum, || {
            format!(
                "{}: layer {l} cluster {c} (offset {})",
                self.io.device().name(),
                cl.offset
            )
        })
    }

    /// [`Core::check_cluster`] for a read whose bytes the read queue hashed as it moved them
    /// (`hash`, their XXH3 in the buffer handed over, which nothing writes afterwards): the same
    /// check, every read, without hashing on the computing thread. Without a hash, or when it
    /// differs, the bytes are checked here (and a mismatch named).
    pub(super) fn check_read(
        &self,
        l: usize,
        c: usize,
        bytes: &[u8],
        hash: Option<u64>,
    ) -> Result<()> {
        if hash == Some(self.plans[l].clusters[c].checksum) {
            return Ok(());
        }
        Ok(self.check_cluster(l, c, bytes)?)
    }

    /// Takes a queued read's buffer, waiting for it, and checks it; the time counts as stalled.
    pub(super) fn take(&mut self, key: ClusterKey) -> Result<AlignedBuf> {
        let start = Instant::now();
        let (ticket, size) = self.pending[self.slots.of(key)].take().expect("queued");
        self.in_flight -= size;
        let (l, c) = (key.0 as usize, key.1 as usize);
        let (buf, hash) = self.io.wait_hashed(ticket);
        let buf = buf.with_context(|| format!("reading layer {l} cluster {c}"))?;
        self.check_read(l, c, &buf, hash)?;
        self.metrics.stall_s += start.elapsed().as_secs_f64();
        Ok(buf)
    }

    /// Watches the queued reads of layer `l`'s clusters `cis`, for [`Core::take_watched`].
    pub(super) fn watch(&mut self, l: usize, cis: &[usize]) {
        let (pending, slots) = (&self.pending, &self.slots);
        self.io.watch_all(cis.iter().map(|&ci| {
            let (ticket, _) = pending[slots.of((l as u32, ci as u32))].expect("queued");
            (ticket, ci as u32)
        }));
    }

    /// Takes the first of the watched reads of layer `l` ([`Core::watch`]) to complete, waiting
    /// for it, and checks it; returns its cluster. O(log n) per read, however many are watched.
    /// The time counts as stalled.
    pub(super) fn take_watched(&mut self, l: usize) -> Result<(usize, AlignedBuf)> {
        let start = Instant::now();
        let (ci, result, hash) = self.io.wait_watched().expect("a watched read is left");
        let ci = ci as usize;
        let (_, size) = self.pending[self.slots.of((l as u32, ci as u32))]
            .take()
            .expect("queued");
        self.in_flight -= size;
        let buf = result.with_context(|| format!("reading layer {l} cluster {ci}"))?;
        self.check_read(l, ci, &buf, hash)?;
        self.metrics.stall_s += start.elapsed().as_secs_f64();
        Ok((ci, buf))
    }

    /// The rows of a cluster that need no read: in a layer held in runs, cached, or in the
    /// mapping; an error if its bytes are too few for its neurons, or if its layer's runs lie
    /// in row groups ([`Core::resident_into`] takes those).
    pub(super) fn resident(&self, key: ClusterKey) -> Option<Result<Resident<'_>>> {
        let (l, ci) = (key.0 as usize, key.1 as usize);
        let plan = &self.plans[l];
        let cl = &plan.clusters[ci];
        if let Some(runs) = self.layer_runs(l) {
            if runs.is_grouped() {
                return Some(Err(anyhow::anyhow!(
                    "layer {l}'s cluster {ci}: its rows lie in row groups (resident_into)"
                )));
            }
            let rows = runs.rows(&plan.layout, cl.first, cl.count);
            return Some(Ok(Resident {
                rows,
                grouped: None,
            }));
        }
        self.resident_elsewhere(key)
    }

    /// [`Core::resident`], with a cluster of a layer whose runs lie in row groups copied out of
    /// them into `scratch`.
    pub(super) fn resident_into<'a>(
        &'a self,
        key: ClusterKey,
        scratch: &'a mut Vec<u8>,
    ) -> Option<Result<ClusterRows<'a>>> {
        let (l, ci) = (key.0 as usize, key.1 as usize);
        let plan = &self.plans[l];
        let cl = &plan.clusters[ci];
        if let Some(runs) = self.layer_runs(l) {
            return Some(Ok(runs.rows_into(
                &plan.layout,
                cl.first,
                cl.count,
                scratch,
            )));
        }
        match self.resident_elsewhere(key)? {
            Ok(Resident {
                grouped: Some(bytes),
                ..
            }) => {
                ungroup_cluster_into(&plan.layout, bytes, cl.count, scratch);
                Some(
                    ClusterRows::new(&plan.layout, scratch, cl.count)
                        .with_context(|| format!("cluster {ci}")),
                )
            }
            other => Some(other.map(|r| r.rows)),
        }
    }

    /// Whether [`Core::resident`] (or [`Core::resident_into`]) has the cluster's rows.
    pub(super) fn has_resident(&self, key: ClusterKey) -> bool {
        self.layer_runs(key.0 as usize).is_some()
            || self.cache.get(key).is_some()
            || self.mapping.is_some()
    }

    /// A cluster cached (in row groups where [`Core::group_kept`] laid it out) or in the
    /// mapping.
    fn resident_elsewhere(&self, key: ClusterKey) -> Option<Result<Resident<'_>>> {
        let (l, ci) = (key.0 as usize, key.1 as usize);
        let plan = &self.plans[l];
        let cl = &plan.clusters[ci];
        let (bytes, grouped) = match self.cache.get(key) {
            Some(bytes) => (bytes, self.kept_in_groups(key)),
            None => (self.mapping.as_ref()?.cluster(cl), false),
        };
        Some(
            ClusterRows::new(&plan.layout, bytes, cl.count)
                .with_context(|| format!("cluster {ci}"))
                .map(|rows| Resident {
                    rows,
                    grouped: grouped.then_some(bytes),
                }),
        )
    }

    /// Layer `l`'s runs, if it is held in runs.
    pub(super) fn layer_runs(&self, l: usize) -> Option<&LayerRuns> {
        self.runs.get(l).and_then(Option::as_ref)
    }

    /// Reads every cluster of layer `l` (checking each) into one [`LayerRuns`] and pins the
    /// clusters, counted at their stored sizes; false, nothing pinned, if they do not all fit.
    /// One cluster's read buffer at a time besides the runs: the layer is never held twice.
    pub fn pin_layer_in_runs(&mut self, l: usize, freq: &[f32]) -> Result<bool> {
        let plan = &self.plans[l];
        let size: u64 = plan.clusters.iter().map(|cl| cl.size).sum();
        if self.cache.used() + size > self.cache.capacity() {
            return Ok(false);
        }
        let mut runs = LayerRuns::for_layer(plan);
        for ci in 0..plan.clusters.len() {
            let stored = self.read_now((l as u32, ci as u32))?;
            runs.put(&self.plans[l], ci, &stored)?;
        }
        for (ci, cl) in self.plans[l].clusters.iter().enumerate() {
            let key = (l as u32, ci as u32);
            let pinned = self
                .cache
                .pin_sized(key, Bytes::Vec(Vec::new()), cl.size, freq[ci]);
            debug_assert!(pinned, "the layer was checked to fit");
        }
        if self.runs.len() <= l {
            self.runs.resize_with(self.plans.len(), || None);
        }
        self.runs[l] = Some(runs.into_groups(&self.plans[l], RowKernels::best()));
        Ok(true)
    }

    /// Gives up layer `l`'s runs (the cache evicted some of its clusters: the budget shrank).
    /// The runs are freed first, then each cluster still cached is read again from the file
    /// (checked) into an entry of its own, so that memory never holds the layer twice.
    pub(super) fn unpack_runs(&mut self, l: usize) -> Result<()> {
        if self.runs.get_mut(l).and_then(Option::take).is_none() {
            return Ok(());
        }
        for ci in 0..self.plans[l].clusters.len() {
            let key = (l as u32, ci as u32);
            if self.cache.contains(key) {
                let bytes = self.read_now(key)?;
                self.cache.replace(key, bytes);
                self.group_kept(key);
            }
        }
        Ok(())
    }

    /// Whether a cluster is in memory now: cached, or (mapping) its pages are in the page cache.
    pub(super) fn in_memory(&self, key: ClusterKey) -> bool {
        self.cache.contains(key)
            || self.mapping.as_ref().is_some_and(|m| {
                m.is_resident(&self.plans[key.0 as usize].clusters[key.1 as usize])
            })
    }

    /// Carries out the policy's refinement of layer `l`'s queued reads; issues the needed reads
    /// that nobody requested (late reads).
    pub(super) fn refine(&mut self, l: usize, is_needed: &[bool], how: Refine) {
        for (ci, &needed) in is_needed.iter().enumerate() {
            let key = (l as u32, ci as u32);
            let s = self.slots.of(key);
            let Some((ticket, size)) = self.pending[s] else {
                continue;
            };
            if needed {
                if how.boost {
                    self.io.boost(ticket, URGENT);
                }
            } else if how.cancel && !self.refilling[s] && self.io.cancel(ticket) {
                self.pending[s] = None;
                self.in_flight -= size;
                self.metrics.cancelled_reads += 1;
            } else if how.reap {
                if let Some(done) = self.io.poll(ticket) {
                    // Read already, though not needed now: the cache may keep it; either way its
                    // buffer is released here rather than held by the queue.
                    self.pending[s] = None;
                    self.in_flight -= size;
                    if !std::mem::take(&mut self.refilling[s]) {
                        self.metrics.wasted_reads += 1;
                    }
                    if let Ok(buf) = done {
                        if self.check_cluster(l, ci, &buf).is_ok() {
                            self.offer(key, Bytes::Read(buf));
                        }
                    }
                }
            }
        }
        if self.mapping.is_none() {
            let mut late = std::mem::take(&mut self.late);
            late.clear();
            late.extend(
                (0..is_needed.len())
                    .filter(|&ci| is_needed[ci] && !self.cache.contains((l as u32, ci as u32)))
                    .map(|ci| ((l as u32, ci as u32), URGENT)),
            );
            self.metrics.late_reads += self.request_all(&late) as u64;
            self.late = late;
        }
    }
}
