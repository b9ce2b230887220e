//! A SQLite VFS that keeps what was made durable and can throw the rest away: simulated power
//! loss and injected I/O errors for the fault tests (issue "Proof under faults"; see
//! docs/reliability.md, "Power loss and I/O errors"). Compiled in only with the `failpoints`
//! cargo feature, and active only in a process started with `TIDEMARK_FAULTFS=<state folder>`.
//!
//! **How.** The VFS wraps the platform's default VFS and becomes the process's default, so every
//! file tidemark opens goes through it. It records into the backend-free fault layer
//! (`tidemark-faultfs`, whose documentation says what is durable and what a power loss keeps):
//! before each write (and each truncation) of a database, WAL or journal file the bytes it
//! overwrites go to that file's undo log, and `xSync` (fsync) empties the log. A file created
//! through the VFS is not durable until its folder is fsynced (the strict POSIX rule: SQLite
//! fsyncs the folder itself with the first fsync of a WAL or journal it opens to create; the
//! creator of a database file fsyncs the folder and says so with [`directory_synced`], as
//! tidemark's `connect` does after it creates a file). [`power_loss`], called while no process
//! has the files open (every one of them killed with SIGKILL), throws away what was not durable.
//!
//! **Limits** (stated in docs/reliability.md): the `-shm` wal-index is shared memory and not
//! tracked (SQLite rebuilds it from the WAL when the first connection opens after the loss);
//! deleting is durable at once; only SQLite's files are covered, which is every file tidemark
//! keeps state in; the layer's own limits (tidemark-faultfs).
//!
//! **I/O errors.** While the state folder holds a file named `full`, a write that would grow a
//! file fails with `SQLITE_FULL` (a full disk: overwrites in place still succeed); `eio-write`
//! fails every write with `SQLITE_IOERR_WRITE` and `eio-fsync` every fsync with
//! `SQLITE_IOERR_FSYNC`. Removing the file ends the fault.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rusqlite::ffi;
use tidemark_core::{Error, Result};
pub use tidemark_faultfs::{process_control, PowerLossReport, Writeback, EIO_FSYNC, EIO_WRITE, ENV, FULL};
use tidemark_faultfs::{Change, UndoLog};

/// The VFS's registered name.
const VFS_NAME: &CStr = c"tidemark-faultfs";

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

/// Record that `dir`'s entries were fsynced by its owner: the files created in it are durable.
/// tidemark calls it after it fsynced the folder of a database file it created.
pub fn directory_synced(dir: &Path) {
    if let Some(state) = STATE.get() {
        tidemark_faultfs::directory_synced(state, dir);
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
    /// This connection's handle on the file's undo log (locked around each write and fsync, so
    /// that a record and its write, or an fsync and the log's reset, are one step for every
    /// process and connection on the file).
    undo: UndoLog,
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
    STATE.get().is_some_and(|state| tidemark_faultfs::control(state, name))
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

/// Open `path`'s undo log and mark its creation when `created`.
fn track(path: &Path, created: bool, syncs_directory: bool) -> std::io::Result<Tracked> {
    let undo = UndoLog::open(STATE.get().expect("installed"), path, created)?;
    let directory_sync_pending = syncs_directory.then(|| path.parent().map(Path::to_path_buf)).flatten();
    Ok(Tracked { undo, directory_sync_pending })
}

unsafe extern "C" fn fault_delete(_vfs: *mut ffi::sqlite3_vfs, name: *const c_char, sync_dir: c_int) -> c_int {
    let base = base_vfs();
    let rc = ((*base).xDelete.expect("xDelete"))(base, name, sync_dir);
    if rc == ffi::SQLITE_OK && !name.is_null() {
        if let Some(state) = STATE.get() {
            let path = PathBuf::from(std::ffi::OsStr::from_bytes(CStr::from_ptr(name).to_bytes()));
            tidemark_faultfs::removed(state, &path);
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

/// Append the undo record of `change` to a file of `size` bytes (reading the bytes it
/// overwrites through the wrapped file).
unsafe fn record(
    file: *mut ffi::sqlite3_file,
    undo: &mut UndoLog,
    change: Change,
    size: i64,
) -> std::result::Result<(), c_int> {
    let (offset, kept) = change.overwritten(size as u64);
    let mut old = vec![0_u8; kept as usize];
    if kept > 0 {
        let rc = (real_methods(file).xRead.expect("xRead"))(
            real(file),
            old.as_mut_ptr() as *mut c_void,
            kept as c_int,
            offset as i64,
        );
        if rc != ffi::SQLITE_OK {
            return Err(rc);
        }
    }
    undo.record(change, size as u64, &old).map_err(|_| ffi::SQLITE_IOERR_WRITE)
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
        Ok(size) => {
            match record(file, &mut t.undo, Change::Write { offset: offset as u64, length: amount as u64 }, size) {
                Ok(()) => write(real(file), buf, amount, offset),
                Err(rc) => rc,
            }
        }
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
        Ok(old) => match record(file, &mut t.undo, Change::Truncate { size: size as u64 }, old) {
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
        rc = match t.undo.synced() {
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

/// Throw away what was not made durable in the files tracked under `state`
/// ([`tidemark_faultfs::power_loss`]). Every process that had them open must be dead (SIGKILL),
/// as after a power loss; the state folder is left clean, ready for the processes to start again
/// on the VFS.
pub fn power_loss(state: &Path, writeback: Writeback) -> Result<PowerLossReport> {
    tidemark_faultfs::power_loss(state, writeback)
        .map_err(|e| Error::io(format!("power loss in {}: {e}", state.display())))
}
