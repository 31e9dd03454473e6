//! What the remote tier's NIXL and fetch processes give up once started
//! (`pinshm.vllm.ec.remote.sandbox`): UCX over TCP lets whoever reaches
//! their ports read and write their memory, so a takeover of one must
//! reach nothing worth taking.
//!
//! - `PR_SET_NO_NEW_PRIVS`: no set-uid program gives anything back.
//! - Landlock (the `landlock` crate, best effort on the running kernel):
//!   the filesystem shrinks to the paths the caller names (libraries,
//!   `/sys`, its own `/proc/PID`), read-only but for `/dev/null`; no
//!   signal to a process outside the sandbox, no abstract UNIX socket
//!   outside it. On kernels before Landlock ABI 8 it binds the calling
//!   thread and those it starts later, so it is applied before UCX starts
//!   any (the caller checks that it is alone).
//! - seccomp (the `seccompiler` crate, all threads): `ptrace`,
//!   `process_vm_readv`/`writev`, `pidfd_getfd`, `execve`, namespaces,
//!   mounts, modules, `bpf`, `perf_event_open`, `userfaultfd`, `io_uring`,
//!   keyrings, `open_by_handle_at` answer EPERM; `clone3` answers ENOSYS
//!   (so threads come from `clone`, whose namespace flags are refused).
//! - `_drop_uid`: a process running as root becomes a uid of its own
//!   (every capability goes with it), after its agent is up.

use std::collections::BTreeMap;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use landlock::{
    path_beneath_rules, Access, AccessFs, CompatLevel, Compatible, RestrictionStatus, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// The newest Landlock ABI this code asks for (best effort: the running
/// kernel's subset is enforced, and the result says which).
const WANT: ABI = ABI::V6;

fn os_err(what: &str, e: impl std::fmt::Display) -> PyErr {
    PyOSError::new_err(format!("sandbox: {what}: {e}"))
}

/// Sets `PR_SET_NO_NEW_PRIVS`, then Landlock with `read` (read files and
/// list directories: libraries are mapped, executable, from files opened
/// to read, which Landlock does not check as an exec) and `write` (also
/// write files) as the only paths, then the seccomp filter.
/// A dict of what took: `no_new_privs`, `landlock` ("full", "partial",
/// "none"), `seccomp`, `threads` (of the process when Landlock was set).
#[pyfunction(name = "_sandbox")]
pub(crate) fn sandbox<'py>(
    py: Python<'py>,
    read: Vec<String>,
    write: Vec<String>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let threads = std::fs::read_dir("/proc/self/task")
        .map(|d| d.count())
        .unwrap_or(0);
    out.set_item("threads", threads)?;
    // SAFETY: a plain prctl with integer arguments; it reads no memory.
    let nnp = unsafe { nix::libc::prctl(nix::libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } == 0;
    out.set_item("no_new_privs", nnp)?;
    let status = landlock(&read, &write).map_err(|e| os_err("landlock", e))?;
    out.set_item(
        "landlock",
        match status.ruleset {
            RulesetStatus::FullyEnforced => "full",
            RulesetStatus::PartiallyEnforced => "partial",
            _ => "none",
        },
    )?;
    seccomp()?;
    out.set_item("seccomp", true)?;
    Ok(out)
}

fn landlock(
    read: &[String],
    write: &[String],
) -> Result<RestrictionStatus, landlock::RulesetError> {
    let all = AccessFs::from_all(WANT);
    // No Execute anywhere: nothing may be run (seccomp refuses execve too).
    let reading = AccessFs::from_read(WANT) & !AccessFs::Execute;
    // Devices (/dev/null; RDMA's /dev/infiniband) are written and ioctl'd.
    let writing = reading | AccessFs::WriteFile | AccessFs::Truncate | AccessFs::IoctlDev;
    let mut created = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(all)?
        .scope(Scope::from_all(WANT))?
        .create()?;
    for (paths, access) in [(read, reading), (write, writing)] {
        // Paths that do not exist are left out; a file gets the file
        // rights of `access` alone.
        created = created.add_rules(path_beneath_rules(paths, access))?;
    }
    created.restrict_self()
}

/// Syscalls answered EPERM, where this architecture has them.
fn denied() -> Vec<i64> {
    use nix::libc as c;
    let mut v = vec![
        c::SYS_ptrace,
        c::SYS_process_vm_readv,
        c::SYS_process_vm_writev,
        c::SYS_pidfd_getfd,
        c::SYS_kcmp,
        c::SYS_execve,
        c::SYS_execveat,
        c::SYS_unshare,
        c::SYS_setns,
        c::SYS_mount,
        c::SYS_umount2,
        c::SYS_pivot_root,
        c::SYS_chroot,
        c::SYS_open_tree,
        c::SYS_move_mount,
        c::SYS_fsopen,
        c::SYS_fsconfig,
        c::SYS_fsmount,
        c::SYS_fspick,
        c::SYS_mount_setattr,
        c::SYS_init_module,
        c::SYS_finit_module,
        c::SYS_delete_module,
        c::SYS_kexec_load,
        c::SYS_kexec_file_load,
        c::SYS_reboot,
        c::SYS_swapon,
        c::SYS_swapoff,
        c::SYS_acct,
        c::SYS_bpf,
        c::SYS_perf_event_open,
        c::SYS_userfaultfd,
        c::SYS_io_uring_setup,
        c::SYS_io_uring_enter,
        c::SYS_io_uring_register,
        c::SYS_keyctl,
        c::SYS_add_key,
        c::SYS_request_key,
        c::SYS_open_by_handle_at,
        c::SYS_name_to_handle_at,
        c::SYS_quotactl,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([c::SYS_iopl, c::SYS_ioperm]);
    v
}

fn arch() -> PyResult<TargetArch> {
    TargetArch::try_from(std::env::consts::ARCH).map_err(|e| os_err("seccomp", e))
}

fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, action: SeccompAction) -> PyResult<BpfProgram> {
    SeccompFilter::new(rules, SeccompAction::Allow, action, arch()?)
        .and_then(BpfProgram::try_from)
        .map_err(|e| os_err("seccomp", e))
}

fn seccomp() -> PyResult<()> {
    use nix::libc as c;
    let mut eperm: BTreeMap<i64, Vec<SeccompRule>> =
        denied().into_iter().map(|n| (n, Vec::new())).collect();
    // clone with any namespace flag (arg 0 on x86_64 and aarch64 alike).
    let ns = [
        c::CLONE_NEWUSER,
        c::CLONE_NEWNS,
        c::CLONE_NEWPID,
        c::CLONE_NEWNET,
        c::CLONE_NEWIPC,
        c::CLONE_NEWUTS,
        c::CLONE_NEWCGROUP,
    ];
    let mut clone = Vec::new();
    for flag in ns {
        let flag = flag as u64;
        let cond = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(flag),
            flag,
        )
        .and_then(|c| SeccompRule::new(vec![c]))
        .map_err(|e| os_err("seccomp", e))?;
        clone.push(cond);
    }
    eperm.insert(c::SYS_clone, clone);
    // A UNIX socket of a path (vLLM's ZMQ ipc://, a Docker socket): Landlock
    // before ABI 9 does not check connect(); its socketpair to the
    // scheduler exists already.
    let unix = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Eq,
        c::AF_UNIX as u64,
    )
    .and_then(|c| SeccompRule::new(vec![c]))
    .map_err(|e| os_err("seccomp", e))?;
    eperm.insert(c::SYS_socket, vec![unix]);
    let enosys: BTreeMap<i64, Vec<SeccompRule>> = [(c::SYS_clone3, Vec::new())].into();
    let mut progs = vec![
        compile(eperm, SeccompAction::Errno(c::EPERM as u32))?,
        compile(enosys, SeccompAction::Errno(c::ENOSYS as u32))?,
    ];
    progs.extend(arch_filters());
    for prog in progs {
        seccompiler::apply_filter_all_threads(&prog).map_err(|e| os_err("seccomp", e))?;
    }
    Ok(())
}

/// The filters this architecture needs besides the common ones.
fn arch_filters() -> Vec<BpfProgram> {
    #[cfg(target_arch = "x86_64")]
    return vec![no_x32()];
    #[cfg(not(target_arch = "x86_64"))]
    return Vec::new();
}

/// x32 system calls (numbers with bit 30 set, on x86_64) answer EPERM:
/// seccompiler's filters match x86_64's numbers only, and an x32 number of
/// the same call would pass them where the kernel has x32 enabled.
#[cfg(target_arch = "x86_64")]
fn no_x32() -> BpfProgram {
    use seccompiler::sock_filter;
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const RET_ALLOW: u32 = 0x7fff_0000;
    const RET_ERRNO: u32 = 0x0005_0000;
    let op = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        op(LD_W_ABS, 0, 0, 4),              // seccomp_data.arch
        op(JEQ_K, 0, 3, AUDIT_ARCH_X86_64), // else allow (not x86_64's)
        op(LD_W_ABS, 0, 0, 0),              // seccomp_data.nr
        op(JGE_K, 0, 1, 0x4000_0000),       // __X32_SYSCALL_BIT
        op(RET_K, 0, 0, RET_ERRNO | nix::libc::EPERM as u32),
        op(RET_K, 0, 0, RET_ALLOW),
    ]
}

/// Becomes `uid`:`gid` with no supplementary groups (every thread; every
/// capability goes), where this process runs as root. The uid after.
#[pyfunction(name = "_drop_uid")]
pub(crate) fn drop_uid(uid: u32, gid: u32) -> PyResult<u32> {
    use nix::unistd::{setgroups, setresgid, setresuid, Gid, Uid};
    if !nix::unistd::geteuid().is_root() {
        return Ok(nix::unistd::geteuid().as_raw());
    }
    setgroups(&[]).map_err(|e| os_err("setgroups", e))?;
    let g = Gid::from_raw(gid);
    setresgid(g, g, g).map_err(|e| os_err("setresgid", e))?;
    let u = Uid::from_raw(uid);
    setresuid(u, u, u).map_err(|e| os_err("setresuid", e))?;
    Ok(nix::unistd::geteuid().as_raw())
}
