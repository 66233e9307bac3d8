//! Storage: where the streamed weights come from. One [`Device`] trait with two implementations —
//! the real disk read with `O_DIRECT` ([`DirectDevice`]) and an emulated phone or board flash
//! ([`FlashModel`] driven by a [`FlashProfile`]) — and the priority read queue the scheduler uses
//! on top of either ([`IoQueue`]). [`FaultyDevice`] wraps either to inject faults in tests.

#[cfg(feature = "cli")]
pub mod probe;

mod aligned;
mod busy;
mod clock;
mod device;
mod direct;
mod faulty;
mod flash;
mod io_queue;
#[cfg(target_os = "linux")]
pub mod page_cache;
mod pending;
mod profile;
mod queue_model;
mod spare;

use std::io;
use std::path::Path;
use std::sync::Arc;

pub use aligned::AlignedBuf;
pub use device::Device;
pub use direct::DirectDevice;
pub use faulty::{Fault, FaultKind, FaultyDevice};
pub use flash::FlashModel;
pub use io_queue::{IoQueue, IoStats, ReadSpan, Ticket, MAX_MERGE_BYTES};
pub use profile::{FlashProfile, BUILTIN_PROFILES};
pub use spare::SpareBuffers;

/// Opens `path` as the device a `--flash` value selects (see [`FlashProfile::from_flash_arg`]):
/// `None` reads the real disk with direct I/O, a profile emulates that device over the file.
pub fn open_device(path: &Path, flash: Option<FlashProfile>) -> io::Result<Arc<dyn Device>> {
    Ok(match flash {
        None => Arc::new(DirectDevice::open(path, DirectDevice::DEFAULT_QUEUE_DEPTH)?),
        Some(profile) => Arc::new(FlashModel::open(path, profile)?),
    })
}
