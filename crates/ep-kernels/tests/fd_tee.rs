//! The init-log capture forwards and records what is written to fd 2 (its own binary: the
//! redirect is process-wide).

use ep_kernels::nvshmem::report::FdTee;

#[test]
fn stderr_is_captured_and_restored() {
    let tee = FdTee::stderr().expect("pipe");
    let msg = b"init failed for transport: IBGDA\n";
    // SAFETY: writing a valid buffer to fd 2.
    let n = unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    assert_eq!(n, msg.len() as isize);
    let log = tee.finish();
    assert!(log.contains("init failed for transport: IBGDA"), "{log:?}");
    // After restore, writes no longer land in the (finished) capture and fd 2 still works.
    // SAFETY: as above.
    assert!(unsafe { libc::write(2, b"after\n".as_ptr().cast(), 6) } == 6);
}
