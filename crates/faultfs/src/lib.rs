//! tidemark-faultfs: the fault layer under a store in the fault tests (issue "Proof under
//! faults"; docs/reliability.md, "Power loss and I/O errors"). It keeps, per file, what was
//! written since the file's last fsync, and [`power_loss`] throws that away as a power cut would.
//! Two front ends record into it: SQLite's fault VFS (`tidemark_store_sqlite::faultfs`, every
//! file tidemark keeps state in) and an `LD_PRELOAD` shim under the PostgreSQL server
//! (`crates/faultfs-preload`). This crate knows no store: it has no SQL and no libc.
//!
//! **The state folder** (named by [`ENV`] in a process on the layer) holds, for each tracked file,
//! an undo log (`<hash of the path>.undo`: a header with the file's path, then one record per
//! write or truncation since the last fsync, each with the bytes it overwrote, appended under the
//! log's lock *before* the change reaches the file), a marker (`<hash>.created`) while the file's
//! creation is not durable, and the control files of the I/O faults ([`FULL`], [`EIO_WRITE`],
//! [`EIO_FSYNC`]). Writes reach the real file at once, so processes sharing a file see each
//! other's writes as through the page cache.
//!
//! **What is durable.** An fsync of a file ([`UndoLog::synced`]) makes every write before it
//! durable. A created file's name is durable once its folder is fsynced ([`directory_synced`]);
//! a front end may also treat the file's own fsync as making its name durable ([`name_synced`]),
//! as ext4 and XFS do (PostgreSQL relies on it; SQLite's VFS keeps the strict rule). Renames and
//! removals are durable at once ([`renamed`], [`removed`]).
//!
//! **What the power loss keeps** of the writes not made durable is drawn by [`Writeback`]: none,
//! a prefix in the order they were made, or any subset (reordered), optionally torn at
//! [`SECTOR`] boundaries. Limits: folders are not tracked (a rename or removal is durable at
//! once); a file that was truncated since its last fsync loses its writes in order only (a
//! reordered draw keeps a prefix there); memory-mapped writes are not seen.

use std::fs::{File, OpenOptions};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// The environment variable that puts a process on the layer: the state folder's path.
pub const ENV: &str = "TIDEMARK_FAULTFS";
/// The control files of the state folder. While `full` exists, a write that would grow a file
/// fails as on a full disk (overwrites in place still succeed). Each control also has a form for
/// one process only, `<name>.<pid>` ([`process_control`]): the fault of a file system that fails
/// one machine's writes while another machine's still reach the same files.
pub const FULL: &str = "full";
/// While `eio-write` exists, every write of a tracked file fails with an I/O error.
pub const EIO_WRITE: &str = "eio-write";
/// While `eio-fsync` exists, every fsync of a tracked file fails with an I/O error.
pub const EIO_FSYNC: &str = "eio-fsync";
/// The unit a torn write is cut at: what a disk writes whole.
pub const SECTOR: u64 = 512;

/// First bytes of an undo log, then the tracked file's path (length, bytes).
const UNDO_MAGIC: &[u8; 8] = b"tmfsundo";
/// An undo record's header: kind, offset, length, file size before.
const RECORD_HEADER: usize = 1 + 8 + 8 + 8;
/// An undo record's kinds.
const RECORD_WRITE: u8 = 1;
const RECORD_TRUNCATE: u8 = 2;

/// A change to a tracked file, as its undo record names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// `length` bytes written at `offset`.
    Write {
        /// Where the write begins.
        offset: u64,
        /// How many bytes it writes.
        length: u64,
    },
    /// The file cut (or grown) to `size` bytes.
    Truncate {
        /// The new size.
        size: u64,
    },
}

impl Change {
    fn kind(self) -> u8 {
        match self {
            Change::Write { .. } => RECORD_WRITE,
            Change::Truncate { .. } => RECORD_TRUNCATE,
        }
    }

    /// The byte range of a file of `size_before` bytes that the change touches, as
    /// `(offset, length)`: a write's own range, or what a truncation cuts off.
    fn range(self, size_before: u64) -> (u64, u64) {
        match self {
            Change::Write { offset, length } => (offset, length),
            Change::Truncate { size } => (size, size_before.saturating_sub(size)),
        }
    }

    /// The bytes of a file of `size_before` bytes that the change overwrites or cuts off, as
    /// `(offset, length)`: what the front end reads and hands to [`UndoLog::record`].
    pub fn overwritten(self, size_before: u64) -> (u64, u64) {
        let (offset, length) = self.range(size_before);
        (offset, size_before.saturating_sub(offset).min(length))
    }
}

/// The file name (in the state folder) that belongs to `path`, with `suffix`.
fn state_file(state: &Path, path: &Path, suffix: &str) -> PathBuf {
    let mut hasher = DefaultHasher::new();
    path.as_os_str().as_bytes().hash(&mut hasher);
    state.join(format!("{:016x}.{suffix}", hasher.finish()))
}

/// An undo log's header for the tracked file `path`: magic, path length, path.
fn header(path: &Path) -> Vec<u8> {
    let bytes = path.as_os_str().as_bytes();
    let mut header = Vec::with_capacity(16 + bytes.len());
    header.extend_from_slice(UNDO_MAGIC);
    header.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    header.extend_from_slice(bytes);
    header
}

/// Whether the control file `name` exists in `state`, for every process or for this one (the
/// fault it names is on here).
pub fn control(state: &Path, name: &str) -> bool {
    state.join(name).exists() || state.join(process_control(name, std::process::id())).exists()
}

/// The file name of control `name` for process `pid` only.
pub fn process_control(name: &str, pid: u32) -> String {
    format!("{name}.{pid}")
}

/// A handle on one tracked file's undo log. Each process (or connection) that changes the file
/// holds its own; [`UndoLog::lock`] makes a record and its change, or an fsync and the log's
/// reset, one step for all of them.
#[derive(Debug)]
pub struct UndoLog {
    file: File,
}

impl UndoLog {
    /// Open the undo log of `path` (writing its header when it is new); when `created`, mark the
    /// file's creation as not durable until its name is synced.
    pub fn open(state: &Path, path: &Path, created: bool) -> std::io::Result<UndoLog> {
        let mut file = OpenOptions::new().create(true).append(true).read(true).open(state_file(state, path, "undo"))?;
        file.lock()?;
        let written = (|| -> std::io::Result<()> {
            if file.metadata()?.len() == 0 {
                file.write_all(&header(path))?;
            }
            Ok(())
        })();
        file.unlock()?;
        written?;
        if created {
            std::fs::write(state_file(state, path, "created"), path.as_os_str().as_bytes())?;
        }
        Ok(UndoLog { file })
    }

    /// Take the log's lock (across processes), before a record and its change.
    pub fn lock(&self) -> std::io::Result<()> {
        self.file.lock()
    }

    /// Release the lock taken by [`UndoLog::lock`].
    pub fn unlock(&self) -> std::io::Result<()> {
        self.file.unlock()
    }

    /// Append the undo record of `change` to a file of `size_before` bytes; `old` holds the bytes
    /// [`Change::overwritten`] names. Called under the lock, before the change is made.
    pub fn record(&mut self, change: Change, size_before: u64, old: &[u8]) -> std::io::Result<()> {
        let (offset, length) = change.range(size_before);
        debug_assert_eq!(change.overwritten(size_before).1, old.len() as u64);
        let mut entry = Vec::with_capacity(RECORD_HEADER + old.len());
        entry.push(change.kind());
        for value in [offset, length, size_before] {
            entry.extend_from_slice(&value.to_le_bytes());
        }
        entry.extend_from_slice(old);
        self.file.write_all(&entry)
    }

    /// The file was fsynced: everything recorded is durable, the log keeps only its header.
    /// Called under the lock, after the fsync succeeded.
    pub fn synced(&mut self) -> std::io::Result<()> {
        let mut head = [0_u8; 16];
        self.file.read_exact_at(&mut head, 0)?;
        self.file.set_len(16 + u64::from_le_bytes(head[8..16].try_into().expect("8 bytes")))
    }
}

/// `path`'s own fsync made its name durable (ext4 and XFS; see the crate's documentation).
pub fn name_synced(state: &Path, path: &Path) {
    let _ = std::fs::remove_file(state_file(state, path, "created"));
}

/// `dir` was fsynced: the files created in it are durable.
pub fn directory_synced(state: &Path, dir: &Path) {
    let Ok(entries) = std::fs::read_dir(state) else { return };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    for marker in entries.flatten().map(|e| e.path()) {
        if marker.extension().is_some_and(|e| e == "created") {
            let Ok(target) = std::fs::read(&marker) else { continue };
            let target = PathBuf::from(std::ffi::OsStr::from_bytes(&target));
            let parent = target.parent().map(|p| p.canonicalize().unwrap_or_else(|_| p.to_path_buf()));
            if parent.as_deref() == Some(dir.as_path()) {
                let _ = std::fs::remove_file(&marker);
            }
        }
    }
}

/// Every tracked file was synced (`syncfs`): nothing is pending.
pub fn all_synced(state: &Path) -> std::io::Result<()> {
    for path in std::fs::read_dir(state)?.flatten().map(|e| e.path()) {
        match path.extension().and_then(|e| e.to_str()) {
            Some("undo") => UndoLog { file: OpenOptions::new().read(true).write(true).open(&path)? }.synced()?,
            Some("created") => std::fs::remove_file(&path)?,
            _ => {}
        }
    }
    Ok(())
}

/// `path` was removed (durable at once): its log and marker go.
pub fn removed(state: &Path, path: &Path) {
    let _ = std::fs::remove_file(state_file(state, path, "undo"));
    let _ = std::fs::remove_file(state_file(state, path, "created"));
}

/// `from` was renamed to `to` (durable at once, replacing what `to` was): `from`'s pending writes
/// and creation now belong to `to`. The log's file is renamed, not copied, so the handles already
/// open on it (held by whoever has the file open) keep recording into it.
pub fn renamed(state: &Path, from: &Path, to: &Path) -> std::io::Result<()> {
    removed(state, to);
    let new_log = state_file(state, to, "undo");
    if std::fs::rename(state_file(state, from, "undo"), &new_log).is_ok() {
        // The path in the header, rewritten in place under the lock.
        let log = UndoLog { file: OpenOptions::new().read(true).write(true).open(&new_log)? };
        log.lock()?;
        let rewritten = (|| {
            let mut bytes = Vec::new();
            (&log.file).read_to_end(&mut bytes)?;
            let name_len = bytes.get(8..16).map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize);
            let mut content = header(to);
            content.extend_from_slice(bytes.get(16 + name_len..).unwrap_or_default());
            log.file.set_len(0)?;
            log.file.write_all_at(&content, 0)
        })();
        log.unlock()?;
        rewritten?;
    }
    if std::fs::rename(state_file(state, from, "created"), state_file(state, to, "created")).is_ok() {
        std::fs::write(state_file(state, to, "created"), to.as_os_str().as_bytes())?;
    }
    Ok(())
}

/// What reached the disk of the writes not made durable before a [`power_loss`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Writeback {
    /// None of them: every write since a file's last fsync is lost.
    Nothing,
    /// In each file, the first k of them in the order they were made, k drawn from 0..=n with
    /// this seed (per file, independently).
    Prefix(u64),
    /// In each file, each of them kept or lost on its own (a disk that reorders its queue), with
    /// this seed; when `torn`, each [`SECTOR`] of a write on its own (a write cut mid-way). A file
    /// truncated since its last fsync keeps a prefix instead.
    Reordered {
        /// The draw's seed.
        seed: u64,
        /// Whether a write may be kept in part, sector by sector.
        torn: bool,
    },
}

/// What a [`power_loss`] threw away.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PowerLossReport {
    /// Tracked files that had writes not made durable.
    pub files_with_unsynced_writes: u64,
    /// Writes and truncations undone whole.
    pub writes_lost: u64,
    /// Writes and truncations kept whole (they reached the disk before the loss).
    pub writes_kept: u64,
    /// Writes kept in part: some of their sectors reached the disk, others not.
    pub writes_torn: u64,
    /// Files removed because their creation was never made durable.
    pub files_removed: u64,
}

/// One undo record as read back.
#[derive(Debug)]
struct UndoRecord {
    kind: u8,
    offset: u64,
    length: u64,
    size_before: u64,
    old: Vec<u8>,
}

/// An undo log as read back: the tracked file and its records, oldest first. A log cut short by
/// the kill ends at its last whole record: each record is whole before the change it protects
/// begins (under the log's lock), so a cut record's change never happened. `None` for a log cut
/// inside its header (nothing was ever recorded in it).
fn read_undo(path: &Path) -> std::io::Result<Option<(PathBuf, Vec<UndoRecord>)>> {
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    if bytes.len() >= UNDO_MAGIC.len() && &bytes[..UNDO_MAGIC.len()] != UNDO_MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: not an undo log", path.display()),
        ));
    }
    let Some(name_len) = bytes.get(8..16).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize) else {
        return Ok(None);
    };
    let Some(target) = bytes.get(16..16 + name_len) else { return Ok(None) };
    let target = PathBuf::from(std::ffi::OsStr::from_bytes(target));
    let mut records = Vec::new();
    let mut at = 16 + name_len;
    while let Some(head) = bytes.get(at..at + RECORD_HEADER) {
        let field = |i: usize| u64::from_le_bytes(head[i..i + 8].try_into().expect("8 bytes"));
        let (offset, length, size_before) = (field(1), field(9), field(17));
        let kept = size_before.saturating_sub(offset).min(length) as usize;
        let Some(old) = bytes.get(at + RECORD_HEADER..at + RECORD_HEADER + kept) else { break };
        records.push(UndoRecord { kind: head[0], offset, length, size_before, old: old.to_vec() });
        at += RECORD_HEADER + kept;
    }
    Ok(Some((target, records)))
}

/// Throw away what was not made durable in the files tracked under `state` (see the crate's
/// documentation). Every process that had them open must be dead, as after a power loss; the
/// state folder is left clean, ready for the processes to start again on the layer.
pub fn power_loss(state: &Path, writeback: Writeback) -> std::io::Result<PowerLossReport> {
    let mut report = PowerLossReport::default();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(state)?.flatten().map(|e| e.path()).collect();
    entries.sort();
    let mut draw = SplitMix(match writeback {
        Writeback::Nothing => 0,
        Writeback::Prefix(seed) | Writeback::Reordered { seed, .. } => seed ^ 0x9e37_79b9_7f4a_7c15,
    });
    for undo_path in entries.iter().filter(|p| p.extension().is_some_and(|e| e == "undo")) {
        let (target, records) = read_undo(undo_path)?.unwrap_or_default();
        if !records.is_empty() {
            report.files_with_unsynced_writes += 1;
            let truncated = records.iter().any(|r| r.kind == RECORD_TRUNCATE);
            match writeback {
                Writeback::Reordered { torn, .. } if !truncated => {
                    reordered(&target, &records, torn, &mut draw, &mut report)?
                }
                Writeback::Nothing => prefix(&target, &records, 0, &mut report)?,
                _ => {
                    let kept = (draw.next() % (records.len() as u64 + 1)) as usize;
                    prefix(&target, &records, kept, &mut report)?
                }
            }
        }
        std::fs::remove_file(undo_path)?;
    }
    for marker in entries.iter().filter(|p| p.extension().is_some_and(|e| e == "created")) {
        let target = PathBuf::from(std::ffi::OsStr::from_bytes(&std::fs::read(marker)?));
        if target.exists() {
            std::fs::remove_file(&target)?;
            report.files_removed += 1;
        }
        std::fs::remove_file(marker)?;
    }
    Ok(report)
}

/// Keep the first `kept` records of `target`, undo the rest, newest first.
fn prefix(target: &Path, records: &[UndoRecord], kept: usize, report: &mut PowerLossReport) -> std::io::Result<()> {
    report.writes_kept += kept as u64;
    report.writes_lost += (records.len() - kept) as u64;
    if !target.exists() {
        return Ok(());
    }
    let file = OpenOptions::new().write(true).open(target)?;
    for undone in records[kept..].iter().rev() {
        if undone.kind == RECORD_WRITE {
            file.write_all_at(&undone.old, undone.offset)?;
            file.set_len(undone.size_before)?;
        } else {
            file.set_len(undone.size_before)?;
            file.write_all_at(&undone.old, undone.offset)?;
        }
    }
    file.sync_all()
}

/// Keep each write of `target` (or, when `torn`, each sector of it) on its own draw. A byte ends
/// with the value of the newest kept write that covers it, or, when none does, its value at the
/// last fsync: undoing the lost writes newest first, a byte stops being undone at the first kept
/// write met. The file keeps its size at the last fsync, grown to the end of the kept writes.
fn reordered(
    target: &Path,
    records: &[UndoRecord],
    torn: bool,
    draw: &mut SplitMix,
    report: &mut PowerLossReport,
) -> std::io::Result<()> {
    let file = if target.exists() { Some(OpenOptions::new().write(true).open(target)?) } else { None };
    let mut size = records[0].size_before;
    // Ranges no older write may undo any more, as (start, end), unordered and disjoint.
    let mut kept_ranges: Vec<(u64, u64)> = Vec::new();
    for record in records.iter().rev() {
        let pieces = pieces(record.offset, record.length, torn);
        let kept: Vec<bool> = pieces.iter().map(|_| draw.next() % 2 == 1).collect();
        match (kept.iter().all(|k| *k), kept.iter().any(|k| *k)) {
            (true, _) => report.writes_kept += 1,
            (false, true) => report.writes_torn += 1,
            (false, false) => report.writes_lost += 1,
        }
        for ((start, end), keep) in pieces.into_iter().zip(kept) {
            if keep {
                size = size.max(end);
                kept_ranges.push((start, end));
                continue;
            }
            let Some(file) = &file else { continue };
            for (from, to) in uncovered(start, end, &kept_ranges) {
                // The bytes before this write; past the file's end then, zeros (a hole).
                let mut old = vec![0_u8; (to - from) as usize];
                let known = record.old.len() as u64 + record.offset;
                if from < known {
                    let n = (known.min(to) - from) as usize;
                    let at = (from - record.offset) as usize;
                    old[..n].copy_from_slice(&record.old[at..at + n]);
                }
                file.write_all_at(&old, from)?;
            }
        }
    }
    if let Some(file) = file {
        file.set_len(size)?;
        file.sync_all()?;
    }
    Ok(())
}

/// A write's byte range, whole or cut at sector boundaries.
fn pieces(offset: u64, length: u64, torn: bool) -> Vec<(u64, u64)> {
    let end = offset + length;
    if !torn || length == 0 {
        return vec![(offset, end)];
    }
    let mut pieces = Vec::new();
    let mut start = offset;
    while start < end {
        let next = ((start / SECTOR) + 1) * SECTOR;
        pieces.push((start, next.min(end)));
        start = next;
    }
    pieces
}

/// The parts of `[start, end)` outside every range of `covered`.
fn uncovered(start: u64, end: u64, covered: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut parts = vec![(start, end)];
    for &(c_start, c_end) in covered {
        parts = parts
            .into_iter()
            .flat_map(|(s, e)| {
                if c_end <= s || e <= c_start {
                    vec![(s, e)]
                } else {
                    [(s, c_start.max(s)), (c_end.min(e), e)].into_iter().filter(|(a, b)| a < b).collect()
                }
            })
            .collect();
    }
    parts
}

/// SplitMix64: a reproducible draw in a few lines.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests;
