//! When a modelled flash device completes a read. Three numbers shape a device's random reads: a
//! lone 4 KiB read takes `latency`; many small reads in flight are limited by how fast the
//! controller takes commands (`1 / iops`); large reads by the link's bandwidth. So each read takes
//! the command slot for `1 / iops` in arrival order, then the bus for `len / bandwidth`, and
//! completes when its transfer ends but not before `latency` after its command started.
//!
//! Times are virtual (nanoseconds from an epoch) and derived only from arrivals, never from when
//! a thread got round to asking, so the model stays exact when one thread issues or completes
//! several reads per wake-up.

use std::time::{Duration, Instant};

use super::FlashProfile;

pub(crate) struct QueueModel {
    epoch: Instant,
    command_ns: f64,
    latency_ns: f64,
    ns_per_byte: f64,
    command_free: f64,
    bus_free: f64,
}

impl QueueModel {
    pub fn new(profile: &FlashProfile) -> Self {
        Self {
            epoch: Instant::now(),
            command_ns: 1e9 / profile.iops_4k,
            latency_ns: profile.latency_us * 1e3,
            ns_per_byte: 1e3 / profile.bandwidth_mb_s,
            command_free: 0.0,
            bus_free: 0.0,
        }
    }

    /// Books a `len`-byte read that reached the device at `arrival` and returns when it completes.
    pub fn complete_at(&mut self, arrival: Instant, len: usize) -> Instant {
        let arrived = arrival.saturating_duration_since(self.epoch).as_nanos() as f64;
        let start = arrived.max(self.command_free);
        self.command_free = start + self.command_ns;
        let transfer_end = start.max(self.bus_free) + len as f64 * self.ns_per_byte;
        self.bus_free = transfer_end;
        let done = transfer_end.max(start + self.latency_ns);
        self.epoch + Duration::from_nanos(done.round() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Runs `n` reads of `len` bytes with `qd` always in flight (each completion admits the next
    /// read at once); returns (mean latency of a read, reads per second).
    fn closed_loop(profile: &FlashProfile, qd: usize, len: usize, n: usize) -> (f64, f64) {
        let mut m = QueueModel::new(profile);
        let t0 = m.epoch;
        let mut in_flight: VecDeque<Instant> = (0..qd).map(|_| m.complete_at(t0, len)).collect();
        let mut total_latency = 0.0;
        let mut last = t0;
        for _ in qd..n {
            let done = in_flight.pop_front().unwrap();
            in_flight.push_back(m.complete_at(done, len));
            let newest = *in_flight.back().unwrap();
            total_latency += (newest - done).as_secs_f64();
            last = done;
        }
        let rate = (n - qd) as f64 / (last - t0).as_secs_f64();
        (total_latency / (n - qd) as f64, rate)
    }

    #[test]
    fn reproduces_each_profile_figure() {
        for p in [
            FlashProfile::ufs4(),
            FlashProfile::ufs31(),
            FlashProfile::nvme(),
        ] {
            let (latency, _) = closed_loop(&p, 1, 4096, 1000);
            assert!((latency * 1e6 / p.latency_us - 1.0).abs() < 0.01, "{p:?}");
            let (_, iops) = closed_loop(&p, p.queue_depth, 4096, 100_000);
            assert!((iops / p.iops_4k - 1.0).abs() < 0.01, "{p:?}: {iops}");
            let (_, reads) = closed_loop(&p, p.queue_depth, 512 << 10, 10_000);
            let mb_s = reads * (512 << 10) as f64 / 1e6;
            assert!(
                (mb_s / p.bandwidth_mb_s - 1.0).abs() < 0.01,
                "{p:?}: {mb_s}"
            );
        }
    }

    #[test]
    fn late_arrivals_in_the_past_keep_the_rate() {
        // All reads arrive at the epoch but are booked one by one: the command slot serialises
        // them at 1 / iops regardless of when they were booked.
        let p = FlashProfile::ufs4();
        let mut m = QueueModel::new(&p);
        let t0 = m.epoch;
        let last = (0..1000).map(|_| m.complete_at(t0, 4096)).last().unwrap();
        let expected = 999.0 / p.iops_4k + p.latency_us * 1e-6;
        assert!(((last - t0).as_secs_f64() / expected - 1.0).abs() < 0.01);
    }
}
