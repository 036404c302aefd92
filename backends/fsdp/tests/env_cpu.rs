//! Runs everywhere (CI has no GPU and no CUDA): building the backend without a driver is a clear,
//! typed error, never a panic.

use lifecycle_cuda::{check_environment, driver_present, CudaError, ThreadRankPool};

#[test]
fn environment_check_is_a_clear_error_without_gpu() {
    if driver_present() {
        eprintln!("a CUDA driver is present: this test checks the GPU-less path only");
        return;
    }
    let err = check_environment(1).expect_err("no driver");
    assert!(matches!(err, CudaError::NoDriver));
    let msg = err.to_string();
    assert!(
        msg.contains("libcuda") && msg.contains("LD_LIBRARY_PATH"),
        "{msg}"
    );
    match ThreadRankPool::new(2) {
        Err(CudaError::NoDriver) => {}
        other => panic!("expected NoDriver, got {other:?}"),
    }
    let nccl = CudaError::NoNccl.to_string();
    assert!(
        nccl.contains("ln -s") && nccl.contains("libnccl.so.2"),
        "{nccl}"
    );
}
