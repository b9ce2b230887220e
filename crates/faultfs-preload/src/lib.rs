//! An `LD_PRELOAD` shim that puts the files of a process under a folder on tidemark's fault
//! layer (`tidemark-faultfs`): the fault tests start the PostgreSQL server on it (issue "Proof
//! under faults", "PostgreSQL's data folder on the same layer where it can be done";
//! docs/reliability.md, "PostgreSQL on the layer").
//!
//! **Turned on** in a process whose environment has `TIDEMARK_FAULTFS` (the layer's state folder)
//! and `TIDEMARK_FAULTFS_ROOT` (the folder whose files are tracked, PostgreSQL's data folder);
//! without both every call goes straight to libc. Both paths must be canonical, and the state
//! folder outside the root.
//!
//! **Interposed** are the libc calls PostgreSQL 15 changes files with (`nm -D postgres`): `open`
//! (and `open64`), `write`, `pwrite`, `pwritev`, `ftruncate`, `truncate`, `posix_fallocate`,
//! `fallocate`, `fsync`, `fdatasync`, `syncfs`, `rename`, `link`, `unlink` and `close`. Before a
//! write, truncation or growth of a regular file under the root, the bytes it changes go to the
//! file's undo log; an fsync or fdatasync of the file empties the log and makes the file's name
//! durable (as ext4 and XFS do: PostgreSQL relies on it, and breaks under the strict POSIX rule
//! that only the folder's fsync does); an fsync of a folder makes its new entries durable;
//! renames, links and removals are durable at once. A file opened with `O_SYNC` or `O_DSYNC` has
//! each write durable as it returns.
//!
//! **Faults** (the layer's control files in the state folder): `full` fails a write or
//! `ftruncate`/`posix_fallocate` that would grow a file with `ENOSPC`; `eio-write` fails every
//! write with `EIO`; `eio-fsync` fails every fsync and fdatasync with `EIO`.
//!
//! **Not seen** (stated in docs/reliability.md): writes through `fwrite`, `dup`ed descriptors,
//! `openat`, `writev`, `creat` and memory maps (PostgreSQL 15 changes its data and WAL files with
//! none of them: its statistics files go through `fwrite` and count as durable at once).

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, OsStr};
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use libc::{iovec, mode_t, off_t, size_t, ssize_t};
use tidemark_faultfs::{Change, UndoLog, EIO_FSYNC, EIO_WRITE, FULL};

/// The environment variable naming the folder whose files are tracked.
pub const ROOT_ENV: &str = "TIDEMARK_FAULTFS_ROOT";
pub use tidemark_faultfs::ENV as STATE_ENV;

/// The layer's state folder and the tracked root, when the process is on the layer.
struct Layer {
    state: PathBuf,
    root: PathBuf,
}

fn layer() -> Option<&'static Layer> {
    static LAYER: OnceLock<Option<Layer>> = OnceLock::new();
    LAYER
        .get_or_init(|| {
            let state = std::env::var_os(STATE_ENV).filter(|v| !v.is_empty())?;
            let root = std::env::var_os(ROOT_ENV).filter(|v| !v.is_empty())?;
            Some(Layer { state: state.into(), root: root.into() })
        })
        .as_ref()
}

/// What the shim keeps of an open descriptor under the root.
enum Open {
    /// A regular file: its undo log, a reader of the same file (the descriptor may be
    /// write-only) and whether each write is durable at once.
    File { undo: UndoLog, reader: Option<File>, fd: c_int, sync_writes: bool, append: bool },
    /// A folder (opened to be fsynced).
    Dir(PathBuf),
}

fn opened() -> &'static Mutex<HashMap<c_int, Open>> {
    static OPENED: OnceLock<Mutex<HashMap<c_int, Open>>> = OnceLock::new();
    OPENED.get_or_init(Default::default)
}

thread_local! {
    /// Set while the shim works: its own file calls (the undo logs) go straight to libc.
    static INSIDE: Cell<bool> = const { Cell::new(false) };
}

/// Run `f` as the shim (its own calls pass through), or `None` when already inside it.
fn as_shim<T>(f: impl FnOnce() -> T) -> Option<T> {
    if INSIDE.with(|inside| inside.replace(true)) {
        return None;
    }
    let out = f();
    INSIDE.with(|inside| inside.set(false));
    Some(out)
}

/// The next definition of a libc function (libc's own), looked up once.
macro_rules! real {
    ($name:literal: $ty:ty) => {{
        static ADDRESS: OnceLock<usize> = OnceLock::new();
        let address = *ADDRESS.get_or_init(|| {
            // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds libc's definition.
            let symbol = unsafe { libc::dlsym(libc::RTLD_NEXT, concat!($name, "\0").as_ptr() as *const c_char) };
            assert!(!symbol.is_null(), concat!("the fault shim finds no ", $name));
            symbol as usize
        });
        // SAFETY: the symbol is libc's function of this signature.
        unsafe { std::mem::transmute::<usize, $ty>(address) }
    }};
}

fn set_errno(code: c_int) {
    // SAFETY: the calling thread's errno.
    unsafe { *libc::__errno_location() = code };
}

/// The absolute form of `path` (relative to the working folder), when it is under the root.
unsafe fn tracked_path(layer: &Layer, path: *const c_char) -> Option<PathBuf> {
    if path.is_null() {
        return None;
    }
    let path = Path::new(OsStr::from_bytes(CStr::from_ptr(path).to_bytes()));
    let absolute = if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir().ok()?.join(path) };
    // `a/./b` as PostgreSQL sometimes writes it.
    let absolute: PathBuf = absolute.components().filter(|c| *c != std::path::Component::CurDir).collect();
    absolute.starts_with(&layer.root).then_some(absolute)
}

fn size_of(fd: c_int) -> Option<u64> {
    // SAFETY: fstat into a zeroed struct.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    (unsafe { libc::fstat(fd, &mut stat) } == 0).then_some(stat.st_size as u64)
}

/// Record the change of the tracked descriptor `fd` that `change` names (from the file's size and
/// whether the descriptor appends) and make it with `apply` under the undo log's lock; `None` when
/// the descriptor is not tracked. A fault, or a log that cannot be written, refuses the change
/// (-1 with errno).
fn change_file(fd: c_int, change: impl FnOnce(u64, bool) -> Change, apply: impl FnOnce() -> isize) -> Option<isize> {
    let layer = layer()?;
    as_shim(|| {
        let mut opened = opened().lock().unwrap_or_else(|e| e.into_inner());
        let Some(Open::File { undo, reader, fd: own, sync_writes, append }) = opened.get_mut(&fd) else {
            return None;
        };
        if tidemark_faultfs::control(&layer.state, EIO_WRITE) {
            set_errno(libc::EIO);
            return Some(-1);
        }
        if undo.lock().is_err() {
            set_errno(libc::EIO);
            return Some(-1);
        }
        let result = (|| {
            let size = size_of(*own).ok_or(libc::EIO)?;
            let change = change(size, *append);
            let grows = match change {
                Change::Write { offset, length } => offset + length > size,
                Change::Truncate { size: to } => to > size,
            };
            if grows && tidemark_faultfs::control(&layer.state, FULL) {
                return Err(libc::ENOSPC);
            }
            let (at, length) = change.overwritten(size);
            let mut old = vec![0_u8; length as usize];
            if length > 0 {
                if reader.is_none() {
                    *reader = Some(File::open(format!("/proc/self/fd/{own}")).map_err(|_| libc::EIO)?);
                }
                reader.as_ref().expect("opened").read_exact_at(&mut old, at).map_err(|_| libc::EIO)?;
            }
            undo.record(change, size, &old).map_err(|_| libc::EIO)?;
            let out = apply();
            if out >= 0 && *sync_writes {
                undo.synced().map_err(|_| libc::EIO)?;
            }
            Ok(out)
        })();
        let _ = undo.unlock();
        Some(result.unwrap_or_else(|errno| {
            set_errno(errno);
            -1
        }))
    })
    .flatten()
}

/// The offset a plain `write` of `fd` writes at: the file's end when it appends, else the
/// descriptor's position.
fn position(fd: c_int, size: u64, append: bool) -> u64 {
    if append {
        return size;
    }
    // SAFETY: lseek on the caller's descriptor, without moving it.
    unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) as u64 }
}

fn remember_open(fd: c_int, path: PathBuf, flags: c_int, created: bool) {
    let Some(layer) = layer() else { return };
    as_shim(|| {
        // SAFETY: fstat into a zeroed struct.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut stat) } != 0 {
            return;
        }
        let entry = match stat.st_mode & libc::S_IFMT {
            libc::S_IFDIR => Open::Dir(path),
            libc::S_IFREG => match UndoLog::open(&layer.state, &path, created) {
                Ok(undo) => Open::File {
                    undo,
                    reader: None,
                    fd,
                    sync_writes: flags & (libc::O_SYNC | libc::O_DSYNC) != 0,
                    append: flags & libc::O_APPEND != 0,
                },
                Err(e) => panic!("the fault shim cannot open the undo log of {}: {e}", path.display()),
            },
            _ => return,
        };
        opened().lock().unwrap_or_else(|e| e.into_inner()).insert(fd, entry);
    });
}

unsafe fn open_tracked(
    path: *const c_char,
    flags: c_int,
    mode: mode_t,
    real: unsafe extern "C" fn(*const c_char, c_int, mode_t) -> c_int,
) -> c_int {
    let target = layer().and_then(|layer| as_shim(|| tracked_path(layer, path)).flatten());
    let Some(target) = target else { return real(path, flags, mode) };
    let existed = target.exists();
    if existed && flags & libc::O_TRUNC != 0 && flags & libc::O_EXCL == 0 {
        // The truncation of the open is a change like any other: record it first (not for an
        // exclusive creation, which fails on an existing file and truncates nothing).
        let fd = real(path, flags & !libc::O_TRUNC & !libc::O_CREAT & !libc::O_EXCL, mode);
        if fd >= 0 {
            remember_open(fd, target.clone(), flags, false);
            ftruncate(fd, 0);
            close(fd);
        }
    }
    let fd = real(path, flags, mode);
    if fd >= 0 {
        remember_open(fd, target, flags, flags & libc::O_CREAT != 0 && !existed);
    }
    fd
}

/// # Safety
/// libc's `open`, with the mode always passed (the variadic argument is read as a third one).
#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    open_tracked(path, flags, mode, real!("open": unsafe extern "C" fn(*const c_char, c_int, mode_t) -> c_int))
}

/// # Safety
/// libc's `open64`, as [`open`].
#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
    open_tracked(path, flags, mode, real!("open64": unsafe extern "C" fn(*const c_char, c_int, mode_t) -> c_int))
}

/// # Safety
/// libc's `close`.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if layer().is_some() {
        as_shim(|| opened().lock().unwrap_or_else(|e| e.into_inner()).remove(&fd));
    }
    real!("close": unsafe extern "C" fn(c_int) -> c_int)(fd)
}

/// # Safety
/// libc's `write`.
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, count: size_t) -> ssize_t {
    let real = real!("write": unsafe extern "C" fn(c_int, *const c_void, size_t) -> ssize_t);
    let change = |size, append| Change::Write { offset: position(fd, size, append), length: count as u64 };
    change_file(fd, change, || real(fd, buf, count)).unwrap_or_else(|| real(fd, buf, count))
}

/// # Safety
/// libc's `pwrite`.
#[no_mangle]
pub unsafe extern "C" fn pwrite(fd: c_int, buf: *const c_void, count: size_t, offset: off_t) -> ssize_t {
    let real = real!("pwrite": unsafe extern "C" fn(c_int, *const c_void, size_t, off_t) -> ssize_t);
    let change = |_, _| Change::Write { offset: offset as u64, length: count as u64 };
    change_file(fd, change, || real(fd, buf, count, offset)).unwrap_or_else(|| real(fd, buf, count, offset))
}

/// # Safety
/// libc's `pwrite64` (the same call on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn pwrite64(fd: c_int, buf: *const c_void, count: size_t, offset: off_t) -> ssize_t {
    pwrite(fd, buf, count, offset)
}

/// # Safety
/// libc's `pwritev`.
#[no_mangle]
pub unsafe extern "C" fn pwritev(fd: c_int, iov: *const iovec, count: c_int, offset: off_t) -> ssize_t {
    let real = real!("pwritev": unsafe extern "C" fn(c_int, *const iovec, c_int, off_t) -> ssize_t);
    let length: usize = (0..count.max(0) as usize).map(|i| (*iov.add(i)).iov_len).sum();
    let change = |_, _| Change::Write { offset: offset as u64, length: length as u64 };
    change_file(fd, change, || real(fd, iov, count, offset)).unwrap_or_else(|| real(fd, iov, count, offset))
}

/// # Safety
/// libc's `pwritev64` (the same call on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn pwritev64(fd: c_int, iov: *const iovec, count: c_int, offset: off_t) -> ssize_t {
    pwritev(fd, iov, count, offset)
}

/// # Safety
/// libc's `ftruncate`.
#[no_mangle]
pub unsafe extern "C" fn ftruncate(fd: c_int, length: off_t) -> c_int {
    let real = real!("ftruncate": unsafe extern "C" fn(c_int, off_t) -> c_int);
    let change = |_, _| Change::Truncate { size: length as u64 };
    change_file(fd, change, || real(fd, length) as isize).map_or_else(|| real(fd, length), |r| r as c_int)
}

/// # Safety
/// libc's `ftruncate64` (the same call on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn ftruncate64(fd: c_int, length: off_t) -> c_int {
    ftruncate(fd, length)
}

/// # Safety
/// libc's `truncate`: the file is opened and truncated through [`ftruncate`].
#[no_mangle]
pub unsafe extern "C" fn truncate(path: *const c_char, length: off_t) -> c_int {
    let real = real!("truncate": unsafe extern "C" fn(*const c_char, off_t) -> c_int);
    let target = layer().and_then(|layer| as_shim(|| tracked_path(layer, path)).flatten());
    if target.is_none() {
        return real(path, length);
    }
    let fd = open(path, libc::O_WRONLY | libc::O_CLOEXEC, 0);
    if fd < 0 {
        return -1;
    }
    let rc = ftruncate(fd, length);
    close(fd);
    rc
}

/// Grow `fd` to `offset + length` (the zeros a preallocation reads as), as a truncation that the
/// undo log can take back; `None` when the descriptor is not tracked.
fn grow(fd: c_int, offset: off_t, length: off_t, apply: impl FnOnce() -> isize) -> Option<isize> {
    let to = (offset + length) as u64;
    change_file(fd, |size, _| Change::Truncate { size: to.max(size) }, apply)
}

/// # Safety
/// libc's `posix_fallocate` (returns the error number instead of setting errno).
#[no_mangle]
pub unsafe extern "C" fn posix_fallocate(fd: c_int, offset: off_t, length: off_t) -> c_int {
    let real = real!("posix_fallocate": unsafe extern "C" fn(c_int, off_t, off_t) -> c_int);
    match grow(fd, offset, length, || real(fd, offset, length) as isize) {
        None => real(fd, offset, length),
        Some(-1) => *libc::__errno_location(),
        Some(rc) => rc as c_int,
    }
}

/// # Safety
/// libc's `posix_fallocate64` (the same call on 64-bit Linux).
#[no_mangle]
pub unsafe extern "C" fn posix_fallocate64(fd: c_int, offset: off_t, length: off_t) -> c_int {
    posix_fallocate(fd, offset, length)
}

/// # Safety
/// libc's `fallocate`; a mode other than plain allocation passes through untracked.
#[no_mangle]
pub unsafe extern "C" fn fallocate(fd: c_int, mode: c_int, offset: off_t, length: off_t) -> c_int {
    let real = real!("fallocate": unsafe extern "C" fn(c_int, c_int, off_t, off_t) -> c_int);
    if mode != 0 {
        return real(fd, mode, offset, length);
    }
    grow(fd, offset, length, || real(fd, mode, offset, length) as isize)
        .map_or_else(|| real(fd, mode, offset, length), |r| r as c_int)
}

/// The fsync of a tracked descriptor: `eio-fsync` fails it; a file's success empties its undo
/// log and makes its name durable; a folder's makes its entries durable.
fn sync(fd: c_int, real: impl Fn() -> c_int) -> c_int {
    let Some(layer) = layer() else { return real() };
    let outcome = as_shim(|| {
        let mut opened = opened().lock().unwrap_or_else(|e| e.into_inner());
        let entry = opened.get_mut(&fd)?;
        if tidemark_faultfs::control(&layer.state, EIO_FSYNC) {
            set_errno(libc::EIO);
            return Some(-1);
        }
        Some(match entry {
            Open::Dir(dir) => {
                let rc = real();
                if rc == 0 {
                    tidemark_faultfs::directory_synced(&layer.state, dir);
                }
                rc
            }
            Open::File { undo, .. } => {
                if undo.lock().is_err() {
                    set_errno(libc::EIO);
                    return Some(-1);
                }
                let mut rc = real();
                if rc == 0 {
                    rc = match undo.synced() {
                        Ok(()) => 0,
                        Err(_) => {
                            set_errno(libc::EIO);
                            -1
                        }
                    };
                    // The file's path now (it may have been renamed since it was opened).
                    if let Ok(path) = std::fs::read_link(format!("/proc/self/fd/{fd}")) {
                        tidemark_faultfs::name_synced(&layer.state, &path);
                    }
                }
                let _ = undo.unlock();
                rc
            }
        })
    });
    match outcome {
        Some(Some(rc)) => rc,
        // Untracked, or the shim's own call: libc's.
        _ => real(),
    }
}

/// # Safety
/// libc's `fsync`.
#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    let real = real!("fsync": unsafe extern "C" fn(c_int) -> c_int);
    sync(fd, || real(fd))
}

/// # Safety
/// libc's `fdatasync`.
#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    let real = real!("fdatasync": unsafe extern "C" fn(c_int) -> c_int);
    sync(fd, || real(fd))
}

/// # Safety
/// libc's `syncfs`: every tracked file is durable after it.
#[no_mangle]
pub unsafe extern "C" fn syncfs(fd: c_int) -> c_int {
    let rc = real!("syncfs": unsafe extern "C" fn(c_int) -> c_int)(fd);
    if let (0, Some(layer)) = (rc, layer()) {
        as_shim(|| tidemark_faultfs::all_synced(&layer.state).expect("the fault layer's state folder is readable"));
    }
    rc
}

/// A change of names under the root (`rename`, `link`), durable at once: the pending writes
/// follow the file to its new name.
unsafe fn rename_like(from: *const c_char, to: *const c_char, real: impl FnOnce() -> c_int) -> c_int {
    let Some(layer) = layer() else { return real() };
    let paths = as_shim(|| Some((tracked_path(layer, from)?, tracked_path(layer, to)?))).flatten();
    let rc = real();
    if let (0, Some((from, to))) = (rc, paths) {
        as_shim(|| {
            tidemark_faultfs::renamed(&layer.state, &from, &to).expect("the fault layer's state folder is writable")
        });
    }
    rc
}

/// # Safety
/// libc's `rename`.
#[no_mangle]
pub unsafe extern "C" fn rename(from: *const c_char, to: *const c_char) -> c_int {
    let real = real!("rename": unsafe extern "C" fn(*const c_char, *const c_char) -> c_int);
    rename_like(from, to, || real(from, to))
}

/// # Safety
/// libc's `link` (PostgreSQL links, then removes the old name).
#[no_mangle]
pub unsafe extern "C" fn link(from: *const c_char, to: *const c_char) -> c_int {
    let real = real!("link": unsafe extern "C" fn(*const c_char, *const c_char) -> c_int);
    rename_like(from, to, || real(from, to))
}

/// # Safety
/// libc's `unlink`.
#[no_mangle]
pub unsafe extern "C" fn unlink(path: *const c_char) -> c_int {
    let rc = real!("unlink": unsafe extern "C" fn(*const c_char) -> c_int)(path);
    if let (0, Some(layer)) = (rc, layer()) {
        as_shim(|| {
            if let Some(path) = tracked_path(layer, path) {
                tidemark_faultfs::removed(&layer.state, &path);
            }
        });
    }
    rc
}
