//! `leanstream-prep push FILE (--adb [SERIAL] | --ssh HOST[:DIR]) [--pack]`: copies a converted
//! file to a device with the system's `adb push` or `scp` (packing it first if asked), then runs
//! `leanstream verify` (or `leanstream unpack`) on the device through `adb shell` or `ssh`.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args};
use leanstream::transfer::progress::mb_per_s;

use crate::pack::{pack_file, Compression};

/// Arguments of `leanstream-prep push`.
#[derive(Args, Debug)]
#[command(group(ArgGroup::new("target").required(true).args(["adb", "ssh"])))]
pub struct PushArgs {
    /// A converted LeanStream file.
    pub file: PathBuf,
    /// Push with `adb` to the device with this serial (default: the only one attached).
    #[arg(long, value_name = "SERIAL", num_args = 0..=1, default_missing_value = "")]
    pub adb: Option<String>,
    /// Push with `scp` to HOST (ssh syntax, e.g. user@board), into DIR if given.
    #[arg(long, value_name = "HOST[:DIR]", value_parser = parse_ssh)]
    pub ssh: Option<SshTarget>,
    /// Send a packed archive and unpack it on the device (needs `leanstream` there).
    #[arg(long)]
    pub pack: bool,
    /// Folder on the device (default: /data/local/tmp with adb, the home folder with ssh).
    #[arg(long)]
    pub remote_dir: Option<String>,
    /// The `leanstream` command on the device, for the check after the copy.
    #[arg(long, default_value = "leanstream")]
    pub remote_leanstream: String,
    #[command(flatten)]
    pub compression: Compression,
}

/// `--ssh HOST[:DIR]`.
#[derive(Debug, Clone)]
pub struct SshTarget {
    host: String,
    dir: Option<String>,
}

fn parse_ssh(s: &str) -> Result<SshTarget, String> {
    let (host, dir) = match s.split_once(':') {
        Some((host, dir)) => (host, Some(dir.to_string()).filter(|d| !d.is_empty())),
        None => (s, None),
    };
    if host.is_empty() {
        return Err("give the host, as HOST or HOST:DIR".into());
    }
    Ok(SshTarget {
        host: host.to_string(),
        dir,
    })
}

/// The device and how to reach it.
enum Transport {
    Adb { serial: Option<String> },
    Ssh { host: String },
}

impl Transport {
    fn adb(&self, args: &[&str]) -> Command {
        let mut c = Command::new("adb");
        if let Transport::Adb {
            serial: Some(serial),
        } = self
        {
            c.args(["-s", serial]);
        }
        c.args(args);
        c
    }

    /// The command that copies `local` to the device's `remote` path.
    fn copy(&self, local: &Path, remote: &str) -> (Command, &'static str) {
        match self {
            Transport::Adb { .. } => {
                let mut c = self.adb(&["push"]);
                c.arg(local).arg(remote);
                (c, "adb")
            }
            Transport::Ssh { host } => {
                let mut c = Command::new("scp");
                c.arg(local).arg(format!("{host}:{remote}"));
                (c, "scp")
            }
        }
    }

    /// The command that runs the shell `script` on the device.
    fn shell(&self, script: &str) -> (Command, &'static str) {
        match self {
            Transport::Adb { .. } => (self.adb(&["shell", script]), "adb"),
            Transport::Ssh { host } => {
                let mut c = Command::new("ssh");
                c.arg(host).arg(script);
                (c, "ssh")
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            Transport::Adb { serial: Some(s) } => format!("adb device {s}"),
            Transport::Adb { serial: None } => "the adb device".into(),
            Transport::Ssh { host } => host.clone(),
        }
    }
}

pub fn run(args: PushArgs) -> Result<()> {
    let (transport, dir) = match (&args.adb, &args.ssh) {
        (Some(serial), None) => (
            Transport::Adb {
                serial: Some(serial.clone()).filter(|s| !s.is_empty()),
            },
            args.remote_dir.clone().unwrap_or("/data/local/tmp".into()),
        ),
        (None, Some(target)) => {
            if target.dir.is_some() && args.remote_dir.is_some() {
                bail!("give the remote folder once: in --ssh HOST:DIR or with --remote-dir");
            }
            let dir = target.dir.clone().or(args.remote_dir.clone());
            (
                Transport::Ssh {
                    host: target.host.clone(),
                },
                dir.unwrap_or_default(),
            )
        }
        _ => unreachable!("clap requires exactly one of --adb and --ssh"),
    };
    // Refuse anything but a LeanStream file before touching the device.
    leanstream_format::LsbFile::open(&args.file)?;
    let name = args
        .file
        .file_name()
        .context("FILE is not a file")?
        .to_string_lossy()
        .into_owned();
    let remote_file = remote_path(&dir, &name);

    // With --pack, the archive goes to a temporary name next to FILE and is removed afterwards.
    let archive = args
        .pack
        .then(|| TempArchive(hidden_archive_path(&args.file)));
    let (local, remote) = match &archive {
        Some(a) => {
            let s = pack_file(&args.file, &a.0, args.compression, true)?;
            eprintln!(
                "packed {} -> {:.1} MiB (ratio {:.3}) in {:.1} s",
                name,
                s.archive_bytes as f64 / (1 << 20) as f64,
                s.ratio,
                s.seconds
            );
            (a.0.clone(), format!("{remote_file}.zst"))
        }
        None => (args.file.clone(), remote_file.clone()),
    };
    let bytes = std::fs::metadata(&local)
        .with_context(|| format!("cannot read {}", local.display()))?
        .len();

    let start = Instant::now();
    let (cmd, tool) = transport.copy(&local, &remote);
    let out = run_tool(cmd, tool, true)?;
    if !out.status.success() {
        return Err(failure(
            &out,
            tool,
            &format!("copying {} to {remote}", local.display()),
        ));
    }
    let seconds = start.elapsed().as_secs_f64();
    eprintln!(
        "copied {:.1} MiB to {}:{remote} in {seconds:.1} s ({:.0} MB/s)",
        bytes as f64 / (1 << 20) as f64,
        transport.describe(),
        mb_per_s(bytes, seconds)
    );

    let ls = shell_quote(&args.remote_leanstream);
    let script = match &archive {
        Some(_) => format!(
            "{ls} unpack {a} -o {f} --force && rm -f {a}",
            a = shell_quote(&remote),
            f = shell_quote(&remote_file)
        ),
        None => format!("{ls} verify {}", shell_quote(&remote_file)),
    };
    let (cmd, tool) = transport.shell(&script);
    let out = run_tool(cmd, tool, false)?;
    std::io::stdout().write_all(&out.stdout)?;
    std::io::stderr().write_all(&out.stderr)?;
    let text = output_text(&out);
    // sh, bash and Android's mksh all say "NAME: [command ]not found" and exit with 127.
    let missing = out.status.code() == Some(127)
        || text.lines().any(|l| {
            l.contains(&format!("{}: ", args.remote_leanstream)) && l.contains("not found")
        });
    if missing {
        let advice = format!(
            "`{}` is not installed on {}: build `leanstream` for the device (docs/arm.md: building for \
             devices), copy it there (e.g. `adb push target/aarch64-linux-android/release/\
             leanstream /data/local/tmp/`), and pass --remote-leanstream PATH if it is not on the \
             device's PATH",
            args.remote_leanstream,
            transport.describe()
        );
        if archive.is_some() {
            bail!("{remote} was copied but cannot be unpacked: {advice}; then run `leanstream unpack {remote} -o {remote_file}` there");
        }
        eprintln!(
            "warning: {remote_file} was copied but not checked on the device: {advice}; then run \
             `leanstream verify {remote_file}` there"
        );
        return Ok(());
    }
    if !out.status.success() {
        let what = if archive.is_some() {
            "unpacking on the device"
        } else {
            "verifying on the device"
        };
        return Err(failure(&out, tool, what));
    }
    println!(
        "pushed {} to {}:{remote_file}; checked on the device: every checksum matches",
        args.file.display(),
        transport.describe()
    );
    Ok(())
}

/// `DIR/NAME` on the device (`NAME` alone for the ssh home folder).
fn remote_path(dir: &str, name: &str) -> String {
    match dir.trim_end_matches('/') {
        "" if dir.starts_with('/') => format!("/{name}"),
        "" => name.to_string(),
        d => format!("{d}/{name}"),
    }
}

fn hidden_archive_path(file: &Path) -> PathBuf {
    let name = file.file_name().unwrap_or_default().to_string_lossy();
    file.with_file_name(format!(".{name}.zst.push-{}", std::process::id()))
}

/// The archive made for one push; removed when the push ends, however it ends.
struct TempArchive(PathBuf);

impl Drop for TempArchive {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs a transfer tool and captures its output; with `live` its stdout goes to ours and its
/// stderr is shown as it comes as well (the tools' progress), and only stderr is captured. A tool
/// missing from PATH is an error that says what to install.
fn run_tool(mut cmd: Command, tool: &str, live: bool) -> Result<Output> {
    cmd.stdin(Stdio::null());
    if !live {
        return cmd.output().map_err(|e| spawn_error(e, tool));
    }
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| spawn_error(e, tool))?;
    let mut stderr = Vec::new();
    let mut reader = BufReader::new(child.stderr.take().expect("stderr is piped"));
    let mut line = Vec::new();
    while reader.read_until(b'\n', &mut line)? > 0 {
        std::io::stderr().write_all(&line)?;
        stderr.append(&mut line);
    }
    let status = child.wait().with_context(|| format!("`{tool}` failed"))?;
    Ok(Output {
        status,
        stdout: Vec::new(),
        stderr,
    })
}

fn spawn_error(e: std::io::Error, tool: &str) -> anyhow::Error {
    if e.kind() != std::io::ErrorKind::NotFound {
        return anyhow::Error::new(e).context(format!("cannot run `{tool}`"));
    }
    let install = match tool {
        "adb" => "Android platform-tools (Debian/Ubuntu: `apt install adb`)",
        _ => "an OpenSSH client (Debian/Ubuntu: `apt install openssh-client`)",
    };
    anyhow::anyhow!("`{tool}` is not on PATH: install {install}, or add its folder to PATH")
}

fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The error for a failed tool: a full device is recognised from the tools' own message.
fn failure(out: &Output, tool: &str, what: &str) -> anyhow::Error {
    let text = output_text(out);
    let said = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output");
    if text.contains("No space left on device") {
        return anyhow::anyhow!(
            "the device is full: {what} failed ({tool}: {said}); free space on the device or \
             choose a folder on a larger partition with --remote-dir"
        );
    }
    anyhow::anyhow!("{what} failed ({tool} exited with {}: {said})", out.status)
}

/// Quotes `s` for a POSIX shell (adb shell and ssh run their command through one).
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_paths_and_quoting() {
        assert_eq!(
            remote_path("/data/local/tmp/", "m.lsb"),
            "/data/local/tmp/m.lsb"
        );
        assert_eq!(remote_path("", "m.lsb"), "m.lsb");
        assert_eq!(remote_path("/", "m.lsb"), "/m.lsb");
        assert_eq!(remote_path("models", "m.lsb"), "models/m.lsb");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        let t = parse_ssh("pi@board:models").unwrap();
        assert_eq!(
            (t.host.as_str(), t.dir.as_deref()),
            ("pi@board", Some("models"))
        );
        assert!(parse_ssh("board").unwrap().dir.is_none());
        assert!(parse_ssh(":x").is_err());
    }
}
