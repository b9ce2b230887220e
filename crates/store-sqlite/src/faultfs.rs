//! A SQLite VFS that keeps what was made durable and can throw the rest away: simulated power
//! loss and injected I/O errors for the fault tests (issue "Proof under faults"; see
//! docs/reliability.md, "Power loss and I/O errors"). Compiled in only with the `failpoints`
//! cargo feature, and active only in a process started with `TIDEMARK_FAULTFS=<state folder>`.
//!
//! **How.** The VFS wraps the platform's default VFS and becomes the process's default, so every
//! file tidemark opens goes through it. Writes reach the real file at once, so processes sharing a
//! file see each other's writes as they would through the page cache, but before each write (and
//! each truncation) of a database, WAL or journal file the bytes it overwrites are appended to an
//! undo log for that file in the state folder. `xSync` (fsync) empties the file's undo log: what
//! it covered is durable. A file created through the VFS is marked as not durable until its
//! folder is fsynced: SQLite does that itself with the first fsync of a WAL or journal it opens
//! to create; the creator of a database file fsyncs the folder and says so with
//! [`directory_synced`] (tidemark's `connect` does both after it creates a file).
//!
//! [`power_loss`], called while no process has the files open (every one of them killed with
//! SIGKILL), then reverts what was not made durable: in each file, a suffix of the writes since
//! its last fsync, newest first, and it removes the files whose creation was never made durable.
//! [`Writeback::Nothing`] loses every unsynced write; [`Writeback::Prefix`] keeps a random prefix
//! of them per file (a disk that wrote some of its queue back, in order, before the power went).
//!
//! **Limits** (stated in docs/reliability.md): a write is lost or kept whole (no torn sectors);
//! within a file, unsynced writes reach the disk in the order they were made (no reordering inside
//! a file, but files are independent of each other); the `-shm` wal-index is shared memory and not
//! tracked (SQLite rebuilds it from the WAL when the first connection opens after the loss);
//! deleting and renaming are durable at once; folders are not tracked. Only SQLite's files are
//! covered, which is every file tidemark keeps state in.
//!
//! **I/O errors.** While the state folder holds a file named `full`, a write that would grow a
//! file fails with `SQLITE_FULL` (a full disk: overwrites in place still succeed); `eio-write`
//! fails every write with `SQLITE_IOERR_WRITE` and `eio-fsync` every fsync with
//! `SQLITE_IOERR_FSYNC`. Removing the file ends the fault.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fs::{File, OpenOptions};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rusqlite::ffi;
use serde::Serialize;
use tidemark_core::{Error, Result};

/// The environment variable that turns the VFS on in a process: the state folder's path.
pub const ENV: &str = "TIDEMARK_FAULTFS";
/// The VFS's registered name.
const VFS_NAME: &CStr = c"tidemark-faultfs";
/// The control files of the state folder (I/O errors while they exist).
pub const FULL: &str = "full";
/// See [`FULL`].
pub const EIO_WRITE: &str = "eio-write";
/// See [`FULL`].
pub const EIO_FSYNC: &str = "eio-fsync";

/// First bytes of an undo log, then the tracked file's path (length, bytes).
const UNDO_MAGIC: &[u8; 8] = b"tmfsundo";
/// An undo record's kinds.
const RECORD_WRITE: u8 = 1;
const RECORD_TRUNCATE: u8 = 2;
/// An undo record's header: kind, offset, length, file size before.
const RECORD_HEADER: usize = 1 + 8 + 8 + 8;

/// The state folder of this process's VFS, once installed.
static STATE: OnceLock<PathBuf> = OnceLock::new();
/// The wrapped VFS (the platform's default), as an address.
static BASE: OnceLock<usize> = OnceLock::new();

/// Register the VFS as the default if `TIDEMARK_FAULTFS` names a folder (created if needed).
/// Called once, before the first connection tidemark opens; a second call changes nothing.
pub(crate) fn install_from_env() {
    let Some(dir) = std::env::var_os(ENV).filter(|v| !v.is_empty()) else { return };
    let dir = PathBuf::from(dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        // A fault test that asked for the VFS must not run without it.
        panic!("{ENV}={}: cannot create the state folder: {e}", dir.display());
    }
    let dir = dir.canonicalize().unwrap_or(dir);
    if STATE.set(dir).is_err() {
        return;
    }
    // SAFETY: the default VFS lives as long as the library; the registered copy is leaked and so
    // lives as long as the process. Both calls are thread-safe.
    unsafe {
        let base = ffi::sqlite3_vfs_find(std::ptr::null());
        assert!(!base.is_null(), "SQLite has no default VFS");
        BASE.set(base as usize).ok();
        let mut vfs = *base;
        vfs.zName = VFS_NAME.as_ptr();
        vfs.szOsFile = (file_header_size() + (*base).szOsFile as usize) as c_int;
        vfs.pNext = std::ptr::null_mut();
        vfs.xOpen = Some(fault_open);
        vfs.xDelete = Some(fault_delete);
        let rc = ffi::sqlite3_vfs_register(Box::into_raw(Box::new(vfs)), 1);
        assert_eq!(rc, ffi::SQLITE_OK, "cannot register the fault VFS");
    }
}

/// Whether this process runs on the VFS.
pub fn active() -> bool {
    STATE.get().is_some()
}

fn base_vfs() -> *mut ffi::sqlite3_vfs {
    *BASE.get().expect("the fault VFS is installed") as *mut ffi::sqlite3_vfs
}

/// The file name (in the state folder) that belongs to `path`, with `suffix`.
fn state_file(state: &Path, path: &Path, suffix: &str) -> PathBuf {
    let mut hasher = DefaultHasher::new();
    path.as_os_str().as_bytes().hash(&mut hasher);
    state.join(format!("{:016x}.{suffix}", hasher.finish()))
}

/// Record that `dir`'s entries were fsynced by its owner: the files created in it are durable.
/// tidemark calls it after it fsynced the folder of a database file it created.
pub fn directory_synced(dir: &Path) {
    let Some(state) = STATE.get() else { return };
    let Ok(entries) = std::fs::read_dir(state) else { return };
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    for entry in entries.flatten() {
        let marker = entry.path();
        if marker.extension().is_some_and(|e| e == "created") {
            if let Ok(target) = std::fs::read(&marker) {
                let target = PathBuf::from(std::ffi::OsStr::from_bytes(&target));
                let parent = target.parent().map(|p| p.canonicalize().unwrap_or_else(|_| p.to_path_buf()));
                if parent.as_deref() == Some(dir.as_path()) {
                    let _ = std::fs::remove_file(&marker);
                }
            }
        }
    }
}

/// The VFS's file: its own methods, then the wrapped VFS's file in the same allocation.
#[repr(C)]
struct FaultFile {
    methods: *const ffi::sqlite3_io_methods,
    /// `None` for a file that is not tracked (temporary files).
    tracked: *mut Tracked,
}

/// What the VFS keeps of an open tracked file.
struct Tracked {
    /// This connection's handle on the file's undo log (append-only; locked around each write
    /// and fsync, so that a record and its write, or an fsync and the log's reset, are one step
    /// for every process and connection on the file).
    undo: File,
    /// The tracked file's folder while its first fsync is still to come, for a WAL or journal
    /// opened to be created: SQLite's unix VFS fsyncs that folder with the file's first fsync,
    /// which makes every entry of the folder durable (the database file's too).
    directory_sync_pending: Option<PathBuf>,
}

fn file_header_size() -> usize {
    std::mem::size_of::<FaultFile>().next_multiple_of(16)
}

/// The wrapped VFS's file of `file`.
unsafe fn real(file: *mut ffi::sqlite3_file) -> *mut ffi::sqlite3_file {
    (file as *mut u8).add(file_header_size()) as *mut ffi::sqlite3_file
}

unsafe fn real_methods(file: *mut ffi::sqlite3_file) -> &'static ffi::sqlite3_io_methods {
    &*(*real(file)).pMethods
}

unsafe fn tracked<'a>(file: *mut ffi::sqlite3_file) -> Option<&'a mut Tracked> {
    (*(file as *mut FaultFile)).tracked.as_mut()
}

fn control(name: &str) -> bool {
    STATE.get().is_some_and(|state| state.join(name).exists())
}

static METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    // Version 2: shared memory, but no xFetch (memory-mapped reads would bypass nothing here,
    // but tidemark never enables them, and the undo log needs every write to pass through).
    iVersion: 2,
    xClose: Some(fault_close),
    xRead: Some(fault_read),
    xWrite: Some(fault_write),
    xTruncate: Some(fault_truncate),
    xSync: Some(fault_sync),
    xFileSize: Some(fault_file_size),
    xLock: Some(fault_lock),
    xUnlock: Some(fault_unlock),
    xCheckReservedLock: Some(fault_check_reserved_lock),
    xFileControl: Some(fault_file_control),
    xSectorSize: Some(fault_sector_size),
    xDeviceCharacteristics: Some(fault_device_characteristics),
    xShmMap: Some(fault_shm_map),
    xShmLock: Some(fault_shm_lock),
    xShmBarrier: Some(fault_shm_barrier),
    xShmUnmap: Some(fault_shm_unmap),
    xFetch: None,
    xUnfetch: None,
};

unsafe extern "C" fn fault_open(
    _vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let own = file as *mut FaultFile;
    std::ptr::write(own, FaultFile { methods: std::ptr::null(), tracked: std::ptr::null_mut() });
    let kinds = ffi::SQLITE_OPEN_MAIN_DB
        | ffi::SQLITE_OPEN_WAL
        | ffi::SQLITE_OPEN_MAIN_JOURNAL
        | ffi::SQLITE_OPEN_SUPER_JOURNAL;
    let path = (!name.is_null() && flags & kinds != 0)
        .then(|| PathBuf::from(std::ffi::OsStr::from_bytes(CStr::from_ptr(name).to_bytes())));
    let existed = path.as_ref().is_some_and(|p| p.exists());
    let base = base_vfs();
    let rc = ((*base).xOpen.expect("xOpen"))(base, name, real(file), flags, out_flags);
    if rc != ffi::SQLITE_OK {
        // The wrapped file is closed by its VFS when it set its methods.
        if !(*real(file)).pMethods.is_null() {
            (real_methods(file).xClose.expect("xClose"))(real(file));
        }
        return rc;
    }
    if let Some(path) = path {
        let journal =
            flags & (ffi::SQLITE_OPEN_WAL | ffi::SQLITE_OPEN_MAIN_JOURNAL | ffi::SQLITE_OPEN_SUPER_JOURNAL) != 0;
        let syncs_directory = journal && flags & ffi::SQLITE_OPEN_CREATE != 0;
        match track(&path, !existed, syncs_directory) {
            Ok(t) => (*own).tracked = Box::into_raw(Box::new(t)),
            Err(_) => {
                (real_methods(file).xClose.expect("xClose"))(real(file));
                return ffi::SQLITE_CANTOPEN;
            }
        }
    }
    (*own).methods = &METHODS;
    ffi::SQLITE_OK
}

/// Open `path`'s undo log (writing its header when new) and mark its creation when `created`.
fn track(path: &Path, created: bool, syncs_directory: bool) -> std::io::Result<Tracked> {
    let state = STATE.get().expect("installed");
    let undo_path = state_file(state, path, "undo");
    let mut undo = OpenOptions::new().create(true).append(true).read(true).open(&undo_path)?;
    undo.lock()?;
    if undo.metadata()?.len() == 0 {
        let bytes = path.as_os_str().as_bytes();
        let mut header = Vec::with_capacity(16 + bytes.len());
        header.extend_from_slice(UNDO_MAGIC);
        header.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        header.extend_from_slice(bytes);
        undo.write_all(&header)?;
    }
    undo.unlock()?;
    if created {
        std::fs::write(state_file(state, path, "created"), path.as_os_str().as_bytes())?;
    }
    let directory_sync_pending = syncs_directory.then(|| path.parent().map(Path::to_path_buf)).flatten();
    Ok(Tracked { undo, directory_sync_pending })
}

/// The length of an undo log's header (magic, path length, path).
fn header_len(undo: &File) -> std::io::Result<u64> {
    let mut head = [0_u8; 16];
    undo.read_exact_at(&mut head, 0)?;
    Ok(16 + u64::from_le_bytes(head[8..16].try_into().expect("8 bytes")))
}

unsafe extern "C" fn fault_delete(_vfs: *mut ffi::sqlite3_vfs, name: *const c_char, sync_dir: c_int) -> c_int {
    let base = base_vfs();
    let rc = ((*base).xDelete.expect("xDelete"))(base, name, sync_dir);
    if rc == ffi::SQLITE_OK && !name.is_null() {
        if let Some(state) = STATE.get() {
            let path = PathBuf::from(std::ffi::OsStr::from_bytes(CStr::from_ptr(name).to_bytes()));
            let _ = std::fs::remove_file(state_file(state, &path, "undo"));
            let _ = std::fs::remove_file(state_file(state, &path, "created"));
        }
    }
    rc
}

unsafe extern "C" fn fault_close(file: *mut ffi::sqlite3_file) -> c_int {
    let rc = (real_methods(file).xClose.expect("xClose"))(real(file));
    let own = file as *mut FaultFile;
    if !(*own).tracked.is_null() {
        drop(Box::from_raw((*own).tracked));
        (*own).tracked = std::ptr::null_mut();
    }
    rc
}

unsafe extern "C" fn fault_read(file: *mut ffi::sqlite3_file, buf: *mut c_void, amount: c_int, offset: i64) -> c_int {
    (real_methods(file).xRead.expect("xRead"))(real(file), buf, amount, offset)
}

/// The wrapped file's size.
unsafe fn real_size(file: *mut ffi::sqlite3_file) -> std::result::Result<i64, c_int> {
    let mut size: i64 = 0;
    let rc = (real_methods(file).xFileSize.expect("xFileSize"))(real(file), &mut size);
    if rc == ffi::SQLITE_OK {
        Ok(size)
    } else {
        Err(rc)
    }
}

/// Append an undo record for the bytes `[offset, offset + length)` of a file of `size` bytes
/// about to change (their current content, the part below `size`).
unsafe fn record(
    file: *mut ffi::sqlite3_file,
    undo: &mut File,
    kind: u8,
    offset: i64,
    length: i64,
    size: i64,
) -> std::result::Result<(), c_int> {
    let kept = (size - offset).clamp(0, length.max(0)) as usize;
    let mut entry = vec![0_u8; RECORD_HEADER + kept];
    entry[0] = kind;
    entry[1..9].copy_from_slice(&(offset as u64).to_le_bytes());
    entry[9..17].copy_from_slice(&(length as u64).to_le_bytes());
    entry[17..25].copy_from_slice(&(size as u64).to_le_bytes());
    if kept > 0 {
        let rc = (real_methods(file).xRead.expect("xRead"))(
            real(file),
            entry[RECORD_HEADER..].as_mut_ptr() as *mut c_void,
            kept as c_int,
            offset,
        );
        if rc != ffi::SQLITE_OK {
            return Err(rc);
        }
    }
    undo.write_all(&entry).map_err(|_| ffi::SQLITE_IOERR_WRITE)
}

unsafe extern "C" fn fault_write(
    file: *mut ffi::sqlite3_file,
    buf: *const c_void,
    amount: c_int,
    offset: i64,
) -> c_int {
    let write = real_methods(file).xWrite.expect("xWrite");
    let Some(t) = tracked(file) else { return write(real(file), buf, amount, offset) };
    if control(EIO_WRITE) {
        return ffi::SQLITE_IOERR_WRITE;
    }
    if t.undo.lock().is_err() {
        return ffi::SQLITE_IOERR_LOCK;
    }
    let rc = match real_size(file) {
        Err(rc) => rc,
        Ok(size) if offset + i64::from(amount) > size && control(FULL) => ffi::SQLITE_FULL,
        Ok(size) => match record(file, &mut t.undo, RECORD_WRITE, offset, i64::from(amount), size) {
            Ok(()) => write(real(file), buf, amount, offset),
            Err(rc) => rc,
        },
    };
    let _ = t.undo.unlock();
    rc
}

unsafe extern "C" fn fault_truncate(file: *mut ffi::sqlite3_file, size: i64) -> c_int {
    let truncate = real_methods(file).xTruncate.expect("xTruncate");
    let Some(t) = tracked(file) else { return truncate(real(file), size) };
    if t.undo.lock().is_err() {
        return ffi::SQLITE_IOERR_LOCK;
    }
    let rc = match real_size(file) {
        Err(rc) => rc,
        Ok(old) => match record(file, &mut t.undo, RECORD_TRUNCATE, size, (old - size).max(0), old) {
            Ok(()) => truncate(real(file), size),
            Err(rc) => rc,
        },
    };
    let _ = t.undo.unlock();
    rc
}

unsafe extern "C" fn fault_sync(file: *mut ffi::sqlite3_file, flags: c_int) -> c_int {
    let sync = real_methods(file).xSync.expect("xSync");
    let Some(t) = tracked(file) else { return sync(real(file), flags) };
    if control(EIO_FSYNC) {
        return ffi::SQLITE_IOERR_FSYNC;
    }
    if t.undo.lock().is_err() {
        return ffi::SQLITE_IOERR_LOCK;
    }
    let mut rc = sync(real(file), flags);
    if rc == ffi::SQLITE_OK {
        // Everything written before this fsync is durable: the log keeps only its header.
        rc = match header_len(&t.undo).and_then(|len| t.undo.set_len(len)) {
            Ok(()) => ffi::SQLITE_OK,
            Err(_) => ffi::SQLITE_IOERR_FSYNC,
        };
        if let Some(dir) = t.directory_sync_pending.take() {
            directory_synced(&dir);
        }
    }
    let _ = t.undo.unlock();
    rc
}

unsafe extern "C" fn fault_file_size(file: *mut ffi::sqlite3_file, size: *mut i64) -> c_int {
    (real_methods(file).xFileSize.expect("xFileSize"))(real(file), size)
}

unsafe extern "C" fn fault_lock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    (real_methods(file).xLock.expect("xLock"))(real(file), level)
}

unsafe extern "C" fn fault_unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    (real_methods(file).xUnlock.expect("xUnlock"))(real(file), level)
}

unsafe extern "C" fn fault_check_reserved_lock(file: *mut ffi::sqlite3_file, out: *mut c_int) -> c_int {
    (real_methods(file).xCheckReservedLock.expect("xCheckReservedLock"))(real(file), out)
}

unsafe extern "C" fn fault_file_control(file: *mut ffi::sqlite3_file, op: c_int, arg: *mut c_void) -> c_int {
    (real_methods(file).xFileControl.expect("xFileControl"))(real(file), op, arg)
}

unsafe extern "C" fn fault_sector_size(file: *mut ffi::sqlite3_file) -> c_int {
    (real_methods(file).xSectorSize.expect("xSectorSize"))(real(file))
}

unsafe extern "C" fn fault_device_characteristics(file: *mut ffi::sqlite3_file) -> c_int {
    (real_methods(file).xDeviceCharacteristics.expect("xDeviceCharacteristics"))(real(file))
}

unsafe extern "C" fn fault_shm_map(
    file: *mut ffi::sqlite3_file,
    page: c_int,
    page_size: c_int,
    extend: c_int,
    out: *mut *mut c_void,
) -> c_int {
    (real_methods(file).xShmMap.expect("xShmMap"))(real(file), page, page_size, extend, out)
}

unsafe extern "C" fn fault_shm_lock(file: *mut ffi::sqlite3_file, offset: c_int, n: c_int, flags: c_int) -> c_int {
    (real_methods(file).xShmLock.expect("xShmLock"))(real(file), offset, n, flags)
}

unsafe extern "C" fn fault_shm_barrier(file: *mut ffi::sqlite3_file) {
    (real_methods(file).xShmBarrier.expect("xShmBarrier"))(real(file))
}

unsafe extern "C" fn fault_shm_unmap(file: *mut ffi::sqlite3_file, delete: c_int) -> c_int {
    (real_methods(file).xShmUnmap.expect("xShmUnmap"))(real(file), delete)
}

/// What reached the disk of the writes not made durable before a [`power_loss`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writeback {
    /// None of them: every write since a file's last fsync is lost.
    Nothing,
    /// In each file, the first k of them in the order they were made, k drawn from 0..=n with
    /// this seed (per file, independently).
    Prefix(u64),
}

/// What a [`power_loss`] threw away.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PowerLossReport {
    /// Tracked files that had writes not made durable.
    pub files_with_unsynced_writes: u64,
    /// Writes and truncations undone.
    pub writes_lost: u64,
    /// Writes and truncations kept (reached the disk before the loss).
    pub writes_kept: u64,
    /// Files removed because their creation was never made durable.
    pub files_removed: u64,
}

/// One undo record as read back.
struct UndoRecord {
    kind: u8,
    offset: u64,
    length: u64,
    size_before: u64,
    old: Vec<u8>,
}

/// An undo log as read back: the tracked file and its records, oldest first. A log cut short
/// by the kill (a process dies inside the `write` that appends a record, or that writes the
/// header of a log it just created) ends at its last whole record: each record is whole before
/// the write it protects begins (under the log's lock), so a cut record's write never happened.
/// `None` for a log cut inside its header (no write was ever recorded in it).
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

/// Throw away what was not made durable in the files tracked under `state` (see the module's
/// documentation). Every process that had them open must be dead (SIGKILL), as after a power
/// loss; the state folder is left clean, ready for the processes to start again on the VFS.
pub fn power_loss(state: &Path, writeback: Writeback) -> Result<PowerLossReport> {
    let io = |e: std::io::Error| Error::io(format!("power loss in {}: {e}", state.display()));
    let mut report = PowerLossReport::default();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(state).map_err(io)?.flatten().map(|e| e.path()).collect();
    entries.sort();
    let mut rng_state = match writeback {
        Writeback::Nothing => 0,
        Writeback::Prefix(seed) => seed ^ 0x9e37_79b9_7f4a_7c15,
    };
    for undo_path in entries.iter().filter(|p| p.extension().is_some_and(|e| e == "undo")) {
        let (target, records) = read_undo(undo_path).map_err(io)?.unwrap_or_default();
        if !records.is_empty() {
            report.files_with_unsynced_writes += 1;
            let kept = match writeback {
                Writeback::Nothing => 0,
                Writeback::Prefix(_) => (split_mix(&mut rng_state) % (records.len() as u64 + 1)) as usize,
            };
            report.writes_kept += kept as u64;
            report.writes_lost += (records.len() - kept) as u64;
            if target.exists() {
                let file = OpenOptions::new().write(true).open(&target).map_err(io)?;
                for undone in records[kept..].iter().rev() {
                    match undone.kind {
                        RECORD_WRITE => {
                            file.write_all_at(&undone.old, undone.offset).map_err(io)?;
                            file.set_len(undone.size_before).map_err(io)?;
                        }
                        RECORD_TRUNCATE => {
                            file.set_len(undone.size_before).map_err(io)?;
                            file.write_all_at(&undone.old, undone.offset).map_err(io)?;
                        }
                        other => return Err(Error::io(format!("{}: undo record kind {other}", undo_path.display()))),
                    }
                    debug_assert!(undone.kind != RECORD_TRUNCATE || undone.length == undone.old.len() as u64);
                }
                file.sync_all().map_err(io)?;
            }
        }
        std::fs::remove_file(undo_path).map_err(io)?;
    }
    for marker in entries.iter().filter(|p| p.extension().is_some_and(|e| e == "created")) {
        let target = PathBuf::from(std::ffi::OsStr::from_bytes(&std::fs::read(marker).map_err(io)?));
        if target.exists() {
            std::fs::remove_file(&target).map_err(io)?;
            report.files_removed += 1;
        }
        std::fs::remove_file(marker).map_err(io)?;
    }
    Ok(report)
}

/// SplitMix64: a few lines for a reproducible draw without a dependency in the store crate.
fn split_mix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log whose last record, or whose header, the kill cut short reads as the whole records
    /// before the cut: the cut record's write never began.
    #[test]
    fn an_undo_log_cut_by_the_kill_ends_at_its_last_whole_record() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("app.db");
        std::fs::write(&target, b"0123456789").unwrap();
        let mut log = Vec::new();
        log.extend_from_slice(UNDO_MAGIC);
        let name = target.as_os_str().as_bytes();
        log.extend_from_slice(&(name.len() as u64).to_le_bytes());
        log.extend_from_slice(name);
        let header = log.len();
        // Two writes of 4 bytes at offset 2 of the 10-byte file, each keeping the 4 old bytes.
        for old in [b"2345", b"abcd"] {
            log.push(RECORD_WRITE);
            for value in [2_u64, 4, 10] {
                log.extend_from_slice(&value.to_le_bytes());
            }
            log.extend_from_slice(old);
        }
        let undo = dir.path().join("x.undo");
        let read = |bytes: &[u8]| {
            std::fs::write(&undo, bytes).unwrap();
            read_undo(&undo).unwrap()
        };
        let (path, whole) = read(&log).unwrap();
        assert_eq!((path, whole.len()), (target.clone(), 2));
        let cut = read(&log[..log.len() - 1]).unwrap().1;
        assert_eq!(cut.len(), 1, "the cut last record is not read");
        assert_eq!(cut[0].old, b"2345");
        assert_eq!(read(&log[..header + 3]).unwrap().1.len(), 0, "a cut record header");
        assert!(read(&log[..header - 2]).is_none(), "a cut log header: nothing recorded");
        assert!(read(&log[..5]).is_none());
        assert!(read(&[]).is_none());
        std::fs::write(&undo, b"something else entirely").unwrap();
        assert!(read_undo(&undo).is_err(), "not an undo log");
    }
}
