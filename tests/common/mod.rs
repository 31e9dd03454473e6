//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};

/// A segment name no other test (in this or another test process) uses, and
/// a guard that removes it from /dev/shm when the test ends, even by panic.
pub struct Name(pub String);

impl Name {
    pub fn new(test: &str) -> Name {
        static N: AtomicU32 = AtomicU32::new(0);
        Name(format!(
            "pinshm-test-{}-{}-{}",
            test,
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
    }
    pub fn path(&self) -> String {
        format!("/dev/shm/{}", self.0)
    }
    pub fn exists(&self) -> bool {
        std::path::Path::new(&self.path()).exists()
    }
}

impl std::ops::Deref for Name {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl Drop for Name {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path());
    }
}

/// Deterministic bytes for object `seed` of `len` bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        let n = (len - v.len()).min(8);
        v.extend_from_slice(&b[..n]);
    }
    v
}

/// FNV-1a, to compare what was put with what was read.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Writes `bytes` at `offset` of a segment's file, as a hostile process would.
pub fn scribble(name: &Name, offset: u64, bytes: &[u8]) {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(name.path())
        .expect("segment file");
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(bytes).unwrap();
}

/// Reads `len` bytes at `offset` of a segment's file.
pub fn peek(name: &Name, offset: u64, len: usize) -> Vec<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(name.path()).expect("segment file");
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut v = vec![0; len];
    f.read_exact(&mut v).unwrap();
    v
}

/// Small xorshift generator for tests.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
