//! What a policy decides, as hooks the engine calls: what to load before the first token, what to
//! read ahead and when, what a layer needs when the policy knows better than the sparsity mode,
//! how queued reads are refined, and whether a layer loads everything before computing. Each
//! policy lives in its own module; the engine does the reading, computing and measuring.

use anyhow::{bail, Result};

use crate::streaming::neuron_cache::ClusterKey;

use super::engine::{Core, Refine};

/// [`Schedule::taken`] is called once this share (1/n) of the I/O budget is free: topping up
/// after every read would issue reads one by one, which do not merge.
pub(super) const TOP_UP_SHARE: u64 = 4;

pub(super) trait Schedule {
    /// Fills the cache before the first token (start-up reads are not counted).
    fn warm(&mut self, _core: &mut Core) -> Result<()> {
        Ok(())
    }

    /// The residual entering layer `l` of token `token` exists: the moment to read ahead.
    fn begin_layer(
        &mut self,
        _core: &mut Core,
        _l: usize,
        _token: usize,
        _residual: &[f32],
    ) -> Result<()> {
        Ok(())
    }

    /// The neurons (stored positions) layer `l` of `token` needs, when the policy knows them in
    /// advance: marked in `candidate` (empty on entry, one flag per neuron on return), and true;
    /// false (`candidate` left empty) lets the sparsity mode decide.
    fn needs(
        &mut self,
        _core: &mut Core,
        _l: usize,
        _token: usize,
        _candidate: &mut Vec<bool>,
    ) -> Result<bool> {
        Ok(false)
    }

    /// What may be done to the layer's queued reads once its needs are known.
    fn refine(&self) -> Refine {
        Refine {
            boost: false,
            cancel: false,
            reap: true,
        }
    }

    /// A read of the layer being computed was taken and a quarter of the I/O budget is free
    /// again ([`TOP_UP_SHARE`]): the moment to queue more reads, in one batch so that neighbours
    /// still merge, rather than let the device idle until the layer ends.
    fn taken(&mut self, _core: &mut Core) {}

    /// Wait for all of a layer's reads before computing any of them (else compute as they land).
    fn load_then_compute(&self) -> bool {
        false
    }

    /// The neurons the look-ahead predicted for layer `l` of the current token, for the metrics.
    fn lookahead_set(&mut self, _l: usize) -> Option<&[bool]> {
        None
    }

    /// Layer `l` of `token` is done; `used` are the computed clusters that held an active neuron.
    fn end_layer(
        &mut self,
        _core: &mut Core,
        _l: usize,
        _token: usize,
        _used: &[usize],
    ) -> Result<()> {
        Ok(())
    }
}

/// `resident`: every cluster pinned at start-up, nothing read afterwards.
pub(super) struct Resident;

impl Schedule for Resident {
    fn warm(&mut self, core: &mut Core) -> Result<()> {
        if !pin_all_in_runs(core)? {
            bail!("the resident policy needs every bundle in DRAM; raise --memory");
        }
        Ok(())
    }
}

/// Where the neuron cache holds every bundle of the file: every layer pinned whole, as runs
/// ([`Core::pin_layer_in_runs`]), each cluster's prior its value in [`hot_order`]; false, nothing
/// pinned, where it does not hold them all.
pub(super) fn pin_all_in_runs(core: &mut Core) -> Result<bool> {
    if core.cache.used() + all_bundles(core) > core.cache.capacity() {
        return Ok(false);
    }
    let mut freq: Vec<Vec<f32>> = (core.plans.iter())
        .map(|p| vec![0.0; p.clusters.len()])
        .collect();
    for (f, (l, c)) in hot_order(core) {
        freq[l as usize][c as usize] = f;
    }
    for (l, freq) in freq.iter().enumerate() {
        let pinned = core.pin_layer_in_runs(l, freq)?;
        debug_assert!(pinned, "every layer was checked to fit");
    }
    Ok(true)
}

/// Bytes of every cluster extent of the file.
fn all_bundles(core: &Core) -> u64 {
    (core.plans.iter())
        .flat_map(|p| p.clusters.iter().map(|cl| cl.size))
        .sum()
}

/// How many times the reads in flight the cache may leave out for [`pin_layers_in_runs`] to hold
/// layers whole (at most 256 MiB a token: 170 ms at 1.5 GB/s, within a 7B token's compute).
const WHOLE_LAYERS_LEFT: u64 = 4;

/// Where every layer needs every cluster (exact mode: [`Core::needs_every_cluster`]) and the
/// cache leaves out at most [`WHOLE_LAYERS_LEFT`] times the reads in flight (`io_budget`): as
/// many layers as fit pinned whole as runs ([`Core::pin_layer_in_runs`]), the first ones first,
/// the rest of the cache left to [`hot_order`]; returns how many. Which clusters such a layer
/// caches does not change the bytes read per token, only how they fall ([`hot_order`]); with so
/// little left to read the compute outweighs them, and a layer held whole is computed in its
/// runs, faster than the same clusters kept one by one (the 7B shape at 4 GiB, 94 % of its
/// bundles cached: 2.73–2.74 tok/s with the clusters kept one by one, 2.86–3.06 with 30 of its
/// 32 layers whole, 3.82 with all of them).
pub(super) fn pin_layers_in_runs(core: &mut Core) -> Result<usize> {
    let layers = core.plans.len();
    if !(0..layers).all(|l| core.needs_every_cluster(l)) {
        return Ok(0);
    }
    let left = all_bundles(core).saturating_sub(core.cache.capacity() - core.cache.used());
    if left > WHOLE_LAYERS_LEFT * core.io_budget {
        return Ok(0);
    }
    let mut pinned = 0;
    for l in 0..layers {
        let freq = core.plans[l].refine.cluster_freq.clone();
        if core.pin_layer_in_runs(l, &freq)? {
            pinned += 1;
        }
    }
    Ok(pinned)
}

/// `mmap`: the mapping holds every cluster; the OS pages them in on first touch.
pub(super) struct Mapped;

impl Schedule for Mapped {}

/// Every cluster, most valuable to cache first, with its value: how often its layer needs it, by
/// the profile. A layer that needs every cluster whatever its input
/// ([`Core::needs_every_cluster`]) reads each of its uncached clusters on every token, so each is
/// worth 1 and which of them are cached changes how the reads fall, not how many bytes they are:
/// they are taken from all such layers in turn, each layer's from its start, so that what is left
/// to read is one run of neighbours per layer (merged into long reads) and every layer's compute
/// has about the same reads to overlap with — filling whole layers first would leave the device
/// idle through the cached layers and the compute waiting on the others.
pub(super) fn hot_order(core: &Core) -> Vec<(f32, ClusterKey)> {
    // (value, share of its layer's clusters before it, key).
    let mut order: Vec<(f32, f32, ClusterKey)> = Vec::new();
    for (l, p) in core.plans.iter().enumerate() {
        let freq = &p.refine.cluster_freq;
        let every = core.needs_every_cluster(l);
        let n = freq.len() as f32;
        order.extend(freq.iter().enumerate().map(|(c, &f)| match every {
            true => (1.0, c as f32 / n, (l as u32, c as u32)),
            false => (f, 0.0, (l as u32, c as u32)),
        }));
    }
    order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.total_cmp(&b.1)));
    order.into_iter().map(|(v, _, key)| (v, key)).collect()
}

/// Pins clusters of `order` while they fit in `limit` bytes; returns how many were pinned.
pub(super) fn pin_hottest(
    core: &mut Core,
    order: &[(f32, ClusterKey)],
    limit: u64,
) -> Result<usize> {
    let mut used = 0u64;
    let mut pinned = 0;
    for &(freq, key) in order {
        let size = core.plans[key.0 as usize].clusters[key.1 as usize].size;
        if used + size > limit {
            continue;
        }
        let bytes = core.read_now(key)?;
        used += size;
        pinned += 1;
        core.pin(key, bytes, freq);
    }
    Ok(pinned)
}
