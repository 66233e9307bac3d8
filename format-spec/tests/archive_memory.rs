//! Packing and unpacking take bounded memory: a 96 MiB stream goes through an archive on disk
//! while the process's peak RSS (`VmHWM`, which counts zstd's own buffers too) grows by a small
//! fraction of the stream's size. One test in its own binary, so no other test shares the process.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;

use leanstream_format::archive::{
    read_body, read_manifest, write_archive, Manifest, PackOptions, ARCHIVE_VERSION,
};
use leanstream_format::container::Checksum;

const SIZE: u64 = 96 << 20;

/// `len` pseudo-random bytes, half of them compressible, generated as they are read.
struct Synthetic {
    left: u64,
    state: u64,
}

impl Read for Synthetic {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.left as usize);
        for (i, b) in buf[..n].iter_mut().enumerate() {
            self.state ^= self.state << 13;
            self.state ^= self.state >> 7;
            self.state ^= self.state << 17;
            *b = if i % 2 == 0 { self.state as u8 } else { 0 };
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Hashes what is written, keeping nothing.
struct HashSink(Checksum, u64);

impl Write for HashSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        self.1 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Restarts the peak-RSS count from the current RSS (Linux `clear_refs` 5).
fn reset_peak_rss() {
    std::fs::write("/proc/self/clear_refs", "5").expect("clear_refs is writable");
}

fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

#[test]
fn a_stream_much_larger_than_the_buffers_packs_and_unpacks_in_bounded_memory() {
    let path = std::env::temp_dir().join(format!("archive-memory-{}.zst", std::process::id()));
    let manifest = Manifest {
        archive_version: ARCHIVE_VERSION,
        format: "LeanStream 1.0".into(),
        name: "big.lsb".into(),
        size: SIZE,
    };
    let mut src = Synthetic {
        left: SIZE,
        state: 0x2545_F491_4F6C_DD1D,
    };
    let mut out = BufWriter::new(File::create(&path).unwrap());
    reset_peak_rss();
    let before = peak_rss();
    let opts = PackOptions {
        level: 3,
        threads: 2,
    };
    let mem = Path::new("synthetic");
    let sum = write_archive(
        (&mut src, mem),
        (&mut out, &path),
        &manifest,
        &opts,
        |_, _| {},
    )
    .unwrap();
    out.flush().unwrap();
    drop(out);
    let packed = peak_rss() - before;
    reset_peak_rss();
    let before = peak_rss();

    let mut r = BufReader::new(File::open(&path).unwrap());
    let m = read_manifest(&mut r, &path).unwrap();
    assert_eq!(m, manifest);
    let mut sink = HashSink(Checksum::new(), 0);
    read_body((&mut r, &path), (&mut sink, mem), &m, |_, _| {}).unwrap();
    assert_eq!((sink.0.digest(), sink.1), (sum, SIZE));
    let archive_bytes = std::fs::metadata(&path).unwrap().len();
    std::fs::remove_file(&path).unwrap();
    let unpacked = peak_rss() - before;
    eprintln!(
        "{} MiB -> {} MiB archive; peak RSS grew by {:.1} MiB packing, {:.1} MiB unpacking",
        SIZE >> 20,
        archive_bytes >> 20,
        packed as f64 / (1 << 20) as f64,
        unpacked as f64 / (1 << 20) as f64,
    );
    // Half the bytes are random: the archive is a real, large stream, not a few bytes.
    assert!(archive_bytes > SIZE / 3, "{archive_bytes}");
    // Two threads' jobs and zstd's tables; the 1 MiB read and write buffers.
    assert!(
        packed < 32 << 20,
        "packing grew the peak RSS by {packed} bytes"
    );
    assert!(
        unpacked < 12 << 20,
        "unpacking grew the peak RSS by {unpacked} bytes"
    );
}
