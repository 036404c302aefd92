//! The owner of lent memory on the Python side: two callables that release a storage
//! (`untyped_storage().resize_(0)`) and restore it (`resize_(bytes)`, returning its new address).

use lifecycle_cuda::driver::LentMemory;
use lifecycle_cuda::CudaError;
use pyo3::prelude::*;

/// Python callables `release(rank, ptr)` and `restore(rank, bytes) -> ptr`.
pub struct PyOwner {
    /// Called once the contents are in pinned host memory.
    pub release: Py<PyAny>,
    /// Called before the contents return; gives the new device address.
    pub restore: Py<PyAny>,
    /// For error messages.
    pub name: String,
}

impl LentMemory for PyOwner {
    fn release(&mut self, rank: usize, ptr: u64) -> Result<(), CudaError> {
        Python::attach(|py| self.release.call1(py, (rank, ptr)).map(drop)).map_err(|e| {
            CudaError::Invalid(format!("releasing the storage of `{}`: {e}", self.name))
        })
    }

    fn restore(&mut self, rank: usize, bytes: usize) -> Result<u64, CudaError> {
        Python::attach(|py| {
            self.restore
                .call1(py, (rank, bytes))
                .and_then(|p| p.extract::<u64>(py))
        })
        .map_err(|e| CudaError::Invalid(format!("restoring the storage of `{}`: {e}", self.name)))
    }
}
