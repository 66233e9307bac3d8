//! Models converted once by the `leanstream-prep` binary and cached, so that `run`, `chat`,
//! `perplexity` and `demo` accept a GGUF file, a Hugging Face folder or a hub id wherever they
//! stream a converted file. A converted file is cached in `$LEANSTREAM_CACHE` (else
//! `~/.cache/leanstream`) under the xxh3 of the conversion flags and the model's files (a hub id:
//! of its name), the converter's version and the format version this build writes (FORMAT.md §12:
//! a file cached by a build that wrote 1.5 has the old cluster layout), so a changed model, flag,
//! converter or format converts anew.
//! `leanstream-prep` writes under a temporary name and renames, so a cached file is always whole.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use leanstream_format::container::{VERSION_MAJOR, VERSION_MINOR};

use crate::source;
use crate::source::model_arg::{classify, ModelArg};

/// What `run`, `chat`, `serve` and `perplexity` open for `--model ARG`: a converted file as given;
/// a GGUF file or model folder as given when nothing asks for streaming (the dense engine reads
/// them); otherwise, and for a hub id, the converted file, converting it now unless `no_convert`.
/// The conversion here is the converter's layout pass alone (`convert --layout-only`: about the
/// time of reading the model once, within `memory` bytes where given), so the first token does
/// not wait for a calibration; the file streams exactly, computing every neuron, until
/// `leanstream-prep calibrate` upgrades it in place.
pub fn model_to_open(
    arg: &Path,
    streaming: bool,
    no_convert: bool,
    memory: Option<u64>,
) -> Result<PathBuf> {
    let model = classify(arg)?;
    if let ModelArg::Path(path) = &model {
        if (path.is_file() && source::is_converted(path)?) || !streaming {
            return Ok(path.clone());
        }
    }
    if no_convert {
        bail!(
            "{} is not a converted file and --no-convert forbids converting it here: run \
             `leanstream-prep convert {} -o model.lsb` and pass --model model.lsb{}",
            arg.display(),
            arg.display(),
            if matches!(model, ModelArg::Path(_)) {
                ", or drop --memory, --flash and --policy to run it dense"
            } else {
                ""
            }
        );
    }
    let budget: Vec<String> = memory
        .map(|b| vec!["--memory".into(), b.to_string()])
        .unwrap_or_default();
    let (file, now) = converted_file(&model, &[LAYOUT_ONLY], &budget)?;
    if now {
        eprintln!(
            "{} holds the weights without calibration: exact, every neuron computed. \
             `leanstream-prep calibrate {}` learns its sparsity, neuron order and predictors \
             in place",
            file.display(),
            file.display()
        );
    }
    Ok(file)
}

/// The converter's flag for a layout-only file (FORMAT.md §4.1 `layout_only`).
const LAYOUT_ONLY: &str = "--layout-only";

/// The converted file for `model` with `leanstream-prep convert` `flags` (part of the cache key)
/// and `extra` arguments (not: a memory budget), and whether it was converted now (else it came
/// from the cache, or `model` is a converted file already).
pub fn converted_file(
    model: &ModelArg,
    flags: &[&str],
    extra: &[String],
) -> Result<(PathBuf, bool)> {
    if let ModelArg::Path(path) = model {
        if path.is_file() && source::is_converted(path)? {
            return Ok((path.clone(), false));
        }
    }
    let shown = match model {
        ModelArg::Path(p) => p.display().to_string(),
        ModelArg::HubId(id) => id.clone(),
    };
    let prep = prep_binary(&shown)?;
    let version = format!(
        "{}-format{VERSION_MAJOR}.{VERSION_MINOR}",
        converter_version(&prep)?
    );
    let (name, key) = match model {
        ModelArg::Path(p) => (
            p.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into()),
            files_key(p, flags)?,
        ),
        ModelArg::HubId(id) => (id.replace('/', "--"), hub_id_key(id, flags)),
    };
    let dir = cache_dir()?;
    let out = dir.join(format!("{name}-{key:016x}-{version}.lsb"));
    if out.is_file() {
        return Ok((out, false));
    }
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create the cache folder {}", dir.display()))?;
    eprintln!(
        "converting {shown} with {} (once; cached as {})",
        prep.display(),
        out.display()
    );
    let start = Instant::now();
    let mut convert = Command::new(&prep);
    convert.arg("convert");
    match model {
        ModelArg::Path(p) => convert.arg(p),
        ModelArg::HubId(id) => convert.arg(id),
    };
    // The converter's progress bar and errors go to stderr; its summary table is not wanted here.
    let status = convert
        .arg("-o")
        .arg(&out)
        .args(flags)
        .args(extra)
        .stdout(Stdio::null())
        .status()
        .with_context(|| format!("cannot run {}", prep.display()))?;
    if !status.success() {
        bail!(
            "converting {shown} failed ({status}): leanstream-prep's message is above; `{} convert \
             {shown} -o model.lsb` runs the same conversion",
            prep.display()
        );
    }
    eprintln!("converted in {:.1} s", start.elapsed().as_secs_f64());
    Ok((out, true))
}

/// The converter: the file `LEANSTREAM_PREP` names when it is set (an error naming it when it is
/// not a file), else `leanstream-prep` beside this executable, else on `PATH`; if none, an error
/// saying how to build it here or convert `model` on a workstation and push the result.
fn prep_binary(model: &str) -> Result<PathBuf> {
    if let Some(explicit) = std::env::var_os("LEANSTREAM_PREP").filter(|v| !v.is_empty()) {
        let explicit = PathBuf::from(explicit);
        if !explicit.is_file() {
            bail!(
                "LEANSTREAM_PREP={} is not a file: point it at a leanstream-prep binary, or unset \
                 it to use the one beside {} or on PATH",
                explicit.display(),
                std::env::current_exe()
                    .map(|e| e.display().to_string())
                    .unwrap_or_else(|_| "leanstream".into())
            );
        }
        return Ok(explicit);
    }
    let name = format!("leanstream-prep{}", std::env::consts::EXE_SUFFIX);
    let exe = std::env::current_exe().context("cannot locate the leanstream executable")?;
    let beside = exe.parent().map(|d| d.join(&name));
    let on_path = || {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(&name))
                .find(|p| p.is_file())
        })
    };
    beside
        .filter(|p| p.is_file())
        .or_else(on_path)
        .with_context(|| {
            format!(
                "{model} must be converted, by leanstream-prep, which is neither beside {} nor on \
                 PATH: on a workstation run `leanstream-prep convert {model} -o model.lsb` and \
                 `leanstream-prep push model.lsb --adb` (or `--ssh HOST`), then pass --model \
                 model.lsb here; or build it here (`cargo build --release` builds both binaries)",
                exe.display()
            )
        })
}

/// `leanstream-prep --version`, made safe for a file name.
fn converter_version(prep: &Path) -> Result<String> {
    let out = Command::new(prep)
        .arg("--version")
        .output()
        .with_context(|| format!("cannot run {}", prep.display()))?;
    if !out.status.success() {
        bail!("{} --version failed ({})", prep.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .trim()
        .trim_start_matches("leanstream-prep")
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect())
}

/// `$LEANSTREAM_CACHE`, else `~/.cache/leanstream`.
fn cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("LEANSTREAM_CACHE") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME")
        .context("neither LEANSTREAM_CACHE nor HOME is set: set LEANSTREAM_CACHE to a folder")?;
    Ok(PathBuf::from(home).join(".cache/leanstream"))
}

/// xxh3 of the conversion flags and of a hub id.
fn hub_id_key(id: &str, flags: &[&str]) -> u64 {
    let mut hash = leanstream_format::container::Checksum::new();
    hash.update(flags.join(" ").as_bytes());
    hash.update(b"\0hub:");
    hash.update(id.as_bytes());
    hash.digest()
}

/// xxh3 of the conversion flags and of a model file, or of a directory's files (names and
/// contents, in name order).
fn files_key(model: &Path, flags: &[&str]) -> Result<u64> {
    let mut files = Vec::new();
    if model.is_dir() {
        for entry in
            std::fs::read_dir(model).with_context(|| format!("cannot list {}", model.display()))?
        {
            let path = entry?.path();
            if path.is_file() {
                files.push(path);
            }
        }
        files.sort();
    } else {
        files.push(model.to_path_buf());
    }
    let mut hash = leanstream_format::container::Checksum::new();
    hash.update(flags.join(" ").as_bytes());
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        hash.update(path.file_name().unwrap_or_default().as_encoded_bytes());
        let mut f = std::fs::File::open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        loop {
            let n = f
                .read(&mut buf)
                .with_context(|| format!("cannot read {}", path.display()))?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
        }
    }
    Ok(hash.digest())
}
