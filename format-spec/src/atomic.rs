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
    /// Creates the temporary file `.NAME.tmp-PID` in `dest`'s folder.
    pub fn create(dest: &Path) -> Result<Self, FormatError> {
        let dir = match dest.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = dest.file_name().ok_or_else(|| {
            FormatError::invalid(format!("{} is not a file path", dest.display()))
        })?;
        let tmp = dir.join(format!(
            ".{}.tmp-{}",
            name.to_string_lossy(),
            std::process::id()
        ));
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
