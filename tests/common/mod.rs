//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod engine;

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

/// A store of `capacity` bytes, objects up to `max`, `readers` readers,
/// named `name`.
pub fn store(name: &Name, capacity: usize, max: usize, readers: u32) -> pinshm::ObjectStore {
    pinshm::ObjectStore::create(pinshm::StoreConfig::new(capacity, max, readers).name(&**name))
        .unwrap()
}

/// Slot bytes for a payload of `len` with `readers` readers.
pub fn slot(readers: u32, len: usize) -> usize {
    pinshm::testing::slot_len(readers, len)
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

/// A word-at-a-time hash, to compare what was put with what was read.
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().unwrap());
        h = (h ^ w).wrapping_mul(0x100_0000_01b3).rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Re-runs this test binary as a child process that runs only `test`, with
/// `PINSHM_CHILD` set to `role` plus the given environment.
pub fn spawn_child(test: &str, role: &str, env: &[(&str, String)]) -> std::process::Child {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    // Child entry points are #[ignore]d so they never count as passes.
    cmd.args([
        test,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("PINSHM_CHILD", role)
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child test process")
}

/// A reader process: this test binary re-executed as `child_reader` with
/// `role`, given the store's handle; it takes lines on stdin and answers
/// `ANSWER ...` lines on stdout.
pub struct Peer {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Peer {
    pub fn spawn(role: &str, sh: &pinshm::store::StoreHandle) -> Peer {
        let mut child = spawn_child(
            "child_reader",
            role,
            &[("PINSHM_HANDLE", serde_json::to_string(sh).unwrap())],
        );
        let stdin = child.stdin.take().unwrap();
        let out = std::io::BufReader::new(child.stdout.take().unwrap());
        Peer {
            child,
            stdin: Some(stdin),
            out,
        }
    }

    pub fn send(&mut self, l: &str) {
        use std::io::Write;
        writeln!(self.stdin.as_mut().unwrap(), "{l}").unwrap();
    }

    /// The next line the child answered (its test-harness chatter skipped).
    pub fn answer(&mut self) -> String {
        use std::io::BufRead;
        loop {
            let mut s = String::new();
            assert!(self.out.read_line(&mut s).unwrap() > 0, "child exited");
            // The harness may print "test child_reader ... " before it.
            if let Some((_, r)) = s.trim().split_once("ANSWER ") {
                return r.to_owned();
            }
        }
    }

    pub fn ask(&mut self, l: &str) -> String {
        self.send(l);
        self.answer()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn finish(mut self) -> String {
        drop(self.stdin.take());
        let a = self.answer();
        assert!(self.child.wait().unwrap().success());
        a
    }
}

/// The `RESULT ...` line a child printed, or a panic with its output.
pub fn child_result(child: std::process::Child) -> String {
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "child failed ({}):\n{text}",
        out.status
    );
    text.lines()
        .find_map(|l| l.split_once("RESULT ").map(|(_, r)| r))
        .unwrap_or_else(|| panic!("child printed no RESULT line:\n{text}"))
        .to_owned()
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

/// Whether `unshare ARGS true` works here (root and namespaces allowed).
/// Where it does not, the test is skipped, said so on stderr; with
/// `PINSHM_REQUIRE_NS=1` (set by `.ci/run`, which runs as root) that is a
/// failure instead, so a green run means the namespace tests ran.
#[allow(dead_code)]
pub fn namespaces_allowed(args: &[&str], what: &str) -> bool {
    let ok = std::process::Command::new("unshare")
        .args(args)
        .arg("true")
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        assert!(
            std::env::var("PINSHM_REQUIRE_NS").as_deref() != Ok("1"),
            "PINSHM_REQUIRE_NS=1 but {what} cannot be created here"
        );
        eprintln!("skipped: cannot create {what} here (needs root and unshare)");
    }
    ok
}

/// The parent's half of a fork test: overwrites every slot of `w`'s ring
/// (eight objects of `len` bytes), checks that `key`'s slot was reused,
/// lets the forked `child` go on (one byte on `go`), and asserts that it
/// faulted (SIGSEGV) rather than read the new bytes. `codes` says what
/// each other exit code of the child means.
pub fn reuse_then_expect_fault(
    w: &mut pinshm::ObjectStore,
    key: &str,
    len: usize,
    go: &mut std::os::unix::net::UnixStream,
    child: nix::unistd::Pid,
    codes: &[(i32, &str)],
) {
    use nix::sys::signal::Signal;
    use nix::sys::wait::{waitpid, WaitStatus};
    use std::io::Write;
    for i in 0..8 {
        w.put(&format!("n{i}"), &pattern(100 + i, len)).unwrap();
    }
    assert!(!w.is_cached(key), "the writer reused {key}'s slot");
    go.write_all(b"x").unwrap();
    match waitpid(child, None).unwrap() {
        WaitStatus::Signaled(_, Signal::SIGSEGV, _) => {}
        WaitStatus::Exited(_, code) => match codes.iter().find(|(c, _)| *c == code) {
            Some((_, why)) => panic!("{why}"),
            None => panic!("the child exited with {code}"),
        },
        other => panic!("the child ended with {other:?}"),
    }
}
