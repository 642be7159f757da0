//! The local state directory: created when missing and locked for the
//! process's group, so two processes of one group never share it.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use super::ServiceError;

/// Held while the process runs; the lock goes with it.
#[derive(Debug)]
pub struct StateDirLock {
    _file: File,
    pub path: PathBuf,
}

/// Creates `dir` when missing and takes its lock for `group`.
pub fn lock_state_dir(dir: &Path, group: &str) -> Result<StateDirLock, ServiceError> {
    let error = |reason: String| ServiceError::State {
        path: dir.to_path_buf(),
        reason,
    };
    std::fs::create_dir_all(dir).map_err(|e| error(format!("cannot create it: {e}")))?;
    let path = dir.join(format!("{group}.lock"));
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| error(format!("cannot open {}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(StateDirLock { _file: file, path }),
        Err(TryLockError::WouldBlock) => Err(error(format!(
            "locked by another afstream process of group {group:?} ({}); give each process its own state_dir",
            path.display()
        ))),
        Err(TryLockError::Error(e)) => Err(error(format!("cannot lock {}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_state_directory_is_refused_with_the_reason() {
        let dir = std::env::temp_dir().join(format!("afstream-state-lock-{}", std::process::id()));
        let held = lock_state_dir(&dir, "group-a").expect("the first lock");
        let refused = lock_state_dir(&dir, "group-a").expect_err("the second lock");
        assert!(
            refused.to_string().contains("locked by another afstream process"),
            "{refused}"
        );
        lock_state_dir(&dir, "group-b").expect("another group's lock is separate");
        drop(held);
        lock_state_dir(&dir, "group-a").expect("free again once released");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_state_directory_that_cannot_be_created_says_so() {
        let file = std::env::temp_dir().join(format!("afstream-state-file-{}", std::process::id()));
        std::fs::write(&file, b"not a directory").expect("write a file");
        let error = lock_state_dir(&file.join("state"), "g").expect_err("under a file");
        assert!(error.to_string().contains("cannot create it"), "{error}");
        let _ = std::fs::remove_file(&file);
    }
}
