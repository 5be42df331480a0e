//! Atomic file replacement: the one file writer of the workspace.
//!
//! Contract: [`atomic_write`] either leaves `path` holding exactly what the closure wrote, or
//! leaves `path` untouched (absent if it was absent) and no temporary file behind. The data goes
//! to a uniquely named temporary file `.NAME.tmp.PID.N` in the destination's own directory (so
//! the final `rename` never crosses a file system) and is flushed and synced before the rename.
//! [`atomic_write_with`]`(.., Durability::Unsynced, ..)` skips the sync, for files that are
//! checked on every read and cheap to rebuild (the plan cache's entries): a power failure may
//! then leave a renamed but incomplete file, never a partly overwritten one.
//! [`atomic_create_bytes`] publishes the synced temporary file with a hard link instead of a
//! rename, so it never replaces an existing file: of several processes racing to create one
//! file exactly one wins, and the others can read the winner's complete file.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use tessera_core::{Error, Result};

/// Per-process counter: together with the pid it makes temporary names unique across threads
/// and processes writing into the same directory.
static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Removes the temporary file on drop unless disarmed; this covers early returns and panics
/// inside the caller's closure alike.
struct TempGuard {
    path: PathBuf,
    armed: bool,
}

impl Drop for TempGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Whether [`atomic_write_with`] syncs the data to the storage device before the rename.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// `fsync` the temporary file before renaming it (what [`atomic_write`] does).
    #[default]
    Synced,
    /// Rename without syncing: atomic for other processes, not across a power failure.
    Unsynced,
}

/// Writes a file atomically: `write` fills a temporary file next to `path`, which is then renamed
/// over `path`. On any error (from `write`, flushing, syncing or renaming) the temporary file is
/// removed and `path` is left as it was.
///
/// ```
/// use std::io::Write;
/// let dir = tempfile::tempdir()?;
/// let path = dir.path().join("hello.txt");
/// tessera_io::atomic_write(&path, |w| {
///     w.write_all(b"hello").map_err(|e| tessera_core::Error::io("hello.txt", e))
/// })?;
/// assert_eq!(std::fs::read(&path)?, b"hello");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn atomic_write(path: &Path, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    atomic_write_with(path, Durability::Synced, |w| write(w))
}

/// Writes `bytes` to `path` atomically (see [`atomic_write`]).
pub fn atomic_write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    atomic_write(path, |w| w.write_all(bytes).map_err(|e| Error::io(path, e)))
}

/// [`atomic_write`] with a choice of [`Durability`], handing `write` the buffered temporary file
/// itself (it can seek, as zip writers need).
pub fn atomic_write_with(
    path: &Path,
    durability: Durability,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<()>,
) -> Result<()> {
    write_then_publish(path, durability, Publish::Replace, write).map(|_| ())
}

/// Creates `path` holding `bytes` unless it already exists, atomically (synced temporary file,
/// then a hard link to `path`, which fails when `path` exists). `Ok(true)` when this call
/// created it; `Ok(false)` when `path` already existed, untouched. On a file system without
/// hard links it falls back to checking for `path` and renaming, which a racing writer can
/// still beat.
pub fn atomic_create_bytes(path: &Path, bytes: &[u8]) -> Result<bool> {
    write_then_publish(path, Durability::Synced, Publish::CreateNew, |w| {
        w.write_all(bytes).map_err(|e| Error::io(path, e))
    })
}

/// How a finished temporary file becomes the destination.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Publish {
    /// `rename` over whatever is there.
    Replace,
    /// Hard link: only when nothing is there.
    CreateNew,
}

/// The shared writer: fills and (optionally) syncs a temporary file next to `path`, then
/// publishes it; `Ok(false)` only for [`Publish::CreateNew`] onto an existing file.
fn write_then_publish(
    path: &Path,
    durability: Durability,
    publish: Publish,
    write: impl FnOnce(&mut BufWriter<File>) -> Result<()>,
) -> Result<bool> {
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::invalid("output path", "a path naming a file", path.display()))?
        .to_string_lossy()
        .into_owned();
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // Checked before any work so the error names the output, not a temporary file.
    if path.is_dir() {
        return Err(Error::invalid(
            "output path",
            "a file path",
            format!("directory {}", path.display()),
        ));
    }
    if !dir.is_dir() {
        let why = format!("cannot write here: no directory {}", dir.display());
        return Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, why),
        ));
    }
    let (tmp_path, file) = create_temp(&dir, &file_name, path)?;
    let mut guard = TempGuard {
        path: tmp_path,
        armed: true,
    };
    let mut out = BufWriter::new(file);
    write(&mut out)?;
    let file = out
        .into_inner()
        .map_err(|e| Error::io(&guard.path, e.into_error()))?;
    if durability == Durability::Synced {
        file.sync_all().map_err(|e| Error::io(&guard.path, e))?;
    }
    drop(file);
    if publish == Publish::CreateNew {
        // The guard still removes the temporary name: the link keeps the data.
        match std::fs::hard_link(&guard.path, path) {
            Ok(()) => return Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
            Err(_) if path.exists() => return Ok(false),
            Err(_) => {} // no hard links here: rename below
        }
    }
    std::fs::rename(&guard.path, path).map_err(|e| Error::io(path, e))?;
    guard.armed = false;
    Ok(true)
}

/// Creates a fresh temporary file `.NAME.tmp.PID.N` in `dir`, retrying past stale leftovers;
/// errors name the destination `path`.
fn create_temp(dir: &Path, file_name: &str, path: &Path) -> Result<(PathBuf, File)> {
    let pid = std::process::id();
    let mut last_err = None;
    for _ in 0..64 {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{file_name}.tmp.{pid}.{n}"));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last_err = Some(e),
            Err(e) => return Err(Error::io(path, e)),
        }
    }
    Err(Error::io(
        dir,
        last_err.unwrap_or_else(|| std::io::Error::other("could not create a temporary file")),
    ))
}
