//! Output into a pipe whose reader leaves early (`leanstream-prep inspect F | head`). Rust starts
//! programs with SIGPIPE ignored, so the next `println!` fails with EPIPE and panics ("failed
//! printing to stdout: Broken pipe"). Both binaries call [`end_quietly_when_stdout_closes`] first,
//! which restores the default that `cat` and `grep` have: the process ends, without a message, when
//! nobody reads what it prints any more. Sockets keep their errors: std sends with MSG_NOSIGNAL
//! (Linux, Android) or sets SO_NOSIGPIPE (Apple), so a client that hangs up on `serve` is an I/O
//! error, not a signal. The C API never calls this: an app's signal handling is its own.

/// Restores the default action for SIGPIPE (end the process). Call at the top of `main`.
pub fn end_quietly_when_stdout_closes() {
    #[cfg(unix)]
    // SAFETY: `signal` with SIG_DFL installs no handler code; it runs before any thread starts, and
    // nothing in these binaries relies on SIGPIPE being ignored (sockets pass MSG_NOSIGNAL or carry
    // SO_NOSIGPIPE, and no child process's stdin is written to). The test
    // `bad_input::a_reader_that_leaves_early_ends_the_tools_quietly` checks both binaries.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
