//! The layer's draws against what a disk could have kept: a front end written here records
//! into the undo logs as the VFS and the shim do.

use super::*;

/// A front end: record the write's undo, then make it.
fn write(state: &Path, target: &Path, offset: u64, data: &[u8]) {
    let mut log = UndoLog::open(state, target, false).unwrap();
    log.lock().unwrap();
    let file = OpenOptions::new().read(true).write(true).open(target).unwrap();
    let size = file.metadata().unwrap().len();
    let change = Change::Write { offset, length: data.len() as u64 };
    let (at, n) = change.overwritten(size);
    let mut old = vec![0_u8; n as usize];
    file.read_exact_at(&mut old, at).unwrap();
    log.record(change, size, &old).unwrap();
    file.write_all_at(data, offset).unwrap();
    log.unlock().unwrap();
}

fn fsync(state: &Path, target: &Path) {
    let mut log = UndoLog::open(state, target, false).unwrap();
    log.lock().unwrap();
    log.synced().unwrap();
    log.unlock().unwrap();
}

/// Durable "0123456789", then A over [0, 4) and B over [2, 6), neither synced.
fn two_overlapping_writes(dir: &Path) -> (PathBuf, PathBuf) {
    let (state, target) = (dir.join("state"), dir.join("data"));
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(&target, b"0123456789").unwrap();
    fsync(&state, &target);
    write(&state, &target, 0, b"AAAA");
    write(&state, &target, 2, b"BBBB");
    (state, target)
}

#[test]
fn nothing_and_prefix_keep_the_synced_state_or_the_writes_in_order() {
    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..40 {
        let dir = tempfile::tempdir().unwrap();
        let (state, target) = two_overlapping_writes(dir.path());
        let writeback = if seed == 0 { Writeback::Nothing } else { Writeback::Prefix(seed) };
        let report = power_loss(&state, writeback).unwrap();
        let content = String::from_utf8(std::fs::read(&target).unwrap()).unwrap();
        assert!(["0123456789", "AAAA456789", "AABBBB6789"].contains(&content.as_str()), "{content}");
        assert_eq!(report.writes_kept + report.writes_lost, 2);
        if seed == 0 {
            assert_eq!(content, "0123456789");
        }
        seen.insert(content);
        assert_eq!(std::fs::read_dir(&state).unwrap().count(), 0, "the state folder is left clean");
    }
    assert_eq!(seen.len(), 3, "every prefix is drawn: {seen:?}");
}

/// A reordering disk may keep B without A: the outcome no prefix gives.
#[test]
fn reordered_keeps_any_subset_of_the_writes() {
    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..40 {
        let dir = tempfile::tempdir().unwrap();
        let (state, target) = two_overlapping_writes(dir.path());
        let report = power_loss(&state, Writeback::Reordered { seed, torn: false }).unwrap();
        let content = String::from_utf8(std::fs::read(&target).unwrap()).unwrap();
        let expected = match report.writes_kept {
            0 => vec!["0123456789"],
            1 => vec!["AAAA456789", "01BBBB6789"],
            _ => vec!["AABBBB6789"],
        };
        assert!(expected.contains(&content.as_str()), "{content} with {report:?}");
        seen.insert(content);
    }
    assert_eq!(seen.len(), 4, "every subset is drawn: {seen:?}");
}

/// A torn write keeps some of its sectors: each sector is old or new whole, and the file's size
/// is its synced size grown to the end of the kept sectors.
#[test]
fn a_torn_write_keeps_whole_sectors_and_grows_the_file_only_as_far_as_they_reach() {
    let mut torn = 0;
    for seed in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let (state, target) = (dir.path().join("state"), dir.path().join("data"));
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(&target, vec![b'o'; 1024]).unwrap();
        fsync(&state, &target);
        // Over the last two sectors and on into two new ones.
        write(&state, &target, 512, &vec![b'n'; 2048]);
        let report = power_loss(&state, Writeback::Reordered { seed, torn: true }).unwrap();
        torn += report.writes_torn;
        let content = std::fs::read(&target).unwrap();
        assert!(content.len() >= 1024 && content.len() % 512 == 0, "{}", content.len());
        assert!(content[..512].iter().all(|b| *b == b'o'));
        let sectors: Vec<u8> = content.chunks(512).map(|s| s[0]).collect();
        for (i, sector) in content.chunks(512).enumerate().skip(1) {
            assert!(sector.iter().all(|b| *b == sector[0]), "sector {i} is whole");
            if i >= 2 {
                assert!(sector[0] == b'n' || sector[0] == 0, "a new sector is written or a hole: {sectors:?}");
            }
        }
        assert_ne!(content.last(), Some(&0), "the file ends at the last kept sector");
    }
    assert!(torn > 0, "some draw tears the write");
}

/// A log whose last record, or whose header, the kill cut short reads as the whole records
/// before the cut: the cut record's change never began.
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

/// A rename moves the pending writes to the new name (and replaces the target's); a created
/// file whose name was never synced is removed; a name synced by the file's own fsync stays.
#[test]
fn renames_removals_and_names_follow_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let (tmp, live, fresh, kept) =
        (dir.path().join("x.tmp"), dir.path().join("x"), dir.path().join("new"), dir.path().join("kept"));
    std::fs::write(&live, b"live").unwrap();
    fsync(&state, &live);
    for path in [&tmp, &fresh, &kept] {
        std::fs::write(path, b"").unwrap();
        UndoLog::open(&state, path, true).unwrap();
        write(&state, path, 0, b"data");
    }
    std::fs::rename(&tmp, &live).unwrap();
    renamed(&state, &tmp, &live).unwrap();
    fsync(&state, &kept);
    name_synced(&state, &kept);
    let report = power_loss(&state, Writeback::Nothing).unwrap();
    assert_eq!(report.files_removed, 2, "{report:?}");
    assert!(!live.exists() && !fresh.exists(), "created files whose names were not synced are gone");
    assert_eq!(std::fs::read(&kept).unwrap(), b"data");
}
