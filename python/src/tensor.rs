//! `_Tensor`: one rollout tensor handed out through DLPack, valid only in the session and at the
//! weight generation it was taken in. The handle and every export of it keep the switch's memory
//! alive ([`Owner`], [`Keep`]); an export also holds a lease while its consumer references it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use dlpark::ffi::{DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned};
use dlpark::metadata::Dynamic;
use dlpark::python::{export_dlpack, DlpackExporter, ExportRequest};
use dlpark::{DlpackFlags, Managed, ManagedTensorBase};
use lifecycle_bridge::{BridgeError, Device, TensorView, ViewDtype};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::errors::to_py;
use crate::shared::{Keep, Owner, Shared};

/// A rollout tensor (see the [module docs](self)).
#[pyclass(name = "_Tensor", module = "lifecycle._lifecycle", frozen)]
pub struct PyTensor {
    view: TensorView,
    bits: bool,
    session: u64,
    generation: u64,
    shared: Owner,
}

impl PyTensor {
    /// View `view` of `shared`'s rollout weights, of the session and generation current now.
    pub fn new(view: TensorView, bits: bool, shared: &Arc<Shared>) -> Self {
        PyTensor {
            view,
            bits,
            session: shared.token.session.load(Ordering::SeqCst),
            generation: shared.token.generation.load(Ordering::SeqCst),
            shared: Owner::new(shared),
        }
    }

    fn check(&self) -> Result<(), BridgeError> {
        let token = &self.shared.token;
        let reason = if token.session.load(Ordering::SeqCst) != self.session {
            "its rollout session ended (take tensors inside `with switch.rollout() as w:`)"
        } else if token.generation.load(Ordering::SeqCst) != self.generation {
            "the weights changed since it was taken"
        } else {
            return Ok(());
        };
        Err(BridgeError::Stale {
            name: self.view.name.clone(),
            reason: reason.into(),
        })
    }

    fn dtype(&self) -> DLDataType {
        match (self.view.dtype, self.bits) {
            (ViewDtype::Bf16, false) => DLDataType::BF16,
            (ViewDtype::Bf16, true) => DLDataType::U16,
            (ViewDtype::Float8E4m3, false) => DLDataType::F8E4M3FN,
            (ViewDtype::Float8E4m3, true) => DLDataType::U8,
            (ViewDtype::F32, _) => DLDataType::F32,
        }
    }

    fn managed<M: ManagedTensorBase>(&self) -> PyResult<Managed<M>> {
        let shape: Vec<i64> = self.view.shape.iter().map(|&d| d as i64).collect();
        let keep = Keep::new(self.shared.shared(), &self.view.name);
        let mut init = Dynamic::compact(shape)
            .initialize_as::<M>(Box::new(keep))
            .map_err(|e| PyValueError::new_err(format!("{}: {e}", self.view.name)))?;
        init.set_data(self.view.ptr as *mut std::ffi::c_void)
            .set_dtype(self.dtype())
            .set_device(self.device());
        // SAFETY: the address is the start of `shape`'s elements of `dtype`, row-major, in the
        // rollout buffer. The context the deleter drops (`Keep`) holds a lease, so no exit,
        // refresh or close rewrites or frees the buffer while the consumer holds it, and a
        // reference to the switch, so dropping the switch does not free it either.
        Ok(unsafe { init.finish() })
    }
}

impl DlpackExporter for PyTensor {
    fn device(&self) -> DLDevice {
        match self.view.device {
            Device::Cpu => DLDevice::CPU,
            Device::Cuda(i) => DLDevice::cuda(i as i32),
        }
    }

    fn flags(&self) -> DlpackFlags {
        // writable: torch refuses read-only DLPack tensors; the weights are the consumer's to read
        DlpackFlags::empty()
    }

    fn prepare_export(&self, _py: Python<'_>, _request: &ExportRequest<'_>) -> PyResult<()> {
        // The switch finished on the device before the enter returned: any consumer stream may
        // read the weights without waiting.
        self.check().map_err(to_py)
    }

    fn export_legacy(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensor>> {
        self.managed()
    }

    fn export_versioned(&self, _py: Python<'_>) -> PyResult<Managed<DLManagedTensorVersioned>> {
        self.managed()
    }
}

#[pymethods]
impl PyTensor {
    /// The rollout layout's name.
    #[getter]
    fn name(&self) -> &str {
        &self.view.name
    }

    /// Shape of the rank's slice.
    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.view.shape.clone()
    }

    /// torch's name of the element type (the unsigned integer of the same width for a `bits`
    /// view).
    #[getter]
    fn dtype_name(&self) -> &'static str {
        match (self.bits, self.view.dtype.bits()) {
            (false, _) => self.view.dtype.name(),
            (true, 16) => "uint16",
            (true, 8) => "uint8",
            (true, _) => "float32",
        }
    }

    /// Raises `StaleWeightsError` when the tensor's session ended or the weights changed.
    fn check_current(&self) -> PyResult<()> {
        self.check().map_err(to_py)
    }

    /// The same tensor exported as unsigned integers of its width (bf16 as uint16, fp8 as
    /// uint8): what numpy, which has neither dtype, can import.
    fn bits(&self) -> PyResult<PyTensor> {
        self.check().map_err(to_py)?;
        Ok(PyTensor {
            view: self.view.clone(),
            bits: true,
            session: self.session,
            generation: self.generation,
            shared: Owner::new(self.shared.shared()),
        })
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(u32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        let request = ExportRequest::parse(stream.as_ref(), max_version, dl_device, copy)?;
        export_dlpack(self, py, request)
    }

    fn __dlpack_device__(&self) -> (u32, i32) {
        let d = DlpackExporter::device(self);
        (d.device_type.0, d.device_id)
    }

    fn __repr__(&self) -> String {
        format!(
            "_Tensor({:?}, shape={:?}, dtype={})",
            self.view.name,
            self.view.shape,
            self.dtype_name()
        )
    }
}
