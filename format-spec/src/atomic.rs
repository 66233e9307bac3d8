//! Atomic output: a file is written under a temporary name in its target folder and renamed into
//! place only when complete, so a failed or interrupted write never leaves a partial file under
//! the target name.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::FormatError;

/// A file being written to a temporary name next to `dest`; removed on drop unless committed.
pub struct AtomicFile {
    file: File,
    tmp: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl AtomicFile {
    /// Creates the temporary file `.NAME.tmp-PID` in `dest`'s folder, first removing the ones
    /// that writers of `dest` killed before they could clean up left behind.
    pub fn create(dest: &Path) -> Result<Self, FormatError> {
        let dir = match dest.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = dest.file_name().ok_or_else(|| {
            FormatError::invalid(format!("{} is not a file path", dest.display()))
        })?;
        let prefix = format!(".{}.tmp-", name.to_string_lossy());
        remove_stale(&dir, &prefix);
        let tmp = dir.join(format!("{prefix}{}", std::process::id()));
        let file = File::create(&tmp).map_err(|e| FormatError::io(&tmp, e))?;
        Ok(Self {
            file,
            tmp,
            dest: dest.to_path_buf(),
            committed: false,
        })
    }

    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    /// The temporary name, under which the content can be checked before [`Self::commit`].
    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    /// Syncs the file to disk and renames it to its target name. Without `overwrite`, an existing
    /// target is an error and is left untouched.
    pub fn commit(mut self, overwrite: bool) -> Result<(), FormatError> {
        self.file
            .sync_all()
            .map_err(|e| FormatError::io(&self.tmp, e))?;
        if !overwrite && self.dest.exists() {
            return Err(exists_error(&self.dest));
        }
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| FormatError::io(&self.dest, e))?;
        self.committed = true;
        Ok(())
    }
}

/// Removes `dir/PREFIX<pid>` files whose process is gone (Linux: no `/proc/<pid>`). Those of
/// live processes — another writer at work — stay; anything else in the folder is not touched.
fn remove_stale(dir: &Path, prefix: &str) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The error for an output that exists and may not be replaced.
pub fn exists_error(dest: &Path) -> FormatError {
    FormatError::invalid(format!(
        "{} already exists: remove it, choose another output, or pass --force to replace it",
        dest.display()
    ))
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_killed_writers_leftover_goes_a_live_ones_stays() {
        let dir = std::env::temp_dir().join(format!("atomic-stale-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dest = dir.join("out.lsb");
        // PIDs never exceed 2^22 on Linux; PID 1 always runs.
        let dead = dir.join(".out.lsb.tmp-99999999");
        let live = dir.join(".out.lsb.tmp-1");
        let other = dir.join(".other.lsb.tmp-99999999");
        for f in [&dead, &live, &other] {
            std::fs::write(f, b"partial").unwrap();
        }
        let mut out = AtomicFile::create(&dest).unwrap();
        std::io::Write::write_all(out.file(), b"whole").unwrap();
        out.commit(false).unwrap();
        assert!(!dead.exists(), "a dead writer's leftover stays");
        assert!(live.exists() && other.exists());
        assert_eq!(std::fs::read(&dest).unwrap(), b"whole");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
