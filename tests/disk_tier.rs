//! The disk tier: values round-trip, survive a reopen, tombstones hold, corruption is
//! detected and never returned, torn tails are skipped, the quota holds.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use mooncake::store::disk::{DiskConfig, DiskTier};
use mooncake::Code;

struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let d = std::env::temp_dir().join(format!("mc-disk-{what}-{}-{nonce}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn log_files(dir: &TempDir) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "mclog"))
        .collect();
    v.sort();
    v
}

#[test]
fn values_round_trip_and_survive_a_reopen() {
    let dir = TempDir::new("reopen");
    {
        let (tier, report) = DiskTier::open(DiskConfig::new(&dir.0, 64 << 20)).unwrap();
        assert_eq!(report.keys, 0);
        tier.put("a", &[&value(1, 1000)]).unwrap();
        tier.put("b", &[&value(2, 10), &value(3, 70_000)]).unwrap();
        tier.put("empty", &[]).unwrap();
        tier.put("a", &[&value(4, 5)]).unwrap(); // replaced
        tier.put("gone", &[&value(5, 50)]).unwrap();
        assert!(tier.remove("gone").unwrap());
        assert!(!tier.remove("gone").unwrap());
        assert_eq!(tier.get("a").unwrap(), value(4, 5));
        let mut both = value(2, 10);
        both.extend(value(3, 70_000));
        assert_eq!(tier.get("b").unwrap(), both);
    }
    let (tier, report) = DiskTier::open(DiskConfig::new(&dir.0, 64 << 20)).unwrap();
    assert_eq!(
        (report.keys, report.skipped_bytes, report.corrupt_files),
        (3, 0, 0)
    );
    assert_eq!(tier.get("a").unwrap(), value(4, 5), "the later value wins");
    assert_eq!(tier.get("b").unwrap().len(), 70_010);
    assert_eq!(tier.get("empty").unwrap(), Vec::<u8>::new());
    assert_eq!(
        tier.get("gone").unwrap_err().code(),
        Code::ObjectNotFound,
        "tombstone held"
    );
    let mut small = [0u8; 4];
    assert_eq!(
        tier.read_into("b", &mut small).unwrap_err().code(),
        Code::BufferOverflow
    );
}

#[test]
fn a_flipped_byte_is_detected_and_never_returned() {
    let dir = TempDir::new("flip");
    let (tier, _) = DiskTier::open(DiskConfig::new(&dir.0, 64 << 20)).unwrap();
    tier.put("victim", &[&value(7, 4096)]).unwrap();
    tier.put("bystander", &[&value(8, 4096)]).unwrap();
    let file = log_files(&dir).pop().unwrap();
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    // The victim's record: 24-byte header, the key, then the value. Flip its 100th byte.
    let at = 24 + "victim".len() as u64 + 100;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();

    let err = tier.get("victim").unwrap_err();
    assert_eq!(err.code(), Code::ChecksumMismatch, "{err}");
    assert!(!tier.contains("victim"), "a corrupt record is dropped");
    assert_eq!(tier.stats().corrupt, 1);
    assert_eq!(tier.get("bystander").unwrap(), value(8, 4096));
    drop(tier);
    // After a restart the header still parses, so the key comes back, and is caught
    // again at its first read.
    let (tier, _) = DiskTier::open(DiskConfig::new(&dir.0, 64 << 20)).unwrap();
    assert_eq!(
        tier.get("victim").unwrap_err().code(),
        Code::ChecksumMismatch
    );
    assert_eq!(tier.get("bystander").unwrap(), value(8, 4096));
}

#[test]
fn torn_tails_and_corrupt_headers_end_a_scan_without_guessing() {
    let dir = TempDir::new("torn");
    {
        let (tier, _) = DiskTier::open(DiskConfig::new(&dir.0, 64 << 20)).unwrap();
        tier.put("first", &[&value(1, 1000)]).unwrap();
        tier.put("second", &[&value(2, 1000)]).unwrap();
    }
    let file = log_files(&dir)
        .into_iter()
        .find(|p| std::fs::metadata(p).unwrap().len() > 0)
        .unwrap();
    let len = std::fs::metadata(&file).unwrap().len();
    // A crash mid-write: the second record is cut short.
    OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let (tier, report) = DiskTier::open(DiskConfig::new(&dir.0, 64 << 20)).unwrap();
    assert_eq!(report.keys, 1);
    assert_eq!(report.skipped_bytes, 24 + 6 + 1000 - 10);
    assert_eq!(tier.get("first").unwrap(), value(1, 1000));
    assert!(!tier.contains("second"));
    // New writes go to a fresh file, never after the torn bytes.
    tier.put("third", &[&value(3, 10)]).unwrap();
    drop(tier);

    // A corrupt header (flipped magic) in the first file ends that file's scan.
    let f = OpenOptions::new().write(true).open(&file).unwrap();
    f.write_all_at(b"X", 0).unwrap();
    let (tier, report) = DiskTier::open(DiskConfig::new(&dir.0, 64 << 20)).unwrap();
    assert_eq!(report.corrupt_files, 1);
    assert!(!tier.contains("first"));
    assert_eq!(tier.get("third").unwrap(), value(3, 10));
}

#[test]
fn the_quota_holds_by_dropping_the_oldest_files() {
    let dir = TempDir::new("quota");
    let mut config = DiskConfig::new(&dir.0, 4 << 20);
    config.file_size = 1 << 20;
    let (tier, _) = DiskTier::open(config.clone()).unwrap();
    for i in 0..64u32 {
        tier.put(&format!("k{i}"), &[&value(i as u8, 200_000)])
            .unwrap();
        assert!(tier.stats().used <= 4 << 20, "after put {i}");
    }
    let s = tier.stats();
    assert!(s.evicted > 0 && s.keys > 0 && s.keys < 64, "{s:?}");
    assert!(tier.contains("k63"), "the newest survive");
    assert!(!tier.contains("k0"), "the oldest go first");
    for k in tier.keys() {
        let i: u32 = k[1..].parse().unwrap();
        assert_eq!(tier.get(&k).unwrap(), value(i as u8, 200_000));
    }
    let on_disk: u64 = log_files(&dir)
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert!(on_disk <= 4 << 20, "files on disk {on_disk}");
    assert_eq!(
        tier.put("huge", &[&vec![0u8; 5 << 20]]).unwrap_err().code(),
        Code::InvalidParams
    );
    assert_eq!(tier.put("", &[b"x"]).unwrap_err().code(), Code::InvalidKey);
    assert_eq!(
        tier.put(&"k".repeat(70_000), &[b"x"]).unwrap_err().code(),
        Code::InvalidKey
    );
    drop(tier);
    let (tier, report) = DiskTier::open(config).unwrap();
    assert_eq!(report.keys, s.keys, "the same keys after a restart");
    assert!(tier.contains("k63"));
}

#[test]
fn concurrent_writers_and_readers_see_whole_values() {
    let dir = TempDir::new("threads");
    let mut config = DiskConfig::new(&dir.0, 8 << 20);
    config.file_size = 1 << 20;
    let (tier, _) = DiskTier::open(config).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let tier = &tier;
            s.spawn(move || {
                for i in 0..200u32 {
                    let key = format!("t{t}-{}", i % 20);
                    let len = 1000 + (i as usize * 37) % 30_000;
                    tier.put(&key, &[&value(t, len)]).unwrap();
                    // Whatever is read is a whole value some writer wrote, or absent.
                    match tier.get(&format!("t{}-{}", (t + 1) % 4, i % 20)) {
                        Ok(v) => assert!(!v.is_empty() && v == value((t + 1) % 4, v.len())),
                        Err(e) => assert_eq!(e.code(), Code::ObjectNotFound, "{e}"),
                    }
                }
            });
        }
    });
    assert_eq!(tier.stats().corrupt, 0);
}
